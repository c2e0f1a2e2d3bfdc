"""The release's scenario, live: long multi-turn RL episodes on real engines, once per router policy,
next to what the routing simulator predicts for the same workload shape (issue #29, item 5).

What runs. For each policy in ``--policies`` (default ``consistent_hash``, ``sticky_least_loaded``,
``round_robin``) one real ``skyrl rl --async`` run (``--repeats`` of them, the order rotated each
repeat), all from the same random-init tiny model, recipe, seed and step count, differing only in
the router policy::

    skyrl rl <out>/long_chat.toml --async --run-dir <out>/<policy> --overwrite --quiet \\
        --set inference.router.policy=<policy> --set seed=<seed>

``inference.engines`` (2) vLLM CPU engines behind vllm-router, the orchestrator and a 1-rank
DeepSpeed learner; on a 2-core machine each engine is bound to one core and the learner shares both
(expected, and the same for every policy). The environment is ``benchmarks/agentic/long_chat.py``:
each prompt's episodes take ``--turns`` +- ``--turns-spread`` (40 +- 10, uniform per prompt, so
that groups started together do not all end together) model turns of at most ``--max-new-tokens``
(4) tokens, each followed (after ``--env-delay`` s, log-normal, as the simulator's environment step)
by a ``--observation-chars`` (12) character user message (18 tokens with the chat markers), so the
context grows ~22 tokens a turn, to ~900 tokens at 50 turns (``inference.max_model_len`` 1024; the
model's ``max_position_embeddings`` is built to match). The model (hidden 128, 4 layers, the
``addition`` alphabet's char tokenizer) is built here (``skyrl_cli.launch.tiny_model``) and is both
``model.path`` and ``rl.init_from``: no SFT stage. The KV cache per engine is ``--kv-ratio`` (0.75,
the README's "moderate" pressure) x the planned working set
(``skyrl_cli.routing.workload.working_set_per_replica``: in-flight trajectories per engine x the
turn-weighted mean context), or ``--kv-cache-bytes``.

What is measured, per run, over the steady state: from the engines serving policy version
``--warmup`` (3; the orchestrator's ``weights/version`` event) to the last batch the learner trains
on (its ``rollout/tokens_per_s`` event at step ``--steps``), from the run's ``events.jsonl``
(``skyrl_contracts.events.iter_events``). A run whose last batch came less than 15 s after that
(generation ran ahead of the learner: too few steps) is measured from its first evaluation on and
marked ``*``.

- engine gen tok/s: ``engine/gen_tokens_per_s`` (process ``inference``: ``MetricsScraper`` in
  ``skyrl_cli/engines/metrics.py``, every 5 s, the increase of the engines' ``vllm:generation_tokens_total``
  per second summed over engines), mean of the samples;
- prefix-cache hit rate: ``engine/prefix_cache_hit_rate`` (hits / queries in tokens, per 5 s
  interval, all engines), the intervals weighted by their ``engine/gen_tokens_per_s`` (the queries
  themselves are not logged; the unweighted mean is in the JSON);
- load imbalance: the coefficient of variation across engines of their mean
  ``engine/<i>/gen_tokens_per_s`` ("gen CV"), and the mean of ``engine/running_cv`` ("run CV": CV of
  running requests across engines per sample, the simulator's ``running_cv``); ``router/load/<i>``
  is read too but vLLM engines report no load to vllm-router (-1, which ``router_events`` leaves
  out), so it is absent;
- preemptions: sum of ``engine/preemptions``;
- rollout tok/s: ``rollout/tokens_per_s`` (orchestrator, one per batch: the tokens the model sampled
  in the groups finished since the previous batch; observations are not counted), time-weighted;
  model tok/s: the model's own tokens (loss mask 1) of the batches written in the window
  (``rl.keep_batches``) per second, the same count from the batches themselves;
- step s (window / batches written in it), learner s (``timing/train_s`` +
  ``timing/publish_weights_s``), wait s (the learner's ``timing/wait_for_batch_s``: above 0 the
  learner waits for generation, the regime where routing can show; near 0 with a growing
  ``async/generation_blocked_s``, worker-seconds the staleness bound held generation back, in the
  JSON, the learner is the bottleneck and every policy gets the same throughput), wall s
  (``summary.json``).

The simulation (``skyrl_cli.routing.simulator``), same shape as a ``WorkloadSpec``: engines,
``samples_per_prompt`` x ``prompts_per_step``, in-flight groups ``max_concurrency //
samples_per_prompt``, staleness, steps; turns (mean and CV), prompt, response and observation
tokens per turn as measured in the live runs' batches; the learner's measured step as
``trainer_step_s``; the environment delay; the engines' KV capacity as vLLM logged it (``KV cache
size: N tokens``), vLLM's CPU block (128) and token budget (2048); ``--sim-seeds`` seeds per
policy, ratios the mean of per-seed ratios. The engine step cost is fitted to these engines first
(``--calibrate``, default: ``skyrl_cli.routing.calibrate.measure_engines`` on the recipe's engines
started alone with the RL stage's ``--async`` layout, ~1 min) or is the simulator's default
(``--no-calibrate``: GPU-like, compare ratios only). Simulated: ``--sim-policies`` (the live ones the
simulator models, and ``sticky_kv_repin``).

What differs between the two. ``sticky_kv_repin`` (ours) runs only in the simulator: the RL stage
sends every request through vllm-router, and ``inference.router.policy`` takes only vllm-router's
own policies (``skyrl bench routing --live`` routes ours client-side, the RL stage cannot).
vllm-router 0.1.17 does have a ``kv_aware`` policy (routing by the engines' KV events, with an
optional session-affinity TTL), the nearest to ours, but the recipe schema does not accept it and
the plan starts neither the engines' KV-event publisher nor the router's ``--kv-event-source``. The simulator's trainer is a sleep on no core; the live learner
computes on the engines' cores. The simulator has no weight-sync pause (live: engines paused for
``timing/sync_weights_s`` each step), draws environment delays and lengths from fixed distributions
(live: the model's own response lengths, the orchestrator's per-turn work, modelled only as the
fitted ``request_overhead_s``), counts over the whole run instead of a steady-state window, and
routes every trajectory as its own session from turn 0 (live: turn 0 of a group is one ``n =
samples_per_prompt`` request under the group's session id; the trajectories' sessions start at
turn 1). Live runs are single measurements made one after another on a shared 2-core machine:
their scatter is tens of percent (``benchmarks/RESULTS.md``, live replay; in the smoke run one
policy's wall time went from 67 to 119 s with the machine's load), so use ``--repeats`` on a quiet
machine and read ratios.

Duration (2-core machine, extrapolated from the smoke run): per policy ~35 s of start-up (the
engine-model job, 2 engines, learner, the first evaluation), ~8-10 s per step and ~15 s at the end
(final evaluation and checkpoint): ~4 min per run; the default (3 policies x 20 steps, calibration)
~13-15 min on a quiet machine, more on a loaded one; x ``--repeats``. The smoke run (the second
command below: 2 policies, 3 steps of 2 x 4 trajectories, 30 turns, calibration with 0.5 s windows) took 277 s on
the busy machine.

    python benchmarks/bench_agentic_routing.py --out /tmp/agentic --json /tmp/agentic/results.json
    python benchmarks/bench_agentic_routing.py --policies consistent_hash,sticky_least_loaded \\
        --steps 3 --warmup 1 --turns 30 --prompts-per-step 2 --calibrate-window 0.5 --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: benchmarks.agentic must import from the repository root
    sys.path.insert(0, str(REPO))
ENVIRONMENT = "benchmarks.agentic.long_chat:LongChat"  # found from the repository root (the cwd of skyrl)
BASELINE = "consistent_hash"  # the release's default: every ratio is against it
DEFAULT_POLICIES = ("consistent_hash", "sticky_least_loaded", "round_robin")
MIN_WINDOW_S = 15.0  # three of the engine scraper's 5 s samples
PROMPT_DIGITS = 2  # addition prompts like "94+05=": 9 prompt tokens with the char template
CHAT_MARKERS_PER_OBSERVATION = 2  # <|user|> before it, <|assistant|> after it (eos is the model's own)


# ------------------------------------------------------------------------------------------ args
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="live runs (vllm-router policies)")
    p.add_argument(
        "--sim-policies",
        default=None,
        help="simulated policies (default: the live ones the simulator knows, and sticky_kv_repin)",
    )
    p.add_argument("--steps", type=int, default=20, help="RL steps per policy")
    p.add_argument("--warmup", type=int, default=3, help="first batches left out of the steady-state figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-concurrency", type=int, default=32, help="in-flight requests (= trajectories)")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--turns", type=int, default=40, help="mean model turns per episode")
    p.add_argument(
        "--turns-spread",
        type=int,
        default=10,
        help="each prompt's episodes take turns +- this many (uniform): groups do not all end together",
    )
    p.add_argument("--observation-chars", type=int, default=12, help="characters of each user message")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--env-delay", type=float, default=0.1, help="mean environment step, s (log-normal)")
    p.add_argument("--hidden", type=int, default=128, help="tiny model: hidden size")
    p.add_argument("--layers", type=int, default=4, help="tiny model: layers")
    p.add_argument("--heads", type=int, default=4, help="tiny model: heads (hidden / heads: a vLLM head size)")
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--kv-ratio", type=float, default=0.75, help="KV cache per engine / planned working set")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache per engine (overrides --kv-ratio)")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--calibrate-window", type=float, default=2.5, help="seconds per measured request shape")
    p.add_argument("--sim-seeds", type=int, default=3)
    p.add_argument(
        "--repeats", type=int, default=1, help="live runs per policy (order rotated each repeat; medians reported)"
    )
    p.add_argument("--reuse", action="store_true", help="keep a completed run directory of a policy under --out")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="extra --set")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one skyrl rl run may take")
    p.add_argument("--out", type=Path, default=None, help="run directories (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--skyrl", default=str(Path(sys.executable).with_name("skyrl")))
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")
    args.turns_spread = max(0, min(args.turns_spread, args.turns - 1))
    per_turn = args.observation_chars + CHAT_MARKERS_PER_OBSERVATION + args.max_new_tokens
    if (args.turns + args.turns_spread) * per_turn + 16 > args.max_model_len:
        print(
            "note: the longest episodes ((--turns + --turns-spread) x (observation + markers + response)) exceed "
            "--max-model-len; their last turns end with finish_reason 'length'",
            file=sys.stderr,
        )
    return args


def max_turns(args) -> int:
    return args.turns + args.turns_spread


def turns_cv(args) -> float:
    """The coefficient of variation of the rows' turn counts (uniform integers turns +- spread)."""
    n = 2 * args.turns_spread + 1
    return math.sqrt((n * n - 1) / 12) / args.turns


