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
    samples = [
        Sample(uid, i, [1], [2, 3], [1, 1], [-0.1, -0.2], reward=r, policy_versions=versions)
        for i, r in enumerate(rewards)
    ]
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


@pytest.mark.parametrize("B, S", [(1, 0), (1, 2), (3, 1), (4, 3), (2, 5), (2, 0), (4, 0)])
@pytest.mark.parametrize("bound", [None, 0, 2])  # partial_after_drops (sync dynamic sampling)
@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_never_exceed_the_bound_and_never_deadlock(B, S, bound, seed):
    rng = random.Random(seed)
    c = StalenessController(batch_groups=B, max_staleness=S)
    c.partial_after_drops = bound
    running: list[tuple[str, int]] = []
    trained_steps = partial_steps = 0
    n = 0
    for _ in range(3000):
        actions = []
        if c.can_start():
            actions.append("start")
        if running:
            actions.append("finish")
        if c.batch_ready() or c.partial_ready():
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
            step, full = c.batches_taken, c.batch_ready()
            batch = c.take(partial=True)
            assert len(batch) == B if full else 1 <= len(batch) < B
            assert all(0 <= step - g.start_version <= S for g in batch), [(step, g.start_version) for g in batch]
            c.publish(step + 1)
            trained_steps += 1
            partial_steps += not full
    assert trained_steps > 50
    assert (partial_steps > 0) == (bound is not None and B > 1)


def _run_async_schedule(B, S, bound, seed, steps=40, workers=5):
    """Workers finish groups out of order (a seeded number of event-loop turns each), half of them
    with equal rewards; the feed takes batches ahead of the learner's publish, as the orchestrator
    does. Deterministic: only sleep(0), no wall-clock waits."""
    rng = random.Random(seed)

    async def main():
        buffer = AsyncGroupBuffer(PromptSampler(10_000, seed=seed), B, S, drop_zero_variance=True)
        published: asyncio.Queue = asyncio.Queue()

        async def worker():
            while (slot := await buffer.start_group()) is not None:
                ref, version = slot
                for _ in range(rng.randrange(30)):
                    await asyncio.sleep(0)
                if rng.random() < 0.05:
                    await buffer.abort_group(ref, version)
                    continue
                rewards = (1.0, 1.0) if rng.random() < 0.5 else (0.0, 1.0)
                await buffer.finish_group(_group(ref.uid, version, rewards))

        async def learner():
            for _ in range(steps):
                step = await published.get()
                for _ in range(rng.randrange(10)):
                    await asyncio.sleep(0)
                await buffer.publish_version(step + 1)

        async def feed():
            taken = []
            for _ in range(steps):
                batch = await buffer.take_batch(partial_after_drops=bound)
                taken.append((batch, buffer.last_batch_partial))
                published.put_nowait(batch.step)
            return taken

        tasks = [asyncio.create_task(worker()) for _ in range(workers)]
        trainer = asyncio.create_task(learner())
        try:
            taken = await asyncio.wait_for(feed(), timeout=10.0)  # a deadlock leaves the loop idle
            await asyncio.wait_for(trainer, timeout=10.0)
        finally:
            await buffer.close()
            await asyncio.gather(*tasks)
        return taken

    return asyncio.run(main())


@pytest.mark.parametrize("B, S, bound", [(1, 0, 0), (2, 0, 0), (3, 0, 2), (2, 1, 0), (3, 2, 1), (4, 1, 3)])
@pytest.mark.parametrize("seed", range(5))
def test_random_async_schedules_with_drop_bound_keep_the_bound(B, S, bound, seed):
    taken = _run_async_schedule(B, S, bound, seed)
    assert [b.step for b, _ in taken] == list(range(len(taken))) and len(taken) == 40
    uids = [g.prompt_uid for b, _ in taken for g in b.groups]
    assert len(uids) == len(set(uids))  # no group trained twice
    for batch, partial in taken:
        assert 1 <= len(batch.groups) <= B and partial == (len(batch.groups) < B)
        assert batch.staleness_max <= S, (batch.step, [g.start_version for g in batch.groups])
        assert all(not g.all_rewards_equal() for g in batch.groups)


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


# ------------------------------------------------------------------------------ drop bound (sync dynamic sampling)


@pytest.mark.parametrize("c_kept", [True, False])
def test_drop_bound_at_staleness_zero_waits_for_groups_of_the_current_version(c_kept):
    # S=0, B=2, partial_after_drops=0: a, b admitted at v0; a dropped, c admitted at v0; b kept.
    # Cutting [b] now would train c (due at batch 0) at batch 1: staleness 1 > S.
    async def main():
        buffer = AsyncGroupBuffer(PromptSampler(10, seed=0), batch_groups=2, max_staleness=0, drop_zero_variance=True)
        (ra, va), (rb, vb) = [await buffer.start_group() for _ in range(2)]
        await buffer.finish_group(_group(ra.uid, va, rewards=(1.0, 1.0)))
        rc, vc = await buffer.start_group()
        await buffer.finish_group(_group(rb.uid, vb))
        waiter = asyncio.ensure_future(buffer.take_batch(partial_after_drops=0))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # c is still generating and due in this batch
        await buffer.finish_group(_group(rc.uid, vc, rewards=(0.0, 1.0) if c_kept else (1.0, 1.0)))
        # the bound stops sampling: c's freed slot is not refilled before the cut
        starter = asyncio.ensure_future(buffer.start_group())
        batch = await asyncio.wait_for(waiter, 1.0)
        assert not starter.done()
        await buffer.publish_version(1)
        assert (await asyncio.wait_for(starter, 1.0))[1] == 1
        return batch, buffer, rb, rc

    batch, buffer, rb, rc = asyncio.run(main())
    assert batch.step == 0 and batch.staleness_max == 0
    expected = [rb.uid, rc.uid] if c_kept else [rb.uid]
    assert [g.prompt_uid for g in batch.groups] == expected
    assert buffer.last_batch_partial == (not c_kept)
    assert batch.dropped_since_last == (1 if c_kept else 2)


