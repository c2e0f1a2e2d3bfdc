"""Async buffer: capacity (S + v + 1) * B, dropped groups return capacity, no group trained with
staleness > S (including the out-of-order straggler case), resume state round-trips through JSON."""

import asyncio
import json
import random

import pytest

from backends.rollout.batch import Group, Sample
from backends.rollout.buffer import AsyncGroupBuffer, PromptRef, PromptSampler, StalenessController


def _group(uid, start_version, rewards=(0.0, 1.0), versions=None):
    versions = versions or (start_version,)
    samples = [Sample(uid, i, [1], [2, 3], [1, 1], [-0.1, -0.2], reward=r, policy_versions=versions)
               for i, r in enumerate(rewards)]
    return Group(uid, samples, start_version)


# ------------------------------------------------------------------------------ controller


def test_capacity_is_s_plus_version_plus_one_batches():
    c = StalenessController(batch_groups=2, max_staleness=1)
    assert c.capacity == 4  # (1 + 0 + 1) * 2
    versions = [c.start() for _ in range(4)]
    assert versions == [0, 0, 0, 0] and c.capacity == 0
    with pytest.raises(RuntimeError):
        c.start()
    c.finish(_group("a", 0))
    c.finish(_group("b", 0))
    assert c.batch_ready()
    assert [g.prompt_uid for g in c.take()] == ["a", "b"]
    assert c.capacity == 0  # still version 0: the trainer has not published yet
    c.publish(1)
    assert c.capacity == 2


def test_staleness_zero_is_the_synchronous_schedule():
    c = StalenessController(batch_groups=2, max_staleness=0)
    assert [c.start(), c.start()] == [0, 0] and c.capacity == 0
    c.finish(_group("a", 0))
    assert not c.batch_ready()
    c.finish(_group("b", 0))
    c.take()
    assert c.capacity == 0
    c.publish(1)
    assert c.capacity == 2


def test_dropped_group_returns_its_capacity():
    c = StalenessController(batch_groups=2, max_staleness=0)
    c.start(), c.start()
    c.finish(_group("a", 0, rewards=(1.0, 1.0)), keep=False)
    assert c.capacity == 1 and c.dropped_total == 1
    assert c.start() == 0  # generation continues instead of deadlocking
    c.finish(_group("b", 0))
    c.finish(_group("c", 0))
    assert [g.prompt_uid for g in c.take()] == ["b", "c"]


def test_trainer_waits_for_a_straggler_about_to_miss_its_deadline():
    # B=1, S=2: a1, a2, a3 admitted at v0; the capacity rule alone would let a2 be trained at step 3
    c = StalenessController(batch_groups=1, max_staleness=2)
    for _ in range(3):
        c.start()
    c.finish(_group("a3", 0))
    assert [g.prompt_uid for g in c.take()] == ["a3"]  # step 0
    c.publish(1)
    assert c.start() == 1
    c.finish(_group("b1", 1))
    # step 1: taking b1 would leave a1, a2 (deadline 2) for the single batch 2 -> wait
    assert not c.batch_ready()
    c.finish(_group("a1", 0))
    assert [g.prompt_uid for g in c.take()] == ["a1"]  # earliest deadline first
    c.publish(2)
    c.finish(_group("a2", 0))
    assert [g.prompt_uid for g in c.take()] == ["a2"]  # step 2: staleness 2 == S


@pytest.mark.parametrize("B, S", [(1, 0), (1, 2), (3, 1), (4, 3), (2, 5)])
@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_never_exceed_the_bound_and_never_deadlock(B, S, seed):
    rng = random.Random(seed)
    c = StalenessController(batch_groups=B, max_staleness=S)
    running: list[tuple[str, int]] = []
    trained_steps = 0
    n = 0
    for _ in range(3000):
        actions = []
        if c.capacity > 0:
            actions.append("start")
        if running:
            actions.append("finish")
        if c.batch_ready():
            actions.append("take")
        assert actions, "deadlock: nothing can move"
        action = rng.choice(actions)
        if action == "start":
            n += 1
            running.append((f"g{n}", c.start()))
        elif action == "finish":
            # out-of-order completion: stragglers are common
            uid, v = running.pop(rng.randrange(len(running)))
            c.finish(_group(uid, v), keep=rng.random() > 0.3)
        else:
            step = c.batches_taken
            batch = c.take()
            assert len(batch) == B
            assert all(0 <= step - g.start_version <= S for g in batch), [(step, g.start_version) for g in batch]
            c.publish(step + 1)
            trained_steps += 1
    assert trained_steps > 50


# ------------------------------------------------------------------------------ sampler


def test_sampler_epochs_are_seeded_permutations():
    s = PromptSampler(num_rows=5, seed=3)
    first = [s.next() for _ in range(10)]
    assert sorted(r.index for r in first[:5]) == list(range(5))
    assert sorted(r.index for r in first[5:]) == list(range(5))
    assert {r.epoch for r in first[:5]} == {0} and {r.epoch for r in first[5:]} == {1}
    again = PromptSampler(num_rows=5, seed=3)
    assert [again.next() for _ in range(10)] == first
    assert PromptRef.parse(first[7].uid) == first[7]


