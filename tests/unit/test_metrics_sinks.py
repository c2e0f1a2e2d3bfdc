"""Metric sinks, the follower and summary.json. A failing sink (W&B included) never raises."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from rich.console import Console

from skyrl_cli.metrics.follow import EventFollower, FollowedRun, follow_events
from skyrl_cli.metrics.live import LiveView, MetricBoard
from skyrl_cli.metrics.sinks import JsonLinesSink, Sink, SinkGroup, SummaryPrinter
from skyrl_cli.metrics.summary import headline_rows, shown_path, summarize, time_split, write_summary
from skyrl_cli.metrics.wandb_sink import WandbSink, wandb_sink_for
from skyrl_contracts.events import EventWriter, MetricEvent
from skyrl_contracts.schema import WandbConfig


def event(step, name, value, process="trainer", t=0.0):
    return MetricEvent(t, step, process, name, value)


class Recorder(Sink):
    name = "recorder"

    def __init__(self):
        self.events, self.started, self.summary = [], False, "not closed"

    def start(self):
        self.started = True

    def handle(self, events):
        self.events += events

    def close(self, summary=None):
        self.summary = summary


class Exploding(Sink):
    name = "exploding"

    def handle(self, events):
        raise RuntimeError("boom")


def test_a_failing_sink_is_disabled_with_one_warning():
    warnings, good = [], Recorder()
    group = SinkGroup([Exploding(), good], warn=warnings.append)
    group.start()
    group.handle([event(1, "train/loss", 1.0)])
    group.handle([event(2, "train/loss", 0.5)])
    group.close({"x": 1})
    assert [e.step for e in good.events] == [1, 2]
    assert good.summary == {"x": 1}
    assert warnings == ["metrics sink 'exploding' failed and is disabled: RuntimeError: boom"]


def test_wandb_import_failure_disables_the_sink(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    warnings = []
    group = SinkGroup([WandbSink(WandbConfig(mode="offline"), "t", "/nonexistent")], warn=warnings.append)
    group.start()
    group.handle([event(1, "train/loss", 1.0)])
    group.close(None)
    assert len(warnings) == 1 and warnings[0].startswith(
        "metrics sink 'wandb' failed and is disabled: ModuleNotFoundError"
    )


def test_wandb_disabled_mode_makes_no_sink():
    assert wandb_sink_for(WandbConfig(mode="disabled"), "t", "/tmp") is None


def test_json_lines_sink_prints_events_then_summary():
    out = io.StringIO()
    sink = JsonLinesSink(out)
    sink.handle([event(1, "train/loss", 1.5)])
    sink.close({"steps": 1})
    lines = out.getvalue().splitlines()
    assert json.loads(lines[0]) == {"time": 0.0, "step": 1, "process": "trainer", "name": "train/loss", "value": 1.5}
    assert json.loads(lines[1]) == {"summary": {"steps": 1}}


def test_board_rows_only_for_seen_metrics_and_mean_over_processes():
    board = MetricBoard()
    board.update(
        [
            event(0, "progress/total_steps", 100),
            event(3, "train/loss", 0.25),
            event(5, "train/loss", 0.125),
            event(1, "engine/kv_cache_usage", 0.2, process="engine-0"),
            event(1, "engine/kv_cache_usage", 0.4, process="engine-1"),
        ]
    )
    assert board.total == 100 and board.step == 5
    assert board.rows() == [("loss", "0.1250"), ("KV-cache use", "30%")]


def test_live_view_renders_progress_and_rows():
    buffer = io.StringIO()
    view = LiveView("sft", console=Console(file=buffer, force_terminal=False, width=100))
    view.start()
    view.handle([event(0, "progress/total_steps", 10), event(4, "train/loss", 0.5), event(4, "eval/accuracy", 0.75)])
    view.close(None)
    text = buffer.getvalue()
    assert "4/10" in text and "loss" in text and "0.750" in text


def test_summary_keeps_last_values_and_throughput():
    events = [
        event(1, "train/loss", 2.0, t=10.0),
        event(1, "train/tokens_per_s", 100.0, t=10.0),
        event(2, "train/tokens_per_s", 300.0, t=12.0),
        event(2, "eval/accuracy", 0.5, process="evaluator", t=12.5),
    ]
    summary = summarize(events)
    assert summary["steps"] == 2 and summary["elapsed_s"] == 2.5
    assert summary["metrics"] == {"train/loss": 2.0, "train/tokens_per_s": 300.0, "eval/accuracy": 0.5}
    assert summary["throughput"] == {"train/tokens_per_s": {"mean": 200.0, "last": 300.0}}


def test_summary_steps_count_an_evaluation_after_the_last_logged_train_step():
    events = [
        event(470, "train/loss", 0.1, t=1.0),
        event(475, "eval/accuracy", 0.54, t=2.0),
        event(480, "engine/running", 3.0, t=3.0),
    ]
    assert summarize(events)["steps"] == 475


def test_summary_printer_prints_the_headline_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    buffer = io.StringIO()
    summary = {**summarize([event(3, "eval/accuracy", 0.9)]), "stage": "sft"}
    SummaryPrinter(Console(file=buffer, width=100), run_dir=tmp_path).close(summary)
    text = buffer.getvalue()
    assert "sft summary" in text and "held-out accuracy" in text and "0.900" in text
    assert f"skyrl runs show {tmp_path.name} (summary.json)" in text


def _rl_summary(final_model: Path) -> dict:
    """A summary shaped like the quickstart's RL one: 60-odd metrics, 4 updates a step."""
    events = [event(0, "progress/total_steps", 20, t=30.0), event(0, "progress/total_steps", 20, t=41.0)]
    for step in range(1, 21):
        t = 41.0 + 5 * step
        events += [
            event(step, f"train/update{u}/{m}", 0.1, t=t) for u in range(1, 5) for m in ("ratio_min", "approx_kl")
        ]
        events += [
            event(step, name, 0.5, t=t) for name in ("train/loss", "train/grad_norm", "train/lr", "rollout/reward_mean")
        ]
        events += [
            event(step, "rollout/tokens_per_s", 1000.0 + step, t=t),
            event(step, "train/tokens_per_s", 50.0, t=t),
        ]
    summary = summarize(events)
    summary.update(
        stage="rl",
        completed=True,
        wall_s=150.0,
        final_model=str(final_model),
        eval_accuracy_initial=0.514,
        eval_accuracy_final=1.0,
        **time_split(events, started_at=0.0, wall_s=150.0),
    )
    return summary


