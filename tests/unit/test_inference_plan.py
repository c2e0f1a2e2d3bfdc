"""Engine and router process specs built from a recipe (pure functions)."""

from __future__ import annotations

import json

import pytest

from skyrl_cli.plan.inference import (
    EAGER_SAMPLER_ENV,
    EAGER_SAMPLER_MAX_VOCAB,
    Machine,
    all_engine_urls,
    engine_specs,
    router_spec,
    speculative_config_json,
)
from skyrl_contracts.engine_api import SERVED_MODEL_NAME
from skyrl_contracts.schema import Recipe, SpeculativeConfig


def recipe(**inference) -> Recipe:
    extra = inference.pop("model_extra", {})
    return Recipe.model_validate(
        {
            "name": "t",
            "seed": 5,
            "model": {"path": "/models/m", **extra},
            "data": {"task": "addition"},
            "rl": {},
            "inference": {"engines": 2, **inference},
        }
    )


CPU = Machine(device="cpu", engine_cores=(0, 1), python="/venv/bin/python", cpu_bf16=True)
GPU = Machine(device="cuda", engine_gpus=(2, 3, 4, 5), python="/venv/bin/python")


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_cpu_engines_one_core_each_and_lean_flags():
    specs = engine_specs(recipe(), CPU, [8101, 8102], "/models/m")
    assert [s.name for s in specs] == ["engine-0", "engine-1"]
    a, b = specs
    assert a.argv[:4] == ("/venv/bin/python", "-m", "backends.inference.serve", "/models/m")
    assert flag(a.argv, "--port") == "8101" and flag(b.argv, "--port") == "8102"
    assert (a.env["VLLM_CPU_OMP_THREADS_BIND"], b.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert a.devices == ("cpu:0",) and b.devices == ("cpu:1",)
    for s in specs:
        assert "--enforce-eager" in s.argv and "--enable-scale-out" in s.argv
        assert flag(s.argv, "--kv-cache-memory-bytes") == str(64 * 2**20)
        # the model runs in the EngineCore process: no third process importing torch and vLLM
        assert (
            flag(s.argv, "--distributed-executor-backend") == "uni" and s.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        )
        assert s.env["SKYRL_ENGINE_CORE_START"] == "fork"  # the EngineCore forked: no second import of vLLM
        assert flag(s.argv, "--logprobs-mode") == "processed_logprobs"
        assert flag(s.argv, "--served-model-name") == SERVED_MODEL_NAME
        assert flag(s.argv, "--dtype") == "bfloat16"
        assert s.env["VLLM_SERVER_DEV_MODE"] == "1" and s.env["VLLM_CPU_CI_ENV"] == "1"
        assert float(s.env["SKYRL_ENGINE_IDLE_SPIN_S"]) < 0.1  # an idle CPU engine must not spin a core
        assert s.env["HF_HUB_OFFLINE"] == "1" and s.env["SKYRL_DIE_WITH_PARENT"] == "1"
        assert s.ready.url == f"http://127.0.0.1:{s.ports[0]}/health"
        assert s.kind == "service" and s.role == "engine"
        assert "CUDA_VISIBLE_DEVICES" not in s.env
    # Distinct sampling seeds, so engines do not draw the same random numbers.
    assert (flag(a.argv, "--seed"), flag(b.argv, "--seed")) == ("5", "6")
    # --async: generation overlaps training, and vLLM's worker process keeps the step faster
    for s in engine_specs(recipe(), CPU, [8101, 8102], "/models/m", async_mode=True):
        assert "--distributed-executor-backend" not in s.argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in s.env
        assert "SKYRL_ENGINE_CORE_START" not in s.env  # vLLM's CPU workers must be spawned


def test_more_engines_than_cores_share_round_robin():
    specs = engine_specs(recipe(engines=3), Machine(device="cpu", engine_cores=(1,)), [1, 2, 3], "m")
    assert {s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs} == {"1"}


def test_gpu_engines_tensor_parallel_placement():
    specs = engine_specs(recipe(tensor_parallel=2, gpu_memory_utilization=0.7), GPU, [1, 2], "m")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["2,3", "4,5"]
    assert specs[1].devices == ("cuda:4", "cuda:5")
    for s in specs:
        assert flag(s.argv, "--tensor-parallel-size") == "2"
        assert flag(s.argv, "--gpu-memory-utilization") == "0.7"
        assert "--weight-transfer-config" not in s.argv  # only for the NCCL weight sync, below
        assert "--enforce-eager" not in s.argv and "--kv-cache-memory-bytes" not in s.argv
        assert "VLLM_CPU_OMP_THREADS_BIND" not in s.env and "SKYRL_ENGINE_IDLE_SPIN_S" not in s.env
        assert "--distributed-executor-backend" not in s.argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in s.env
        assert "SKYRL_ENGINE_CORE_START" not in s.env


def test_gpu_engines_get_the_weight_transfer_engine_only_for_the_nccl_sync():
    for mode in ("disk", "lora"):
        assert all(
            "--weight-transfer-config" not in s.argv for s in engine_specs(recipe(), GPU, [1, 2], "m", weight_sync=mode)
        )
    for s in engine_specs(recipe(), GPU, [1, 2], "m", weight_sync="nccl"):
        assert json.loads(flag(s.argv, "--weight-transfer-config")) == {"backend": "nccl"}


def test_port_count_must_match():
    with pytest.raises(ValueError):
        engine_specs(recipe(), CPU, [1], "m")


def test_speculative_config():
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert json.loads(speculative_config_json(ngram)) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
    }
    eagle = SpeculativeConfig(method="eagle", num_speculative_tokens=2, model="/d")
    assert json.loads(speculative_config_json(eagle)) == {"method": "eagle", "num_speculative_tokens": 2, "model": "/d"}
    (spec, _) = engine_specs(recipe(speculative={"method": "ngram"}), CPU, [1, 2], "m")
    assert json.loads(flag(spec.argv, "--speculative-config"))["method"] == "ngram"