def router_policies() -> tuple[str, ...]:
    """What ``inference.router.policy`` accepts (vllm-router's policies)."""
    from skyrl_contracts.schema import RouterConfig

    return typing.get_args(RouterConfig.model_fields["policy"].annotation)


def split_policies(args) -> tuple[list[str], list[str], list[str]]:
    """(live, simulated, notes)."""
    from skyrl_cli.routing.policies import POLICIES

    routable = router_policies()
    notes, live = [], []
    for name in args.policies:
        if name in routable:
            live.append(name)
        elif name in POLICIES:
            notes.append(
                f"{name}: simulated only (not a vllm-router policy: inference.router.policy takes "
                f"{', '.join(routable)}; the RL stage routes every request through vllm-router)"
            )
        else:
            raise SystemExit(f"unknown policy {name!r}: live {', '.join(routable)}; simulated {', '.join(POLICIES)}")
    if args.sim_policies is None:
        sim = [n for n in args.policies if n in POLICIES]
        if "sticky_kv_repin" not in sim:
            sim.append("sticky_kv_repin")
            notes.append(
                "sticky_kv_repin (ours): simulated only; it is not a vllm-router policy and the RL stage routes "
                "every request through vllm-router (`skyrl bench routing --live` routes it client-side, "
                "skyrl_cli/routing/live.py)"
            )
    else:
        sim = [n.strip() for n in args.sim_policies.split(",") if n.strip()]
        unknown = [n for n in sim if n not in POLICIES]
        if unknown:
            raise SystemExit(f"the simulator has no policy {', '.join(unknown)} (it has {', '.join(POLICIES)})")
    skipped = [n for n in live if n not in POLICIES]
    if skipped:
        notes.append(f"{', '.join(skipped)}: live only (the simulator does not model it)")
    return live, sim, notes