def test_drop_bound_never_cuts_more_than_b_groups_nor_past_a_straggler():
    # B=2, S=1: g1..g4 at v0 (due batch 1); batch 0 = g1, g2; h1, h2 at v1 (due batch 2) finish;
    # g3 dropped, h3 at v1 kept. Buffered h1..h3 (3 > B) with g4 running: taking any of the h's at
    # batch 1 would leave g4 for batch 2 (staleness 2 > S), so the trainer must wait for g4.
    async def main():
        buffer = AsyncGroupBuffer(PromptSampler(20, seed=0), batch_groups=2, max_staleness=1, drop_zero_variance=True)
        g = [await buffer.start_group() for _ in range(4)]
        for ref, v in g[:2]:
            await buffer.finish_group(_group(ref.uid, v))
        first = await buffer.take_batch()  # no bound yet: h3 below may take g3's slot
        await buffer.publish_version(1)
        h = [await buffer.start_group() for _ in range(2)]
        for ref, v in h:
            await buffer.finish_group(_group(ref.uid, v))
        await buffer.finish_group(_group(g[2][0].uid, g[2][1], rewards=(1.0, 1.0)))
        h.append(await buffer.start_group())
        await buffer.finish_group(_group(h[2][0].uid, h[2][1]))
        assert buffer.controller.buffered == 3 and buffer.controller.running == 1
        waiter = asyncio.ensure_future(buffer.take_batch(partial_after_drops=0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await buffer.finish_group(_group(g[3][0].uid, g[3][1]))
        second = await asyncio.wait_for(waiter, 1.0)
        await buffer.publish_version(2)
        await buffer.close()
        third = await buffer.take_batch(partial_after_drops=0)  # drained
        return first, second, third, g, h

    first, second, third, g, h = asyncio.run(main())
    assert [x.prompt_uid for x in second.groups] == [g[3][0].uid, h[0][0].uid]  # the straggler first
    assert second.staleness_max == 1
    assert [x.prompt_uid for x in third.groups] == [h[1][0].uid, h[2][0].uid] and third.staleness_max == 1
    assert all(len(b.groups) <= 2 for b in (first, second, third))


def test_drop_bound_stops_sampling_at_staleness_zero_when_every_group_is_dropped():
    # Only the first group has a signal; without the admission stop, every dropped slot would be
    # refilled at once and the cut would never come.
    async def main():
        buffer = AsyncGroupBuffer(PromptSampler(500, seed=0), batch_groups=4, max_staleness=0, drop_zero_variance=True)
        finished = {"n": 0}

        async def worker():
            while (slot := await buffer.start_group()) is not None:
                ref, version = slot
                await asyncio.sleep(0)
                finished["n"] += 1
                rewards = (0.0, 1.0) if finished["n"] == 1 else (1.0, 1.0)
                await buffer.finish_group(_group(ref.uid, version, rewards))

        workers = [asyncio.create_task(worker()) for _ in range(4)]
        batch = await asyncio.wait_for(buffer.take_batch(partial_after_drops=2), 5.0)
        await buffer.close()
        await asyncio.gather(*workers)
        return batch

    batch = asyncio.run(main())
    assert len(batch.groups) == 1 and batch.staleness_max == 0
    assert 3 <= batch.dropped_since_last <= 3 + 4  # the bound, plus groups that were already running


def test_close_drains_at_most_b_groups_per_batch():
    async def main():
        buffer = AsyncGroupBuffer(PromptSampler(10, seed=0), batch_groups=2, max_staleness=2)
        slots = [await buffer.start_group() for _ in range(6)]
        for ref, v in slots[:5]:
            await buffer.finish_group(_group(ref.uid, v))
        await buffer.close()
        late = await buffer.finish_group(_group(slots[5][0].uid, slots[5][1]))  # after close: not kept
        sizes = []
        while (batch := await buffer.take_batch()) is not None:
            sizes.append(len(batch.groups))
        return late, sizes, buffer

    late, sizes, buffer = asyncio.run(main())
    assert not late and sizes == [2, 2, 1]
    assert buffer.controller.running == 0 and buffer.controller.buffered == 0


def test_a_batch_reports_the_span_its_groups_were_generated_over():
    from backends.rollout.batch import generation_span_s
    from backends.rollout.buffer import TakenBatch

    timed = [_group("a", 0), _group("b", 0)]
    timed[0].started_s, timed[0].finished_s = 100.0, 103.0
    timed[1].started_s, timed[1].finished_s = 101.0, 104.5
    assert generation_span_s(timed) == 4.5
    assert TakenBatch(0, timed, 0.0, 0, 0, 0.1).metrics()["timing/generate_s"] == 4.5
    # a group read back from a saved state carries no times: no figure rather than a wrong one
    read_back = Group.from_dict(json.loads(json.dumps(timed[0].to_dict())))
    assert generation_span_s([timed[1], read_back]) is None
    assert "timing/generate_s" not in TakenBatch(0, [read_back], 0.0, 0, 0, 0.1).metrics()
