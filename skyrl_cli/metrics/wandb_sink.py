"""The W&B sink: events -> ``wandb.log``. Offline unless the recipe says ``mode = "online"``.

wandb is imported only when the sink starts. Any wandb failure (import, init timeout, log) raises
out of the sink, and ``SinkGroup`` disables it with one warning: W&B never stops a run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from skyrl_cli.metrics.sinks import Sink
from skyrl_contracts.events import MetricEvent
from skyrl_contracts.schema import WandbConfig

INIT_TIMEOUT_S = 20.0


class WandbSink(Sink):
    name = "wandb"

    def __init__(
        self, config: WandbConfig, run_name: str, run_dir: str | os.PathLike, recipe: dict[str, Any] | None = None
    ):
        self.config = config
        self.run_name = run_name
        self.run_dir = Path(run_dir)
        self.recipe = recipe or {}
        self._run = None

    def start(self) -> None:
        # lazy: wandb; skyrl --help and the light commands stay light
        import wandb

        self._run = wandb.init(
            project=self.config.project,
            entity=self.config.entity,
            name=self.run_name,
            dir=str(self.run_dir),
            mode=self.config.mode,
            config=self.recipe,
            settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S, silent=True, console="off"),
            reinit="finish_previous",
        )
        # Processes log with their own step counters; plot everything against the logged "step".
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def handle(self, events: Sequence[MetricEvent]) -> None:
        if self._run is None:
            return
        by_step: dict[int, dict[str, float]] = {}
        for e in events:
            by_step.setdefault(e.step, {})[e.name] = e.value
        for step, metrics in by_step.items():
            self._run.log({**metrics, "step": step})

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self._run is None:
            return
        run, self._run = self._run, None
        if summary:
            for name, value in summary.get("metrics", {}).items():
                run.summary[name] = value
        run.finish()


def wandb_sink_for(
    config: WandbConfig, run_name: str, run_dir: str | os.PathLike, recipe: dict[str, Any] | None = None
) -> WandbSink | None:
    """The sink the recipe asks for, or None when ``logging.wandb.mode = "disabled"``."""
    if config.mode == "disabled":
        return None
    return WandbSink(config, run_name, run_dir, recipe)
