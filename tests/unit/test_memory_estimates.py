"""The memory estimates (``skyrl_cli.plan.memory``) against DeepSpeed's own estimators, hand-computed
KV-cache figures, and torch's saved-tensor accounting of one decoder layer."""

from __future__ import annotations

import json

import pytest

from skyrl_cli.plan.memory import (
    CPU_BYTES_PER_EXAMPLE,
    CPU_KEPT_ACTIVATIONS,
    ENGINE_RESERVE_BYTES,
    GIB,
    TRAINER_CPU_RUNTIME_BYTES,
    TRAINER_CUDA_RESERVE_BYTES,
    TrainerSetup,
    engine_memory,
    engine_weight_bytes,
    kv_bytes_per_token,
    layer_activation_bytes,
    lora_parameters,
    trainer_rank_memory,
)
from skyrl_cli.plan.shape import ModelShape
from tests.docs_blocks import REPO

CONFIGS = REPO / "benchmarks" / "model_configs"
SIZES = ("0.5b", "1.5b", "7b")
# Qwen2.5's published sizes (the model cards: 0.49 B, 1.54 B, 7.61 B parameters).
PUBLISHED_PARAMETERS = {"0.5b": 494_032_768, "1.5b": 1_543_714_304, "7b": 7_615_616_512}


def _config(size: str) -> dict:
    return json.loads((CONFIGS / f"qwen2.5-{size}-instruct.json").read_text())


def _shape(size: str) -> ModelShape:
    shape = ModelShape.from_config(_config(size))
    assert shape is not None
    return shape


