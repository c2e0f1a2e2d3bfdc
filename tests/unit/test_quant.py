"""INT4 fake-quant (torchao QAT) and the W4A16 export (compressed-tensors), against hand-checked
values and bit for bit against each other."""

from __future__ import annotations

import json

import pytest
import torch

from skyrl_contracts.schema import QuantizationConfig, TinyModelInit

pytest.importorskip("torchao")
pytest.importorskip("compressed_tensors")

from backends.quant import export, fake_quant

INIT = TinyModelInit(hidden_size=64, layers=2, heads=2, intermediate_size=128, max_position_embeddings=64)
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tok():
    from backends.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer("0123456789+=")


def tiny(tok, seed: int = 0, init: TinyModelInit = INIT):
    from backends.models.tiny import build_tiny_model

    return build_tiny_model(init, tok, seed)


def hand_layer() -> torch.nn.Sequential:
    """One output row, two groups of 32: group 0 has max |w| 1.875 (scale 1.875 / 7.5 = 0.25),
    group 1 max |w| 3.75 (scale 0.5); every value below is exact in binary."""
    w = torch.zeros(1, 64)
    w[0, :8] = torch.tensor([1.875, -1.875, 0.25, -0.5, 0.375, 0.625, 1.0, -0.125])
    w[0, 32:35] = torch.tensor([3.75, -1.25, 0.5])
    layer = torch.nn.Linear(64, 1, bias=False)
    layer.weight.data = w
    return torch.nn.Sequential(layer)


# Round half to even: 7.5 -> 8 clipped to 7, -7.5 -> -8, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0; -2.5 -> -2.
HAND_CODES = [7, -8, 1, -2, 2, 2, 4, 0]
HAND_CODES_GROUP1 = [7, -2, 1]


def test_hand_checked_codes_scales_and_fake_quant_forward():
    model = hand_layer()
    cfg = QuantizationConfig(group_size=32)
    assert fake_quant.prepare_qat(model, cfg) == ["0"]
    x = torch.eye(64)
    out = model(x)[:, 0]  # row i: the fake-quantized weight of column i
    assert out[:8].tolist() == [1.75, -2.0, 0.25, -0.5, 0.5, 0.5, 1.0, 0.0]
    assert out[32:35].tolist() == [3.5, -1.0, 0.5]
    assert fake_quant.fake_quant_scales(model)["0"].flatten().tolist() == [0.25, 0.5]
    fake_quant.convert_qat(model, cfg)
    (codes, scales) = fake_quant.int4_codes(model)["0"]
    assert codes.dtype == torch.int8 and codes[0, :8].tolist() == HAND_CODES
    assert codes[0, 32:35].tolist() == HAND_CODES_GROUP1 and scales.tolist() == [[0.25, 0.5]]
    assert int(codes.min()) >= fake_quant.QMIN and int(codes.max()) <= fake_quant.QMAX


def test_straight_through_estimator_passes_the_gradient_except_where_codes_clip():
    model = hand_layer()
    fake_quant.prepare_qat(model, QuantizationConfig(group_size=32))
    x = torch.arange(1, 65, dtype=torch.float32).reshape(1, 64) / 64
    model(x).sum().backward()
    # d(sum(fq(W) x))/dW = x (the rounding is skipped, the scales are constants), but zero where the
    # code was clipped: columns 0 and 32 hold +max, which rounds to 8 and is clipped to 7.
    expected = x.clone()
    expected[0, [0, 32]] = 0.0
    assert torch.equal(model[0].weight.grad, expected)


def test_targets_select_linear_layers_and_never_the_head(tok):
    model = tiny(tok)
    every = fake_quant.target_layers(model, QuantizationConfig())
    assert len(every) == 2 * len(LLAMA_LINEARS) and "lm_head" not in every
    assert all(name.split(".")[-1] in LLAMA_LINEARS for name in every)
    some = fake_quant.target_layers(
        model, QuantizationConfig(targets=("q_proj", "mlp.down_proj", "lm_head", "embed_tokens"))
    )
    assert sorted(some) == [f"model.layers.{i}.{n}" for i in (0, 1) for n in ("mlp.down_proj", "self_attn.q_proj")]
    assert sorted(fake_quant.target_layers(model, QuantizationConfig(targets=("layers.1.mlp",)))) == [
        f"model.layers.1.mlp.{n}" for n in ("down_proj", "gate_proj", "up_proj")
    ]
    assert not fake_quant.target_layers(
        model, QuantizationConfig(targets=("proj", "layers.2"))
    )  # whole name parts only
    with pytest.raises(ValueError, match="select no Linear layer"):
        fake_quant.prepare_qat(model, QuantizationConfig(targets=("nope",)))


