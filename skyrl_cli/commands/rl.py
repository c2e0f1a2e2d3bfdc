"""`skyrl rl RECIPE [--async]`: RL with vLLM engines behind vllm-router and a DeepSpeed learner."""

from __future__ import annotations

from typing import Annotated

import typer

from skyrl_cli.commands import common

AsyncOpt = Annotated[
    bool,
    typer.Option(
        "--async", help="Fully-async RL: generation runs ahead of training up to rl.async.max_staleness versions."
    ),
]
PoolOpt = Annotated[
    str,
    typer.Option(
        "--pool",
        help="Engines from a running pool (skyrl engines up): auto = the first free one that fits, else the run's "
        "own; none = always its own; or a pool's name.",
    ),
]


def register(app: typer.Typer) -> None:
    @app.command("rl")
    def rl(
        recipe: common.RecipeArg,
        async_mode: AsyncOpt = False,
        set_: common.SetOpt = None,
        run_dir: common.RunDirOpt = None,
        dry_run: common.DryRunOpt = False,
        resume: common.ResumeOpt = False,
        overwrite: common.OverwriteOpt = False,
        quiet: common.QuietOpt = False,
        json_: common.JsonOpt = False,
        pool_name: PoolOpt = "auto",
        node_rank: common.NodeRankOpt = None,
        slurm: common.SlurmOpt = False,
    ) -> None:
        """Reinforcement learning from the recipe's rl section (GRPO family), sync or fully async.

        Starts rl.init_from: "sft" is this recipe's SFT output (SFT runs first when it has not).
        Writes runs/<name>/rl/ (or --run-dir): events.jsonl, logs/, checkpoints/, final/, summary.json.
        """
        # lazy: command implementation; skyrl --help stays fast
        from skyrl_cli.stages.dispatch import run_stage

        request = common.stage_request(
            "rl",
            recipe,
            set_,
            run_dir,
            quiet=quiet,
            json_=json_,
            dry_run=dry_run,
            resume=resume,
            overwrite=overwrite,
            async_mode=async_mode,
            node_rank=node_rank,
            slurm=slurm,
            pool=pool_name,
        )
        run_stage(request)
