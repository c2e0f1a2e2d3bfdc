"""After one real weight sync, do the engines serve the weights the trainer published?

For tied and untied Llama, Qwen2 and Qwen3 models (built locally like the tiny model), an engine
loads a moved policy published as the learner publishes it, and its prompt logprobs of a fixed
sequence are compared with transformers' on those weights (``backends.inference.sync_check``).
One engine per architecture and dtype serves both its cases: it starts the way the RL stage starts
a tied model's engine (from ``engine-model/``, the untied copy, ``backends.models.tied``), and an
untied model of the same architecture has the same shapes, so a sync replaces every weight either
way (a head the engine kept from its start-up would show as a gap in both cases).

Bounds (measured on this kind of machine): fp32 engines agree to ~1e-6 (asserted: 1e-4); bf16
engines to ~8e-3 max, ~2e-3 mean (asserted: 2e-2 max; ``skyrl_contracts.health`` has the floors an
RL step's mean gap is judged by). Before the fix, a tied model's engine kept its first output head across the
reload: 0.05-0.25 away in fp32.

Then the guard: an RL run whose engines serve other weights than the trainer holds (engines started
elsewhere, ``inference.urls``) says so in one line and records it in ``summary.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli_runs import run_skyrl
from tests.integration.conftest import TINY_ALPHABET, cpu_machine, free_ports, inference_recipe

pytestmark = pytest.mark.integration

CASES = [(arch, tied, "float32") for arch in ("llama", "qwen2", "qwen3") for tied in (False, True)]
CASES += [("llama", True, "bfloat16")]
BOUND = {"float32": 1e-4, "bfloat16": 2e-2}
PLACEHOLDER = "__MODEL__"


def case_id(case) -> str:
    arch, tied, dtype = case
    return f"{arch}-{'tied' if tied else 'untied'}-{dtype}"


def build_model(out_dir: Path, arch: str, tied: bool) -> Path:
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = build_char_tokenizer(TINY_ALPHABET)
    init = TinyModelInit(arch=arch, hidden_size=64, layers=2, heads=2, intermediate_size=128, tie_embeddings=tied)
    return save_hf(build_tiny_model(init, tokenizer, seed=3), tokenizer, out_dir)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One engine per architecture and dtype, started together (their start-ups overlap) from the
    tied model's ``engine-model/``, as ``case -> (url, model dir)``: both cases of a kind share it."""
    from backends.models.tied import write_untied_copy
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import engine_specs, engine_url

    root = tmp_path_factory.mktemp("sync-matrix")
    models = {case: build_model(root / case_id(case) / "model", case[0], case[1]) for case in CASES}
    kinds = sorted({(arch, dtype) for arch, _, dtype in CASES})
    machine = cpu_machine()
    ports = free_ports(len(kinds))
    specs, urls = [], {}
    for index, ((arch, dtype), port) in enumerate(zip(kinds, ports)):
        engine_model = root / f"{arch}-{dtype}" / "engine-model"
        write_untied_copy(models[(arch, True, dtype)], engine_model)
        recipe = inference_recipe(engines=len(kinds), model={"dtype": dtype})
        spec = engine_specs(recipe, machine, ports, PLACEHOLDER)[index]
        argv = tuple(str(engine_model) if a == PLACEHOLDER else a for a in spec.argv)
        specs.append(spec.model_copy(update={"name": f"engine-{arch}-{dtype}", "argv": argv}))
        urls[(arch, dtype)] = engine_url(machine, port)
    served = {case: (urls[(case[0], case[2])], model) for case, model in models.items()}
    with Supervisor(root / "run") as supervisor:
        for spec in specs:
            supervisor.start(spec)
        supervisor.wait_ready([s.name for s in specs])
        yield served


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_engine_serves_the_synced_weights(engines, case, tmp_path):
    from backends.inference.sync_check import round_trip

    url, model = engines[case]
    result = round_trip(url, model, tmp_path)
    assert result["tied"] == case[1]
    assert result["max_abs_diff"] < BOUND[case[2]], result


