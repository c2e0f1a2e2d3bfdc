"""Tool-using episodes: run_episode driven by a scripted generate (no engines). Tool calls are run
and answered as ``tool`` messages, every failed call is an "error: ..." answer the model sees (or
the end of the episode), and async environments overlap under the caller's concurrency bound."""

import asyncio
import copy
import time

import pytest

from backends.data.tasks import get_task
from backends.rollout.environments import (
    Environment,
    LookupEnvironment,
    StepResult,
    ToolUse,
    TurnText,
    declares_tools,
    run_episode,
)
from backends.rollout.rewards import GuardedCaller

LOOKUP = get_task("lookup", 3)
ROW = {"prompt": "kqz?", "answer": "417"}
CALL = '[lookup(key="kqz")]'


class Script:
    """A fake generate: the scripted turns in order; records (history, new_messages, tools) of each call."""

    def __init__(self, *turns):
        self.turns = [t if isinstance(t, TurnText) else TurnText(t, t) for t in turns]
        self.seen = []

    async def __call__(self, history, new_messages, tools):
        # run_episode grows its history list in place: keep what this call was given
        self.seen.append((copy.deepcopy(list(history)), copy.deepcopy(list(new_messages)), copy.deepcopy(tools)))
        return self.turns[len(self.seen) - 1]


def _run(make_env, script, parser, max_turns=4, end_on_error=False, tool_timeout_s=0.2, row=ROW):
    tool_use = None if parser is None else ToolUse(parser, tool_timeout_s, end_on_error)
    return asyncio.run(run_episode(make_env, row, script, GuardedCaller(5.0), max_turns, tool_use))


# ------------------------------------------------------------------------------ the lookup task


def test_lookup_episode_calls_the_tool_then_answers(parser):
    script = Script(CALL, "417")
    ep = _run(LookupEnvironment, script, parser)
    assert (ep.reward, ep.turns, ep.done, ep.tool_calls, ep.tool_errors, ep.error) == (1.0, 2, True, 1, [], None)
    (h0, new0, tools0), (h1, new1, tools1) = script.seen
    assert h0 == [] and new0 == [{"role": "user", "content": "kqz?"}]
    assert tools0 == tools1 == LOOKUP.tools  # the schemas the template shows, each turn
    assert h1 == [{"role": "user", "content": "kqz?"}, {"role": "assistant", "content": CALL}]
    [answer] = new1
    assert answer["role"] == "tool" and answer["content"] == "417" and answer["name"] == "lookup"
    assert answer["tool_call_id"].startswith("call_")
    assert ep.messages == [*h1, answer, {"role": "assistant", "content": "417"}]


def test_lookup_of_a_wrong_key_is_not_found(parser):
    script = Script('[lookup(key="abc")]', "417")
    ep = _run(LookupEnvironment, script, parser)
    assert script.seen[1][1][0]["content"] == "not found"
    assert ep.tool_calls == 1 and ep.tool_errors == []  # a tool's answer, not a failed call
    assert ep.reward == 1.0  # the answer turn still scores on its own


def test_answering_without_calling(parser):
    script = Script("123")
    ep = _run(LookupEnvironment, script, parser)
    assert (ep.reward, ep.turns, ep.done, ep.tool_calls, ep.error) == (0.0, 1, True, 0, None)
    assert len(script.seen) == 1


def test_two_calls_in_one_turn_answered_in_order(parser):
    script = Script('[lookup(key="abc"), lookup(key="kqz")]', "417")
    ep = _run(LookupEnvironment, script, parser)
    assert [m["content"] for m in script.seen[1][1]] == ["not found", "417"]
    assert (ep.reward, ep.tool_calls, ep.tool_errors) == (1.0, 2, [])


def test_max_turns_spent_on_calls(parser):
    ep = _run(LookupEnvironment, Script(CALL, CALL), parser, max_turns=2)
    assert (ep.reward, ep.turns, ep.done, ep.tool_calls, ep.error) == (0.0, 2, False, 2, None)


