"""The orchestrator's task supervision: a failed task must end the run, not hang it."""

from __future__ import annotations

import asyncio

import pytest

from backends.rollout.orchestrator import until_done_or_failed


async def finishes(after_s: float) -> str:
    await asyncio.sleep(after_s)
    return "ok"


async def fails(after_s: float) -> None:
    await asyncio.sleep(after_s)
    raise RuntimeError("weight sync refused")


def test_returns_when_the_required_tasks_finish_even_if_others_run_on():
    async def main():
        forever = asyncio.create_task(asyncio.sleep(3600))
        await asyncio.wait_for(
            until_done_or_failed({asyncio.create_task(finishes(0.01)), asyncio.create_task(finishes(0.02))}, {forever}),
            timeout=5,
        )
        assert not forever.done()
        forever.cancel()

    asyncio.run(main())


@pytest.mark.parametrize("failing_is_required", [True, False])
def test_a_failure_anywhere_is_raised_while_the_rest_would_wait_forever(failing_is_required):
    async def main():
        stuck = asyncio.create_task(asyncio.sleep(3600))  # e.g. the feeder waiting for a batch
        failing = asyncio.create_task(fails(0.01))
        required, others = ({stuck, failing}, set()) if failing_is_required else ({stuck}, {failing})
        with pytest.raises(RuntimeError, match="weight sync refused"):
            await asyncio.wait_for(until_done_or_failed(required, others), timeout=5)
        stuck.cancel()

    asyncio.run(main())
