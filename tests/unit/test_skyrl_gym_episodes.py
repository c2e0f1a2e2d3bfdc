"""skyrl-gym environments as our episodes (``backends.rollout.episodes.skyrl_gym``): SkyRL-format
rows, SkyRL's built-in gsm8k environment and a user-registered two-turn one, driven by
``run_episode`` with scripted model turns; the recipe checks and the row checks."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

pytest.importorskip("skyrl_gym")

from backends.models.tokenizer import build_char_tokenizer
from backends.rollout.environments import TurnText, run_episode
from backends.rollout.episodes.skyrl_gym import SkyRLGymEnvironment, SkyRLGymEpisodes
from backends.rollout.rewards import GuardedCaller
from backends.rollout.trainer_feed import environment_metrics
from skyrl_cli.recipe.validate import environment_problems, user_code_problems
from skyrl_contracts.episodes import episode_kind, turn_limit
from skyrl_contracts.errors import UsageError
from skyrl_contracts.samples import Sample
from skyrl_contracts.schema import Recipe

TWO_TURNS = '''
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

CLOSED = []


class TwoTurns(BaseTextEnv):
    """Turn 1 earns the configured bonus and asks again; the last turn earns 1 for an answer of
    even length. What it was told is kept for the tests."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.max_turns = extras["max_turns"]
        self.bonus = env_config.bonus  # attribute access: SkyRL hands a DictConfig
        self.extras = extras

    def init(self, prompt):
        return [{"role": "system", "content": "be brief"}, *prompt], {}

    def step(self, action):
        self.turns += 1
        if self.turns < self.max_turns:
            obs = [{"role": "user", "content": "again?"}]
            return BaseTextEnvStepOutput(observations=obs, reward=self.bonus, done=False, metadata={"chars": len(action)})
        reward = float(len(action) % 2 == 0)
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={"chars": len(action)})

    def get_metrics(self):
        return {"turns_taken": self.turns, "note": "not a number"}

    def close(self):
        CLOSED.append(self.turns)


