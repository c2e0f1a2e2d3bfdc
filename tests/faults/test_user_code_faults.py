"""User code that misbehaves inside real RL runs (one engine, one learner rank, the tiny model): a
reward that raises, hangs, returns NaN, infinity, a string or None; an environment that never ends
its episodes, returns malformed observations or prompts, or a wrong type from step(). Each faulty
sample gets reward 0 and a record in ``sample_errors.jsonl``, the run goes on to its last step, and
the count is in the events (the live view's "sample errors" row) and in ``summary.json``.

    .venv/bin/python -m pytest -q -m faults tests/faults/test_user_code_faults.py
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.faults.rl_runs import last_metric, run, sample_errors, tiny_rl_recipe, write_module

pytestmark = pytest.mark.faults  # the real runs are marked integration one by one


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.integration.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("faults-model") / "model")


# The reward's answer, call by call (a counter, so that every kind comes up in a short run); each
# call's kind is appended to calls.jsonl for the test to compare with the records.
FAULTY_REWARD = """
    import itertools, json, math, time

    CALLS = {calls!r}

    KINDS = ["raise", "hang", "nan", "inf", "string_number", "string", "none", "bool", "ok"]
    _calls = itertools.count()

    def score(response, row):
        kind = KINDS[next(_calls) % len(KINDS)]
        with open(CALLS, "a") as fh:
            fh.write(json.dumps(kind) + "\\n")
        if kind == "raise":
            raise ValueError("boom in the user's reward")
        if kind == "hang":
            time.sleep(60)
        return {"nan": math.nan, "inf": math.inf, "string_number": "0.5", "string": "abc", "none": None,
                "bool": True, "ok": 1.0}[kind]
"""
# What the record of each faulty kind says.
REWARD_ERRORS = {
    "raise": "ValueError: boom in the user's reward",
    "hang": "timeout: score took longer than 1 s (rl.reward_timeout_s)",
    "nan": "reward is not finite: nan",
    "inf": "reward is not finite: inf",
    "string_number": "reward must be a number, got str",
    "string": "reward must be a number, got str",
    "none": "reward must be a number, got NoneType",
}


@pytest.mark.integration
def test_a_reward_that_raises_hangs_or_returns_no_number_scores_0_and_the_run_goes_on(tmp_path, tiny_model):
    write_module(tmp_path, "faulty_reward", FAULTY_REWARD.replace("{calls!r}", repr(str(tmp_path / "calls.jsonl"))))
    recipe = tiny_rl_recipe(tmp_path, tiny_model, rl={"reward": "faulty_reward:score", "reward_timeout_s": 1.0})
    proc = run(recipe)
    run_dir = tmp_path / "run"
    assert "rl done:" in proc.stdout and "Traceback" not in proc.stderr

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is True and summary["steps"] == 2
    records = sample_errors(run_dir)
    calls = Counter(json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines())
    said = Counter(r["error"] for r in records)
    print(
        f"\nreward faults: {sum(calls[k] for k in REWARD_ERRORS)} faulty calls of {sum(calls.values())}, "
        f"{len(records)} error records, rollout/errors {summary['metrics']['rollout/errors']:.0f}"
    )
    for kind, message in REWARD_ERRORS.items():
        assert said[f"step: {message}"] >= 1, (kind, said)
    # Every record is one faulty call (calls of groups cut short at shutdown leave none).
    assert len(records) <= sum(calls[k] for k in REWARD_ERRORS)
    assert set(said) == {f"step: {m}" for m in REWARD_ERRORS.values()}, said  # True and 1.0 are no errors
    train = [r for r in records if not r["sample"].startswith("eval-")]
    assert 0 < summary["metrics"]["rollout/errors"] <= len(train)
    assert summary["metrics"]["rollout/errors"] == last_metric(run_dir, "rollout/errors")
    # True and 1.0 pay 1, every faulty call 0: a step's mean reward over its 16 samples is k/16, k < 16.
    value = last_metric(run_dir, "rollout/reward_mean")
    assert 0 <= value < 1 and value * 16 == pytest.approx(round(value * 16))


# The environment's behaviour, episode by episode (again a counter over all episodes).
FAULTY_ENV = """
    import itertools
    from backends.rollout.environments import Environment, StepResult

    KINDS = ["never_ends", "observation_string", "observation_no_content", "reset_none", "step_tuple",
             "reward_string", "ok"]
    _episodes = itertools.count()

    class Faulty(Environment):
        def reset(self, row):
            self.kind = KINDS[next(_episodes) % len(KINDS)]
            self.row = row
            if self.kind == "reset_none":
                return None
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, response):
            if self.kind == "never_ends":
                return StepResult(observation=[{"role": "user", "content": "more"}], reward=0.25, done=False)
            if self.kind == "observation_string":
                return StepResult(observation="not a list of messages", done=False)
            if self.kind == "observation_no_content":
                return StepResult(observation=[{"role": "user"}], done=False)
            if self.kind == "step_tuple":
                return ("obs", 1.0, True)
            if self.kind == "reward_string":
                return StepResult(reward="1", done=True)
            return StepResult(reward=1.0, done=True)
