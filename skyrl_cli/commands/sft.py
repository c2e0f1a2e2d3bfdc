"""`skyrl sft RECIPE`: supervised fine-tuning on a DeepSpeed trainer launched with torchrun."""

from __future__ import annotations

import typer

from skyrl_cli.commands import common


def register(app: typer.Typer) -> None:
    @app.command("sft")
    def sft(
        recipe: common.RecipeArg,
        set_: common.SetOpt = None,
        run_dir: common.RunDirOpt = None,
        dry_run: common.DryRunOpt = False,
        resume: common.ResumeOpt = False,
        overwrite: common.OverwriteOpt = False,
        quiet: common.QuietOpt = False,
        json_: common.JsonOpt = False,
    ) -> None:
        """Supervised fine-tuning from the recipe's sft section: torchrun + DeepSpeed, dynamic micro-batching.

        Writes runs/<name>/sft/ (or --run-dir): events.jsonl, logs/trainer.log, checkpoints/,
        final/ (HF model + tokenizer) and summary.json.
        """
        from skyrl_cli.plan.build import build_plan
        from skyrl_cli.plan.machine import detect_machine

        mode = common.output_mode(quiet, json_)
        machine = detect_machine()  # one look at the host: validation and the plan see the same facts
        loaded = common.load_for_run(recipe, set_, "sft", machine=machine)
        directory = common.run_dir_for(loaded, "sft", run_dir).resolve()
        plan = build_plan(loaded, "sft", directory, resume=resume, machine=machine)
        if dry_run:
            common.print_plan(plan, json_)
            return
        summary = run_sft(loaded, plan, directory, mode, resume=resume, overwrite=overwrite)
        if mode != "json":
            typer.echo(final_line(summary, directory))


def run_sft(
    recipe, plan, directory, mode, *, resume: bool, overwrite: bool, interrupt_hints: dict | None = None
) -> dict:
    """The SFT trainer as a job (``common.run_job``); returns the summary."""
    from skyrl_contracts.rundir import RunDir

    extra = {"final_model": str(RunDir(directory).final)}
    return common.run_job(
        recipe,
        plan,
        directory,
        mode,
        stage="sft",
        summary_extra=extra,
        resume=resume,
        overwrite=overwrite,
        interrupt_hints=interrupt_hints,
    )


def final_line(summary: dict, directory) -> str:
    from skyrl_cli.metrics.summary import wall_time_text

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