@pytest.mark.parametrize(("hidden", "group_size"), [(96, 64), (64, 128)])
def test_a_group_size_that_does_not_divide_a_layer_is_refused(tok, hidden, group_size):
    model = tiny(tok, init=INIT.model_copy(update={"hidden_size": hidden, "heads": hidden // 32}))
    message = f"group_size {group_size} does not divide the input width {hidden} of model.layers.0.self_attn.q_proj"
    with pytest.raises(ValueError, match=message):
        fake_quant.prepare_qat(model, QuantizationConfig(group_size=group_size))


def test_per_channel_fits_any_width(tok):
    model = tiny(tok, init=INIT.model_copy(update={"hidden_size": 96, "heads": 3}))
    assert len(fake_quant.quantize_rtn(model, QuantizationConfig(group_size="channel"))) == 14


def test_maybe_prepare_qat_is_off_unless_the_recipe_asks(tok):
    model = tiny(tok)
    assert fake_quant.maybe_prepare_qat(model, None) is model
    fake_quant.maybe_prepare_qat(model, QuantizationConfig(int4_qat=False))
    assert not fake_quant.fake_quant_scales(model) and type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    fake_quant.maybe_prepare_qat(model, QuantizationConfig(int4_qat=True), say=lambda _: None)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "FakeQuantizedLinear"


def train_a_little(model, steps: int = 5):
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        batch = torch.randint(3, 15, (4, 12), generator=gen)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def read_export(out_dir):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    state = load_file(out_dir / "model.safetensors")
    shapes = {
        k[: -len(".weight_shape")]: torch.Size(v.tolist()) for k, v in state.items() if k.endswith(".weight_shape")
    }
    return {
        n: (unpack_from_int32(state[f"{n}.weight_packed"], 4, s).to(torch.int8), state[f"{n}.weight_scale"])
        for n, s in shapes.items()
    }


@pytest.mark.parametrize("group_size", [32, 64, "channel"])
def test_export_of_a_qat_model_equals_its_fake_quant_bit_for_bit(tmp_path, tok, group_size):
    from transformers import AutoModelForCausalLM

    from backends.models.loading import save_hf

    cfg = QuantizationConfig(int4_qat=True, group_size=group_size)
    model = fake_quant.maybe_prepare_qat(tiny(tok, init=INIT.model_copy(update={"hidden_size": 128})), cfg, say=print)
    train_a_little(model)
    ids = torch.randint(3, 15, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fake_logits = model(ids).logits
    fake_scales = fake_quant.fake_quant_scales(model)
    save_hf(model, tok, tmp_path / "final")  # what the trainer publishes: the master weights
    report = export.export_rtn(tmp_path / "final", tmp_path / "int4", cfg)
    fake_quant.convert_qat(model, cfg)
    converted = fake_quant.int4_codes(model)
    exported = read_export(tmp_path / "int4")
    assert sorted(exported) == sorted(converted) == sorted(fake_scales) and report.layers == len(converted) == 14
    for name, (codes, scales) in exported.items():
        assert torch.equal(codes, converted[name][0]) and torch.equal(scales, converted[name][1])
        assert torch.equal(scales, fake_scales[name].reshape(scales.shape))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fake_logits)  # torchao's converted model
        served = AutoModelForCausalLM.from_pretrained(tmp_path / "int4", dtype=torch.float32).eval()
        assert torch.equal(served(ids).logits, fake_logits)  # the export, decompressed by transformers
    qcfg = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    assert (qcfg["format"], qcfg["quant_method"], qcfg["ignore"]) == (
        "pack-quantized",
        "compressed-tensors",
        ["lm_head"],
    )
    weights = qcfg["config_groups"]["group_0"]["weights"]
    if group_size == "channel":  # one scale per output row, whatever the layer's width
        assert (weights["strategy"], weights["group_size"]) == ("channel", None)
        assert {s.shape[1] for _, s in exported.values()} == {1}
    else:
        assert (weights["strategy"], weights["group_size"]) == ("group", group_size)
    assert (tmp_path / "int4" / "tokenizer.json").is_file() and 0 < report.size_ratio < 0.35


def test_ptq_export_equals_torchao_rtn_and_keeps_untargeted_layers(tmp_path, tok):
    from backends.models.loading import save_hf

    cfg = QuantizationConfig(targets=("mlp",), group_size=32)
    save_hf(tiny(tok, seed=3), tok, tmp_path / "src")
    export.export_rtn(tmp_path / "src", tmp_path / "int4", cfg)
    reference = tiny(tok, seed=3)
    assert fake_quant.quantize_rtn(reference, cfg) == [
        f"model.layers.{i}.mlp.{n}" for i in (0, 1) for n in ("gate_proj", "up_proj", "down_proj")
    ]
    expected = fake_quant.int4_codes(reference)
    exported = read_export(tmp_path / "int4")
    assert sorted(exported) == sorted(expected)
    assert all(
        torch.equal(exported[n][0], expected[n][0]) and torch.equal(exported[n][1], expected[n][1]) for n in expected
    )
    ignore = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "lm_head" in ignore and "model.layers.0.self_attn.q_proj" in ignore


def test_export_needs_int4_layers(tmp_path, tok):
    with pytest.raises(ValueError, match="no int4 layer"):
        export.export_w4a16(tiny(tok), tok, tmp_path / "out")
    with pytest.raises(ValueError, match="call prepare_qat first"):
        fake_quant.convert_qat(tiny(tok), QuantizationConfig())


def test_a_policy_version_for_int4_rollouts_is_the_rtn_export_of_the_fake_quant_learner(tmp_path, tok):
    """What the RL learner publishes with quantization.int4_rollouts: its master weights (under
    fake-quant) as W4A16 whose codes are the ones it trained with, rounded in memory: nothing but
    the export is written."""
    from transformers import AutoModelForCausalLM

    cfg = QuantizationConfig(int4_qat=True, int4_rollouts=True, group_size=32)
    learner = fake_quant.maybe_prepare_qat(tiny(tok, seed=5), cfg, say=lambda _: None)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        fake_logits = learner(ids).logits
    out = tmp_path / "weights" / "v3"
    out.mkdir(parents=True)
    report = export.export_version(learner, tok, out, cfg)
    assert report.layers == 14 and report.weights_bytes == export.weights_bytes(out)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_dir()) == ["v3", "weights"]
    served = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(served(ids).logits, fake_logits)
        assert torch.equal(learner(ids).logits, fake_logits)  # the learner keeps its fake-quant layers


def disk_round_trip(model, tok, out, cfg) -> None:
    """The reference: a policy version as it was made before the rounding moved into memory, the
    full-precision model saved (the trainer's exporter), read back and rounded."""
    from backends.models.loading import save_hf

    full = out.with_name(f"{out.name}-full-precision")
    save_hf(model, tok, full)
    export.export_rtn(full, out, cfg, for_engines=True)


def files(out_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}


@pytest.mark.parametrize(
    "tied, qat, dtype, gathered",
    [
        (True, False, torch.float32, False),
        (False, False, torch.float32, False),
        (True, True, torch.float32, False),
        (False, True, torch.float32, False),
        (True, True, torch.bfloat16, False),  # a DeepSpeed bf16 module
        (True, True, torch.float32, True),  # ZeRO-3's gathered tensors, the shared one named once
    ],
)
def test_the_in_memory_version_is_the_disk_round_trip_byte_for_byte(tmp_path, tok, tied, qat, dtype, gathered):
    from backends.models.tokenizer import load_tokenizer

    tok.save_pretrained(tmp_path / "tokenizer")
    tok = load_tokenizer(str(tmp_path / "tokenizer"))  # the RL learner's: loaded from its init_from directory
    cfg = QuantizationConfig(int4_qat=qat, int4_rollouts=True, group_size=32)
    learner = tiny(tok, seed=7, init=INIT.model_copy(update={"tie_embeddings": tied})).to(dtype)
    learner = fake_quant.maybe_prepare_qat(learner, cfg, say=lambda _: None)
    if qat:
        train_a_little(learner, steps=2)  # master weights off the random init
    before = {n: t.clone() for n, t in learner.state_dict().items()}
    state = learner.state_dict()
    if gathered:
        state.pop("lm_head.weight")
    report = export.export_version(learner, tok, tmp_path / "memory", cfg, state_dict=state if gathered else None)
    disk_round_trip(learner, tok, tmp_path / "disk", cfg)
    in_memory, on_disk = files(tmp_path / "memory"), files(tmp_path / "disk")
    assert sorted(in_memory) == sorted(on_disk) and ("untied-head.safetensors" in in_memory) == tied
    assert [n for n in in_memory if in_memory[n] != on_disk[n]] == []
    assert report.layers == 14 and report.weights_bytes == export.weights_bytes(tmp_path / "disk")
    assert all(torch.equal(t, before[n]) for n, t in learner.state_dict().items())  # the learner is untouched


class ZeRO3Engine:
    """A ZeRO-3 engine as ``HFExporter`` sees it: its module, and the gather every rank joins,
    whose full tensors only rank 0 receives."""

    def __init__(self, module, main: bool):
        self.module, self.main, self.gathers = module, main, 0

    def _zero3_consolidated_16bit_state_dict(self):
        self.gathers += 1
        return self.module.state_dict() if self.main else {}


@pytest.mark.parametrize("main", [True, False])
def test_every_rank_joins_the_gather_of_an_int4_version_and_rank_0_alone_writes_it(tmp_path, tok, main):
    from types import SimpleNamespace

    from backends.train.common import HFExporter

    engine = ZeRO3Engine(tiny(tok), main)
    exporter = HFExporter(engine, tok, SimpleNamespace(is_main=main), zero_stage=3)
    exporter.int4_for_engines(tmp_path / "v1" if main else None, QuantizationConfig(group_size=32))
    assert engine.gathers == 1 and (tmp_path / "v1" / "config.json").is_file() == main