def test_a_bf16_engine_ends_with_the_same_weights_from_a_bf16_version(engines, tmp_path):
    """The learner writes each version in the engines' dtype (``HFExporter.for_engines``): a bf16
    engine rounds what it loads the same way, so it serves the same logprobs, to the last bit, from
    the bf16 version (half the bytes) as from the fp32 one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.inference.sync_check import engine_logprobs, fixed_sequence, moved_policy
    from backends.inference.weight_sync import run_blocking, sync_weights
    from backends.models.tied import save_for_engines

    url, model = engines[("llama", True, "bfloat16")]
    moved = moved_policy(AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32), seed=2)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = fixed_sequence(min(moved.config.get_text_config().vocab_size, len(tokenizer)))
    served = {}
    for name, dtype in (("fp32", None), ("bf16", "bfloat16"), ("fp32-again", None)):
        save_for_engines(moved, tokenizer, tmp_path / name, dtype=dtype)
        run_blocking(sync_weights([url], tmp_path / name, name))
        served[name] = engine_logprobs(url, ids)
    assert served["fp32"] == served["fp32-again"]  # the comparison is deterministic
    assert served["bf16"] == served["fp32"]


GUARD_RECIPE = """
name = "guard"
seed = 0

[model]
path = "{model}"
dtype = "float32"

[data]
task = "addition"
digits = 2
eval_size = 8

[rl]
init_from = "{model}"
steps = 1
prompts_per_step = 4
samples_per_prompt = 4
max_new_tokens = 4
eval_every = 0
save_every = 0

[inference]
engines = 0
urls = ["{url}"]

[trainer]
ranks = 1
zero_stage = 0
"""


def test_the_guard_fires_when_the_engines_serve_other_weights(engines, tmp_path):
    """Engines started elsewhere that serve a moved copy of the policy: step 1 (on-policy by the
    engines' label, version 0) shows a gap no numerics explain; the run says so and records it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.inference.sync_check import moved_policy
    from backends.inference.weight_sync import run_blocking, sync_weights
    from backends.models.tied import save_for_engines

    url, model = engines[("llama", True, "float32")]
    other = moved_policy(AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32), seed=1)
    save_for_engines(other, AutoTokenizer.from_pretrained(str(model)), tmp_path / "other")
    run_blocking(sync_weights([url], tmp_path / "other", "0"))
    (tmp_path / "recipe.toml").write_text(GUARD_RECIPE.format(model=model, url=url))
    proc = run_skyrl("rl", "recipe.toml", "--quiet", cwd=tmp_path, timeout=600)
    assert "warning: step 1: trainer and engines disagree" in proc.stderr, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "runs/guard/rl/summary.json").read_text())
    health = summary["health"]
    # step 1 is judged against 10x the fp32 floor: no numerics reach it
    assert health["sync_gap_first_step"] == 1 and health["sync_gap_max"] > health["sync_gap_bound"] == 1e-2
    assert "not serving the trainer's weights" in (tmp_path / "runs/guard/rl/logs/trainer.log").read_text()


# ------------------------------------------------------------------------------ the delta sync

DELTA_CASES = [("llama", True, "float32"), ("llama", True, "bfloat16"), ("qwen2", False, "float32")]


class Main:
    is_main = True


class Exporter:
    """The learner's exporter as the delta publisher uses it (``HFExporter.engine_tensors`` and
    ``write_engine_tensors``, the same functions) over a transformers model, no DeepSpeed."""

    def __init__(self, model, tokenizer, dtype: str):
        self.model, self.tokenizer, self.dtype = model, tokenizer, dtype

    def engine_tensors(self):
        from backends.models.tied import engine_state

        return engine_state(self.model, dtype=self.dtype)

    def write_engine_tensors(self, out, tensors):
        from backends.models.tied import save_engine_state

        save_engine_state(self.model, self.tokenizer, out, tensors)


