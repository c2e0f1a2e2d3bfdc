"""Shared by the fault suite.

The tests that inject faults into real runs (marked ``faults`` and ``integration``: engines,
router, trainer ranks, tmpfs mounts) take about 25 minutes on 2 cores, most of CI's 30-minute
budget on their own, so they run on request:

    SKYRL_FAULTS=1 .venv/bin/python -m pytest -q -m faults tests/faults

The rest of the suite (the recipe fuzz, the router's argv, a remote engine down at start, the live
view's rows) runs with every test command. Every fault test leaves no ``skyrl`` driver it started
running, whatever it asserted.
"""

from __future__ import annotations

import os

import pytest

from tests.faults.harness import Driver

REAL_RUNS = os.environ.get("SKYRL_FAULTS", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if REAL_RUNS:
        return
    skip = pytest.mark.skip(reason="a fault injected into real runs; set SKYRL_FAULTS=1 (tests/faults/conftest.py)")
    for item in items:
        if item.get_closest_marker("faults") and item.get_closest_marker("integration"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_driver_left():
    yield
    Driver.stop_all()
