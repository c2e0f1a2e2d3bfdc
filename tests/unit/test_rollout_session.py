"""RolloutSession and SharedFirstTurn bookkeeping against a recording client (no engine: the
request/response path is covered by tests/integration/test_inference*.py)."""

from __future__ import annotations

import asyncio

import pytest

from backends.rollout.client import Completion, RolloutError, WeightSpan
from backends.rollout.session import RolloutSession, SharedFirstTurn


class RecordingClient:
    """Answers ``generate`` with distinct made-up tokens and records every call."""

    max_model_len = None

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[tuple[int, ...], str, int, int]] = []
        self.finished: list[str] = []
        self.fail = fail

    async def generate(self, prompt_ids, session_id, max_tokens, temperature=1.0, n=1, **kwargs):
        self.calls.append((tuple(prompt_ids), session_id, max_tokens, n))
        base = 100 * len(self.calls)
        await asyncio.sleep(0)
        if self.fail:
            raise RolloutError("engine gone")
        return [Completion([base + j, 2], [-0.5, -0.1], "stop", (WeightSpan("3", 0, 2),)) for j in range(n)]

    async def generate_batch(self, prompts, session_id, max_tokens, temperature=1.0, **kwargs):
        self.calls.append((tuple(map(tuple, prompts)), session_id, max_tokens, "batch"))
        await asyncio.sleep(0)
        return [Completion([p[-1] + 1000, 2], [-0.2, -0.1], "stop") for p in prompts]

    async def finish_session(self, session_id):
        self.finished.append(session_id)
        return True


def run(coro):
    return asyncio.run(coro)


def test_one_request_for_a_group_sharing_its_prompt():
    client = RecordingClient()

    async def main():
        shared = SharedFirstTurn(client, 4, "g0", max_tokens=8, temperature=1.0)
        sessions = [RolloutSession(client, [1, 5, 7], f"g0_{i}") for i in range(4)]
        turns = await asyncio.gather(*(shared.take(i, s) for i, s in enumerate(sessions)))
        for s in sessions:
            await s.finish()
        return sessions, turns

    sessions, turns = run(main())
    assert client.calls == [((1, 5, 7), "g0", 8, 4)]
    assert [t.token_ids[0] for t in turns] == [100, 101, 102, 103]  # every trajectory its own sample
    assert sessions[2].response_ids == [102, 2] and sessions[2].loss_mask == [1, 1]
    assert sessions[2].rollout_logprobs == [-0.5, -0.1] and sessions[2].policy_versions == (3,)
    assert client.finished == ["g0"]  # the group's pin only: the per-sample ids never reached the router


def test_distinct_prompts_and_a_skipped_trajectory():
    client = RecordingClient()

    async def main():
        shared = SharedFirstTurn(client, 3, "g1", max_tokens=4, temperature=1.0)
        a, b = RolloutSession(client, [1, 5], "a"), RolloutSession(client, [1, 6], "b")
        shared.skip(2)  # e.g. its environment's reset raised
        shared.skip(2)  # idempotent
        return await asyncio.gather(shared.take(0, a), shared.take(1, b))

    turns = run(main())
    assert sorted((c[0], c[3]) for c in client.calls) == [((1, 5), 1), ((1, 6), 1)]
    assert turns[0].token_ids != turns[1].token_ids


def test_failure_reaches_every_waiting_trajectory():
    client = RecordingClient(fail=True)

    async def main():
        shared = SharedFirstTurn(client, 2, "g2", max_tokens=4, temperature=1.0)
        sessions = [RolloutSession(client, [1], f"s{i}") for i in range(2)]
        return await asyncio.gather(*(shared.take(i, s) for i, s in enumerate(sessions)), return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, RolloutError) for r in results)
    assert client.finished == ["g2"]


def test_batched_first_turns_of_different_prompts():
    client = RecordingClient()
    client.max_model_len = 10

    async def main():
        shared = SharedFirstTurn(client, 5, "eval-v3", max_tokens=8, temperature=0.0, batch_size=2)
        sessions = [RolloutSession(client, [1] * (2 + i) + [i], f"e{i}") for i in range(4)]
        shared.skip(4)
        turns = await asyncio.gather(*(shared.take(i, s) for i, s in enumerate(sessions)))
        return sessions, turns

    sessions, turns = run(main())
    # chunks of 2 prompts, own session ids; max_tokens = the least room in the chunk (10 - 4, 10 - 6)
    assert [(c[1], c[2], c[3], len(c[0])) for c in client.calls] == [
        ("eval-v3-0", 6, "batch", 2),
        ("eval-v3-1", 4, "batch", 2),
    ]
    assert [t.token_ids[0] for t in turns] == [1000, 1001, 1002, 1003]  # each its own prompt's answer
    assert sessions[3].response_ids == [1003, 2] and sessions[3].loss_mask == [1, 1]
    assert sorted(client.finished) == ["eval-v3-0", "eval-v3-1"]


def test_session_generate_then_observation_then_generate():
    client = RecordingClient()

    async def main():
        s = RolloutSession(client, [1, 5], "t")
        await s.generate(max_tokens=4)
        s.add_observation([9, 9])
        await s.generate(max_tokens=4)
        await s.finish()
        return s

    s = run(main())
    assert s.loss_mask == [1, 1, 0, 0, 1, 1] and s.num_turns == 2
    assert client.calls[1][0] == (1, 5, 100, 2, 9, 9)  # the second turn sees the whole context
    assert client.finished == ["t"]


@pytest.mark.parametrize("limit,expected", [(None, 8), (10, 5), (5, 0)])
def test_room_is_capped_by_the_context_window(limit, expected):
    client = RecordingClient()
    client.max_model_len = limit
    assert RolloutSession(client, [1, 2, 3, 4, 5], "r").room(8) == expected