# ------------------------------------------------------------------------------------------ set-up
def model_init(args):
    from skyrl_contracts.schema import TinyModelInit

    return TinyModelInit(
        hidden_size=args.hidden,
        layers=args.layers,
        heads=args.heads,
        max_position_embeddings=max(args.max_model_len, 512),
    )


def build_model(args, out: Path) -> tuple[Path, list[int]]:
    """The random-init tiny model (seed ``--seed``) with the addition alphabet's char tokenizer."""
    from benchmarks.agentic.long_chat import ALPHABET
    from skyrl_cli.launch.tiny_model import build_tiny_model_dir

    model = out / "model"
    ids = build_tiny_model_dir(model_init(args), ALPHABET, model, seed=args.seed)
    return model, ids


def write_rows(args, out: Path) -> tuple[Path, Path]:
    """Training rows (addition prompts with the episode's shape) and a few cheap held-out rows."""
    from backends.data.tasks import get_task

    task = get_task("addition", PROMPT_DIGITS)
    shape = {"observation_chars": args.observation_chars, "env_delay_s": args.env_delay}
    rng = random.Random(f"agentic-routing:{args.seed}")
    train = out / "rows.jsonl"
    n = max(4 * args.steps * args.prompts_per_step, 256)
    lines = []
    for row in task.make_rows(args.seed, n, "train"):
        turns = rng.randint(args.turns - args.turns_spread, args.turns + args.turns_spread)
        lines.append(json.dumps({**row, **shape, "turns": turns}) + "\n")
    train.write_text("".join(lines))
    # Evaluation runs at the first and the last version only (eval_every = 0), outside the window;
    # two-turn episodes keep it short.
    held = out / "eval.jsonl"
    rows = task.make_rows(args.seed, 4, "eval")
    held.write_text("".join(json.dumps({**r, **shape, "turns": 2, "env_delay_s": 0.0}) + "\n" for r in rows))
    return train, held


def kv_bytes_per_token(args) -> int:
    """K and V of every layer in the engines' dtype (bf16 on CPUs with native bf16, else fp32)."""
    from skyrl_cli.plan.machine import cpu_has_native_bf16

    return 2 * args.layers * args.hidden * (2 if cpu_has_native_bf16() else 4)


