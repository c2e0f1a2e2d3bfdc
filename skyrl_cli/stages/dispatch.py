"""``run_stage``: the one place that decides how ``skyrl sft`` and ``skyrl rl`` run their stage.

``--slurm`` writes (or, with ``--dry-run``, prints) an sbatch script and starts nothing here; a
recipe with a ``[cluster]`` layout runs this node's share (``--dry-run``: every node's plan);
anything else runs on this machine. What a stage does in each of those ways is its ``Stage``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import typer

from skyrl_cli.stages import local, nodes, pool, results, slurm
from skyrl_cli.stages.request import StageRequest


def _nothing_to_refuse(request: StageRequest) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Stage:
    """What a stage does in each way it runs; ``run_stage`` picks the way."""

    here: Callable[[StageRequest], dict | None]  # this machine; None: --dry-run printed the plan
    on_node: Callable[[StageRequest, nodes.NodeRun], dict | None]  # None: a node other than node 0
    final_line: Callable[[dict, Path], str]
    # Options with no meaning across nodes (RL's --pool) fail in one line before anything starts.
    refuse_across_nodes: Callable[[StageRequest], None] = _nothing_to_refuse


STAGES = {
    "sft": Stage(here=local.sft_here, on_node=nodes.run_sft_on_node, final_line=results.sft_final_line),
    "rl": Stage(
        here=local.rl_here,
        on_node=nodes.run_rl_on_node,
        final_line=results.rl_final_line,
        refuse_across_nodes=pool.refuse_across_nodes,
    ),
}


def run_stage(request: StageRequest) -> None:
    """Run the request's stage the way its options and recipe ask for, then print its closing line."""
    stage = STAGES[request.stage]
    if request.slurm:
        slurm.submit(request)
        return
    node = nodes.node_run(request.recipe, request.node_rank, need_address=not request.dry_run)
    if node is None:
        summary = stage.here(request)
    else:
        stage.refuse_across_nodes(request)
        if request.dry_run:
            nodes.dry_run(request, node)
            return
        summary = stage.on_node(request, node)
    if summary is None or request.json_:
        return
    typer.echo(stage.final_line(summary, request.directory))
    # Only RL's learner logs health checks; across nodes, node 0's summary table is where they show.
    if node is None and "health" in summary:
        typer.echo(f"warning: {summary['health']['message']}", err=True)
