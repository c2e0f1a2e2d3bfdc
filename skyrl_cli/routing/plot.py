"""``--plot``: generation throughput and p90 group latency against KV pressure, one line per policy."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from skyrl_cli.routing.sweep import SweepRow


def plot_sweep(rows: Sequence[SweepRow], path: str | Path, title: str = "") -> Path:
    # lazy: matplotlib; skyrl --help and the light commands stay light
    import matplotlib

    matplotlib.use("Agg")  # no display here, and none wanted
    # lazy: matplotlib; skyrl --help and the light commands stay light
    import matplotlib.pyplot as plt

    # Left to right = increasing pressure = decreasing KV capacity / working set.
    levels = sorted({(r.kv_ratio, r.pressure) for r in rows}, reverse=True)
    ticks = [
        f"{label}\n(KV = {ratio:g} x working set)" if label != f"{ratio:g}" else f"{ratio:g} x working set"
        for ratio, label in levels
    ]
    policies = list(dict.fromkeys(r.policy for r in rows))
    by_key = {(r.policy, r.kv_ratio): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = (
        ("gen_tokens_per_s", "generated tokens / s (higher is better)"),
        ("group_latency_p90_s", "p90 group latency, s (lower is better)"),
    )
    for ax, (metric, ylabel) in zip(axes, panels):
        for policy in policies:
            xs, ys = [], []
            for i, (ratio, _) in enumerate(levels):
                row = by_key.get((policy, ratio))
                if row is not None:
                    xs.append(i)
                    ys.append(row.metrics[metric])
            ax.plot(xs, ys, marker="o", linewidth=2, label=policy)
        ax.set_xticks(range(len(levels)))
        ax.set_xticklabels(ticks, fontsize=9)
        ax.set_xlabel("KV-cache pressure")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=9)
    fig.suptitle(title or "Routing policies under KV-cache pressure (simulated)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
