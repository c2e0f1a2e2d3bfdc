"""The sbatch script of a run across nodes (``skyrl sft|rl RECIPE --slurm``; pure: text only).

One Slurm task per node, each running the same ``skyrl`` command; the task's node rank is
``$SLURM_NODEID`` (passed as ``--node-rank``, expanded inside the task), node 0's address the job's
first host (``scontrol show hostnames``), exported as ``SKYRL_CLUSTER_ADDRESS`` unless
``cluster.address`` is set. Each node's output goes to ``logs/slurm-<job>-node<k>.log`` in the
run directory (``srun --output`` with ``%j`` and ``%n``), the batch step's own to
``logs/slurm-<job>.log``. ``srun --kill-on-bad-exit=1`` ends every task when one fails, on top of
the heartbeat in the run directory (``skyrl_cli.launch.nodes``), which also covers runs started by hand.

What the user sets in ``[cluster.slurm]``: partition, account and time (most clusters need them),
optionally GPUs and CPUs per node and shell lines to run first (activating the environment).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Sequence

from skyrl_cli.plan.nodes import ADDRESS_ENV, Layout
from skyrl_contracts.schema import Recipe


def gpus_per_node(recipe: Recipe, layout: Layout, stage: str) -> int:
    """GPUs the busiest node of ``stage`` uses: trainer ranks, engines x tensor_parallel, or both
    on a node that trains and serves; 0 with ``trainer.device = "cpu"`` (``cluster.slurm.gpus_per_node``
    overrides it)."""
    slurm = recipe.cluster.slurm if recipe.cluster is not None else None
    if slurm is not None and slurm.gpus_per_node is not None:
        return slurm.gpus_per_node
    if recipe.trainer.device == "cpu":
        return 0
    engines = recipe.inference.engines * recipe.inference.tensor_parallel
    busiest = 0
    for node in range(layout.stage_nodes(stage)):
        used = recipe.trainer.ranks if layout.trains(node) else 0
        if stage == "rl" and layout.serves(node):
            used += engines
        busiest = max(busiest, used)
    return busiest


def skyrl_executable() -> str:
    """The ``skyrl`` console script beside this interpreter (the nodes see the same path on a
    shared file system), else ``skyrl`` from PATH."""
    beside = Path(sys.executable).parent / "skyrl"
    return str(beside) if beside.exists() else "skyrl"


def node_command(
    stage: str,
    recipe_path: Path,
    run_dir: Path,
    sets: Sequence[str],
    async_mode: bool,
    resume: bool,
    executable: str | None = None,
) -> list[str]:
    """The command every node runs (without its ``--node-rank``)."""
    argv = [executable or skyrl_executable(), stage, str(recipe_path), "--run-dir", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    if async_mode:
        argv.append("--async")
    if resume:
        argv.append("--resume")
    return [*argv, "--quiet"]


def sbatch_script(
    recipe: Recipe,
    stage: str,
    layout: Layout,
    *,
    recipe_path: Path,
    run_dir: Path,
    sets: Sequence[str] = (),
    async_mode: bool = False,
    resume: bool = False,
    workdir: Path,
    executable: str | None = None,
) -> str:
    slurm = recipe.cluster.slurm
    nodes = layout.stage_nodes(stage)
    logs = run_dir / "logs"
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"skyrl-{recipe.name}-{stage}")
    options = [
        ("job-name", name),
        ("nodes", str(nodes)),
        ("ntasks-per-node", "1"),
    ]
    gpus = gpus_per_node(recipe, layout, stage)
    if gpus:
        options.append(("gpus-per-node", str(gpus)))
    if slurm.cpus_per_node:
        options.append(("cpus-per-task", str(slurm.cpus_per_node)))
    for key in ("partition", "account", "time"):
        value = getattr(slurm, key)
        if value:
            options.append((key, value))
    options.append(("output", str(logs / "slurm-%j.log")))
    command = node_command(stage, recipe_path, run_dir, sets, async_mode, resume, executable)
    inner = " ".join(shlex.quote(part) for part in command) + ' --node-rank "$SLURM_NODEID"'
    roles = _span(0, layout.trainer_nodes - 1, "train")
    if stage == "rl" and layout.inference_nodes:
        roles += ", " + _span(layout.nodes - layout.inference_nodes, layout.nodes - 1, "serve")
    lines = [
        "#!/bin/bash",
        f"# skyrl {stage} {recipe_path.name} on {nodes} nodes ({roles}), one task per node.",
        "# Written by skyrl --slurm; set partition, account and time in [cluster.slurm] of the recipe.",
        *(f"#SBATCH --{key}={value}" for key, value in options),
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(str(workdir))}",
        *slurm.setup,
        f"mkdir -p {shlex.quote(str(logs))}",
    ]
    if layout.address:
        lines.append(f"export {ADDRESS_ENV}={shlex.quote(layout.address)}")
    else:
        lines.append(f'export {ADDRESS_ENV}="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"')
    lines += [
        f'echo "skyrl: node 0 is ${ADDRESS_ENV}; logs per node: {logs}/slurm-$SLURM_JOB_ID-node<k>.log"',
        f"srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        f"  --output={shlex.quote(str(logs / 'slurm-%j-node%n.log'))} \\",
        f"  bash -c {shlex.quote(inner)}",
        "",
    ]
    return "\n".join(lines)


def _span(first: int, last: int, verb: str) -> str:
    return f"node {first} {verb}s" if first == last else f"nodes {first}-{last} {verb}"