def test_sampler_resume_skips_finished_and_redraws_in_flight():
    s = PromptSampler(num_rows=6, seed=0)
    refs = [s.next() for _ in range(4)]
    s.mark_consumed(refs[0].uid)
    s.mark_dropped(refs[1].uid)  # dropped: must not be regenerated after resume
    # refs[2], refs[3] are in flight at the checkpoint
    state = json.loads(json.dumps(s.state_dict()))
    resumed = PromptSampler.from_state(state)
    redrawn = [resumed.next() for _ in range(4)]
    assert {r.uid for r in redrawn} == {refs[2].uid, refs[3].uid} | {r.uid for r in redrawn[2:]}
    assert refs[0].uid not in {r.uid for r in redrawn} and refs[1].uid not in {r.uid for r in redrawn}
    assert all(r.epoch == 0 for r in redrawn)
    assert (resumed.consumed_total, resumed.dropped_total) == (1, 1)


def test_sampler_requeue_draws_a_failed_prompt_again():
    s = PromptSampler(num_rows=4, seed=1)
    a = s.next()
    s.requeue(a.uid)
    assert s.next() == a


# ------------------------------------------------------------------------------ asyncio buffer


def test_async_loop_respects_bound_and_in_flight_trajectory_carries_both_versions():
    B, S, steps = 2, 1, 6

    async def main():
        buffer = AsyncGroupBuffer(PromptSampler(50, seed=0), B, S, drop_zero_variance=True)
        published = {"v": 0}
        counter = {"n": 0}
        rng = random.Random(0)
        trained = []

        async def worker():
            while (slot := await buffer.start_group()) is not None:
                ref, version = slot
                await asyncio.sleep(rng.random() * 0.01)
                # the engine may receive new weights mid-trajectory (pause "keep" + reload)
                versions = (version, published["v"])
                counter["n"] += 1
                rewards = (1.0, 1.0) if counter["n"] % 3 == 0 else (0.0, 1.0)  # every third: no signal
                await buffer.finish_group(_group(ref.uid, version, rewards, versions))

        async def trainer():
            for _ in range(steps):
                batch = await buffer.take_batch()
                trained.append(batch)
                await asyncio.sleep(0.005)  # "training"
                published["v"] = batch.step + 1
                await buffer.publish_version(batch.step + 1)
            await buffer.close()

        await asyncio.gather(trainer(), *(worker() for _ in range(4)))
        return trained, buffer

    trained, buffer = asyncio.run(main())
    assert [b.step for b in trained] == list(range(steps))
    for batch in trained:
        assert len(batch.groups) == B and batch.staleness_max <= S
        assert all(not g.all_rewards_equal() for g in batch.groups)  # zero-variance groups dropped
    spanning = [g for b in trained for g in b.groups if len(g.policy_versions) == 2]
    assert spanning, "some trajectory should have spanned a weight update"
    assert all(g.policy_versions[0] == g.start_version for g in spanning)
    assert buffer.controller.dropped_total == buffer.sampler.dropped_total > 0


def test_async_state_round_trip_with_prefetched_batch():
    async def main():
        buffer = AsyncGroupBuffer(PromptSampler(20, seed=5), batch_groups=2, max_staleness=2, drop_zero_variance=True)
        slots = [await buffer.start_group() for _ in range(6)]
        (r0, v0), (r1, v1), (r2, v2), (r3, v3), (r4, v4), (r5, v5) = slots
        await buffer.finish_group(_group(r0.uid, v0))
        await buffer.finish_group(_group(r1.uid, v1))
        await buffer.finish_group(_group(r2.uid, v2, rewards=(0.0, 0.0)))  # dropped
        first = await buffer.take_batch()
        await buffer.finish_group(_group(r3.uid, v3))
        await buffer.finish_group(_group(r4.uid, v4))
        second = await buffer.take_batch()  # prefetched: the checkpoint's model only trained batch 0
        # r5 still in flight
        state = json.loads(json.dumps(buffer.state_dict(trained_batches=1)))
        return state, first, second, slots

    state, first, second, slots = asyncio.run(main())
    assert first.dropped_since_last == 1 and state["dropped_groups"] == 1
    assert state["version"] == 1
    resumed = AsyncGroupBuffer.from_state(state, batch_groups=2, max_staleness=2)
    assert resumed.controller.version == 1 and resumed.controller.batches_taken == 1
    assert resumed.controller.capacity == (2 + 1 + 1) * 2 - 2
    trained = {g.prompt_uid for g in first.groups}
    dropped = slots[2][0].uid
    redo = {g.prompt_uid for g in second.groups} | {slots[5][0].uid}
    drawn = set()

    async def draw():
        for _ in range(3):
            ref, version = await resumed.start_group()
            assert version == 1
            drawn.add(ref.uid)

    asyncio.run(draw())
    assert drawn == redo  # prefetched and in-flight prompts come back first (same epoch order)
    assert not drawn & trained and dropped not in drawn


def test_close_releases_waiters_and_drains_leftovers():
    async def main():
        buffer = AsyncGroupBuffer(PromptSampler(10, seed=0), batch_groups=3, max_staleness=0)
        ref, v = await buffer.start_group()
        await buffer.finish_group(_group(ref.uid, v))
        waiter = asyncio.ensure_future(buffer.take_batch())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await buffer.close()
        leftover = await waiter
        assert [g.prompt_uid for g in leftover.groups] == [ref.uid]
        assert await buffer.take_batch() is None
        assert await buffer.start_group() is None

    asyncio.run(main())
