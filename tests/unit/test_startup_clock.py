"""``StartupClock``: laps from the process's creation, the log line and the metric names."""

from __future__ import annotations

import os

import pytest

from skyrl_contracts.logs import StartupClock, metric_word, process_created_at


def test_laps_count_from_the_origin_and_read_as_one_line_and_metrics():
    clock = StartupClock("orchestrator")
    ticks = iter([12.5, 15.7, 16.0])
    clock.origin = clock.last = 10.0
    clock._now = lambda: next(ticks)
    for name in ("imports", "recipe, data and tokenizer", "v0 on the engines"):
        clock.lap(name)
    assert clock.total_s == 6.0
    assert clock.line("orchestrator ready") == (
        "orchestrator ready in 6.0 s (imports 2.5 s, recipe, data and tokenizer 3.2 s, v0 on the engines 0.3 s)"
    )
    assert clock.figures() == {
        "startup/orchestrator/imports_s": 2.5,
        "startup/orchestrator/recipe_data_and_tokenizer_s": 3.2,
        "startup/orchestrator/v0_on_the_engines_s": 0.3,
        "startup/orchestrator_s": 6.0,
    }
    assert metric_word("publish v0") == "publish_v0"


def test_the_process_creation_time_is_the_systems():
    psutil = pytest.importorskip("psutil")
    # both read /proc on Linux; the boot time there has a resolution of 1 s
    assert abs(process_created_at() - psutil.Process(os.getpid()).create_time()) <= 1.0
