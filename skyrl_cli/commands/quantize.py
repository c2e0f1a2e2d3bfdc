"""`skyrl quantize RECIPE --int4-qat | --ptq`: an INT4 W4A16 checkpoint that vLLM serves."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from skyrl_cli.commands import common
from skyrl_contracts.errors import UsageError

QatOpt = Annotated[
    bool, typer.Option("--int4-qat", help="Fine-tune under INT4 fake-quant for the recipe's sft steps, then export.")
]
PtqOpt = Annotated[bool, typer.Option("--ptq", help="Round-to-nearest INT4 of the model, no training (the baseline).")]


def register(app: typer.Typer) -> None:
    @app.command("quantize")
    def quantize(
        recipe: common.RecipeArg,
        int4_qat: QatOpt = False,
        ptq: PtqOpt = False,
        set_: common.SetOpt = None,
        run_dir: common.RunDirOpt = None,
        dry_run: common.DryRunOpt = False,
        resume: common.ResumeOpt = False,
        overwrite: common.OverwriteOpt = False,
        quiet: common.QuietOpt = False,
        json_: common.JsonOpt = False,
    ) -> None:
        """INT4 weight-only quantization of quantization.init_from into a W4A16 checkpoint for vLLM.

        --int4-qat fine-tunes under fake-quant with the SFT trainer (the recipe's sft section);
        --ptq rounds to nearest without training.

        Writes runs/<name>/quantize/ (or --run-dir): int4/ (compressed-tensors pack-quantized +
        tokenizer), events.jsonl, logs/, summary.json; --int4-qat also checkpoints/ and final/
        (the full-precision weights it trained).
        """
        # lazy: command implementation; skyrl --help stays fast
        from skyrl_cli.plan.build import build_plan
        from skyrl_cli.plan.machine import detect_machine
        from skyrl_cli.plan.quantize import quantize_source, stage_recipe

        if int4_qat == ptq:
            raise UsageError("give one of --int4-qat (quantization-aware training) and --ptq (round-to-nearest)")
        mode = common.output_mode(quiet, json_)
        machine = detect_machine()  # one look at the host: validation and the plan see the same facts
        loaded = common.load_for_run(recipe, set_, "quantize", machine=machine)
        source = quantize_source(loaded)
        staged = stage_recipe(loaded, source, qat=int4_qat)
        directory = common.run_dir_for(loaded, "quantize", run_dir).resolve()
        plan = build_plan(staged, "quantize", directory, resume=resume, machine=machine)
        if dry_run:
            common.print_plan(plan, json_)
            return
        if not (source / "config.json").is_file():
            hint = f"; run `skyrl sft {recipe}` first" if loaded.quantization.init_from == "sft" else ""
            raise UsageError(f"quantization.init_from: no model at {source}{hint}")
        summary = run_quantize(
            staged, plan, directory, mode, resume=resume, overwrite=overwrite, method="qat" if int4_qat else "ptq"
        )
        if mode != "json":
            typer.echo(final_line(summary, directory))


def run_quantize(recipe, plan, directory: Path, mode, *, resume: bool, overwrite: bool, method: str) -> dict:
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_contracts.rundir import RunDir

    extra = {"method": method, "source_model": recipe.model.path, "int4_model": str(RunDir(directory).int4)}
    return common.run_job(
        recipe, plan, directory, mode, stage="quantize", summary_extra=extra, resume=resume, overwrite=overwrite
    )


def final_line(summary: dict, directory: Path) -> str:
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.metrics.summary import wall_time_text

    metrics = summary.get("metrics", {})
    parts = []
    if "eval/accuracy" in metrics:
        parts.append(f"held-out accuracy {metrics['eval/accuracy']:.3f} under fake-quant")
    if "quant/size_ratio" in metrics:
        parts.append(
            f"{metrics['quant/int4_layers']:.0f} INT4 layers, {metrics['quant/size_ratio']:.3f}x the full-precision weights"
        )
    if "wall_s" in summary:
        parts.append(f"wall time {wall_time_text(summary)}")
    method = "INT4 QAT" if summary.get("method") == "qat" else "INT4 PTQ"
    return f"quantize done ({method}): {', '.join(parts)}; W4A16 model: {directory / 'int4'}"