skyrl_gym.register(id="two_turns_unit", entry_point=TwoTurns)
'''

TOKENIZER = build_char_tokenizer("abc")
ROW = {
    "prompt": [{"role": "user", "content": "what is 2+3?"}],
    "env_class": "gsm8k",
    "reward_spec": {"method": "rule", "ground_truth": "5"},
    "extra_info": {"split": "train", "index": 7},
    "data_source": "unit",
}


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    (tmp_path / "two_turn_env_unit.py").write_text(textwrap.dedent(TWO_TURNS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "two_turn_env_unit"
    if sys.modules.pop("two_turn_env_unit", None) is not None:
        from skyrl_gym.envs import deregister

        deregister("two_turns_unit")  # registering twice is an error: each test imports it afresh


def recipe(**rl) -> Recipe:
    return Recipe.model_validate(
        {"name": "t", "model": {"init": {}, "tokenizer": "char"}, "data": {"train": "rows.jsonl"}, "rl": rl}
    )


def scripted(responses, seen):
    async def generate(history, new_messages, tools):
        turn = sum(m["role"] == "assistant" for m in history)
        seen.append(list(new_messages))
        return TurnText(responses[turn], responses[turn])

    return generate


def run(make_env, row, responses, max_turns=None):
    seen = []
    episode = asyncio.run(run_episode(make_env, row, scripted(responses, seen), GuardedCaller(5.0), max_turns))
    return episode, seen


def test_builtin_gsm8k_scores_skyrl_rows_as_skyrl_does():
    make = lambda: SkyRLGymEnvironment("", {}, 1)  # noqa: E731 - the row's env_class names it
    right, seen = run(make, ROW, ["so it is #### 5"])
    assert right.reward == 1.0 and right.done and right.turns == 1 and right.error is None
    assert seen == [ROW["prompt"]]  # init() hands the row's chat messages on unchanged
    wrong, _ = run(make, ROW, ["it is 5"])  # gsm8k's strict format wants '#### 5'
    assert wrong.reward == 0.0 and wrong.error is None


def test_user_environment_two_turns_with_config_extras_metrics_and_close(user_env):
    module = __import__(user_env)
    rows = dict(ROW, env_class="two_turns_unit")
    make = lambda: SkyRLGymEnvironment("", {"two_turns_unit": {"bonus": 0.25}}, 2)  # noqa: E731
    episode, seen = run(make, rows, ["abc", "abcd"], max_turns=None)
    assert episode.turns == 2 and episode.done and episode.reward == pytest.approx(1.25)
    assert seen[0][0] == {"role": "system", "content": "be brief"}  # what init() returned is the prompt
    assert seen[1] == [{"role": "user", "content": "again?"}]
    assert episode.step_infos == [{"chars": 3}, {"chars": 4}]
    assert episode.env_metrics == {"chars": 3.5, "turns_taken": 2.0}  # numbers only
    assert module.CLOSED == [2]
    odd, _ = run(make, rows, ["abc", "abc"])
    assert odd.reward == pytest.approx(0.25) and module.CLOSED == [2, 2]


def test_extras_are_the_row_less_prompt_and_env_class_plus_max_turns(user_env):
    __import__(user_env)
    env = SkyRLGymEnvironment("two_turns_unit", {"two_turns_unit": {"bonus": 0.5}}, 3)
    env.reset({k: v for k, v in ROW.items() if k != "env_class"})
    assert env.env.extras == {
        "reward_spec": ROW["reward_spec"],
        "extra_info": ROW["extra_info"],
        "data_source": "unit",
        "max_turns": 3,
    }
    assert env.env.bonus == 0.5


def test_a_limit_stops_an_environment_that_never_ends(user_env):
    __import__(user_env)
    make = lambda: SkyRLGymEnvironment("two_turns_unit", {"two_turns_unit": {"bonus": 0.1}}, 5)  # noqa: E731
    episode, _ = run(make, dict(ROW, env_class="two_turns_unit"), ["a"] * 5, max_turns=2)
    assert episode.turns == 2 and not episode.done and episode.reward == pytest.approx(0.2)


def test_episode_kind_and_turn_limit():
    assert episode_kind(recipe(environment="skyrl_gym:gsm8k")) == "skyrl_gym"
    assert episode_kind(recipe(environment="skyrl_gym")) == "skyrl_gym"
    assert turn_limit(recipe(environment="skyrl_gym:gsm8k")) is None  # the environment's done decides
    assert turn_limit(recipe(environment="skyrl_gym:gsm8k", max_turns=3)) == 3


def test_runner_refuses_unregistered_ids_with_close_matches(user_env):
    with pytest.raises(UsageError, match=r"no environment 'gsm8'; did you mean gsm8k"):
        SkyRLGymEpisodes(recipe(environment="skyrl_gym:gsm8"), tokenizer=TOKENIZER)
    with pytest.raises(UsageError, match="rl.env_config.nope"):
        SkyRLGymEpisodes(recipe(environment="skyrl_gym:gsm8k", env_config={"nope": {}}), tokenizer=TOKENIZER)
    with pytest.raises(UsageError, match="rl.environment_modules .*cannot import module 'no_such_env_mod'"):
        SkyRLGymEpisodes(recipe(environment="skyrl_gym", environment_modules=["no_such_env_mod"]), tokenizer=TOKENIZER)
    runner = SkyRLGymEpisodes(recipe(environment="skyrl_gym", environment_modules=[user_env]), tokenizer=TOKENIZER)
    runner.check_rows([ROW, dict(ROW, env_class="two_turns_unit")], "training data")


def test_rows_without_what_their_environment_needs_name_the_row_and_field():
    runner = SkyRLGymEpisodes(recipe(environment="skyrl_gym"), tokenizer=TOKENIZER)
    with pytest.raises(UsageError, match="training data row 1: row has no 'env_class'"):
        runner.check_rows([ROW, {"prompt": "hi"}], "training data")
    with pytest.raises(UsageError, match="held-out data row 0: row needs 'prompt'"):
        runner.check_rows([{"env_class": "gsm8k"}], "held-out data")
    with pytest.raises(UsageError, match="held-out data row 0: env_class: skyrl-gym has no environment 'gsm9k'"):
        runner.check_rows([dict(ROW, env_class="gsm9k")], "held-out data")


def test_recipe_checks(tmp_path):
    inert = environment_problems(recipe(environment="skyrl_gym:gsm8k", tool_parser="hermes", tool_errors="end"))
    assert [p.path for p in inert] == [("rl", "tool_parser"), ("rl", "tool_errors")]
    assert "runs its tool groups itself" in inert[0].message
    assert environment_problems(recipe(environment="skyrl_gym:gsm8k", env_config={"gsm8k": {}})) == []
    bad = environment_problems(recipe(environment="my_env", env_args={"a": 1}, environment_modules=["m"]))
    assert [p.path for p in bad] == [("rl", "environment"), ("rl", "environment_modules"), ("rl", "env_args")]
    assert "neither a class 'module:Class' nor a library environment" in bad[0].message
    assert [p.path for p in environment_problems(recipe(environment="verifiers"))] == [("rl", "environment")]
    assert environment_problems(recipe(environment="verifiers", env_args={"taskset": {"id": "vf_echo"}})) == []
    found = user_code_problems(recipe(environment="skyrl_gym", environment_modules=["not_here_mod"]), tmp_path)
    assert [(p.path, "cannot find module 'not_here_mod'" in p.message) for p in found] == [
        (("rl", "environment_modules", 0), True)
    ]


def test_environment_metrics_average_each_trajectory_once():
    def sample(uid, index, info):
        return Sample(uid, index, [1], [2], [1], [-0.5], info=info)

    samples = [
        sample("a", 0, {"env/x": 1.0}),
        sample("a", 0, {"env/x": 1.0}),  # a second sample of the same trajectory
        sample("a", 1, {"env/x": 3.0, "env/y": 2.0}),
        sample("b", 0, {"tool_calls": 1}),
    ]
    assert environment_metrics(samples) == {"rollout/env/x": 2.0, "rollout/env/y": 2.0}