def planned_workload(args, *, trainer_step_s: float = 1.0, shape: dict | None = None):
    """The run as a simulator ``WorkloadSpec``: planned lengths, or the measured ``shape``."""
    from skyrl_cli.routing.workload import WorkloadSpec

    shape = shape or {}
    return WorkloadSpec(
        group_size=args.samples_per_prompt,
        groups_per_step=args.prompts_per_step,
        trainer_steps=args.steps,
        max_inflight_groups=max(1, args.max_concurrency // args.samples_per_prompt),
        max_staleness=args.max_staleness,
        trainer_step_s=trainer_step_s,
        turns_mean=shape.get("turns_mean", args.turns),
        turns_cv=shape.get("turns_cv", turns_cv(args)),
        prompt_mean=max(1, round(shape.get("prompt_tokens", 2 * PROMPT_DIGITS + 2 + 3))),
        response_mean=max(1, round(shape.get("response_tokens_per_turn", args.max_new_tokens))),
        observation_mean=max(
            1,
            round(shape.get("observation_tokens_per_turn", args.observation_chars + CHAT_MARKERS_PER_OBSERVATION)),
        ),
        length_sigma=0.0,
        max_response=args.max_new_tokens,
        max_context=args.max_model_len,
        env_latency_mean_s=args.env_delay,
    )


def kv_plan(args) -> dict:
    from skyrl_cli.routing.live_bench import kv_tokens_for
    from skyrl_cli.routing.workload import working_set_per_replica

    spec = planned_workload(args)
    working_set = working_set_per_replica(spec, 0, args.engines)
    per_token = kv_bytes_per_token(args)
    if args.kv_cache_bytes:
        tokens = args.kv_cache_bytes // per_token
        kv_bytes = args.kv_cache_bytes
    else:
        tokens = kv_tokens_for(spec, args.kv_ratio, working_set)
        kv_bytes = tokens * per_token
    return {
        "kv_cache_bytes": int(kv_bytes),
        "planned_kv_tokens": int(tokens),
        "bytes_per_token": per_token,
        "planned_working_set": working_set,
        "planned_ratio": tokens / working_set,
    }


def write_recipe(args, out: Path, model: Path, rows: tuple[Path, Path], kv_bytes: int) -> Path:
    import tomli_w

    train, held = rows
    recipe = {
        "name": "agentic-routing",
        "seed": args.seed,
        "model": {"path": str(model), "tokenizer": "auto"},
        "data": {"train": str(train), "eval": str(held), "eval_size": 4},
        "rl": {
            "init_from": str(model),
            "steps": args.steps,
            "prompts_per_step": args.prompts_per_step,
            "samples_per_prompt": args.samples_per_prompt,
            "max_new_tokens": args.max_new_tokens,
            "max_turns": max_turns(args),
            "environment": ENVIRONMENT,
            "learning_rate": args.learning_rate,
            "eval_every": 0,
            "save_every": 0,
            "keep_batches": True,
            "async": {"max_staleness": args.max_staleness},
        },
        "inference": {
            "engines": args.engines,
            "kv_cache_bytes": kv_bytes,
            "max_model_len": args.max_model_len,
            "max_concurrency": args.max_concurrency,
            "router": {"policy": BASELINE},
        },
        "trainer": {"ranks": 1},
    }
    path = out / "long_chat.toml"
    path.write_text(tomli_w.dumps(recipe))
    return path


# ------------------------------------------------------------------------------------------ live runs
def run_policy(args, recipe: Path, policy: str, run_dir: Path) -> tuple[dict, float]:
    summary_path = run_dir / "summary.json"
    if args.reuse and summary_path.exists():
        summary = json.loads(summary_path.read_text())
        if summary.get("completed"):
            print(f"{policy}: reusing {run_dir}", flush=True)
            return summary, float(summary.get("wall_s") or 0.0)
    argv = [args.skyrl, "rl", str(recipe), "--async", "--run-dir", str(run_dir), "--overwrite", "--quiet"]
    for item in [f"inference.router.policy={policy}", f"seed={args.seed}", *args.sets]:
        argv += ["--set", item]
    print(f"{policy}: {' '.join(argv)}", flush=True)
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{policy}: skyrl rl ran past --run-timeout {args.run_timeout:.0f} s (logs: {run_dir}/logs)")
    wall = time.monotonic() - started
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-8:])
        raise SystemExit(f"{policy}: skyrl rl failed (exit {done.returncode}), logs in {run_dir}/logs:\n{tail}")
    return json.loads(summary_path.read_text()), wall


def mean(values) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(values) if values else None


def cv(values) -> float | None:
    if not values or any(v is None for v in values):
        return None
    m = statistics.fmean(values)
    return statistics.pstdev(values) / m if m > 0 else 0.0


def loss_mask_runs(mask: list[int]) -> tuple[list[int], list[int]]:
    """Lengths of the model's turns (runs of 1) and of the observations between them (runs of 0)."""
    model, other = [], []
    run, value = 0, None
    for m in [*mask, -1]:
        if m == value:
            run += 1
            continue
        if value == 1:
            model.append(run)
        elif value == 0:
            other.append(run)
        run, value = 1, m
    return model, other


