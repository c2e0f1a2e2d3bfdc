"""A recipe at its real model size, end to end on this machine: a few RL steps with every process's
peak memory and each step split into its phases, and each phase beside its limit on the same
machine, measured in the same run.

The run is ``skyrl rl`` as a user starts it (real vLLM engine, router, orchestrator, DeepSpeed
learner). While it goes, every process's resident memory is sampled (``run_watch.ProcessMemory``)
and the batches and weight versions it deletes behind it are kept. Per step, from ``events.jsonl``:

- generation: ``timing/generate_s``, the batch's groups from the first starting to the last finishing;
- learner: ``timing/prepare_s`` (advantages, layout), ``timing/forward_backward_s`` (the KL
  reference's forward included), ``timing/optimizer_s`` (DeepSpeed's step);
- publish: ``timing/publish_weights_s`` (the learner writes the version);
- engine load: ``timing/sync_weights_s`` (pause, load the version into every engine, resume);
- orchestrator overhead: the step's wall time (between the learner's step events) less all of these.

Then the limits, each on the run's own inputs after the run ended (nothing else running):

- the engine driven directly: vLLM's offline ``LLM`` with the engine's own arguments and
  environment (from ``plan.json``), on the kept batches' prompts with the run's sampling settings:
  generated tokens/s against ours (the batch's sampled tokens / ``timing/generate_s``);
- a bare PyTorch loop over the same model, dtype, threads and batches (the same mini-batch slices,
  the KL reference's forward when the recipe has one, AdamW at the recipe's learning rate): tokens/s
  against the learner's (the same tokens / forward-backward + optimizer + prepare);
- the disk: the version's bytes written and fsynced, and read back, against publish and engine load.

    python benchmarks/make_shape_model.py --config benchmarks/model_configs/qwen2.5-0.5b-instruct.json --out /tmp/q05
    python benchmarks/bench_shape_phases.py --model /tmp/q05 --steps 3 --json shape.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its neighbours import
from run_watch import Keeper, ProcessMemory, event_times, per_step, rl_argv, versions, work_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PHASES = (
    ("generation", "timing/generate_s"),
    ("learner: prepare", "timing/prepare_s"),
    ("learner: forward + backward", "timing/forward_backward_s"),
    ("learner: optimizer", "timing/optimizer_s"),
    ("publish (learner writes)", "timing/publish_weights_s"),
    ("engine load (sync)", "timing/sync_weights_s"),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", type=Path, default=REPO / "benchmarks/shapes/qwen0.5b.toml")
    p.add_argument("--model", type=Path, required=True, help="the model (make_shape_model.py's output)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--out", type=Path, default=None, help="keep the runs here (default: a temporary directory, removed at the end)"
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--skyrl", default=str(Path(sys.executable).with_name("skyrl")))
    p.add_argument("--direct-engine", type=Path, help=argparse.SUPPRESS)  # child mode: the engine's limit
    p.add_argument("--bare-learner", type=Path, help=argparse.SUPPRESS)  # child mode: the learner's limit
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ the run


def run_rl(args, out: Path) -> tuple[Path, ProcessMemory, float]:
    run_dir = out / "rl"
    sets = [
        f"model.path={args.model.resolve()}",
        f"rl.init_from={args.model.resolve()}",
        f"rl.steps={args.steps}",
        "rl.eval_every=0",
        "rl.save_every=0",
        *args.sets,
    ]
    argv = rl_argv(args.skyrl, args.recipe, run_dir, sets)
    started = time.monotonic()
    with (
        Keeper(run_dir / "batches", out / "batches", lambda p: p.suffix == ".json"),
        Keeper(run_dir / "weights", out / "versions", versions),
    ):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with ProcessMemory(proc.pid) as memory:
            output, _ = proc.communicate()
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-8:])
        raise SystemExit(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{tail}")
    return run_dir, memory, time.monotonic() - started


def kept_batches(out: Path) -> dict[int, list[dict]]:
    """learner step -> the samples it trained (the orchestrator's ``batches/step-<k>.json`` is the
    batch of learner step k + 1)."""
    batches = {}
    for path in sorted((out / "batches").glob("step-*.json")):
        batches[int(path.stem.split("-")[1]) + 1] = json.loads(path.read_text())["samples"]
    return batches


def step_phases(run_dir: Path, steps: int) -> dict[int, dict[str, float]]:
    """Per learner step k: each phase's seconds, and from step 2 on the wall time between the
    learner's step events k - 1 and k and what of it no phase accounts for. In that interval, in a
    synchronous run: the engines load version k - 1, generate batch k, the learner trains on it and
    writes version k (the batch's figures and the learner's carry step k, the load of version k - 1
    carries step k - 1)."""
    rows = per_step(run_dir)
    ends = event_times(run_dir, "train/policy_loss")
    out = {}
    for k in range(1, steps + 1):
        this, before = rows.get(k, {}), rows.get(k - 1, {})
        phase = {label: this.get(name) for label, name in PHASES if name != "timing/sync_weights_s"}
        phase["engine load (sync)"] = before.get("timing/sync_weights_s") if k > 1 else None
        phase = {label: value for label, value in phase.items() if value is not None}
        if k - 1 in ends and k in ends:
            wall = ends[k] - ends[k - 1]
            phase["step wall time"] = wall
            phase["orchestrator and the rest"] = wall - sum(phase[label] for label, _ in PHASES if label in phase)
        out[k] = phase
    return out


def sampled_tokens(samples: list[dict]) -> int:
    return sum(sum(s["loss_mask"]) for s in samples)


def all_tokens(samples: list[dict]) -> int:
    return sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)


# ------------------------------------------------------------------------------ limits


def argv_value(argv: list[str], flag: str, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


def direct_engine_spec(argv: list[str], batches: dict[int, list[dict]], rl: dict) -> dict:
    """The engine's own arguments (its argv in ``plan.json``), the batches' prompts, the run's sampling."""
    model = argv[argv.index("backends.inference.serve") + 1]
    return {
        "model": model,
        "dtype": argv_value(argv, "--dtype", "auto"),
        "max_model_len": int(argv_value(argv, "--max-model-len")),
        "max_num_seqs": int(argv_value(argv, "--max-num-seqs", 256)),
        "seed": int(argv_value(argv, "--seed", 0)),
        "kv_cache_memory_bytes": int(argv_value(argv, "--kv-cache-memory-bytes", 0)) or None,
        "enforce_eager": "--enforce-eager" in argv,
        "logprobs_mode": argv_value(argv, "--logprobs-mode"),
        "temperature": rl["temperature"],
        "max_tokens": rl["max_new_tokens"],
        "batches": {k: [s["prompt_ids"] for s in samples] for k, samples in batches.items()},
    }