def test_the_end_of_run_table_is_short_and_says_what_each_time_counts(tmp_path):
    (tmp_path / "final").mkdir()
    summary = _rl_summary(tmp_path / "final")
    assert len(summary["metrics"]) > 12
    rows = dict(headline_rows(summary, tmp_path))
    assert len(rows) <= 15
    assert rows["outcome"] == "finished, 20 steps"
    assert rows["held-out accuracy"] == "0.514 -> 1.000"
    assert rows["rollout tokens/s"] == "1,010"  # the mean of 1001..1020
    # Start-up ends when the later of the two training processes is ready (t = 41 s of 150 s).
    assert rows["wall time"] == "150 s (start-up 41 s, training 109 s)"
    assert rows["model"] == shown_path(tmp_path / "final")
    assert not any(label.startswith("train/update") for label in rows)


def test_time_split_needs_a_ready_event_after_the_start():
    events = [event(0, "progress/total_steps", 10, t=5.0)]
    assert time_split(events, started_at=2.0, wall_s=20.0) == {"startup_s": 3.0, "training_s": 17.0}
    assert time_split(events, started_at=6.0, wall_s=20.0) == {}  # an earlier attempt's (resume)


def test_a_run_that_failed_early_shows_no_model_and_no_wall_time(tmp_path):
    summary = {**_rl_summary(tmp_path / "final"), "completed": False}  # final/ never written
    del summary["wall_s"]
    rows = dict(headline_rows(summary))
    assert rows["outcome"] == "stopped at step 20"
    assert "model" not in rows and "wall time" not in rows


def test_follower_reads_only_new_complete_lines(tmp_path):
    recorder = Recorder()
    follower = EventFollower(tmp_path, recorder)
    assert follower.poll() == 0  # no file yet
    with EventWriter(tmp_path / "events.jsonl", "trainer") as writer:
        writer.log(1, {"train/loss": 1.0})
        assert follower.poll() == 1
        with open(tmp_path / "events.jsonl", "a") as fh:
            fh.write('{"time": 1, "step": 2')  # a line being written
        assert follower.poll() == 0
    assert [e.value for e in recorder.events] == [1.0]