def batch_shape(run_dir: Path, batches: list[int]) -> dict:
    """Token figures of the window's batches (``rl.keep_batches``): per trajectory and per turn."""
    prompts, responses, observations, turns, contexts, model_tokens, finish = [], [], [], [], [], 0, defaultdict(int)
    for index in batches:
        path = run_dir / "batches" / f"step-{index}.json"
        if not path.exists():
            continue
        for sample in json.loads(path.read_text())["samples"]:
            mine, theirs = loss_mask_runs(sample["loss_mask"])
            prompts.append(len(sample["prompt_ids"]))
            responses += mine
            observations += theirs
            turns.append(sample["num_turns"])
            contexts.append(len(sample["prompt_ids"]) + len(sample["response_ids"]))
            model_tokens += sum(sample["loss_mask"])
            finish[str(sample.get("finish_reason"))] += 1
    if not prompts:
        return {}
    return {
        "trajectories": len(prompts),
        "prompt_tokens": statistics.fmean(prompts),
        "response_tokens_per_turn": statistics.fmean(responses) if responses else 0.0,
        "observation_tokens_per_turn": statistics.fmean(observations) if observations else 0.0,
        "turns_mean": statistics.fmean(turns),
        "turns_cv": cv(turns),
        "final_context_mean": statistics.fmean(contexts),
        "final_context_max": max(contexts),
        "model_tokens": model_tokens,
        "finish_reasons": dict(finish),
    }


def steady_state(run_dir: Path, warmup: int, steps: int) -> dict:
    """The run's figures over the batches after the first ``warmup`` (see the module docstring)."""
    from skyrl_contracts.events import iter_events

    events = list(iter_events(run_dir / "events.jsonl"))
    batch_events = sorted(
        (e for e in events if e.name == "rollout/tokens_per_s" and e.process == "orchestrator"), key=lambda e: e.step
    )
    by_step = {e.step: e for e in batch_events}
    if steps not in by_step:
        raise SystemExit(f"{run_dir}: no rollout/tokens_per_s event for the last batch (step {steps})")
    # Generation starts after the first evaluation; the steady state once the engines serve the
    # version after `warmup` learner steps, and it ends with the last batch the learner trains on.
    first_eval = [e.time for e in events if e.name == "eval/accuracy" and e.process == "orchestrator"]
    start = min(first_eval) if first_eval else min(e.time for e in events)
    served = {int(e.value): e.time for e in events if e.name == "weights/version" and e.process == "orchestrator"}
    t1 = by_step[steps].time
    t0 = served.get(warmup, start) if warmup > 0 else start
    steady = t1 - t0 >= MIN_WINDOW_S
    if not steady:  # generation ran ahead of the learner past the last batch: the whole run instead
        t0 = start
    span = max(t1 - t0, 1e-9)
    window = [e for e in batch_events if t0 < e.time <= t1]  # batches written in the window
    # rollout/tokens_per_s is the rate since the previous batch: count the part of it inside the window.
    rollout_tokens, previous = 0.0, start
    for e in batch_events:
        if e.time > t0 and e.time <= t1:
            rollout_tokens += e.value * max(e.time - max(previous, t0), 0.0)
        previous = e.time

    def in_window(name: str, process: str | None = None) -> list[float]:
        return [e.value for e in events if e.name == name and t0 < e.time <= t1 and process in (None, e.process)]

    def step_values(name: str) -> list[float]:
        return [e.value for e in events if e.name == name and warmup < e.step <= steps]

    engines = sorted(
        {int(e.name.split("/")[1]) for e in events if e.name.startswith("engine/") and e.name.split("/")[1].isdigit()}
    )
    per_engine_gen = [mean(in_window(f"engine/{i}/gen_tokens_per_s")) for i in engines]
    # Hit rates of the 5 s intervals, weighted by the interval's generation (a proxy for its
    # requests: the scraper logs no query counts); both come from one scrape, with one time stamp.
    activity = {e.time: e.value for e in events if e.name == "engine/gen_tokens_per_s" and t0 < e.time <= t1}
    hits = [
        (e.value, activity.get(e.time, 0.0))
        for e in events
        if e.name == "engine/prefix_cache_hit_rate" and t0 < e.time <= t1
    ]
    weight = sum(w for _, w in hits)
    routers = sorted({e.name for e in events if e.name.startswith("router/load/")})
    router_load = [mean(in_window(name)) for name in routers]
    shape = batch_shape(run_dir, list(range(steps)))  # the workload's shape: every batch
    window_shape = batch_shape(run_dir, [e.step - 1 for e in window])
    blocked = [e for e in events if e.name == "async/generation_blocked_s"]
    blocked_in = [e.value for e in blocked if t0 < e.time <= t1]
    learner = [a + b for a, b in zip(step_values("timing/train_s"), step_values("timing/publish_weights_s"))]
    return {
        "steady": steady,
        "window_s": span,
        "window_batches": len(window),
        "engine_samples": len(in_window("engine/gen_tokens_per_s")),
        "gen_tokens_per_s": mean(in_window("engine/gen_tokens_per_s")),
        "per_engine_gen_tokens_per_s": per_engine_gen,
        "gen_tokens_cv": cv(per_engine_gen),
        "prefix_hit_rate": sum(h * w for h, w in hits) / weight if weight > 0 else mean([h for h, _ in hits]),
        "prefix_hit_rate_unweighted": mean([h for h, _ in hits]),
        "running_cv": mean(in_window("engine/running_cv")),
        "running_mean": mean(in_window("engine/running")),
        "waiting_mean": mean(in_window("engine/waiting")),
        "kv_cache_usage": mean(in_window("engine/kv_cache_usage")),
        "per_engine_kv_cache_usage": [mean(in_window(f"engine/{i}/kv_cache_usage")) for i in engines],
        "preemptions": sum(in_window("engine/preemptions")),
        "router_load": router_load or None,  # None: the router reported no load (vLLM engines: -1)
        "router_load_cv": cv(router_load) if router_load else None,
        "rollout_tokens_per_s": rollout_tokens / span,
        "model_tokens_per_s": window_shape["model_tokens"] / span if window_shape else None,
        "step_time_s": span / max(len(window), 1),
        "learner_step_s": mean(learner),
        "learner_wait_for_batch_s": mean(step_values("timing/wait_for_batch_s")),
        "generation_blocked_s": (max(blocked_in) - min(blocked_in)) if len(blocked_in) > 1 else 0.0,
        "sync_weights_s": mean(step_values("timing/sync_weights_s")),
        "staleness_mean": mean(step_values("async/staleness_mean")),
        "reward_mean": mean(step_values("rollout/reward_mean")),
        "rollout_errors": max([e.value for e in events if e.name == "rollout/errors"], default=0.0),
        "shape": shape,
    }


