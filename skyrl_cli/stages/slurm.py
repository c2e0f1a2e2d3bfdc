"""``skyrl sft|rl --slurm``: an sbatch script that runs the same command on every node of the
recipe's ``[cluster]`` layout (``skyrl_cli.plan.slurm`` writes it), printed or submitted."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from skyrl_cli.plan.nodes import cluster_layout
from skyrl_cli.plan.slurm import sbatch_script
from skyrl_cli.recipe.registry import resolve_recipe_arg
from skyrl_contracts.errors import LaunchError, UsageError
from skyrl_contracts.rundir import RunDir

if TYPE_CHECKING:
    from skyrl_cli.stages.request import StageRequest


def submit(request: StageRequest) -> None:
    """Print the script (``--dry-run``), or write it into the run directory and submit it."""
    script = sbatch_script_for(request)
    if request.dry_run:
        typer.echo(script, nl=False)
        return

    path = RunDir(request.directory).slurm_script(request.stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        typer.echo(f"wrote {path}; sbatch is not on PATH here: submit it with `sbatch {path}` on the cluster")
        return
    proc = subprocess.run([sbatch, str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise LaunchError(f"sbatch {path} failed: {why[-1] if why else f'exit code {proc.returncode}'}")
    logs = RunDir(request.directory).logs
    typer.echo(f"{proc.stdout.strip()} ({path}); per-node logs: {logs}/slurm-<job>-node<k>.log")


def sbatch_script_for(request: StageRequest) -> str:
    layout = cluster_layout(request.recipe)
    if layout is None or layout.legacy:
        raise UsageError("--slurm: the recipe needs a [cluster] section (nodes, trainer_nodes, inference_nodes)")
    return sbatch_script(
        request.recipe,
        request.stage,
        layout,
        recipe_path=resolve_recipe_arg(request.recipe_arg).resolve(),
        run_dir=request.directory,
        sets=list(request.sets or ()),
        async_mode=request.async_mode,
        resume=request.resume,
        workdir=Path.cwd(),
    )
