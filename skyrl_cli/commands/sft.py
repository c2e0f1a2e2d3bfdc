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
        node_rank: common.NodeRankOpt = None,
        slurm: common.SlurmOpt = False,
    ) -> None:
        """Supervised fine-tuning from the recipe's sft section: torchrun + DeepSpeed, dynamic micro-batching.

        Writes runs/<name>/sft/ (or --run-dir): events.jsonl, logs/trainer.log, checkpoints/,
        final/ (HF model + tokenizer) and summary.json.
        """
        # lazy: command implementation; skyrl --help stays fast
        from skyrl_cli.stages.dispatch import run_stage

        request = common.stage_request(
            "sft",
            recipe,
            set_,
            run_dir,
            quiet=quiet,
            json_=json_,
            dry_run=dry_run,
            resume=resume,
            overwrite=overwrite,
            node_rank=node_rank,
            slurm=slurm,
        )
        run_stage(request)