def kv_capacity(run_dir: Path, engines: int) -> list[int | None]:
    from skyrl_cli.routing.live import kv_capacity_from_log

    return [kv_capacity_from_log(run_dir / "logs" / f"engine-{i}.log") for i in range(engines)]


def summarize(runs: list[dict]) -> dict:
    """One policy's repeats: the median of every number, every run kept under ``runs``."""
    if len(runs) == 1:
        return {**runs[0], "runs": runs}
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out = {k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in keys}
    out["steady"] = all(r["steady"] for r in runs)
    out["runs"] = runs
    return out


def say_run(args, policy: str, figures: dict) -> None:
    print(
        f"{policy}: engine gen {fmt(figures['gen_tokens_per_s'])} tok/s, prefix hit "
        f"{fmt(figures['prefix_hit_rate'], '.2f')}, rollout {fmt(figures['rollout_tokens_per_s'])} tok/s, "
        f"wall {fmt(figures['wall_s'])} s ({figures['engine_samples']} engine samples, "
        f"{figures['window_batches']} batches in the window)",
        flush=True,
    )
    if not figures["steady"]:
        print(
            f"{policy}: warning: the last batch was written within {MIN_WINDOW_S:.0f} s of the engines serving "
            f"version {args.warmup} (generation ran ahead of the learner): these figures are over the whole "
            "run, not a steady state; use more --steps",
            flush=True,
        )


# ------------------------------------------------------------------------------------------ calibration
def calibrate(args, recipe_path: Path, model: Path, token_pool: list[int], out: Path):
    """The engines' step cost, fitted on the run's own engine configuration started alone."""
    from skyrl_cli.launch.supervisor import Supervisor
    from skyrl_cli.plan.inference import Machine, all_engine_urls, engine_specs
    from skyrl_cli.recipe.loader import load_recipe
    from skyrl_cli.routing import calibrate as cal
    from skyrl_cli.routing import live as lv
    from skyrl_contracts.ports import find_free_ports

    recipe = load_recipe(recipe_path)
    machine = Machine(device="cpu", engine_cores=tuple(sorted(os.sched_getaffinity(0))))
    ports = find_free_ports(recipe.inference.engines)
    specs = engine_specs(recipe, machine, ports, str(model), async_mode=True)  # the RL run's engine layout
    urls = all_engine_urls(recipe, machine, ports)

    async def measure():
        async with lv.http_client() as http:
            return await cal.measure_engines(http, urls, token_pool, args.seed, window_s=args.calibrate_window)

    where = out / "calibration"
    print(f"calibration: starting {len(specs)} engines alone to fit the simulator's step cost ...", flush=True)
    with Supervisor(where) as sup:
        for spec in specs:
            sup.start(spec)
        sup.wait_ready([s.name for s in specs])
        fitted = asyncio.run(measure())
    print(
        f"calibration: request overhead {fitted.request_overhead_s * 1e3:.1f} ms, max fit error "
        f"{fitted.max_relative_error:.0%} (logs in {where}/logs)",
        flush=True,
    )
    return fitted


# ------------------------------------------------------------------------------------------ simulation
@dataclass
class SimFigures:
    policy: str
    gen_tokens_per_s: float
    vs_baseline: float | None
    prefix_hit_rate: float
    running_cv: float
    preemptions: float
    step_time_s: float
    per_seed: list[dict]