def test_lora_enables_runtime_adapters():
    (spec, _) = engine_specs(recipe(model_extra={"lora": {"rank": 16}}), CPU, [1, 2], "m")
    assert "--enable-lora" in spec.argv and flag(spec.argv, "--max-lora-rank") == "16"
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


@pytest.mark.parametrize("rank, served", [(1, 1), (4, 8), (8, 8), (12, 16), (512, 512)])
def test_lora_rank_rounds_up_to_a_rank_vllm_accepts(rank, served):
    (spec, _) = engine_specs(recipe(model_extra={"lora": {"rank": rank}}), CPU, [1, 2], "m")
    assert flag(spec.argv, "--max-lora-rank") == str(served)


def test_fp32_model_dtype_serves_fp32():
    (spec, _) = engine_specs(recipe(model_extra={"dtype": "float32"}), CPU, [1, 2], "m")
    assert flag(spec.argv, "--dtype") == "float32"


def test_remote_engines_join_the_router_without_a_process():
    r = recipe(urls=["http://gpu-host:8000/"])
    urls = all_engine_urls(r, CPU, [8101, 8102])
    assert urls == ["http://127.0.0.1:8101", "http://127.0.0.1:8102", "http://gpu-host:8000"]
    spec = router_spec(r, CPU, urls, 8100, 29100)
    workers = spec.argv[spec.argv.index("--worker-urls") + 1 : spec.argv.index("--policy")]
    assert list(workers) == urls
    assert flag(spec.argv, "--policy") == "sticky_least_loaded"  # the default
    assert flag(spec.argv, "--prometheus-port") == "29100" and spec.ports == (8100, 29100)
    assert spec.ready.url == "http://127.0.0.1:8100/liveness"


@pytest.mark.parametrize("policy", ["consistent_hash", "round_robin", "power_of_two", "cache_aware"])
def test_router_policy_from_recipe(policy):
    spec = router_spec(recipe(router={"policy": policy}), CPU, ["http://a:1"], 1, 2)
    assert flag(spec.argv, "--policy") == policy


@pytest.mark.parametrize(
    "device, cpu_bf16, model_dtype, expected",
    [
        ("cpu", True, "auto", "bfloat16"),  # AVX-512-BF16 / AMX: native
        ("cpu", False, "auto", "float32"),  # AVX2 only: bf16 would be emulated (2.7x slower)
        ("cuda", False, "auto", "bfloat16"),
        ("cpu", True, "float32", "float32"),
        ("cpu", False, "bfloat16", "bfloat16"),  # stated in the recipe: obeyed
    ],
)
def test_engine_dtype_follows_what_the_cpu_does_natively(device, cpu_bf16, model_dtype, expected):
    machine = Machine(device=device, engine_cores=(0,), engine_gpus=(0, 1), cpu_bf16=cpu_bf16)
    (spec, *_) = engine_specs(recipe(model_extra={"dtype": model_dtype}), machine, [1, 2], "m")
    assert flag(list(spec.argv), "--dtype") == expected


@pytest.mark.parametrize(
    "flags, native",
    [
        ("fpu avx2 fma", False),
        ("avx2 avx512f avx512_bf16", True),
        ("avx512f amx_bf16 amx_tile", True),
        ("avx512f", False),
    ],
)
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, flags, native):
    from skyrl_cli.plan.machine import cpu_has_native_bf16

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n")
    assert cpu_has_native_bf16(str(info)) is native
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is False


def test_cpu_engines_run_the_sampler_eager_for_small_vocabularies_only(tmp_path):
    from backends.inference.serve import COMPILE_DISABLE_ENV, eager_sampler_for_small_vocabularies

    (cpu,) = engine_specs(recipe(engines=1), CPU, [8101], "/models/m")
    (gpu,) = engine_specs(recipe(engines=1), GPU, [8101], "/models/m")
    assert cpu.env[EAGER_SAMPLER_ENV] == str(EAGER_SAMPLER_MAX_VOCAB) and EAGER_SAMPLER_ENV not in gpu.env

    def decided(vocab: int | None, environ: dict) -> bool:
        model = tmp_path / f"m{vocab}"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps({} if vocab is None else {"vocab_size": vocab}))
        return eager_sampler_for_small_vocabularies(["serve", str(model)], environ)

    limit = {EAGER_SAMPLER_ENV: "256"}
    small, big, unknown, gpu_env = dict(limit), dict(limit), dict(limit), {}
    assert decided(64, small) and small[COMPILE_DISABLE_ENV] == "1"
    assert not decided(151936, big) and COMPILE_DISABLE_ENV not in big
    assert not decided(None, unknown) and COMPILE_DISABLE_ENV not in unknown  # compiled, as vLLM has it
    assert not decided(64, gpu_env) and COMPILE_DISABLE_ENV not in gpu_env  # the plan sets no limit on GPUs
    assert not eager_sampler_for_small_vocabularies(["serve", str(tmp_path / "missing")], dict(limit))