def test_followed_run_writes_summary_and_closes_sinks(tmp_path):
    recorder = Recorder()
    with EventWriter(tmp_path / "events.jsonl", "trainer") as writer:
        with FollowedRun(tmp_path, recorder, {"stage": "sft"}) as run:
            writer.log(1, {"train/loss": 1.0, "train/tokens_per_s": 10.0})
            run.poll()
            writer.log(2, {"train/loss": 0.5, "eval/accuracy": 0.8})
    assert recorder.started and [e.step for e in recorder.events] == [1, 1, 2, 2]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == recorder.summary
    assert summary["metrics"]["eval/accuracy"] == 0.8 and summary["stage"] == "sft" and summary["completed"] is True


def test_follow_events_until_stop(tmp_path):
    with EventWriter(tmp_path / "events.jsonl", "trainer") as writer:
        writer.log(1, {"train/loss": 1.0})
    recorder, calls = Recorder(), iter([False, True])
    summary = follow_events(tmp_path, recorder, stop_condition=lambda: next(calls), interval_s=0)
    assert summary["metrics"] == {"train/loss": 1.0} and len(recorder.events) == 1


def test_write_summary_without_events(tmp_path):
    assert write_summary(tmp_path)["steps"] == 0
    assert (tmp_path / "summary.json").exists()


ZERO_SPEC = {
    "spec/drafts": 0.0,
    "spec/draft_tokens": 0.0,
    "spec/accepted_tokens": 0.0,
    "spec/acceptance_rate": 0.0,
    "spec/mean_accepted_length": 1.0,
}


def test_speculation_with_no_drafts_is_reported_as_zero_everywhere(tmp_path):
    """The quickstart with n-gram speculation: short answers, nothing proposed. The live view,
    summary.json and the end-of-run table say speculation was on and drafted nothing."""
    recorder = Recorder()
    extra = {"stage": "rl", "speculative": {"method": "ngram", "num_speculative_tokens": 3}}
    with EventWriter(tmp_path / "events.jsonl", "inference") as writer:
        with FollowedRun(tmp_path, recorder, extra) as run:
            writer.log(1, {"engine/running": 0.0, **ZERO_SPEC})
            run.poll()
    board = MetricBoard()
    board.update(recorder.events)
    live = dict(board.rows())["speculation"]
    assert live.startswith("on: 0 drafts, 0 draft tokens, 0 accepted")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["speculative"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "drafts": 0.0,
        "draft_tokens": 0.0,
        "accepted_tokens": 0.0,
        "acceptance_rate": 0.0,
        "mean_accepted_length": 1.0,
    }
    row = dict(headline_rows(summary))["speculative decoding"]
    assert row == "ngram, k=3: 0 drafts, 0 draft tokens, 0 accepted (nothing proposed: no speed-up)"


def test_speculation_figures_in_the_end_of_run_table():
    events = [event(3, "spec/" + k[5:], v, process="inference") for k, v in ZERO_SPEC.items()]
    events += [
        event(4, "spec/drafts", 412.0, process="inference"),
        event(4, "spec/draft_tokens", 1236.0, process="inference"),
        event(4, "spec/accepted_tokens", 830.0, process="inference"),
        event(4, "spec/acceptance_rate", 830 / 1236, process="inference"),
        event(4, "spec/mean_accepted_length", 1 + 830 / 412, process="inference"),
    ]
    summary = summarize(events)
    assert summary["speculative"]["drafts"] == 412.0
    row = dict(headline_rows(summary))["speculative decoding"]
    assert row == "on: 412 drafts, 1,236 draft tokens, 830 accepted (67%), 3.01 tokens/step"
    # Speculation set in the recipe but the engines' metrics never scraped: said, not hidden.
    rows = dict(headline_rows({"speculative": {"method": "draft_model", "num_speculative_tokens": 4}}))
    assert rows["speculative decoding"].startswith("draft_model, k=4: no figures")
    assert "speculative decoding" not in dict(headline_rows(summarize([event(1, "train/loss", 1.0)])))