"""
ENV_ERRORS = {
    "observation_string": "step: observation: messages must be a list of {'role', 'content'} dicts, got str",
    "observation_no_content": "step: observation: message 0: 'content' must be a string, got NoneType",
    "reset_none": "reset: messages must be a list of {'role', 'content'} dicts, got NoneType",
    "step_tuple": "step: step() must return StepResult, got tuple",
    "reward_string": "step: reward must be a number, got str",
}


@pytest.mark.integration
def test_an_environment_that_never_ends_or_returns_malformed_messages(tmp_path, tiny_model):
    write_module(tmp_path, "faulty_env", FAULTY_ENV)
    recipe = tiny_rl_recipe(tmp_path, tiny_model, rl={"environment": "faulty_env:Faulty", "max_turns": 3})
    proc = run(recipe)
    run_dir = tmp_path / "run"
    assert "rl done:" in proc.stdout and "Traceback" not in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is True and summary["steps"] == 2

    said = Counter(r["error"] for r in sample_errors(run_dir))
    print(
        f"\nenvironment faults: {sum(said.values())} error records, rollout/errors "
        f"{summary['metrics']['rollout/errors']:.0f}, turns_mean {last_metric(run_dir, 'rollout/turns_mean'):.2f}"
    )
    for kind, message in ENV_ERRORS.items():
        assert said[message] >= 1, (kind, said)
    assert set(said) == set(ENV_ERRORS.values()), said  # an episode that never ends is no error
    assert summary["metrics"]["rollout/errors"] >= 1
    # Episodes that never end stop at rl.max_turns: the mean number of turns stays within it.
    assert 1 <= last_metric(run_dir, "rollout/turns_mean") <= 3


def test_the_live_view_shows_the_error_and_retry_counts():
    from skyrl_cli.metrics.live import MetricBoard
    from skyrl_contracts.events import MetricEvent

    board = MetricBoard()
    board.update(
        [
            MetricEvent(0.0, 3, "orchestrator", "rollout/errors", 7.0),
            MetricEvent(0.0, 3, "orchestrator", "rollout/retries", 2.0),
        ]
    )
    assert ("sample errors", "7") in board.rows() and ("request retries", "2") in board.rows()


def test_an_episode_that_never_ends_stops_at_max_turns_without_an_error():
    import asyncio

    from backends.rollout.environments import Environment, StepResult, TurnText, run_episode
    from backends.rollout.rewards import GuardedCaller

    class NeverEnds(Environment):
        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, response):
            return StepResult(observation=[{"role": "user", "content": "more"}], reward=0.25, done=False)

    turns_asked = []

    async def generate(history, new_messages, tools):
        turns_asked.append(sum(m["role"] == "assistant" for m in history))
        return TurnText("1", "1")

    episode = asyncio.run(run_episode(NeverEnds, {"prompt": "1+1="}, generate, GuardedCaller(1.0), max_turns=3))
    assert (episode.turns, episode.done, episode.error, episode.reward, turns_asked) == (
        3,
        False,
        None,
        0.75,
        [0, 1, 2],
    )
