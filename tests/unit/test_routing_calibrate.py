"""Calibration maths (fitting the step cost to timed batches) and the live helpers that need no engine."""

import numpy as np
import pytest

from skyrl_cli.routing.calibrate import CONTEXT_SHAPES, DECODE_SHAPES, PREFILL_SHAPES, features, fit_step_cost, nnls
from skyrl_cli.routing.engine_model import StepCost
from skyrl_cli.routing.live import kv_capacity_from_log


def test_features_match_the_simulators_run_time():
    cost = StepCost(base_s=0.002, per_prefill_token_s=3e-6, per_seq_s=5e-5, per_kv_token_s=4e-9)
    for m, prompt, decode in DECODE_SHAPES + PREFILL_SHAPES + CONTEXT_SHAPES:
        x = np.array([0.0, 0.0, cost.base_s, cost.per_prefill_token_s, cost.per_seq_s, cost.per_kv_token_s])
        assert np.dot(features(m, prompt, decode), x) == pytest.approx(cost.run_time(m * prompt, m, m * prompt, decode))


def test_fit_recovers_a_known_cost_and_overhead():
    truth = StepCost(base_s=0.0015, per_prefill_token_s=2e-6, per_seq_s=6e-5, per_kv_token_s=3e-9)
    per_batch, per_request = 0.003, 0.001
    shapes = DECODE_SHAPES + PREFILL_SHAPES + CONTEXT_SHAPES
    measured = [
        (s, per_batch + per_request * s[0] + truth.run_time(s[0] * s[1], s[0], s[0] * s[1], s[2])) for s in shapes
    ]
    fitted = fit_step_cost(measured)
    assert fitted.request_overhead_s == pytest.approx(per_batch + per_request, rel=1e-6)
    assert fitted.cost.base_s == pytest.approx(truth.base_s, rel=1e-6)
    assert fitted.cost.per_seq_s == pytest.approx(truth.per_seq_s, rel=1e-6)
    assert fitted.max_relative_error < 1e-9


def test_nnls_never_returns_negative_coefficients():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # unconstrained slope is -1
    x = nnls(a, b)
    assert (x >= 0).all() and x[1] == 0 and x[0] == pytest.approx(2.0)


def test_kv_capacity_is_read_from_the_engine_log(tmp_path):
    log = tmp_path / "engine-0.log"
    log.write_text(
        "noise\n(EngineCore pid=1) INFO [kv_cache_utils.py:2327] CPU KV cache size: 65,536 tokens, "
        "Maximum concurrency for 512 tokens per request: 128.00x\n"
    )
    assert kv_capacity_from_log(log) == 65536
    assert kv_capacity_from_log(tmp_path / "missing.log") is None
