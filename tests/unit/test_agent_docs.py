"""The examples of the docs page ``docs/agents.md`` (the two python blocks marked
``<!-- run: tests/unit/test_agent_docs.py -->``), run as written: the tool environment drives an
episode (scripted model turns, the real pythonic tool parser), and the black-box agent talks to the
real agent endpoint over HTTP with the ``openai`` client (a scripted rollout client behind it)."""

from __future__ import annotations

import asyncio
import types

from backends.rollout.agents import AgentServer, run_agent, samples_from_calls
from backends.rollout.environments import ToolUse, TurnText, run_episode
from backends.rollout.rewards import GuardedCaller
from tests.docs_blocks import DOCS, blocks
from tests.unit.test_agent_endpoint import ScriptedClient

PAGE = DOCS / "agents.md"
MARKER = ("run", "tests/unit/test_agent_docs.py")
ROW = {"prompt": "apples?", "answer": 7, "stock": {"main": {"apple": 7}}}  # the environment's
AGENT_ROW = {"prompt": "kqz?", "answer": "417", "table": {"kqz": "417", "abq": "052"}}  # the agent's


def examples() -> list[str]:
    """The page's python blocks that this test runs, in page order."""
    return [b.code for b in blocks(PAGE) if b.lang == "python" and b.marker == MARKER]


def load(code: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(code, f"docs/agents.md:{name}", "exec"), module.__dict__)
    return module


def test_the_page_has_both_examples():
    env_code, agent_code = examples()
    assert "class Inventory(Environment)" in env_code and "async def solve(row, endpoint)" in agent_code
    assert len(env_code.splitlines()) <= 30 and len(agent_code.splitlines()) <= 25


def test_the_tool_environment_example_runs(parser):
    inventory = load(examples()[0], "my_tools").Inventory
    turns = iter(['[count_items(product="apple")]', "7"])
    seen = []

    async def generate(history, new_messages, tools):
        seen.append((list(new_messages), tools))
        text = next(turns)
        return TurnText(text, text)

    episode = asyncio.run(run_episode(inventory, ROW, generate, GuardedCaller(5.0), 4, ToolUse(parser, 5.0)))
    assert (episode.reward, episode.turns, episode.tool_calls, episode.tool_errors) == (1.0, 2, 1, [])
    (prompt, tools), (observation, _) = seen
    assert tools[0]["function"]["name"] == "count_items"
    assert set(tools[0]["function"]["parameters"]["properties"]) == {"product", "warehouse"}
    assert observation[0]["role"] == "tool" and observation[0]["content"] == "7"


def test_the_agent_example_runs_against_the_endpoint(tok, parser):
    solve = load(examples()[1], "my_agent").solve
    script = ['[lookup(key="kqz")]<eos>', "417<eos>"]

    async def main():
        client = ScriptedClient(tok, script)
        server = AgentServer(client, tok, parser, 32, [tok.eos_token_id])
        await server.start()
        try:
            trajectory, endpoint = server.open("0-1_0")
            outcome = await run_agent(solve, AGENT_ROW, endpoint, 30.0)
            await server.close("0-1_0")
        finally:
            await server.stop()
        return outcome, trajectory

    outcome, trajectory = asyncio.run(main())
    assert (outcome.reward, outcome.error) == (1.0, None)
    (sample,) = samples_from_calls(trajectory.calls)  # the agent appends: one sample
    assert sample.num_turns == 2 and sample.loss_mask.count(0) > 0
