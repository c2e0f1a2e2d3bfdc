"""What a finished stage leaves: RL's ``final/`` and ``int4/`` models, its accuracy figures, and the
closing line each stage prints."""

from __future__ import annotations

import shutil
from pathlib import Path

from skyrl_cli.metrics.summary import wall_time_text
from skyrl_contracts.atomic import publish_dir
from skyrl_contracts.events import iter_events
from skyrl_contracts.rundir import CHECKPOINT_MODEL, RunDir


def publish_final_model(run_dir: RunDir) -> None:
    """``final/``: the newest checkpoint's HF model (the learner checkpoints its last step).

    Built next to it and published whole, so a crash here keeps the previous ``final/``."""
    newest = run_dir.latest_checkpoint()
    if newest is None:
        return
    shutil.rmtree(run_dir.final_tmp, ignore_errors=True)
    shutil.copytree(newest / CHECKPOINT_MODEL, run_dir.final_tmp)
    publish_dir(run_dir.final_tmp, run_dir.final)


def publish_final_int4(run_dir: RunDir, recipe) -> bool:
    """INT4 rollouts: ``int4/`` (the initial policy's export the engines started from) becomes the
    last version they served, the learner's W4A16 export of its final weights."""
    version = run_dir.latest_weights_version()
    if recipe.quantization is None or not recipe.quantization.int4_rollouts or version is None:
        return False
    shutil.rmtree(run_dir.int4_tmp, ignore_errors=True)
    shutil.copytree(run_dir.weights_version(version), run_dir.int4_tmp)
    publish_dir(run_dir.int4_tmp, run_dir.int4)
    return True


def initial_and_final_accuracy(run_dir: RunDir) -> dict:
    accuracy = [e for e in iter_events(run_dir.events) if e.name == "eval/accuracy"]
    if not accuracy:
        return {}
    initial = run_dir.initial_accuracy()
    if initial is None:  # a run that evaluated its initial policy before eval_initial.json existed
        initial = accuracy[0].value
    final = max(accuracy, key=lambda e: (e.step, e.time)).value
    return {"eval_accuracy_initial": initial, "eval_accuracy_final": final, "eval_accuracy_gain": final - initial}


def rl_final_line(summary: dict, directory: Path) -> str:
    parts = []
    if "eval_accuracy_final" in summary:
        parts.append(
            f"held-out accuracy {summary['eval_accuracy_initial']:.3f} -> {summary['eval_accuracy_final']:.3f}"
        )
    for key, label in (("rollout/tokens_per_s", "rollout tokens/s"), ("train/tokens_per_s", "training tokens/s")):
        figure = summary.get("throughput", {}).get(key)
        if figure:
            parts.append(f"{figure['mean']:,.0f} {label}")
    if "wall_s" in summary:
        parts.append(f"wall time {wall_time_text(summary)}")
    return f"rl done: {', '.join(parts)}; model: {RunDir(directory).final}"


def sft_final_line(summary: dict, directory: Path) -> str:
    metrics = summary.get("metrics", {})
    parts = []
    if "eval/accuracy" in metrics:
        parts.append(f"held-out accuracy {metrics['eval/accuracy']:.3f}")
    if metrics.get("progress/stopped_early"):
        parts.append(f"stopped early at step {summary.get('steps', '?')} (sft.stop_at_accuracy)")
    tokens = summary.get("throughput", {}).get("train/tokens_per_s")
    if tokens:
        parts.append(f"{tokens['mean']:,.0f} training tokens/s")
    if "wall_s" in summary:
        parts.append(f"wall time {wall_time_text(summary)}")
    return f"sft done: {', '.join(parts)}; model: {directory / 'final'}"