def simulate(args, policies: list[str], workload, capacity: int, fitted) -> dict[str, SimFigures]:
    from skyrl_cli.routing.engine_model import StepCost
    from skyrl_cli.routing.live_bench import CPU_BLOCK_SIZE, CPU_MAX_BATCHED_TOKENS
    from skyrl_cli.routing.simulator import SimConfig
    from skyrl_cli.routing.simulator import simulate as run_sim

    cost = fitted.cost if fitted is not None else StepCost()
    overhead = fitted.request_overhead_s if fitted is not None else 0.0
    results = {}
    for policy in policies:
        results[policy] = [
            run_sim(
                SimConfig(
                    policy=policy,
                    replicas=args.engines,
                    kv_capacity=capacity,
                    cost=cost,
                    workload=workload,
                    seed=seed,
                    max_num_seqs=64,  # inference.max_num_seqs's default, which the recipe keeps
                    max_num_batched_tokens=CPU_MAX_BATCHED_TOKENS,
                    block_size=CPU_BLOCK_SIZE,
                    request_overhead_s=overhead,
                )
            )
            for seed in range(args.sim_seeds)
        ]
    base = results.get(BASELINE)
    out = {}
    for policy, runs in results.items():
        ratio = None
        if base is not None:
            ratio = statistics.fmean(
                a.gen_tokens_per_s / b.gen_tokens_per_s for a, b in zip(runs, base) if b.gen_tokens_per_s > 0
            )
        out[policy] = SimFigures(
            policy=policy,
            gen_tokens_per_s=statistics.fmean(r.gen_tokens_per_s for r in runs),
            vs_baseline=ratio,
            prefix_hit_rate=statistics.fmean(r.prefix_hit_rate for r in runs),
            running_cv=statistics.fmean(r.running_cv for r in runs),
            preemptions=statistics.fmean(r.preemptions for r in runs),
            step_time_s=statistics.fmean(r.step_time_s for r in runs),
            per_seed=[r.to_dict() for r in runs],
        )
    return out


