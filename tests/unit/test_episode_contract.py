"""``skyrl recipes validate`` and the run agree on the episode keys.

For every combination of ``rl.agent``, ``rl.max_turns``, the data (a user's JSONL files, a built-in
task with a tool, one without), a reward function and ``rl.tool_parser``: the recipe goes through
the real entry point (``skyrl recipes validate``), and, where it is accepted, through what the run
does with it: the driver writes ``recipe.resolved.json``, the orchestrator reads it back and builds
its episodes (``Orchestrator``: environment or agent, tool parser) and its agent endpoint. A recipe
that validate accepts must start, with the turn or call limit the recipe states (an agent's calls
uncapped where it states none); one it refuses must be refused by the orchestrator too, or be a
setting that could not act there.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import os
import sys
from pathlib import Path

import pytest
import tomli_w

from skyrl_contracts.errors import UsageError
from skyrl_contracts.rundir import RunDir

AGENT = """
async def solve(row, endpoint):
    return 0.0
"""
REWARD = """
def score(response, row):
    return float(response == row["completion"])
"""

SOURCES = {
    "user_data": {"train": "train.jsonl", "eval": "eval.jsonl", "eval_size": 4},
    "tool_task": {"task": "lookup", "digits": 2, "train_size": 16, "eval_size": 4},
    "plain_task": {"task": "addition", "digits": 1, "train_size": 16, "eval_size": 4},
}
CASES = list(
    itertools.product(
        sorted(SOURCES),
        ("agent", "reward", None),  # what scores the episode (None: the data's own check)
        (None, 1, 2, 4),  # rl.max_turns (None: unset)
        (None, "pythonic"),  # rl.tool_parser
    )
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    rows = [{"prompt": f"{i}?", "completion": str(i)} for i in range(8)]
    for name in ("train.jsonl", "eval.jsonl"):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "contract_agent.py").write_text(AGENT)
    (root / "contract_reward.py").write_text(REWARD)
    old = os.getcwd()
    os.chdir(root)
    sys.path.insert(0, str(root))  # the orchestrator's --import-path: the recipe's directory
    yield root
    sys.path.remove(str(root))
    for name in ("contract_agent", "contract_reward"):  # other tests look modules up by name
        sys.modules.pop(name, None)
    os.chdir(old)


def recipe_source(source: str, scorer: str | None, max_turns: int | None, parser: str | None) -> str:
    rl = {"init_from": "sft", "steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2}
    if scorer == "agent":
        rl["agent"] = "contract_agent:solve"
    elif scorer == "reward":
        rl["reward"] = "contract_reward:score"
    if max_turns is not None:
        rl["max_turns"] = max_turns
    if parser is not None:
        rl["tool_parser"] = parser
    recipe = {
        "name": "episodes",
        "model": {"init": {"hidden_size": 64, "layers": 1, "heads": 2}, "tokenizer": "char"},
        "data": SOURCES[source],
        "rl": rl,
        "inference": {"engines": 1},
        "trainer": {"ranks": 1},
    }
    return tomli_w.dumps(recipe)


def validate(path: Path) -> tuple[int, str]:
    from skyrl_cli.app import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(["recipes", "validate", str(path)])
            return 0, out.getvalue()
        except SystemExit as done:
            return (done.code if isinstance(done.code, int) else 1), out.getvalue()


class Exchange:
    def __init__(self, root: Path):
        self.paths = RunDir(root)


class Client:
    max_model_len = 512

    async def finish_session(self, session_id):
        return None


def start_run(recipe_path: Path, run_dir: Path, tok):
    """What the run does with the recipe up to its first trajectory: the driver loads it and writes
    ``recipe.resolved.json``; the orchestrator reads that and builds its episodes, and an agent
    run starts its endpoint. Returns the endpoint's call cap (None: uncapped), or "no endpoint"."""
    from backends.rollout.episodes.agent import AgentEpisodes
    from backends.rollout.episodes.environment import EnvironmentEpisodes
    from backends.rollout.orchestrator import Orchestrator
    from skyrl_cli.recipe.loader import load_recipe

    paths = RunDir(run_dir).prepare(load_recipe(recipe_path), overwrite=True)
    recipe = paths.read_recipe()  # what the worker sees: every key present
    orchestrator = Orchestrator(
        recipe,
        tokenizer=tok,
        rows=([{"prompt": "1?", "completion": "1"}], []),
        open_client=None,
        engines=None,
        exchange=Exchange(run_dir),
        events=None,
        async_mode=False,
    )
    episodes = orchestrator.episodes
    if not isinstance(episodes, AgentEpisodes):
        assert isinstance(episodes, EnvironmentEpisodes)
        return "no endpoint"
    assert not hasattr(episodes, "make_env")  # an agent run builds no environment

    async def endpoint_cap():
        await episodes.start(Client(), [tok.eos_token_id])
        try:
            return episodes.server.max_calls
        finally:
            await episodes.stop()

    return asyncio.run(endpoint_cap())


@pytest.mark.parametrize(("source", "scorer", "max_turns", "parser"), CASES)
def test_validate_and_the_run_agree(workdir, tok, source, scorer, max_turns, parser):
    name = f"{source}-{scorer}-{max_turns}-{parser}"
    path = workdir / f"{name}.toml"
    path.write_text(recipe_source(source, scorer, max_turns, parser))
    code, output = validate(path)
    assert code in (0, 2), output
    assert "Traceback" not in output
    if code == 2:
        assert "rl.max_turns" in output, output  # the only key these combinations can break
        with pytest.raises(UsageError, match=r"rl\.max_turns"):
            start_run(path, workdir / "runs" / name, tok)
        return
    cap = start_run(path, workdir / "runs" / name, tok)
    if scorer == "agent":
        assert cap == max_turns  # the stated cap, or none where the recipe states none
    else:
        assert cap == "no endpoint"


def test_every_episode_kind_has_a_runner():
    from typing import get_args

    from backends.rollout.episodes import RUNNERS, runner_class
    from skyrl_contracts.episodes import EpisodeKind

    assert set(RUNNERS) == set(get_args(EpisodeKind))
    for kind in RUNNERS:
        assert callable(getattr(runner_class(kind), "trajectory"))


def test_the_combinations_cover_both_outcomes(workdir):
    """The matrix above is not all-accept: single-turn scorers refuse a turn limit above 1, the
    tool task one below 2, and agents accept every limit."""
    outcomes = {}
    for source, scorer, max_turns, parser in CASES:
        path = workdir / f"outcome-{source}-{scorer}-{max_turns}-{parser}.toml"
        path.write_text(recipe_source(source, scorer, max_turns, parser))
        outcomes[(source, scorer, max_turns, parser)] = validate(path)[0]
    assert outcomes[("user_data", "reward", 2, None)] == 2
    assert outcomes[("plain_task", None, 4, None)] == 2
    assert outcomes[("tool_task", None, None, None)] == 2
    assert outcomes[("tool_task", None, 2, None)] == 0
    assert all(outcomes[("user_data", "agent", t, p)] == 0 for t in (None, 1, 2, 4) for p in (None, "pythonic"))
