"""`skyrl sft RECIPE`: supervised fine-tuning on a DeepSpeed trainer launched with torchrun."""

from __future__ import annotations

import typer

from skyrl_cli.commands import cluster, common


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
        node_rank: cluster.NodeRankOpt = None,
        slurm: cluster.SlurmOpt = False,
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
        if slurm:
            cluster.slurm(loaded, "sft", recipe, directory, set_, async_mode=False, resume=resume, dry_run_=dry_run)
            return
        node = cluster.node_run(loaded, node_rank, need_address=not dry_run)
        if node is not None:
            if dry_run:
                opts = dict(node_rank_flag=node_rank, resume=resume, async_mode=False, machine=machine, code_dir=None)
                cluster.dry_run(loaded, "sft", node, directory, json_=json_, **opts)
                return
            summary = run_sft_on_node(
                loaded, node, directory, mode, resume=resume, overwrite=overwrite, machine=machine
            )
            if summary is not None and mode != "json":
                typer.echo(final_line(summary, directory))
            return
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


def run_sft_on_node(recipe, node, directory, mode, *, resume: bool, overwrite: bool, machine) -> dict | None:
    """One node's share of an SFT run across nodes (``skyrl_cli.commands.cluster``): node 0 prepares
    the run directory, meets the others and runs its trainer ranks as on one machine (the summary
    is its); the other nodes run theirs (None)."""
    from skyrl_contracts.rundir import RunDir

    opts = dict(resume=resume, async_mode=False, machine=machine, code_dir=None)
    if not node.layout.trains(node.rank):
        cluster.say(
            mode,
            f"sft: node {node.rank} does not train (cluster.trainer_nodes = {node.layout.trainer_nodes}); nothing to run",
            always=True,
        )
        return None
    if node.rank != 0:
        cluster.run_peer(recipe, "sft", node, directory, mode, **opts)
        return None
    plan = cluster.plan_here(recipe, "sft", node, directory, **opts)
    RunDir(directory).prepare(recipe, plan, resume=resume, overwrite=overwrite)
    with cluster.rendezvous(recipe, "sft", node, directory, resume=resume, async_mode=False) as rdv:
        cluster.say(mode, f"sft: node 0 of {node.layout.trainer_nodes}: waiting for the other nodes in {directory}")
        rdv.join()
        rdv.set(phase="running")
        extra = {"final_model": str(RunDir(directory).final), "nodes": node.layout.trainer_nodes}
        with rdv.blaming_nodes():
            return common.run_job(
                recipe,
                plan,
                directory,
                mode,
                stage="sft",
                summary_extra=extra,
                resume=resume,
                overwrite=overwrite,
                prepared=True,
                watch=rdv.check,
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