# ------------------------------------------------------------------------------------------ report
def fmt(value, spec: str = ".0f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def render(live: dict[str, dict], sim: dict[str, SimFigures], baseline: str | None, header: str) -> str:
    lines = [header, ""]
    cols = [
        ("policy", 20),
        ("gen tok/s", 9),
        ("x base", 6),
        ("hit", 5),
        ("gen CV", 6),
        ("run CV", 6),
        ("preempt", 7),
        ("rollout tok/s", 13),
        ("x base", 6),
        ("model tok/s", 11),
        ("step s", 6),
        ("learner s", 9),
        ("wait s", 6),
        ("wall s", 6),
    ]
    lines.append("live (steady state): " + (f"ratios against {baseline}" if baseline else "no baseline run"))
    lines.append("  ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w) in enumerate(cols)))
    base = live.get(baseline) if baseline else None
    for policy, r in live.items():
        cells = [
            fmt(r["gen_tokens_per_s"]),
            fmt(ratio(r["gen_tokens_per_s"], base and base["gen_tokens_per_s"]), ".2f", "x"),
            fmt(r["prefix_hit_rate"] and r["prefix_hit_rate"] * 100, ".0f", "%"),
            fmt(r["gen_tokens_cv"], ".2f"),
            fmt(r["running_cv"], ".2f"),
            fmt(r["preemptions"]),
            fmt(r["rollout_tokens_per_s"]),
            fmt(ratio(r["rollout_tokens_per_s"], base and base["rollout_tokens_per_s"]), ".2f", "x"),
            fmt(r["model_tokens_per_s"]),
            fmt(r["step_time_s"], ".2f"),
            fmt(r["learner_step_s"], ".2f"),
            fmt(r["learner_wait_for_batch_s"], ".2f"),
            fmt(r["wall_s"]),
        ]
        name = policy if r.get("steady", True) else policy + " *"
        lines.append("  ".join([f"{name:<20}"] + [f"{c:>{w}}" for c, (_, w) in zip(cells, cols[1:])]))
    if not all(r.get("steady", True) for r in live.values()):
        lines.append("* not a steady state (generation ran ahead of the learner): figures over the whole run")
    lines.append("")
    lines.append(f"simulated (same shape; mean over seeds, ratios per seed against {BASELINE}):")
    scols = [("policy", 20), ("gen tok/s", 9), ("x base", 6), ("hit", 5), ("run CV", 6), ("preempt", 7), ("step s", 6)]
    lines.append("  ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w) in enumerate(scols)))
    for policy, s in sim.items():
        cells = [
            fmt(s.gen_tokens_per_s),
            fmt(s.vs_baseline, ".2f", "x"),
            fmt(s.prefix_hit_rate * 100, ".0f", "%"),
            fmt(s.running_cv, ".2f"),
            fmt(s.preemptions),
            fmt(s.step_time_s, ".2f"),
        ]
        lines.append("  ".join([f"{policy:<20}"] + [f"{c:>{w}}" for c, (_, w) in zip(cells, scols[1:])]))
    both = [p for p in live if p in sim]
    if baseline and baseline in sim and len(both) > 1:
        lines.append("")
        lines.append(f"gen tok/s against {baseline}, live vs simulated:")
        for p in both:
            if p == baseline:
                continue
            lv_ratio = ratio(live[p]["gen_tokens_per_s"], live[baseline]["gen_tokens_per_s"])
            lines.append(f"  {p:<20} live {fmt(lv_ratio, '.2f', 'x')}  simulated {fmt(sim[p].vs_baseline, '.2f', 'x')}")
    return "\n".join(lines)


def write_json(path: Path | None, report: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> None:
    args = parse_args(argv)
    live_policies, sim_policies, notes = split_policies(args)
    out = (args.out or Path(tempfile.mkdtemp(prefix="skyrl-agentic-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for note in notes:
        print(f"note: {note}", flush=True)

    print(f"building the tiny model in {out / 'model'} ...", flush=True)
    model, token_pool = build_model(args, out)
    rows = write_rows(args, out)
    kv = kv_plan(args)
    recipe = write_recipe(args, out, model, rows, kv["kv_cache_bytes"])
    print(
        f"recipe {recipe}: {args.engines} engines, KV {kv['kv_cache_bytes']:,} B per engine "
        f"(~{kv['planned_kv_tokens']:,} "
        f"tokens, {kv['planned_ratio']:.2f} x the planned working set of {kv['planned_working_set']:,.0f})",
        flush=True,
    )
    report: dict = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "recipe": str(recipe),
        "out": str(out),
        "notes": notes,
        "kv": kv,
        "planned_workload": asdict(planned_workload(args)),
        "live": {},
    }
    write_json(args.json, report)

    fitted = None
    if args.calibrate:
        fitted = calibrate(args, recipe, model, token_pool, out)
        report["calibration"] = fitted.to_dict()
        write_json(args.json, report)

    from skyrl_cli.routing.live_bench import rotated

    runs: dict[str, list[dict]] = {p: [] for p in live_policies}
    for repeat in range(args.repeats):
        for policy in rotated(live_policies, repeat):  # no policy always runs first while the load drifts
            run_dir = out / (policy if repeat == 0 else f"{policy}-r{repeat}")
            summary, wall = run_policy(args, recipe, policy, run_dir)
            figures = steady_state(run_dir, args.warmup, args.steps)
            figures["wall_s"] = summary.get("wall_s", wall)
            figures["kv_capacity_tokens"] = kv_capacity(run_dir, args.engines)
            figures["run_dir"] = str(run_dir)
            figures["repeat"] = repeat
            runs[policy].append(figures)
            report["live"][policy] = summarize(runs[policy])
            write_json(args.json, report)
            say_run(args, policy, figures)
    live = {p: summarize(rs) for p, rs in runs.items() if rs}

    # The simulated workload: the live runs' measured shape and learner step, the engines' KV capacity.
    shapes = [r["shape"] for rs in runs.values() for r in rs if r.get("shape")]
    shape = (
        {
            k: statistics.fmean(s[k] for s in shapes)
            for k in (
                "prompt_tokens",
                "response_tokens_per_turn",
                "observation_tokens_per_turn",
                "turns_mean",
                "turns_cv",
            )
        }
        if shapes
        else {}
    )
    learner = [r["learner_step_s"] for rs in runs.values() for r in rs if r.get("learner_step_s")]
    trainer_step_s = statistics.median(learner) if learner else 1.0
    capacities = [c for rs in runs.values() for r in rs for c in r["kv_capacity_tokens"] if c]
    capacity = min(capacities) if capacities else kv["planned_kv_tokens"]
    workload = planned_workload(args, trainer_step_s=trainer_step_s, shape=shape)
    from skyrl_cli.routing.workload import working_set_per_replica

    working_set = working_set_per_replica(workload, 0, args.engines)
    capacity = max(capacity, workload.max_context + 1)
    sim = simulate(args, sim_policies, workload, capacity, fitted)
    report["simulation"] = {
        "workload": asdict(workload),
        "kv_capacity_tokens": capacity,
        "working_set_tokens": working_set,
        "kv_ratio": capacity / working_set,
        "cost": "fitted to these engines" if fitted is not None else "simulator default (GPU-like)",
        "results": {p: asdict(s) for p, s in sim.items()},
    }
    baseline = BASELINE if BASELINE in live else (next(iter(live)) if live else None)
    report["live_vs_baseline"] = (
        {
            p: {
                "gen_tokens_per_s": ratio(r["gen_tokens_per_s"], live[baseline]["gen_tokens_per_s"]),
                "rollout_tokens_per_s": ratio(r["rollout_tokens_per_s"], live[baseline]["rollout_tokens_per_s"]),
                "model_tokens_per_s": ratio(r["model_tokens_per_s"], live[baseline]["model_tokens_per_s"]),
                "step_time_s": ratio(r["step_time_s"], live[baseline]["step_time_s"]),
            }
            for p, r in live.items()
        }
        if baseline
        else {}
    )
    report["elapsed_s"] = time.monotonic() - started
    write_json(args.json, report)

    header = (
        f"agentic routing: {args.engines} CPU engines, {args.prompts_per_step}x{args.samples_per_prompt} trajectories "
        f"per step, {args.max_concurrency} in flight, {args.turns}+-{args.turns_spread} turns of <= "
        f"{args.max_new_tokens} tokens + "
        f"{shape.get('observation_tokens_per_turn', args.observation_chars + 2):.0f}-token observations, env step "
        f"{args.env_delay:g} s, staleness {args.max_staleness}, {args.steps} steps (first {args.warmup} left out), "
        f"seed {args.seed}\nKV {capacity:,} tokens per engine = {capacity / working_set:.2f} x the working set "
        f"({working_set:,.0f}); simulator cost: {report['simulation']['cost']}; learner step "
        f"{trainer_step_s:.2f} s"
    )
    print()
    print(render(live, sim, baseline, header))
    for note in notes:
        print(f"note: {note}")
    print(
        f"\nrun directories: {out}; {report['elapsed_s']:.0f} s in all"
        + (f"; figures: {args.json}" if args.json else "")
    )


if __name__ == "__main__":
    main()