# ------------------------------------------------------------------------------ failed calls


class FaultEnv(Environment):
    """Tools that fail in every way; the answer turn scores 1 for "417"."""

    def reset(self, row):
        return [{"role": "user", "content": "kqz?"}]

    def tools(self):
        return [self.lookup, self.explode, self.stall, self.sleepy, {"name": "weather", "parameters": {}}]

    def lookup(self, key: str) -> str:
        """The value under a key.

        Args:
            key: the key
        """
        return "417" if key == "kqz" else "not found"

    def explode(self) -> str:
        """Always fails."""
        raise RuntimeError("disk on fire")

    async def stall(self) -> str:
        """Never answers in time."""
        await asyncio.sleep(30)
        return "late"

    def sleepy(self) -> str:
        """Blocks its thread past the timeout (abandoned: a daemon thread)."""
        time.sleep(1.5)
        return "late"

    def step(self, response):
        return StepResult(reward=float(response.strip() == "417"), done=True)


class AnsweringEnv(FaultEnv):
    def call_tool(self, name, arguments):
        return {"city": arguments["city"], "temp": -3}


FAULTS = {
    "malformed": (
        '[lookup(key="kqz"',
        "malformed tool call (the pythonic parser cannot read it): '[lookup(key=\"kqz\"'",
    ),
    "unknown": ('[search(q="kqz")]', "unknown tool 'search'; tools: explode, lookup, sleepy, stall, weather"),
    "missing argument": ("[lookup()]", "wrong arguments for lookup: missing a required argument: 'key'"),
    "extra argument": (
        '[lookup(key="kqz", n=1)]',
        "wrong arguments for lookup: got an unexpected keyword argument 'n'",
    ),
    "raising": ("[explode()]", "tool explode raised RuntimeError: disk on fire"),
    "hanging async": ("[stall()]", "timeout: tool stall took longer than 0.2 s (rl.tool_timeout_s)"),
    "hanging sync": ("[sleepy()]", "timeout: tool sleepy took longer than 0.2 s (rl.tool_timeout_s)"),
    "schema only": (
        '[weather(city="Oslo")]',
        "tool 'weather' is declared by schema only and the environment has no call_tool",
    ),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_call_is_shown_to_the_model_and_the_episode_goes_on(parser, fault):
    turn, error = FAULTS[fault]
    # the record shows what the model wrote; the model, which has its turn in context, sees the error only
    visible = error.split(": '")[0] if fault == "malformed" else error
    script = Script(turn, CALL, "417")
    start = time.monotonic()
    ep = _run(FaultEnv, script, parser)
    assert time.monotonic() - start < 1.2  # a hung tool is not waited for
    assert (ep.reward, ep.turns, ep.done, ep.error) == (1.0, 3, True, None)
    assert ep.tool_calls == 2 and ep.tool_errors == [f"tool: {error}"]
    [seen] = script.seen[1][1]
    assert seen["role"] == "tool" and seen["content"] == f"error: {visible}"
    assert script.seen[2][1][0]["content"] == "417"  # the retry worked


@pytest.mark.parametrize("fault", ["malformed", "unknown", "raising", "hanging async"])
def test_end_on_error_ends_the_episode(parser, fault):
    turn, error = FAULTS[fault]
    script = Script(turn, "417")
    ep = _run(FaultEnv, script, parser, end_on_error=True)
    assert (ep.reward, ep.turns, ep.done) == (0.0, 1, False)
    assert ep.error == f"tool: {error} (rl.tool_errors = 'end')"
    assert ep.tool_errors == [f"tool: {error}"] and len(script.seen) == 1


def test_end_on_error_keeps_the_first_error_of_the_turn(parser):
    ep = _run(FaultEnv, Script('[explode(), search(q="x")]', "417"), parser, end_on_error=True)
    assert len(ep.tool_errors) == 2
    assert ep.error == f"tool: {FAULTS['raising'][1]} (rl.tool_errors = 'end')"


def test_one_failed_call_among_good_ones(parser):
    script = Script('[lookup(key="kqz"), explode()]', "417")
    ep = _run(FaultEnv, script, parser)
    assert [m["content"] for m in script.seen[1][1]] == ["417", "error: tool explode raised RuntimeError: disk on fire"]
    assert (ep.reward, ep.tool_calls, len(ep.tool_errors)) == (1.0, 2, 1)


def test_schema_only_tool_answered_by_call_tool(parser):
    script = Script('[weather(city="Oslo")]', "417")
    ep = _run(AnsweringEnv, script, parser)
    assert script.seen[1][1][0]["content"] == '{"city": "Oslo", "temp": -3}'
    assert (ep.reward, ep.tool_errors) == (1.0, [])
    assert [t["function"]["name"] for t in script.seen[0][2]] == ["lookup", "explode", "stall", "sleepy", "weather"]


def test_tools_offered_without_a_parser_is_an_episode_error():
    script = Script("417")
    ep = _run(LookupEnvironment, script, None)
    assert ep.error == "tools: the environment offers tools but the run has no tool parser (rl.tool_parser)"
    assert (ep.reward, ep.turns, script.seen) == (0.0, 0, [])


def test_declares_tools():
    assert declares_tools(LookupEnvironment) and declares_tools(FaultEnv)
    assert not declares_tools(SlowAsyncEnv)


def test_unusable_tools_are_an_episode_error(parser):
    class Undocumented(FaultEnv):
        def tools(self):
            def peek(key: str) -> str:
                return key

            return [peek]

    class Twice(FaultEnv):
        def tools(self):
            return [self.lookup, {"name": "lookup"}]

    class Raising(FaultEnv):
        def tools(self):
            raise OSError("no sandbox")

    ep = _run(Undocumented, Script("417"), parser)
    assert ep.error.startswith("tools: tool peek: ") and ep.turns == 0
    assert _run(Twice, Script("417"), parser).error == "tools: two tools are named 'lookup'"
    assert _run(Raising, Script("417"), parser).error == "tools: OSError: no sandbox"


# ------------------------------------------------------------------------------ async environments


class AsyncLookupEnv(Environment):
    async def reset(self, row):
        await asyncio.sleep(0)
        self.value = row["answer"]
        return [{"role": "user", "content": row["prompt"]}]

    async def tools(self):
        return [self.lookup]

    async def lookup(self, key: str) -> str:
        """The value under a key.

        Args:
            key: the key
        """
        await asyncio.sleep(0)
        return self.value if key == "kqz" else "not found"

    async def step(self, response):
        await asyncio.sleep(0)
        return StepResult(reward=float(response.strip() == self.value), done=True)


def test_async_environment_with_an_async_tool(parser):
    script = Script(CALL, "417")
    ep = _run(AsyncLookupEnv, script, parser)
    assert (ep.reward, ep.turns, ep.tool_calls, ep.tool_errors, ep.error) == (1.0, 2, 1, [], None)
    assert script.seen[1][1][0]["content"] == "417"


class SlowAsyncEnv(Environment):
    async def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, response):
        await asyncio.sleep(0.5)
        return StepResult(reward=float(response == "417"), done=True)


def _gather_64(concurrency):
    async def generate(history, new_messages, tools):
        return TurnText("417", "417")

    async def main():
        caller = GuardedCaller(timeout_s=10, concurrency=concurrency)  # its semaphore: this loop's
        return await asyncio.gather(*(run_episode(SlowAsyncEnv, ROW, generate, caller, 1) for _ in range(64)))

    start = time.monotonic()
    episodes = asyncio.run(main())
    elapsed = time.monotonic() - start
    assert [ep.reward for ep in episodes] == [1.0] * 64
    assert all(ep.error is None for ep in episodes)
    return elapsed


def test_async_steps_overlap():
    assert _gather_64(concurrency=256) < 3.0  # serial: 64 * 0.5 s = 32 s


def test_concurrency_bound_holds():
    assert _gather_64(concurrency=8) >= 3.9  # 64 / 8 batches of 0.5 s
