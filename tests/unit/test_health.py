"""Run health: the sync-gap check (which learner steps it judges, the one line it says, where the run
records it) and a judge without verdicts for most replies."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from skyrl_cli.metrics.live import LiveView
from skyrl_cli.metrics.summary import summarize
from skyrl_contracts.events import MetricEvent
from skyrl_contracts.health import (
    SYNC_GAP,
    SYNC_GAP_BOUND,
    SYNC_GAP_FLOORS,
    SyncGapCheck,
    judge_health,
    sync_gap_floor,
    sync_gap_health,
)


def event(step: int, name: str, value: float, process: str = "trainer") -> MetricEvent:
    return MetricEvent(time=float(step), step=step, process=process, name=name, value=value)


def test_floors_follow_the_engine_dtype_and_int4_engines_have_none():
    assert sync_gap_floor("float32") == SYNC_GAP_FLOORS["float32"] == 1e-3
    assert sync_gap_floor("bfloat16") == sync_gap_floor("float16") == 1e-2
    assert sync_gap_floor("float32", int4_rollouts_without_qat=True) is None


def steps(check: SyncGapCheck, *gaps, stale: float = 0.0):
    return [check.judge({"train/logprob_diff": g, "async/staleness_max": stale}) for g in gaps]


def test_a_gap_that_stays_at_the_first_steps_numerics_is_never_flagged():
    """bf16 numerics of a flat model (5e-3..1.2e-2 in RL runs): above the floor, but not growing."""
    check = SyncGapCheck(floor=1e-2)
    assert steps(check, 0.006, 0.0117, 0.009, 0.017) == [None] * 4
    assert check.baseline == 0.006


def test_a_gap_that_grows_past_three_times_the_first_step_is_flagged():
    """A head left behind: 4e-7 at step 1 in fp32, then growing with training."""
    check = SyncGapCheck(floor=1e-3)
    assert steps(check, 4e-7, 5e-4, 0.023) == [None, None, (0.023, 1e-3)]
    check = SyncGapCheck(floor=1e-2)
    assert steps(check, 0.006, 0.012, 0.022)[-1] == (0.022, pytest.approx(0.018))


def test_a_first_step_beyond_any_numerics_is_flagged():
    """Engines that serve other weights from the start: 10x the floor, the first step included."""
    assert steps(SyncGapCheck(floor=1e-3), 0.5) == [(0.5, 1e-2)]
    assert steps(SyncGapCheck(floor=1e-3), 0.009) == [None]


def test_stale_steps_are_not_judged_and_set_no_baseline():
    check = SyncGapCheck(floor=1e-3)
    assert steps(check, 0.5, stale=1.0) == [None] and check.baseline is None
    assert check.judge({}) is None


def test_the_summary_records_the_first_and_worst_step():
    events = [
        event(0, SYNC_GAP_BOUND, 1e-2),
        event(3, SYNC_GAP_BOUND, 1e-2),
        event(3, SYNC_GAP, 0.02),
        event(5, SYNC_GAP_BOUND, 1e-2),
        event(5, SYNC_GAP, 0.04),
        event(6, "train/loss", 1.0),
    ]
    health = sync_gap_health(events)
    assert health["sync_gap_steps_over_bound"] == 2 and health["sync_gap_first_step"] == 3
    assert health["sync_gap_max"] == 0.04 and health["sync_gap_bound"] == 1e-2
    assert health["message"].startswith("step 3: trainer and engines disagree") and "0.02 > 0.01" in health["message"]
    assert summarize(events)["health"] == health
    assert "health" not in summarize([event(1, "train/loss", 1.0)])


def test_the_live_view_shows_the_line_once_seen():
    buffer = io.StringIO()
    view = LiveView("rl", console=Console(file=buffer, width=400, force_terminal=False))
    view.start()
    view.handle([event(0, SYNC_GAP_BOUND, 1e-3), event(2, "train/loss", 1.0)])
    assert view.board.notice is None
    view.handle([event(2, SYNC_GAP_BOUND, 1e-2), event(2, SYNC_GAP, 0.3), event(3, SYNC_GAP, 0.5)])
    view.close()
    assert view.board.notice.startswith("step 2: ") and "0.3 > 0.01" in view.board.notice
    assert "warning: step 2: trainer and engines disagree" in buffer.getvalue()


def judge_events(verdicts: float, unparsed: float, errors: float = 0.0) -> list:
    return [
        event(2, "judge/verdicts", verdicts),
        event(2, "judge/unparsed", unparsed),
        event(2, "judge/errors", errors),
    ]


def test_a_judge_without_verdicts_for_most_replies_is_a_health_warning():
    health = summarize(judge_events(verdicts=11, unparsed=30, errors=7))["health"]
    assert health["judge_no_verdict_share"] == 37 / 48
    assert health["message"].startswith("the judge gave no verdict for 37 of 48 replies (77%: 30 unparsed, 7 failed)")
    assert "rl.judge.template" in health["message"]


def test_a_judge_with_verdicts_for_most_replies_or_no_judge_is_healthy():
    assert "health" not in summarize(judge_events(verdicts=24, unparsed=24))  # half is not most
    assert judge_health({"train/loss": 1.0}) is None


def test_both_checks_firing_keep_both_figures_and_messages():
    events = [event(3, SYNC_GAP_BOUND, 1e-2), event(3, SYNC_GAP, 0.5), *judge_events(verdicts=1, unparsed=9)]
    health = summarize(events)["health"]
    assert health["sync_gap_first_step"] == 3 and health["judge_no_verdict_share"] == 0.9
    first, second = health["message"].split("; the judge")
    assert first.startswith("step 3: trainer and engines disagree") and second.startswith(
        " gave no verdict for 9 of 10"
    )