@pytest.fixture(scope="module")
def meta_models():
    """Each config built by transformers on the meta device: DeepSpeed's parameter counts (its
    ``model_to_params`` reads data pointers, which meta tensors lack, so the same sums by module)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    counts = {}
    for size in SIZES:
        with torch.device("meta"):
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_config(size)))
        total = sum(p.numel() for p in model.parameters())  # a tied head is listed once
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        counts[size] = (total, largest)
    return counts


@pytest.mark.parametrize("size", SIZES)
def test_parameter_counts_match_the_model_transformers_builds(size, meta_models):
    shape = _shape(size)
    total, largest = meta_models[size]
    assert shape.parameters() == total == PUBLISHED_PARAMETERS[size]
    assert shape.largest_module_parameters() == largest


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_zero_model_states_within_10_percent_of_deepspeeds_estimators(size, ranks, meta_models):
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    total, largest = meta_models[size]
    _, zero2 = stage_1_and_2.estimate_zero2_model_states_mem_needs(total, ranks, cpu_offload=False)
    _, zero3, _ = stage3.estimate_zero3_model_states_mem_needs(total, largest, ranks, cpu_offload=False)
    ours = {
        stage: trainer_rank_memory(_shape(size), TrainerSetup(ranks, stage, micro_batch_tokens=1)).model_states
        for stage in (2, 3)
    }
    assert ours[2] == zero2  # the same 2 + 18 / N bytes a parameter
    assert abs(ours[3] / zero3 - 1) < 0.10, (ours[3] / GIB, zero3 / GIB)


@pytest.mark.parametrize("size", SIZES)
def test_offloaded_states_match_deepspeeds_estimators(size, meta_models):
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    total, largest = meta_models[size]
    shape = _shape(size)
    _, zero2 = stage_1_and_2.estimate_zero2_model_states_mem_needs(total, 4, cpu_offload=True)
    _, zero3, _ = stage3.estimate_zero3_model_states_mem_needs(
        total, largest, 4, cpu_offload=True, cpu_offload_params=False
    )
    _, zero3_params, _ = stage3.estimate_zero3_model_states_mem_needs(
        total, largest, 4, cpu_offload=True, cpu_offload_params=True
    )
    offloaded = {
        (stage, offload): trainer_rank_memory(shape, TrainerSetup(4, stage, 1, offload=offload)).model_states
        for stage, offload in ((2, "optimizer"), (3, "optimizer"), (3, "optimizer+parameters"))
    }
    assert offloaded[2, "optimizer"] == zero2
    assert offloaded[3, "optimizer"] == zero3
    assert offloaded[3, "optimizer+parameters"] == zero3_params


def test_zero_stages_by_hand_for_the_1_5b_model():
    p = PUBLISHED_PARAMETERS["1.5b"]
    shape = _shape("1.5b")
    zero0 = trainer_rank_memory(shape, TrainerSetup(4, 0, 1))
    zero1 = trainer_rank_memory(shape, TrainerSetup(4, 1, 1))
    assert zero0.model_states == 2 * p + 2 * p + 16 * p  # bf16 weights and gradients, fp32 grads, master, Adam
    assert zero1.model_states == 2 * p + 2 * p + 16 * p // 4
    fp32 = {stage: trainer_rank_memory(shape, TrainerSetup(4, stage, 1, weight_bytes=4)) for stage in (0, 2, 3)}
    assert fp32[0].model_states == 4 * p + 4 * p + 8 * p  # stepped in place: no master copy, no fp32 gradients
    # ZeRO-2 clones its partition and flattens its gradient in fp32 even when the weights are fp32
    assert fp32[2].model_states == 4 * p + (4 + 4 + 4 + 8) * p // 4
    assert fp32[3].master_weights == 0 and fp32[3].fp32_gradients == 0  # ZeRO-3 steps fp32 partitions as they are


def test_a_steps_transients_by_hand():
    """Backward computes the embedding's gradient whole (a tied head's too); several ranks at ZeRO 0-2
    reduce a flattened copy of the gradients; AdamW's step allocates temporaries (CUDA's foreach path:
    one fp32 copy of what it steps; CPU's single-tensor path: two of the largest tensor)."""
    p, shape = PUBLISHED_PARAMETERS["0.5b"], _shape("0.5b")
    embedding = shape.vocab * shape.hidden
    assert shape.tied and shape.largest_module_parameters() == embedding
    gpu = trainer_rank_memory(shape, TrainerSetup(4, 2, 512))
    assert gpu.embedding_gradients == 2 * 2 * embedding  # bf16, the head's and the embedding's
    assert gpu.reduce_copy == 2 * p and gpu.optimizer_temps == 4 * (p // 4)
    cpu0 = trainer_rank_memory(shape, TrainerSetup(2, 0, 128, weight_bytes=4, device="cpu"))
    assert cpu0.reduce_copy == 4 * p and cpu0.optimizer_temps == 2 * 4 * embedding
    cpu2 = trainer_rank_memory(shape, TrainerSetup(2, 2, 128, weight_bytes=4, device="cpu"))
    assert cpu2.optimizer_temps == 2 * 4 * (p // 2)  # the flat fp32 partition
    reduction = dict(cpu2.phases()["the gradient reduction"])
    assert "fp32 gradients" not in reduction and reduction["reduction copy"] == 4 * p
    assert reduction["DeepSpeed buckets"] == 4 * p  # filled by backward
    step = dict(cpu2.phases()["the optimizer step"])
    assert "gradients" not in step and step["fp32 gradients"] == 4 * (p // 2)  # fp32: one partition left
    assert "gradients" in dict(gpu.phases()["the optimizer step"])  # bf16 beside the fp32 partition
    one_rank = trainer_rank_memory(shape, TrainerSetup(1, 2, 512))
    assert one_rank.reduce_copy == 0 and one_rank.phases()["the gradient reduction"] == []
    zero3 = trainer_rank_memory(shape, TrainerSetup(4, 3, 512))
    assert zero3.reduce_copy == 0 and zero3.optimizer_temps == 4 * (p // 4)
    lora = trainer_rank_memory(shape, TrainerSetup(2, 2, 512, lora_rank=8, lora_targets=("q_proj", "v_proj")))
    assert lora.embedding_gradients == 0  # frozen
    for memory in (gpu, cpu0, cpu2, one_rank, zero3, lora):
        assert sum(value for _, value in memory.parts()) == memory.peak
        totals = {name: sum(v for _, v in parts) for name, parts in memory.phases().items()}
        assert memory.peak == max(totals.values())
    assert cpu0.peak_phase == "the gradient reduction"


def test_lora_trains_only_adapters_and_keeps_the_base_whole():
    shape = _shape("1.5b")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = lora_parameters(shape, 32, targets)
    # per layer: r x (in + out) of q (1536->1536), k, v (1536->256), o (1536->1536), gate, up (1536->8960), down
    per_layer = 32 * ((1536 + 1536) * 2 + (1536 + 256) * 2 + (1536 + 8960) * 3)
    assert adapters == 28 * per_layer
    lora = trainer_rank_memory(shape, TrainerSetup(4, 2, 1, lora_rank=32, lora_targets=targets))
    assert lora.weights == 2 * shape.parameters()
    assert lora.optimizer == 8 * adapters // 4


def test_kv_cache_per_token_by_hand():
    # 2 (keys and values) x layers x KV heads x head_dim x 2 bytes (bf16)
    assert kv_bytes_per_token(_shape("0.5b"), 2) == 2 * 24 * 2 * 64 * 2 == 12_288
    assert kv_bytes_per_token(_shape("1.5b"), 2) == 2 * 28 * 2 * 128 * 2 == 28_672
    assert kv_bytes_per_token(_shape("7b"), 2) == 2 * 28 * 4 * 128 * 2 == 57_344
    assert kv_bytes_per_token(_shape("7b"), 2, tensor_parallel=2) == 2 * 28 * 2 * 128 * 2
    # 2 KV heads over 4 GPUs: vLLM keeps one head on each (replicated), not half a head
    assert kv_bytes_per_token(_shape("1.5b"), 2, tensor_parallel=4) == 2 * 28 * 1 * 128 * 2


def test_trajectories_that_fit_in_an_80_gib_engine_by_hand():
    shape = _shape("1.5b")
    engine = engine_memory(shape, 80 * GIB, 0.85, tensor_parallel=1, trajectory_tokens=1536)
    kv_cache = int(0.85 * 80 * GIB) - 2 * 1_543_714_304 - ENGINE_RESERVE_BYTES
    assert engine.kv_cache == kv_cache
    assert engine.tokens == kv_cache // 28_672
    assert engine.trajectories == kv_cache // 28_672 // 1536 == 1539


def test_int4_engine_weights():
    shape = _shape("7b")
    linear = 28 * shape.layer_linear_parameters()
    expected = linear // 2 + linear * 2 // 32 + 2 * (shape.parameters() - linear)
    assert abs(engine_weight_bytes(shape, 2, int4_group=32) - expected) <= 1
    assert engine_weight_bytes(shape, 2) == 2 * shape.parameters()


def test_layer_activations_match_what_autograd_saves():
    """Two decoder layers at the 1.5B model's widths (vocabulary cut to 1024), 128 tokens in bf16:
    the bytes autograd saves for backward, by storage, against the formula's layers, final norm
    and the log-softmax's fp32 output."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = dict(_config("1.5b"), num_hidden_layers=2, vocab_size=1024, bos_token_id=0, eos_token_id=1)
    config = transformers.Qwen2Config(**config)
    config._attn_implementation = "sdpa"
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    tokens = 128
    saved: dict[int, int] = {}

    def pack(tensor):
        saved.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return tensor

    ids = torch.randint(0, 1024, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=ids, position_ids=torch.arange(tokens)[None], use_cache=False).logits
        torch.log_softmax(logits.float(), dim=-1)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(size for ptr, size in saved.items() if ptr not in weights)
    shape = ModelShape.from_config(config.to_dict())
    expected = tokens * (2 * layer_activation_bytes(shape) + 3 * 2 * shape.hidden + 4 * shape.vocab)
    assert abs(measured / expected - 1) < 0.05, (measured, expected)


# ------------------------------------------------------------------------------------------ on CPU


def test_a_cpu_rank_by_hand():
    """The same model states as on a GPU; the bucket only as far as gradients fill it, after the
    activations (ZeRO-1/2); the process and its data instead of CUDA's reserve; what glibc keeps."""
    shape = _shape("0.5b")
    p = PUBLISHED_PARAMETERS["0.5b"]
    gpu = trainer_rank_memory(shape, TrainerSetup(2, 2, 512, weight_bytes=4))
    cpu = trainer_rank_memory(shape, TrainerSetup(2, 2, 512, weight_bytes=4, device="cpu", data_examples=1000))
    assert cpu.model_states == gpu.model_states
    assert gpu.buckets == 4 * 500_000_000 and gpu.reserve == TRAINER_CUDA_RESERVE_BYTES
    assert cpu.buckets == 0 and cpu.reduction_buckets == 4 * p
    assert cpu.reserve == TRAINER_CPU_RUNTIME_BYTES + 1000 * CPU_BYTES_PER_EXAMPLE
    assert cpu.allocator == int(CPU_KEPT_ACTIVATIONS * cpu.activations)
    zero3 = trainer_rank_memory(shape, TrainerSetup(2, 3, 512, weight_bytes=4, device="cpu"))
    assert zero3.buckets == 4 * (p + 50_000_000)  # the trained parameters' reduction, the prefetched weights
    assert zero3.allocator == int(CPU_KEPT_ACTIVATIONS * zero3.activations) + 2 * 4 * p  # gathered twice a step


# The larger trainer rank's peak resident memory (VmHWM), GB, in short runs of the quickstart
# recipe on its own model, the SmolLM2-135M shape (512-token micro-batches) and the Qwen2.5-0.5B
# shape (128-token micro-batches: 2 ranks fit 24 GiB only so, and not at ZeRO-3): 2 ranks, fp32;
# `skyrl sft` (the recipe's 100,000 sums) at each ZeRO stage, `skyrl rl` from its output at ZeRO-2;
# a 2-core Intel Xeon (AMX), nothing else running:
#   python benchmarks/bench_memory_estimates.py --sizes quickstart smollm2-135m --rl
#   python benchmarks/bench_memory_estimates.py --sizes qwen2.5-0.5b --budget 128 --stages 0 1 2
MEASURED_ON_CPU = {
    ("quickstart", "sft", 0): 0.585,
    ("quickstart", "sft", 1): 0.614,
    ("quickstart", "sft", 2): 0.611,
    ("quickstart", "sft", 3): 0.626,
    ("quickstart", "rl", 2): 0.533,
    ("smollm2-135m", "sft", 0): 4.176,
    ("smollm2-135m", "sft", 1): 4.524,
    ("smollm2-135m", "sft", 2): 4.224,
    ("smollm2-135m", "sft", 3): 5.444,
    ("smollm2-135m", "rl", 2): 3.828,
    ("qwen2.5-0.5b", "sft", 0): 10.871,
    ("qwen2.5-0.5b", "sft", 1): 11.376,
    ("qwen2.5-0.5b", "sft", 2): 10.917,
}
MICRO_BATCH_TOKENS = {"quickstart": 512, "smollm2-135m": 512, "qwen2.5-0.5b": 128}


def _measured_shape(size: str) -> ModelShape:
    if size == "quickstart":
        from skyrl_cli.recipe.loader import load_recipe

        model = load_recipe(REPO / "recipes" / "quickstart.toml").model
        return ModelShape.from_init(model.init, model.tokenizer)
    return ModelShape.from_config(json.loads((CONFIGS / f"{size}-instruct.json").read_text()))


@pytest.mark.parametrize(("size", "stage", "zero"), sorted(MEASURED_ON_CPU))
def test_cpu_estimate_within_10_percent_of_the_measured_runs(size, stage, zero):
    rl = stage == "rl"  # the learner: no dataset, no KL reference (the quickstart's kl.coef is 0)
    tokens = MICRO_BATCH_TOKENS[size]
    setup = TrainerSetup(2, zero, tokens, weight_bytes=4, device="cpu", data_examples=0 if rl else 100_000)
    estimate = trainer_rank_memory(_measured_shape(size), setup).peak
    assert abs(MEASURED_ON_CPU[size, stage, zero] * 1e9 / estimate - 1) < 0.10, estimate / 1e9
