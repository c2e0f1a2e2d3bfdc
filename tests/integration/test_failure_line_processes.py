"""A real process that fails before it is ready is reported by the one log line that says why."""

from __future__ import annotations

import sys

import pytest

from skyrl_cli.launch.supervisor import Supervisor
from skyrl_cli.plan.model import ProcessSpec, ReadinessCheck
from skyrl_contracts.errors import LaunchError

pytestmark = pytest.mark.integration


def test_an_engine_that_raises_before_it_is_ready_is_reported_by_its_error(tmp_path):
    argv = (sys.executable, "-c", "raise ValueError('max_model_len (512) is greater than the model allows (256)')")
    spec = ProcessSpec(
        name="engine-0", role="engine", argv=argv, ready=ReadinessCheck(url="http://127.0.0.1:9/health", timeout_s=10)
    )
    with Supervisor(tmp_path) as sup:
        sup.start(spec)
        with pytest.raises(LaunchError) as info:
            sup.wait_ready(["engine-0"])
    assert str(info.value) == (
        "engine-0 exited before it was ready (exit code 1): ValueError: max_model_len (512) is greater than the model allows (256)\n"
        f"log: {tmp_path / 'logs' / 'engine-0.log'}"
    )
