"""docs/environments.md shows the example's real files (the verifiers taskset is the one
tests/integration/test_verifiers_env.py trains on), and its skyrl-gym environment runs as the page
says: registered by importing its module, made from a row of the example's SkyRL-format
data, a wrong first answer told so and a right second one earning ``second_try``."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from tests.docs_blocks import DOCS, REPO, blocks

pytest.importorskip("skyrl_gym")

from skyrl_gym.envs import deregister  # noqa: E402

from backends.rollout.environments import TurnText, run_episode  # noqa: E402
from backends.rollout.episodes.skyrl_gym import SkyRLGymEnvironment  # noqa: E402
from backends.rollout.rewards import GuardedCaller  # noqa: E402

PAGE = DOCS / "environments.md"
EXAMPLE = REPO / "recipes" / "environments"


def block(lang: str, contains: str):
    found = [b for b in blocks(PAGE) if b.lang == lang and contains in b.code]
    assert len(found) == 1, f"{PAGE.name}: {len(found)} {lang} blocks contain {contains!r}"
    return found[0]


def test_the_files_shown_are_the_example_files():
    assert block("python", "class RetryArithmetic").code == (EXAMPLE / "skyrl_gym_envs.py").read_text()
    echo = block("python", "class EchoTaskset")
    assert echo.code == (REPO / "tests" / "fixtures" / "vf_echo.py").read_text()
    assert echo.marker == ("run", "tests/cli/test_docs_environments.py")  # tests/integration/test_verifiers_env.py
    assert block("toml", 'name = "skyrl_gym_example"').code == (EXAMPLE / "skyrl_gym.toml").read_text()
    shown = block("text", '"env_class"').code.splitlines()
    assert shown == (EXAMPLE / "skyrl_gym_rows.jsonl").read_text().splitlines()[: len(shown)]


def test_the_environment_shown_retries_and_scores_as_the_page_says(monkeypatch):
    assert block("python", "class RetryArithmetic").marker == ("run", "tests/cli/test_docs_environments.py")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    __import__("skyrl_gym_envs")
    try:
        row = json.loads((EXAMPLE / "skyrl_gym_rows.jsonl").read_text().splitlines()[0])
        assert row["env_class"] == "retry_arithmetic"
        answer = row["reward_spec"]["ground_truth"]

        def episode(turns):
            async def generate(history, new_messages, tools):
                text = turns[sum(m["role"] == "assistant" for m in history)]
                return TurnText(text, text)

            make = lambda: SkyRLGymEnvironment("", {"retry_arithmetic": {"second_try": 0.5}}, 2)  # noqa: E731
            return asyncio.run(run_episode(make, row, generate, GuardedCaller(5.0), 2))

        first = episode([answer])
        assert (first.reward, first.turns, first.env_metrics) == (1.0, 1, {"tries": 1.0})
        second = episode(["1", answer])
        assert (second.reward, second.turns) == (0.5, 2)
        assert second.messages[2] == {"role": "user", "content": "not quite, try again"}
        assert episode(["1", "2"]).reward == 0.0
    finally:
        sys.modules.pop("skyrl_gym_envs", None)
        deregister("retry_arithmetic")
