"""The inference part of a launch plan: vLLM engines and the vllm-router in front of them.

Pure functions of the recipe and the machine's facts; nothing is started here.

Engines
    One ``python -m backends.inference.serve`` process per engine (vLLM's OpenAI server plus the
    RL admin routes). On CPU each engine gets one core (``VLLM_CPU_OMP_THREADS_BIND``; by default
    every engine would bind core 0) and a fixed KV-cache size; on GPUs each engine gets
    ``tensor_parallel`` devices through ``CUDA_VISIBLE_DEVICES``. Every engine serves the model
    under the one name ``policy`` (``SERVED_MODEL_NAME``) so that clients never need its path.
    Flags every engine gets, and why:

    - ``--enable-scale-out``: ``/inference/v1/generate``, token ids in and out, with the weight
      version of every sampled token (what the rollout client uses).
    - ``--logprobs-mode processed_logprobs``: the logprobs of the distribution the token was
      actually sampled from (after temperature), which is what the trainer's importance ratio
      needs; vLLM's default is the raw model distribution.
    - ``--generation-config vllm``: sampling defaults are vLLM's, not the checkpoint's
      ``generation_config.json`` (a request's parameters are then exactly what the client sent).
    - ``VLLM_SERVER_DEV_MODE=1``: the admin routes (pause, ``collective_rpc``, weight version).
    - ``SKYRL_DIE_WITH_PARENT=1``: the engine takes its process group down when the driver dies.

Router
    ``vllm-router`` with the recipe's policy. The default is ``sticky_least_loaded``:

    - RL rollouts are multi-turn sessions whose every turn extends the previous prompt, so the
      engine that served turn t holds turn t+1's prefix in its KV cache; a policy that is not
      sticky (round_robin, power_of_two, random) throws that away at every turn.
    - Among sticky policies, ``consistent_hash`` places sessions by hash, blind to load: on m
      engines and N sessions its busiest engine carries about ``1 + sqrt(2 ln m / (N/m))`` times
      the mean (the balls-into-bins bound), and whole groups of long sessions can pile onto one engine.
      ``sticky_least_loaded`` places a *new* session on the engine with the fewest active
      sessions and then keeps it there (released by ``/finish_session``).
    - Measured by others at scale (the SkyRL v0.3 release's routing benchmark): against consistent_hash it
      cut the step time 580 -> 302 s under moderate KV pressure (preemptions 32 -> 6, CV of
      running requests across engines 0.81 -> 0.14) and 775 -> 585 s under high pressure, and
      was only slightly behind at low pressure (287 vs 270 s); prime-rl switched to it after
      consistent_hash dropped prefix-cache hits from 98% to 5% on a saturated engine.
    - ``cache_aware`` (the router's own default) approximates prefix locality by matching request
      text; with token-id requests and one session per trajectory, the session key is the exact
      and cheaper signal.
    ``skyrl bench routing`` measures the policies side by side on this machine.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from skyrl_cli.plan.machine import cpu_has_native_bf16
from skyrl_cli.plan.model import ProcessSpec, ReadinessCheck
from skyrl_cli.recipe.lengths import config_positions, with_model_lengths
from skyrl_contracts.auxiliary import TEACHER, AuxiliaryModel, auxiliary_engine
from skyrl_contracts.engine_api import SERVED_MODEL_NAME
from skyrl_contracts.schema import Recipe, RouterConfig, SpeculativeConfig
from skyrl_contracts.transports import DEFAULT_TRANSPORT, TRANSPORTS, WORKER_EXTENSION

# Attention head sizes vLLM's CPU attention backend serves (vllm/v1/attention/backends/cpu_attn.py);
# the GPU backends accept all of them too.
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The values vLLM accepts for --max-lora-rank (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ENGINE_READY_TIMEOUT_S = 600.0
ROUTER_READY_TIMEOUT_S = 60.0
# How often the router probes its workers; short so a dead engine leaves rotation quickly even
# before the recovery loop removes it.
ROUTER_HEALTH_CHECK_INTERVAL_S = 5


@dataclass(frozen=True)
class Machine:
    """The facts about this host that the inference plan depends on.

    ``engine_cores``: CPU cores the engines may use (one per engine, round robin if fewer);
    ``engine_gpus``: GPU ids given to the engines (``tensor_parallel`` per engine, in order).
    """

    device: Literal["cpu", "cuda"]
    engine_cores: tuple[int, ...] = (0,)
    engine_gpus: tuple[int, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)
    host: str = "127.0.0.1"
    cpu_bf16: bool = field(default_factory=cpu_has_native_bf16)  # this host's, unless stated


def engine_name(index: int) -> str:
    return f"engine-{index}"


def engine_url(machine: Machine, port: int) -> str:
    return f"http://{machine.host}:{port}"


def speculative_config_json(spec: SpeculativeConfig) -> str:
    """The recipe's ``[inference.speculative]`` as vLLM's ``--speculative-config`` JSON."""
    config: dict[str, object] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "ngram":
        config["prompt_lookup_max"] = spec.prompt_lookup_max
    if spec.model:
        config["model"] = spec.model
    return json.dumps(config, separators=(",", ":"))


def engine_dtype(recipe: Recipe, machine: Machine) -> str:
    """The engines' dtype. "auto": bf16 on GPUs and on CPUs that compute it natively (AVX-512-BF16,
    AMX), else fp32: emulated bf16 made the quickstart's rollouts 2.7x slower on an AVX2-only CPU.
    The off-policy correction absorbs the small train (fp32) / inference (bf16) numeric gap."""
    if recipe.model.dtype != "auto":
        return recipe.model.dtype
    return "bfloat16" if machine.device != "cpu" or machine.cpu_bf16 else "float32"


def serve_argv(
    machine: Machine,
    model_dir: str,
    port: int,
    served_name: str,
    dtype: str,
    max_model_len: int,
    seed: int,
    logprobs_mode: str,
    tensor_parallel: int,
    inf,
    async_mode: bool,
) -> list[str]:
    """``backends.inference.serve`` of ``model_dir`` on ``port`` under ``served_name``: what every
    engine the plan starts shares, the policy's and an auxiliary model's (``inf``: the recipe's
    ``[inference]``, its sequence, KV-cache and GPU-memory settings)."""
    argv = [
        machine.python,
        "-m",
        "backends.inference.serve",
        str(model_dir),
        "--host",
        machine.host,
        "--port",
        str(port),
        "--served-model-name",
        served_name,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(inf.max_num_seqs),
        "--seed",
        str(seed),
        "--logprobs-mode",
        logprobs_mode,
        "--generation-config",
        "vllm",
        "--disable-uvicorn-access-log",
    ]
    if machine.device == "cpu":
        # CUDA graphs and torch.compile do not exist / do not pay off for CPU serving here.
        argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(inf.kv_cache_bytes)]
        if model_in_engine_core(machine, async_mode):
            argv += ["--distributed-executor-backend", "uni"]
    else:
        argv += [
            "--tensor-parallel-size",
            str(tensor_parallel),
            "--gpu-memory-utilization",
            str(inf.gpu_memory_utilization),
        ]
    return argv


def engine_argv(
    recipe: Recipe,
    machine: Machine,
    port: int,
    model_dir: str,
    index: int = 0,
    async_mode: bool = False,
    weight_sync: str = DEFAULT_TRANSPORT,
    seed_offset: int = 0,
) -> tuple[str, ...]:
    inf = recipe.inference
    # A distinct sampling seed per engine: with one seed, the k-th request on every engine draws
    # the same random numbers, and samples of a group spread over engines repeat.
    seed = recipe.seed + seed_offset + index
    argv = serve_argv(
        machine,
        model_dir,
        port,
        SERVED_MODEL_NAME,
        engine_dtype(recipe, machine),
        inf.max_model_len,
        seed,
        "processed_logprobs",
        inf.tensor_parallel,
        inf,
        async_mode,
    )
    argv += ["--enable-scale-out", "--worker-extension-cls", WORKER_EXTENSION]
    argv += TRANSPORTS[weight_sync].engine_flags
    if inf.speculative is not None:
        argv += ["--speculative-config", speculative_config_json(inf.speculative)]
    if recipe.model.lora is not None:
        rank = vllm_lora_rank(recipe.model.lora.rank)
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(max_loras(recipe, async_mode))]
    return tuple(argv)


def model_in_engine_core(machine: Machine, async_mode: bool) -> bool:
    """Whether a CPU engine runs the model inside its EngineCore process (vLLM's uni executor, with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) instead of vLLM's CPU default, a separate worker process.

    One process fewer importing torch and vLLM: ready in 21.4 s instead of 28.2 s on 2 cores, the
    same generation speed alone (``benchmarks/bench_engine_start.py``), and the same sync RL step.
    Not with ``--async``: there the engine generates while the learner trains, and the quickstart's
    step took 1.98-2.03 s with the model in the EngineCore against 1.47 s with a worker process
    (scheduling and model execution no longer overlap), more than the start-up saves over a run
    (benchmarks/RESULTS.md, "On a quiet machine")."""
    return machine.device == "cpu" and not async_mode


def max_loras(recipe: Recipe, async_mode: bool) -> int:
    """Adapters an RL engine may hold at once (``--max-loras``). Each policy version is an adapter
    of its own name, and an old one is unloaded only once no request in flight names it
    (``backends.inference.weight_sync.EngineAdapters``): requests may still run on every version
    the staleness bound admits (the current one and ``max_staleness`` before it; 0 in sync mode)
    while the next one is loaded, hence ``max_staleness + 2`` (sync: 2)."""
    staleness = recipe.rl.async_.max_staleness if async_mode and recipe.rl is not None else 0
    return staleness + 2


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds an adapter of ``rank`` (larger ones are refused
    when the recipe is loaded: ``skyrl_cli.plan.feasibility``)."""
    fits = [allowed for allowed in VLLM_LORA_RANKS if allowed >= rank]
    assert fits, f"model.lora.rank = {rank} above {VLLM_LORA_RANKS[-1]} got past validation"
    return fits[0]


# With --enforce-eager the only torch.compile left in a CPU engine is vLLM's sampler helpers (the
# sampled token's logprob rank, the random sample), compiled with inductor and g++ at the first
# request: 2.4-4.7 s before it is answered, against 0.15-1.8 s eager (benchmarks/bench_engine_start.py,
# fork vs fork-compiled, 4 starts each on a loaded machine). Per sampled token, eager costs about 43 ns more per vocabulary entry
# (151,936 entries: 1.6 ms against 0.15 ms a row for the rank, 8.0 against 3.0 ms for the sample),
# so the compile pays off for real vocabularies; an engine serving a model of at most this many
# entries (character and byte tokenizers: the quickstart's) runs them eager
# (``backends.inference.serve``, which reads the model's config).
EAGER_SAMPLER_ENV = "SKYRL_EAGER_SAMPLER_MAX_VOCAB"
EAGER_SAMPLER_MAX_VOCAB = 256


def device_env(
    machine: Machine, slot: int, first_gpu: int, tensor_parallel: int, async_mode: bool
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Environment and owned devices of an engine: on CPU the core of ``slot`` (round robin over the
    engine cores), on GPUs ``tensor_parallel`` GPUs from the ``first_gpu``-th engine GPU."""
    env = {"HF_HUB_OFFLINE": "1", "SKYRL_DIE_WITH_PARENT": "1", "VLLM_NO_USAGE_STATS": "1"}
    if machine.device == "cpu":
        core = machine.engine_cores[slot % len(machine.engine_cores)]
        # VLLM_CPU_CI_ENV skips the start-up warm-up (seconds per engine, nothing to warm on CPU
        # with eager execution). SKYRL_ENGINE_IDLE_SPIN_S: see backends/inference/serve.py (an idle
        # engine otherwise spins a core the trainer needs).
        env.update(
            {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_CI_ENV": "1", "SKYRL_ENGINE_IDLE_SPIN_S": "0.001"}
        )
        env[EAGER_SAMPLER_ENV] = str(EAGER_SAMPLER_MAX_VOCAB)
        if model_in_engine_core(machine, async_mode):
            # vLLM's CPU platform forces the multiprocess executor unless this is 0; the API server
            # still runs the EngineCore in a process of its own (AsyncLLM always does), so the OMP
            # binding and LD_PRELOAD set before that spawn still apply to the process running the model.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # and that process is forked from the API server, not spawned (a fresh interpreter
            # re-importing vLLM and torch): engine ready in 11.9 s instead of 19.6 s here
            # (benchmarks/bench_engine_start.py); see backends/inference/serve.py
            env["SKYRL_ENGINE_CORE_START"] = "fork"
        return env, (f"cpu:{core}",)
    gpus = machine.engine_gpus[first_gpu : first_gpu + tensor_parallel]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env, tuple(f"cuda:{g}" for g in gpus)


def engine_env(
    recipe: Recipe, machine: Machine, index: int, async_mode: bool = False
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Environment and owned devices of policy engine ``index``."""
    tp = recipe.inference.tensor_parallel
    env, devices = device_env(machine, index, index * tp, tp, async_mode)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if recipe.model.lora is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env, devices


def engine_specs(
    recipe: Recipe,
    machine: Machine,
    ports: Sequence[int],
    model_dir: str,
    async_mode: bool = False,
    weight_sync: str = DEFAULT_TRANSPORT,
    seed_offset: int = 0,
) -> list[ProcessSpec]:
    """One ProcessSpec per local engine (``recipe.inference.engines`` of them). The devices fit:
    ``skyrl_cli.plan.feasibility`` checked them when the recipe was loaded. ``async_mode``: the RL
    stage runs with ``--async`` (more LoRA versions may be live at once, see ``max_loras``);
    ``weight_sync``: the RL run's (``skyrl_cli.plan.weight_sync``), whose engine flags it adds.
    ``seed_offset``: engines of earlier nodes (across nodes every engine gets a sampling seed of its own)."""
    # A loaded recipe passes through unchanged; one built in code (tests, benchmarks) gets the
    # length defaults the loader would have given it.
    recipe = with_model_lengths(recipe)
    inf = recipe.inference
    if len(ports) != inf.engines:
        raise ValueError(f"{inf.engines} engines need {inf.engines} ports, got {len(ports)}")
    specs = []
    for index, port in enumerate(ports):
        env, devices = engine_env(recipe, machine, index, async_mode)
        specs.append(
            ProcessSpec(
                name=engine_name(index),
                role="engine",
                argv=engine_argv(recipe, machine, port, model_dir, index, async_mode, weight_sync, seed_offset),
                env=env,
                devices=devices,
                ports=(port,),
                ready=ReadinessCheck(url=f"{engine_url(machine, port)}/health", timeout_s=ENGINE_READY_TIMEOUT_S),
            )
        )
    return specs


def auxiliary_engine_name(model: AuxiliaryModel, index: int) -> str:
    return auxiliary_engine(model.name, index)


def auxiliary_dtype(recipe: Recipe, machine: Machine, model: AuxiliaryModel) -> str:
    """The section's ``dtype``; "auto": the policy engines' dtype (``engine_dtype``)."""
    stated = model.engines.dtype
    return engine_dtype(recipe, machine) if stated == "auto" else stated


def auxiliary_model_len(recipe: Recipe, model: AuxiliaryModel, model_dir: str) -> int:
    """A teacher scores whole trajectories: the policy's ``inference.max_model_len``. A judge reads
    a question and a response (each at most that long) in its template and writes its reply: its
    own positions, capped at twice the policy's length (a CPU engine's KV cache must hold one
    sequence of this length: a long-context judge is not given 32k positions by default)."""
    length = recipe.inference.max_model_len
    if model.name == TEACHER:
        return length
    positions = config_positions(Path(model_dir))
    return min(positions, 2 * length) if positions else 2 * length


def auxiliary_engine_specs(
    recipe: Recipe,
    machine: Machine,
    model: AuxiliaryModel,
    ports: Sequence[int],
    model_dir: str,
    before: Sequence[AuxiliaryModel] = (),
    async_mode: bool = False,
) -> list[ProcessSpec]:
    """The engines of an auxiliary model (``skyrl_contracts.auxiliary``): vLLM serving ``model_dir``
    under the model's name, never weight-synced (no LoRA, no transport flags, no speculative
    decoding). ``--logprobs-mode raw_logprobs``: a token a teacher scores has the teacher's own
    logprob (``backends.rollout.teacher`` forces the last token of a sequence through the sampler,
    whose processed logprob would be 0 after the forcing). Placed after the policy engines and the
    engines of the auxiliary models ``before`` this one: on CPU the next cores (round robin), on
    GPUs the GPUs after theirs."""
    recipe = with_model_lengths(recipe)
    inf, tp = recipe.inference, model.engines.tensor_parallel
    dtype, length = auxiliary_dtype(recipe, machine, model), auxiliary_model_len(recipe, model, model_dir)
    first_slot = inf.engines + sum(m.engines.engines for m in before)
    first_gpu = inf.engines * inf.tensor_parallel + sum(m.gpus for m in before)
    specs = []
    for index, port in enumerate(ports):
        seed = recipe.seed + index
        argv = serve_argv(
            machine, model_dir, port, model.name, dtype, length, seed, "raw_logprobs", tp, inf, async_mode
        )
        env, devices = device_env(machine, first_slot + index, first_gpu + index * tp, tp, async_mode)
        specs.append(
            ProcessSpec(
                name=auxiliary_engine_name(model, index),
                role="auxiliary",
                argv=tuple(argv),
                env=env,
                devices=devices,
                ports=(port,),
                ready=ReadinessCheck(url=f"{engine_url(machine, port)}/health", timeout_s=ENGINE_READY_TIMEOUT_S),
            )
        )
    return specs


def all_engine_urls(recipe: Recipe, machine: Machine, ports: Sequence[int]) -> list[str]:
    """Local engines first, then the recipe's remote ones (``inference.urls``), used the same way."""
    return [engine_url(machine, p) for p in ports] + [u.rstrip("/") for u in recipe.inference.urls]


def router_binary(machine: Machine) -> str:
    beside_python = Path(machine.python).parent / "vllm-router"
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("vllm-router") or "vllm-router"


def router_failure_args(router: RouterConfig) -> tuple[str, ...]:
    """``[inference.router]``'s retry and circuit-breaker settings as vllm-router flags (0.1.17:
    ``--retry-max-retries`` counts attempts, 1 is none; the breaker opens after consecutive failures
    and closes after ``--cb-success-threshold`` successful trials)."""
    args = (
        "--retry-max-retries",
        str(router.retries + 1),
        "--retry-initial-backoff-ms",
        str(router.retry_backoff_ms),
        "--retry-max-backoff-ms",
        str(router.retry_max_backoff_ms),
    )
    if router.circuit_breaker_failures == 0:
        return (*args, "--disable-circuit-breaker")
    return (
        *args,
        "--cb-failure-threshold",
        str(router.circuit_breaker_failures),
        "--cb-timeout-duration-secs",
        str(router.circuit_breaker_open_s),
    )


def router_spec(
    recipe: Recipe, machine: Machine, worker_urls: Sequence[str], port: int, prometheus_port: int
) -> ProcessSpec:
    inf = recipe.inference
    argv = (
        router_binary(machine),
        "--host",
        machine.host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        inf.router.policy,
        "--prometheus-host",
        machine.host,
        "--prometheus-port",
        str(prometheus_port),
        "--request-timeout-secs",
        str(int(inf.request_timeout_s) + 30),
        "--health-check-interval-secs",
        str(ROUTER_HEALTH_CHECK_INTERVAL_S),
        # Engines are already healthy when the router starts (the supervisor waited for them).
        "--worker-startup-timeout-secs",
        "30",
        *router_failure_args(inf.router),
        "--log-level",
        "warning",
    )
    return ProcessSpec(
        name="router",
        role="router",
        argv=argv,
        # --log-level does not reach the Rust policies' own log lines: sticky_least_loaded wrote an
        # INFO line per finished session (6.3 MB of router.log in a 400-step quickstart run).
        env={"RUST_LOG": "warn"},
        ports=(port, prometheus_port),
        ready=ReadinessCheck(url=f"{engine_url(machine, port)}/liveness", timeout_s=ROUTER_READY_TIMEOUT_S),
    )
