"""A long ``skyrl rl --async`` run, watched from outside: does anything grow that should not?

Runs the quickstart's RL stage (``--async``, ``--steps`` steps, from an SFT model: ``--sft-model``, or
the quickstart's SFT run made first) as a user does, and every ``--every`` seconds samples, per
process of the run (the engines, the router, the orchestrator, the learner's ranks, the CLI itself):
resident memory, open files and threads; and for the run: the run directory's size split into
``events.jsonl`` (grows by design: one line per metric per step) and everything else (checkpoints,
weight versions, batches: bounded by ``keep_last`` and the exchange's clean-up), and the engines'
KV-cache usage from their ``/metrics``.

The verdict splits the samples after ``--warmup-s`` into halves and compares their peaks: memory
per role may be at most ``--rss-margin`` (default 15%) higher in the second half, open files and
threads at most ``--fd-margin`` / ``--thread-margin`` more, the run directory without events.jsonl
at most 10% larger. It writes ``soak.csv``, ``soak.json`` and ``soak.png`` to ``--out`` and prints
the table (first-half peak, second-half peak) and the verdict last.

    python benchmarks/bench_rl_soak.py --steps 300                         # SFT first (~4 min), then RL
    python benchmarks/bench_rl_soak.py --sft-model runs/quickstart/sft/final --steps 300
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
SKYRL = Path(sys.executable).parent / "skyrl"
ROLES = ("engine", "router", "orchestrator", "learner", "cli")


def role_of(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    if "vllm_router" in cmd or "vllm-router" in cmd or cmd.startswith("vllm::router"):  # it renames itself
        return "router"
    if "backends.rollout.orchestrator" in cmd:
        return "orchestrator"
    if "rl_learner" in cmd or "torchrun" in cmd or "torch.distributed.run" in cmd:
        return "learner"
    if "backends.inference.serve" in cmd:
        return "engine"
    return "other"


def process_sample(root: psutil.Process) -> dict[str, dict[str, float]]:
    """Per role: RSS (MiB), open files and threads summed over its processes. The supervisor starts
    each process of the plan as a child of the CLI; everything below a child (vLLM's EngineCore,
    torchrun's ranks) counts for that child's role."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"rss_mib": 0.0, "fds": 0, "threads": 0, "procs": 0})
    try:
        families = [("cli", [root])] + [(role_of(c), [c, *c.children(recursive=True)]) for c in root.children()]
    except psutil.NoSuchProcess:
        return {}
    for role, family in families:
        for proc in family:
            try:
                with proc.oneshot():
                    figures = (proc.memory_info().rss / 2**20, proc.num_fds(), proc.num_threads())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            entry = out[role]
            entry["rss_mib"] += figures[0]
            entry["fds"] += figures[1]
            entry["threads"] += figures[2]
            entry["procs"] += 1
    return dict(out)


def dir_sizes(run_dir: Path) -> tuple[float, float]:
    """(events.jsonl MiB, everything else MiB); files being replaced may vanish while walked."""
    events = other = 0
    for path in run_dir.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                size = path.stat().st_size
            else:
                continue
        except OSError:
            continue
        if path.name == "events.jsonl":
            events += size
        else:
            other += size
    return events / 2**20, other / 2**20


def kv_usage(run_dir: Path) -> float | None:
    """Mean KV-cache usage (0..1) over the run's engines, from their Prometheus metrics."""
    import httpx

    from skyrl_cli.engines.metrics import parse_prometheus

    try:
        urls = json.loads((run_dir / "plan.json").read_text())["engine_urls"]
    except (OSError, ValueError, KeyError):
        return None
    values = []
    for url in urls:
        try:
            metrics = parse_prometheus(httpx.get(f"{url}/metrics", timeout=2).text)
        except httpx.HTTPError:
            continue
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            if name in metrics:
                values.append(metrics[name])
                break
    return sum(values) / len(values) if values else None


def last_step(run_dir: Path) -> int:
    from skyrl_contracts.events import iter_events

    try:
        return max((e.step for e in iter_events(run_dir / "events.jsonl") if e.name.startswith("train/")), default=0)
    except OSError:
        return 0


def make_sft_model(work: Path) -> Path:
    sft_dir = work / "sft"
    subprocess.run([str(SKYRL), "sft", "quickstart", "--run-dir", str(sft_dir), "--quiet"], check=True, cwd=REPO)
    return sft_dir / "final"


def sample_rows(proc: subprocess.Popen, run_dir: Path, every_s: float) -> list[dict]:
    root = psutil.Process(proc.pid)
    started = time.monotonic()
    rows = []
    while proc.poll() is None:
        per_role = process_sample(root)
        events_mib, other_mib = dir_sizes(run_dir) if run_dir.is_dir() else (0.0, 0.0)
        row = {
            "t_s": round(time.monotonic() - started, 1),
            "step": last_step(run_dir),
            "events_mib": round(events_mib, 3),
            "run_dir_mib": round(other_mib, 2),
            "kv_usage": kv_usage(run_dir),
        }
        for role in ROLES:
            figures = per_role.get(role, {})
            for key in ("rss_mib", "fds", "threads"):
                row[f"{role}_{key}"] = round(figures.get(key, 0.0), 1)
        rows.append(row)
        print(
            f"t={row['t_s']:7.1f}s step {row['step']:4d}  "
            + "  ".join(f"{r} {row[f'{r}_rss_mib']:.0f}MiB/{row[f'{r}_fds']:.0f}fd" for r in ROLES[:4])
            + f"  run dir {other_mib:.1f} MiB",
            flush=True,
        )
        time.sleep(every_s)
    return rows


def verdict(rows: list[dict], warmup_s: float, rss_margin: float, fd_margin: int, thread_margin: int) -> list[dict]:
    """Bounded means: the peak of the second half of the samples after warm-up is no higher than
    the peak of the first half (plus the margin). Peaks, not points, because checkpoints, weight
    versions and evaluations come and go in cycles. Only samples in which the learner ran count
    (the final evaluation and the teardown change the process set on purpose)."""
    training = [r for r in rows if r["step"] > 0 and r["learner_rss_mib"] > 0]
    after = [r for r in training if r["t_s"] >= warmup_s]
    if len(after) < 4:
        raise SystemExit("soak: too few samples after warm-up; run longer (--steps) or sample more often (--every)")
    first, second = after[: len(after) // 2], after[len(after) // 2 :]
    checks = []

    def check(figure: str, key: str, allowed) -> None:
        start, end = max(r[key] for r in first), max(r[key] for r in second)
        checks.append({"figure": figure, "start": start, "end": end, "ok": end <= allowed(start)})

    for role in ROLES[:4]:
        check(f"{role} RSS (MiB)", f"{role}_rss_mib", lambda v: v * (1 + rss_margin) + 1)
        check(f"{role} open files", f"{role}_fds", lambda v: v + fd_margin)
        check(f"{role} threads", f"{role}_threads", lambda v: v + thread_margin)
    check("run dir without events (MiB)", "run_dir_mib", lambda v: v * 1.1 + 1)
    steps = max(after[-1]["step"] - after[0]["step"], 1)
    per_step = (after[-1]["events_mib"] - after[0]["events_mib"]) / steps * 1024
    checks.append({"figure": "events.jsonl (KiB per step)", "start": 0.0, "end": per_step, "ok": True})
    return checks


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    t = [r["t_s"] for r in rows]
    for role in ROLES:
        axes[0].plot(t, [r[f"{role}_rss_mib"] for r in rows], label=role)
        axes[1].plot(t, [r[f"{role}_fds"] for r in rows], label=role)
        axes[2].plot(t, [r[f"{role}_threads"] for r in rows], label=role)
    axes[3].plot(t, [r["run_dir_mib"] for r in rows], label="run dir without events.jsonl (MiB)")
    axes[3].plot(t, [r["events_mib"] for r in rows], label="events.jsonl (MiB)")
    kv = [(r["t_s"], r["kv_usage"] * 100) for r in rows if r["kv_usage"] is not None]
    if kv:
        axes[3].plot(*zip(*kv), label="engine KV-cache usage (%)")
    for ax, label in zip(axes, ("RSS (MiB)", "open files", "threads", "run dir / KV")):
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel("wall time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sft-model", type=Path, help="the quickstart's SFT output (made first when not given)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--warmup-s", type=float, default=120.0, help="samples before this are warm-up")
    parser.add_argument("--rss-margin", type=float, default=0.15)
    parser.add_argument("--fd-margin", type=int, default=16)
    parser.add_argument("--thread-margin", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_rl_soak")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    sft_model = (args.sft_model or make_sft_model(args.out)).resolve()
    run_dir = args.out / "rl"
    argv = [str(SKYRL), "rl", "quickstart", "--async", "--run-dir", str(run_dir), "--overwrite", "--quiet"]
    for key, value in (("rl.steps", args.steps), ("rl.init_from", str(sft_model)), ("rl.eval_every", 50)):
        argv += ["--set", f"{key}={json.dumps(value) if isinstance(value, str) else value}"]
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = sample_rows(proc, run_dir, args.every)
    if proc.wait() != 0:
        raise SystemExit(f"soak: skyrl rl exited {proc.returncode} (see {run_dir}/logs)")
    wall = time.monotonic() - started

    with open(args.out / "soak.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    checks = verdict(rows, args.warmup_s, args.rss_margin, args.fd_margin, args.thread_margin)
    (args.out / "soak.json").write_text(json.dumps({"steps": args.steps, "wall_s": wall, "checks": checks}, indent=2))
    plot(rows, args.out / "soak.png")

    print(f"\nsoak: {args.steps} steps of skyrl rl quickstart --async in {wall:.0f} s, {len(rows)} samples")
    print(f"{'figure':34s} {'peak, 1st half':>14s} {'2nd half':>10s}  ok")
    for check in checks:
        print(f"{check['figure']:34s} {check['start']:14.1f} {check['end']:10.1f}  {'yes' if check['ok'] else 'NO'}")
    bad = [c["figure"] for c in checks if not c["ok"]]
    print(f"verdict: {'flat after warm-up' if not bad else 'grew: ' + ', '.join(bad)}  ({args.out}/soak.png)")


if __name__ == "__main__":
    main()
