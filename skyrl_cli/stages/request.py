"""``StageRequest``: one ``skyrl sft|rl`` invocation with its options read and its recipe loaded."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from skyrl_cli.plan.build import build_plan
from skyrl_cli.stages.output import OutputMode

if TYPE_CHECKING:  # pydantic stays out of `skyrl --help`
    from skyrl_cli.plan.machine import MachineFacts
    from skyrl_cli.plan.model import PoolAttachment
    from skyrl_contracts.schema import Recipe


@dataclasses.dataclass(frozen=True)
class StageRequest:
    """``recipe`` was loaded and checked against ``machine``, the one look at this host that every
    plan of the run is built from. ``code_dir``: the recipe file's folder, where an RL recipe's own
    reward, environment and agent code is imported from (the SFT planners take no code)."""

    stage: str
    recipe_arg: str
    sets: list[str] | None
    recipe: Recipe
    machine: MachineFacts
    directory: Path
    code_dir: Path
    mode: OutputMode
    dry_run: bool = False
    resume: bool = False
    overwrite: bool = False
    async_mode: bool = False
    node_rank: int | None = None
    slurm: bool = False
    pool: str = "none"

    @property
    def json_(self) -> bool:
        return self.mode == "json"

    def plan(self, pool: PoolAttachment | None = None):
        """The stage's plan on this machine (``pool``: RL with that engine pool's engines)."""
        return build_plan(
            self.recipe,
            self.stage,
            self.directory,
            resume=self.resume,
            async_mode=self.async_mode,
            machine=self.machine,
            recipe_dir=self.code_dir,
            pool=pool,
        )
