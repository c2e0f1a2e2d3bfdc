"""verifiers episodes without engines: how a recipe becomes verifiers' env config, what is refused
(one line naming rl.environment), rows as task data, and real verifiers rollouts (its chat harness
in a subprocess, its interception server, its rubric) against the agent endpoint over a scripted
rollout client: the recorded tokens, the rewards, untrainable seats, the time limit.

The envs are tests/fixtures/vf_echo.py (a taskset: say a word back) and vf_judged.py (a second,
untrainable seat)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backends.data.chat import encode_text
from backends.rollout.client import Completion, WeightSpan
from backends.rollout.episodes import episode_runner
from backends.rollout.episodes.verifiers import env_table, load_env, taskset_rows
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe
from tests.recipes import RL, tiny_recipe

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CHAT = {"agent": {"harness": {"id": "null"}}}  # verifiers' chat loop: no sandbox needed


@pytest.fixture(autouse=True)
def fixture_envs_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def recipe(environment: str = "verifiers:vf_echo", env_args=CHAT, **rl) -> Recipe:
    data = {"task": None, "digits": None, "train": "train.jsonl"}
    return Recipe.model_validate(
        tiny_recipe(RL, data=data, rl={"environment": environment, "env_args": env_args, "max_new_tokens": 8, **rl})
    )


# ------------------------------------------------------------------------------ the env config


def test_the_taskset_id_is_rl_environments_name_and_env_args_the_rest_of_verifiers_env_table():
    table = env_table(recipe(env_args={"taskset": {"system_prompt": "system.txt"}, **CHAT}))
    assert table == {"taskset": {"system_prompt": "system.txt", "id": "vf_echo"}, **CHAT}
    assert env_table(recipe("verifiers", {"taskset": {"id": "vf_echo"}}))["taskset"] == {"id": "vf_echo"}
    with pytest.raises(UsageError, match="names no taskset: write 'verifiers:<taskset id>'"):
        env_table(recipe("verifiers", {}))
    with pytest.raises(UsageError, match="name two tasksets; keep one"):
        env_table(recipe(env_args={"taskset": {"id": "other"}}))


def test_a_chat_seat_runs_on_this_host_and_is_told_rl_max_turns():
    env, config = load_env(recipe(max_turns=3))
    assert config.agent.runtime.type == "subprocess"  # verifiers' own default: a Prime sandbox
    assert config.agent.max_turns == 3 and config.agent.harness.id == "null"
    assert type(env).__name__ == "SingleAgentEnv" and type(env.taskset).__name__ == "EchoTaskset"
    _, config = load_env(recipe(env_args={"agent": {**CHAT["agent"], "max_turns": 5}}, max_turns=3))
    assert config.agent.max_turns == 5  # the env's own limit stands
    _, config = load_env(recipe())
    assert config.agent.max_turns is None


def test_a_code_running_harness_runs_on_this_host_only_when_the_recipe_says_so():
    _, config = load_env(recipe(env_args={"agent": {"runtime": {"type": "subprocess"}}}))
    assert config.agent_harnesses()["agent"].id == "bash" and config.agent.runtime.type == "subprocess"


@pytest.mark.parametrize(
    "environment, env_args, message",
    [
        (
            "verifiers:vf_echo",
            {},
            "seat 'agent' runs harness 'bash' in a prime runtime (a sandbox); for a chat-only seat set "
            'rl.env_args.agent.harness = { id = "null" }, or to run its commands on this host, '
            'rl.env_args.agent.runtime = { type = "subprocess" }',
        ),
        ("verifiers:vf_echo", {"agent": {**CHAT["agent"], "runtime": {"type": "docker"}}}, "in a docker runtime"),
        (
            "verifiers:vf_echo",
            {"agent": {**CHAT["agent"], "client": {"type": "eval", "base_url": "https://api.example.com/v1"}}},
            "seat 'agent' calls its own endpoint (https://api.example.com/v1)",
        ),
        ("verifiers:vf_echo", {"agent": {**CHAT["agent"], "model": "gpt-x"}}, "seat 'agent' plays model 'gpt-x'"),
        ("verifiers:vf_echo", {**CHAT, "id": "vf_judged"}, "seat 'judge' runs harness 'bash' in a prime runtime"),
        (
            "verifiers:vf_echo",
            {"agent": {**CHAT["agent"], "retries": {"max_retries": 2}}},
            "seat 'agent' retries failed runs, whose calls would train on the retry's reward",
        ),
    ],
)
def test_what_cannot_run_beside_the_trainer_is_refused_in_one_line(environment, env_args, message):
    with pytest.raises(UsageError) as caught:
        load_env(recipe(environment, env_args))
    text = str(caught.value)
    assert text.startswith(f"rl.environment {environment!r} cannot run beside the trainer: ") and "\n" not in text
    assert message in text


def test_unknown_tasksets_and_keys_are_usage_errors_naming_what_is_wrong():
    with pytest.raises(UsageError, match=r"rl.environment 'verifiers:no_such_taskset': .*no_such_taskset"):
        load_env(recipe("verifiers:no_such_taskset"))
    with pytest.raises(UsageError, match=r"^rl.env_args \(rl.environment 'verifiers:vf_echo'\): agent.harnes"):
        load_env(recipe(env_args={"agent": {"harnes": {"id": "null"}}}))


# ------------------------------------------------------------------------------ rows


def test_the_tasksets_own_tasks_as_rows_and_rows_checked_as_task_data(tok):
    rows = taskset_rows(recipe())
    assert [(r["prompt"], r["answer"], r["idx"]) for r in rows] == [
        (f"say {w}", w, i) for i, w in enumerate(("cat", "dog", "sun", "pen"))
    ]
    assert [r["prompt"] for r in taskset_rows(recipe(), limit=2)] == ["say cat", "say dog"]
    runner = episode_runner(recipe(), tok)
    runner.check_rows(rows + [{"prompt": "say hi", "answer": "hi", "extra": 1}], "training data")
    with pytest.raises(UsageError, match=r"^training data row 1: not a task of 'verifiers:vf_echo': answer: Field"):
        runner.check_rows([rows[0], {"prompt": "say hi"}], "training data")


def test_an_rl_only_recipe_without_data_trains_on_the_tasksets_own_tasks():
    from pydantic import ValidationError

    from backends.rollout.orchestrator import load_rows

    own = Recipe.model_validate(
        tiny_recipe(
            RL,
            data={"task": None, "digits": None, "eval_size": 2},
            rl={"environment": "verifiers:vf_echo", "env_args": CHAT},
        )
    )
    train, held_out = load_rows(own)
    assert sorted(r["answer"] for r in train + held_out) == ["cat", "dog", "pen", "sun"]
    for rl, sft in (({"environment": "verifiers:vf_echo"}, {"steps": 1}), ({}, None)):
        with pytest.raises(ValidationError, match="set exactly one of data.task or data.train"):
            Recipe.model_validate(tiny_recipe(RL, data={"task": None, "digits": None}, rl=rl, sft=sft))


# ------------------------------------------------------------------------------ rollouts


class ScriptedClient:
    """A rollout client whose engine says each scripted text in turn (logprob -0.5 a token)."""

    max_model_len = 4096

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.requests = tokenizer, list(script), []

    async def generate(self, prompt_ids, session_id, max_tokens, temperature=1.0, n=1, **kw):
        self.requests.append({"prompt_ids": list(prompt_ids), "session_id": session_id, "temperature": temperature})
        ids = encode_text(self.tokenizer, self.script.pop(0))
        return [Completion(ids, [-0.5] * len(ids), "stop", (WeightSpan("0", 0, len(ids)),))] * n

    async def finish_session(self, session_id):
        return True


async def run_group(runner, client, row, k: int, temperature: float = 1.0):
    await runner.start(client, [client.tokenizer.eos_token_id])
    try:
        return await asyncio.gather(*(runner.trajectory(row, f"p_{i}", temperature, None, i) for i in range(k)))
    finally:
        await runner.stop()


ROW = {"prompt": "say dog", "answer": "dog"}


def test_verifiers_rolls_out_the_row_and_its_rubric_scores_exactly_the_sampled_tokens(tok):
    runner = episode_runner(recipe(), tok)
    client = ScriptedClient(tok, ["dog<eos>", "cat<eos>"])
    results = asyncio.run(run_group(runner, client, ROW, 2))
    by_session = {r["session_id"]: r for r in client.requests}
    answers = {}
    for i, (parts, episode) in enumerate(results):
        (sample,) = parts
        asked = by_session[f"p_{i}"]
        assert sample.prompt_ids == asked["prompt_ids"] and asked["temperature"] == 1.0
        prompt = tok.decode(sample.prompt_ids, skip_special_tokens=False)
        assert "say dog" in prompt and prompt.endswith("<|assistant|>"), prompt
        said = tok.decode(sample.response_ids, skip_special_tokens=False)
        assert sample.loss_mask == [1] * len(sample.response_ids)
        assert sample.rollout_logprobs == [-0.5] * len(sample.response_ids)
        assert episode.error is None and episode.turns == 1
        info = runner.sample_info(episode, parts)
        assert info == {"agent_calls": 1, "agent_samples": 1, "env/correct": episode.reward, "env/reply_chars": 3.0}
        answers[said] = episode.reward
    assert answers == {"dog<eos>": 1.0, "cat<eos>": 0.0}


def test_an_untrainable_seat_is_answered_and_not_trained_on(tok):
    env_args = {"id": "vf_judged", "agent": CHAT["agent"], "judge": CHAT["agent"]}
    runner = episode_runner(recipe(env_args=env_args), tok)
    client = ScriptedClient(tok, ["dog<eos>", "cat<eos>"])  # the agent's call, then the judge's
    ((parts, episode),) = asyncio.run(run_group(runner, client, ROW, 1))
    assert [r["session_id"] for r in client.requests] == ["p_0", "p_0-untrained"]
    (sample,) = parts
    assert tok.decode(sample.response_ids, skip_special_tokens=False) == "dog<eos>"
    assert episode.error is None and episode.reward == 1.0  # the judge's wrong answer is not the reward


def test_evaluation_is_greedy_and_a_slow_episode_is_an_error_record(tok):
    runner = episode_runner(recipe(), tok)
    client = ScriptedClient(tok, ["dog<eos>"])
    ((_, episode),) = asyncio.run(run_group(runner, client, ROW, 1, temperature=0.0))
    assert client.requests[0]["temperature"] == 0.0 and episode.reward == 1.0

    runner = episode_runner(recipe(agent_timeout_s=0.05), tok)
    ((parts, episode),) = asyncio.run(run_group(runner, ScriptedClient(tok, ["dog<eos>"]), ROW, 1))
    assert parts == [] and episode.reward == 0.0
    assert episode.error == "verifiers: timeout after 0.05s (rl.agent_timeout_s)"
