"""Routing policies under KV-cache pressure, simulated: the figures behind `skyrl bench routing`.

Runs every policy on the same seeds (paired: identical trajectories) at each pressure level and
prints, last, the median over seeds of the per-seed generation-throughput ratios
sticky_least_loaded / consistent_hash (the release's comparison) and sticky_kv_repin /
sticky_least_loaded (ours against the best router policy), with their min and max.

    .venv/bin/python benchmarks/bench_routing.py [--seeds 8] [--pressure low,moderate,high]
"""

from __future__ import annotations

import argparse
import statistics
import time

from skyrl_cli.routing.sweep import SweepConfig, parse_pressures, run_sweep, working_set_per_replica

PAIRS = (
    ("sticky_least_loaded", "consistent_hash"),
    ("sticky_kv_repin", "sticky_least_loaded"),
    ("sticky_kv_repin", "consistent_hash"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--pressure", default="low,moderate,high")
    args = parser.parse_args()

    config = SweepConfig(pressures=tuple(parse_pressures(args.pressure)), seeds=tuple(range(args.seeds)))
    started = time.perf_counter()
    rows = run_sweep(config)
    elapsed = time.perf_counter() - started
    runs = len(rows) * args.seeds
    print(
        f"{config.replicas} replicas, {config.workload.max_inflight_trajectories} trajectories in flight, "
        f"~{config.workload.turns_mean:g} turns, working set {working_set_per_replica(config.workload, 0, config.replicas):,.0f} "
        f"tokens/replica; {runs} simulations in {elapsed:.1f} s ({elapsed / runs:.2f} s each)\n"
    )
    header = f"{'pressure':>9} {'policy':<20} {'tok/s':>7} {'traj/s':>7} {'step s':>7} {'preempt':>8} {'hit':>6} {'CV':>5} {'p50':>6} {'p90':>6}"
    print(header)
    for r in rows:
        m = r.metrics
        print(
            f"{r.pressure:>9} {r.policy:<20} {m['gen_tokens_per_s']:7.0f} {m['trajectories_per_s']:7.3f} "
            f"{m['step_time_s']:7.1f} {m['preemptions']:8.1f} {m['prefix_hit_rate']:6.3f} {m['running_cv']:5.2f} "
            f"{m['group_latency_p50_s']:6.0f} {m['group_latency_p90_s']:6.0f}"
        )
    print(f"\ngeneration tokens/s ratios, median [min, max] over {args.seeds} paired seeds:")
    by = {(r.pressure, r.policy): r for r in rows}
    for label, _ in config.pressures:
        parts = []
        for subject, baseline in PAIRS:
            a, b = by[(label, subject)].per_seed, by[(label, baseline)].per_seed
            ratios = [x["gen_tokens_per_s"] / y["gen_tokens_per_s"] for x, y in zip(a, b)]
            parts.append(
                f"{subject}/{baseline} {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"
            )
        print(f"  {label:>9}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