def run_direct_engine(spec_path: Path) -> None:
    """Child: vLLM's offline engine on the batches' prompts; prints {batch: [tokens, seconds]}."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(spec_path.read_text())
    options = {key: spec[key] for key in ("dtype", "max_model_len", "max_num_seqs", "seed", "enforce_eager")}
    if spec["kv_cache_memory_bytes"]:
        options["kv_cache_memory_bytes"] = spec["kv_cache_memory_bytes"]
    if spec["logprobs_mode"]:
        options["logprobs_mode"] = spec["logprobs_mode"]
    llm = LLM(model=spec["model"], **options)
    # logprobs=0: the sampled token's logprob, as the rollouts ask for it
    params = SamplingParams(temperature=spec["temperature"], max_tokens=spec["max_tokens"], logprobs=0)
    first = next(iter(spec["batches"].values()))
    llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in first], params, use_tqdm=False)  # warm-up
    timed = {}
    for k, prompts in spec["batches"].items():
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        timed[k] = [sum(len(o.outputs[0].token_ids) for o in outputs), seconds]
    print("DIRECT " + json.dumps(timed), flush=True)


def run_bare_learner(spec_path: Path) -> None:
    """Child: the learner's work on the batches in plain PyTorch (no DeepSpeed, no framework): per
    mini-batch slice one padded forward with grad, the reference's forward when there is a KL
    term, backward, AdamW; prints {batch: [tokens, seconds]}."""
    import torch
    from transformers import AutoModelForCausalLM

    from backends.train.rl.minibatch import group_slices

    spec = json.loads(spec_path.read_text())
    dtype = getattr(torch, spec["dtype"])
    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).train()
    reference = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval() if spec["kl"] else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=spec["learning_rate"])

    def update(rows: list[list[int]]) -> None:
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        logprobs = torch.log_softmax(policy(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        taken = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
        if reference is not None:
            with torch.no_grad():
                reference(input_ids=ids, attention_mask=mask)
        (-taken.sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timed = {}
    for step, (k, samples) in enumerate(spec["batches"].items()):
        rows = [s["prompt_ids"] + s["response_ids"] for s in samples]
        slices = group_slices([s["prompt_uid"] for s in samples], spec["mini_batches"])
        started = time.perf_counter()
        for members in slices:
            update([rows[i] for i in members])
        if step > 0:  # the first is the warm-up (allocations, optimizer states)
            timed[k] = [sum(len(r) for r in rows), time.perf_counter() - started]
    print("BARE " + json.dumps(timed), flush=True)


def child(mode: str, spec: dict, env: dict[str, str], out: Path) -> dict:
    path = out / f"{mode}.json"
    path.write_text(json.dumps(spec))
    flag = {"DIRECT": "--direct-engine", "BARE": "--bare-learner"}[mode]
    done = subprocess.run(
        [sys.executable, __file__, "--model", spec["model"], flag, str(path)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith(mode + " ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"the {mode.lower()} limit failed:\n" + "\n".join(done.stderr.splitlines()[-12:]))
    return json.loads(line[len(mode) + 1 :])


def disk_limit(version_dir: Path, scratch: Path) -> dict[str, float]:
    """The version's bytes written and fsynced to the run's file system, then read back."""
    payload = [f.read_bytes() for f in sorted(version_dir.rglob("*")) if f.is_file()]
    scratch.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i, data in enumerate(payload):
        with open(scratch / f"part-{i}", "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    written = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(len(payload)):
        (scratch / f"part-{i}").read_bytes()
    read = time.perf_counter() - started
    size = sum(len(d) for d in payload)
    return {"bytes": size, "write_s": written, "read_s": read}


def largest_micro_batch(batches: dict[int, list[dict]], mini_batches: int, budget: int) -> int:
    """The largest micro-batch the learner laid out, padding included: each step's slices of whole
    groups, padded to their longest row, within the token budget."""
    from backends.train.rl.minibatch import group_slices

    largest = 0
    for samples in batches.values():
        lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
        for members in group_slices([s["prompt_uid"] for s in samples], mini_batches):
            longest = max(lengths[i] for i in members)
            largest = max(largest, min(len(members), max(1, budget // longest)) * longest)
    return largest


def learner_estimate(run_dir: Path, batches: dict[int, list[dict]]) -> dict:
    """What ``skyrl recipes validate`` estimates for one learner rank of this run (on CPU: its
    resident memory, the process itself included), at the largest micro-batch the run laid out,
    part by part."""
    from skyrl_cli.plan.fit import Hardware, trainer_setup
    from skyrl_cli.plan.memory import trainer_rank_memory
    from skyrl_cli.plan.shape import ModelShape
    from skyrl_contracts.schema import Recipe

    recipe = Recipe.model_validate_json((run_dir / "recipe.resolved.json").read_text())
    config = json.loads((Path(recipe.rl.init_from) / "config.json").read_text())
    setup = trainer_setup(recipe, "rl", Hardware(gpus=1, gpu_bytes=None, gpu=None, device="cpu"))
    tokens = largest_micro_batch(batches, recipe.rl.mini_batches, recipe.rl.max_tokens_per_microbatch)
    memory = trainer_rank_memory(ModelShape.from_config(config), dataclasses.replace(setup, micro_batch_tokens=tokens))
    return {"micro_batch_tokens": tokens, "peak": memory.peak, "parts": dict(memory.parts())}


FRAMEWORK = (
    "import deepspeed, transformers, backends.train.rl_learner, psutil; print(psutil.Process().memory_info().rss)"
)


def framework_rss(env: dict[str, str]) -> int:
    """A learner rank's resident size before it loads a model: the interpreter, torch, DeepSpeed and
    transformers (for comparison with the estimate's ``TRAINER_CPU_RUNTIME_BYTES``)."""
    done = subprocess.run(
        [sys.executable, "-c", FRAMEWORK], env={**os.environ, **env}, capture_output=True, text=True, cwd=REPO
    )
    return int(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ report


def med(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def limits(run_dir: Path, out: Path, phases: dict[int, dict], batches: dict[int, list[dict]]) -> dict:
    """Each phase's limit, on the steps after the first (step 1 pays the engine's and the learner's
    warm-up)."""
    recipe = json.loads((run_dir / "recipe.resolved.json").read_text())
    rl = recipe["rl"]
    timed = [k for k in sorted(phases) if k > 1 and k in batches] or [k for k in sorted(phases) if k in batches]
    plan = json.loads((run_dir / "plan.json").read_text())
    engine = next(p for p in plan["processes"] if p["role"] == "engine")
    trainer = next(p for p in plan["processes"] if p["role"] == "trainer")
    direct = child("DIRECT", direct_engine_spec(engine["argv"], {k: batches[k] for k in timed}, rl), engine["env"], out)
    learner_dtype = "bfloat16" if recipe["model"]["dtype"] == "bfloat16" else "float32"  # the CPU learner's
    bare_spec = {
        "model": rl["init_from"],
        "dtype": learner_dtype,
        "kl": bool(rl["kl"]["coef"]),
        "learning_rate": rl["learning_rate"],
        "mini_batches": rl["mini_batches"],
        "batches": {k: batches[k] for k in sorted(batches)},  # the first one warms up
    }
    bare = child("BARE", bare_spec, trainer["env"], out)
    ours_generation = [sampled_tokens(batches[k]) / phases[k]["generation"] for k in timed]
    ours_learner = [all_tokens(batches[k]) / sum(phases[k][label] for label in LEARNER) for k in timed]
    kept = sorted((out / "versions").glob("v*"), key=lambda p: int(p.name[1:]))
    disk = disk_limit(kept[-1], out / "disk-scratch")
    return {
        "steps_timed": timed,
        "generation_tokens_per_s": {
            "ours": med(ours_generation),
            "vLLM direct": med(t / s for t, s in direct.values()),
        },
        "learner_tokens_per_s": {"ours": med(ours_learner), "bare PyTorch": med(t / s for t, s in bare.values())},
        "publish_s": {
            "ours": med(phases[k].get("publish (learner writes)") for k in timed),
            "disk write": disk["write_s"],
        },
        "engine_load_s": {"ours": med(phases[k].get("engine load (sync)") for k in timed), "disk read": disk["read_s"]},
        "version_bytes": disk["bytes"],
        "learner_dtype": learner_dtype,
        "learner_estimate": learner_estimate(run_dir, batches),
        "framework_rss": framework_rss(trainer["env"]),
    }


LEARNER = ("learner: prepare", "learner: forward + backward", "learner: optimizer")


def report(phases: dict[int, dict], memory: ProcessMemory, limit: dict, wall_s: float) -> None:
    print(f"\nthe run: {wall_s:.0f} s from launch to exit, start-up included")
    print("\nstep phases (s):")
    labels = [label for label, _ in PHASES] + ["orchestrator and the rest", "step wall time"]
    print(f"  {'phase':32s}" + "".join(f"{'step ' + str(k):>10s}" for k in sorted(phases)))
    for label in labels:
        cells = "".join(f"{phases[k][label]:10.2f}" if label in phases[k] else f"{'-':>10s}" for k in sorted(phases))
        print(f"  {label:32s}{cells}")
    print("\npeak resident memory per process (GB; shared pages count in each):")
    for role, pid, rss in memory.peaks():
        if rss > 50e6:
            print(f"  {role:32s} pid {pid:<8d} {rss / 1e9:6.2f}")
    print(f"\neach phase against its limit (medians over steps {limit['steps_timed']}):")
    for key, unit, digits in (
        ("generation_tokens_per_s", "tokens/s", 1),
        ("learner_tokens_per_s", "tokens/s", 1),
        ("publish_s", "s", 3),
        ("engine_load_s", "s", 3),
    ):
        ours, (name, bound) = limit[key]["ours"], next((k, v) for k, v in limit[key].items() if k != "ours")
        ratio = ours / bound if unit == "tokens/s" else bound / ours
        print(
            f"  {key:24s} ours {ours:10.{digits}f} {unit:8s} {name:13s} {bound:10.{digits}f}: ours at {ratio:.2f}x the limit"
        )
    print(f"  (the version: {limit['version_bytes'] / 1e6:.0f} MB; the learner in {limit['learner_dtype']})")
    est, base = limit["learner_estimate"], limit["framework_rss"]
    ranks = [rss for role, _, rss in memory.peaks() if role == "learner rank"]
    parts = ", ".join(f"{name} {value / 1e9:.2f}" for name, value in est["parts"].items() if value)
    print(
        f"\na learner rank, estimated (skyrl_cli.plan.memory, micro-batch {est['micro_batch_tokens']} tokens): "
        f"{est['peak'] / 1e9:.2f} GB ({parts}; the libraries alone, before a model loads: {base / 1e9:.2f} GB); "
        f"measured peak {', '.join(f'{r / 1e9:.2f}' for r in ranks)} GB"
        + (f" ({max(ranks) / est['peak']:.2f}x)" if ranks else "")
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.direct_engine:
        return run_direct_engine(args.direct_engine)
    if args.bare_learner:
        return run_bare_learner(args.bare_learner)
    with work_dir(args.out, "skyrl-shape-") as out:
        run_dir, memory, wall_s = run_rl(args, out)
        phases = step_phases(run_dir, args.steps)
        batches = kept_batches(out)
        limit = limits(run_dir, out, phases, batches)
    report(phases, memory, limit, wall_s)
    if args.json:
        figures = {
            "phases": {str(k): v for k, v in phases.items()},
            "peak_rss": [{"role": r, "pid": p, "bytes": b} for r, p, b in memory.peaks()],
            "limits": limit,
            "wall_s": wall_s,
        }
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
