"""The W&B sink in offline mode writes its run locally (wandb starts its wandb-core service process)."""

from __future__ import annotations

import pytest

from skyrl_cli.metrics.sinks import SinkGroup
from skyrl_cli.metrics.wandb_sink import WandbSink
from skyrl_contracts.schema import WandbConfig
from tests.unit.test_metrics_sinks import event

pytestmark = pytest.mark.integration


def test_wandb_offline_run_writes_locally(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    warnings = []
    group = SinkGroup([WandbSink(WandbConfig(mode="offline"), "t", tmp_path, {"name": "t"})], warn=warnings.append)
    group.start()
    group.handle([event(1, "train/loss", 1.0), event(1, "train/lr", 0.1), event(2, "train/loss", 0.5)])
    group.close({"metrics": {"train/loss": 0.5}})
    assert warnings == []
    assert list((tmp_path / "wandb").glob("offline-run-*"))
