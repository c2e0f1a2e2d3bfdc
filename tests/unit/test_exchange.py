"""Batches and weights move between orchestrator and trainer whole or not at all."""

from __future__ import annotations

import threading
import time

import pytest

from skyrl_contracts.exchange import RunExchange, StopRequested


def test_batch_round_trip_and_wait(tmp_path):
    ex = RunExchange(tmp_path)
    threading.Timer(0.1, ex.write_batch, args=(3, {"samples": [1, 2]})).start()
    assert ex.read_batch(3, timeout_s=5) == {"samples": [1, 2]}
    with pytest.raises(TimeoutError, match="batch 4"):
        ex.read_batch(4, timeout_s=0.1)


def test_weights_versions_and_latest(tmp_path):
    ex = RunExchange(tmp_path)
    assert ex.latest_version() is None
    with ex.publish_weights(0) as d:
        (d / "w").write_text("0")
    assert (ex.wait_version(0, timeout_s=1) / "w").read_text() == "0"  # version 0 counts as published
    for v in (1, 2):
        with ex.publish_weights(v) as d:
            (d / "w").write_text(str(v))
    assert ex.latest_version() == 2
    assert (ex.wait_version(1, timeout_s=1) / "w").read_text() == "2"
    ex.prune_weights_before(2)
    assert sorted(p.name for p in (tmp_path / "weights").glob("v*")) == ["v2"]


def test_pruning_never_deletes_a_version_newer_than_the_served_one(tmp_path):
    """The learner renames v<k> into place before LATEST says k: pruning at that moment (seen in an
    async run: the engines were then told to load a deleted v231) must leave it alone."""
    ex = RunExchange(tmp_path)
    for v in (1, 2, 3):
        with ex.publish_weights(v) as d:
            (d / "w").write_text(str(v))
    (tmp_path / "weights" / "LATEST").write_text("2")  # v3 renamed into place, LATEST not yet
    ex.prune_weights_before(2)
    assert sorted(p.name for p in (tmp_path / "weights").glob("v*")) == ["v2", "v3"]


def test_stop_request_interrupts_a_wait(tmp_path):
    ex = RunExchange(tmp_path)
    threading.Timer(0.1, ex.request_stop, args=("trainer failed",)).start()
    start = time.monotonic()
    with pytest.raises(StopRequested, match="trainer failed"):
        ex.read_batch(0, timeout_s=10)
    assert time.monotonic() - start < 5