def rl_like_step(model, gen, lr: float = 1e-5) -> None:
    """An Adam-sized step: every weight moves by about ``lr`` (sign-like updates, as Adam's are)."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen).sign() * lr)


@pytest.mark.parametrize("case", DELTA_CASES, ids=case_id)
def test_twenty_delta_versions_leave_the_engine_bit_for_bit_on_the_full_weights(engines, case, tmp_path):
    """The learner's delta publisher and the orchestrator's loader over a real engine: v0 whole, then
    20 versions as deltas (the engine's first one rebuilt from v0, the others applied to what it
    holds), with a whole version every 11 (v11): 20 deltas. The engine's parameters (CRC-32 each) and its logprobs
    then equal those it has after vLLM's own reload of the same version written whole; a corrupted
    delta is refused by the engine (which keeps serving its version) and comes whole from the
    learner's memory."""
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.inference.sync_check import engine_logprobs, fixed_sequence
    from backends.inference.transports.delta import DeltaEngineWeights, DeltaPublisher
    from backends.inference.weight_sync import WeightSyncResult, run_blocking, sync_weights
    from backends.models.tied import engine_state, save_engine_state
    from skyrl_contracts.exchange import RunExchange

    url, model_dir = engines[case]
    dtype = case[2]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = fixed_sequence(min(model.config.get_text_config().vocab_size, len(tokenizer)))
    exchange = RunExchange(tmp_path / "run")
    publisher = DeltaPublisher(exchange, Main(), Exporter(model, tokenizer, dtype), full_every=11)
    loader = DeltaEngineWeights([url], tmp_path / "run")

    def rpc(method: str, **kwargs):
        response = httpx.post(f"{url}/collective_rpc", json={"method": method, "kwargs": kwargs}, timeout=120)
        response.raise_for_status()
        return response.json()["results"][0]

    gen = torch.Generator().manual_seed(0)
    written = []
    publisher.publish(0)
    for version in range(1, 22):
        rl_like_step(model, gen)
        publisher.publish(version)
        written.append(publisher.metrics())
        run_blocking(loader.load(version, exchange.weights_dir(version)))
    assert [m["weights/delta"] for m in written] == [1.0] * 10 + [0.0] + [1.0] * 10  # v11 whole
    assert all(m["weights/written_bytes"] < m["weights/full_bytes"] for m in written if m["weights/delta"])
    assert loader.held() == frozenset(range(11, 22))  # a restarted engine rebuilds v21 from v11 on
    after_deltas = (rpc("policy_checksums"), engine_logprobs(url, ids))

    whole = tmp_path / "whole-v21"
    save_engine_state(model, tokenizer, whole, engine_state(model, dtype=dtype))
    run_blocking(sync_weights([url], whole, "21-whole"))  # vLLM's own reload, from files
    assert (rpc("policy_checksums"), engine_logprobs(url, ids)) == after_deltas

    # a corrupted delta: refused, and v22 comes whole from what the learner holds
    run_blocking(loader.load(21, exchange.weights_dir(21)))
    rl_like_step(model, gen)
    publisher.full_every = 100  # v22 a delta
    publisher.publish(22)
    blob = exchange.weights_dir(22) / "delta.bin"
    blob.write_bytes(bytes(b ^ 0x5A for b in blob.read_bytes()))
    result = run_blocking(loader.load(22, exchange.weights_dir(22)))
    assert isinstance(result, WeightSyncResult) and loader.current == exchange.paths.full_weights(22)
    save_engine_state(model, tokenizer, tmp_path / "whole-v22", engine_state(model, dtype=dtype))
    served = (rpc("policy_checksums"), engine_logprobs(url, ids))
    run_blocking(sync_weights([url], tmp_path / "whole-v22", "22-whole"))
    assert (rpc("policy_checksums"), engine_logprobs(url, ids)) == served
    rl_like_step(model, gen)
    publisher.publish(23)  # after a repair the next version is whole: no chain runs through v22's delta
    assert not (exchange.weights_dir(23) / "delta.json").exists()
