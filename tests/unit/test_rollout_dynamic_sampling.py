"""Dynamic sampling (DAPO filter): keep varying-reward groups, sample more up to a bound."""

import pytest

from backends.rollout.batch import Group, Sample
from backends.rollout.dynamic_sampling import BatchFiller, fill_batch


def _group(uid, rewards):
    samples = [Sample(uid, i, [1], [2], [1], [-0.5], reward=r, policy_versions=(0,)) for i, r in enumerate(rewards)]
    return Group(uid, samples, start_version=0)


def _sampler(batches):
    """batch k -> the groups listed for it (a scripted stand-in for generation)."""
    calls = []

    def sample(k):
        calls.append(k)
        return [_group(f"b{k}g{i}", r) for i, r in enumerate(batches[k])]

    return sample, calls


def test_keeps_sampling_until_full_and_trims_surplus():
    sample, calls = _sampler([[[1, 1], [0, 1], [0, 0]], [[1, 0], [1, 1], [0, 1]]])
    out = fill_batch(sample, target_groups=3, max_extra_batches=4)
    assert calls == [0, 1]
    assert [g.prompt_uid for g in out.groups] == ["b0g1", "b1g0", "b1g2"]
    assert [g.prompt_uid for g in out.dropped] == ["b0g0", "b0g2", "b1g1"]
    assert out.surplus == [] and not out.bound_hit and out.message is None
    assert out.dropped_fraction == pytest.approx(3 / 6)


def test_surplus_informative_groups_are_not_trained():
    sample, _ = _sampler([[[0, 1], [1, 0]], [[0, 1], [1, 0], [1, 0]]])
    out = fill_batch(sample, target_groups=3, max_extra_batches=4)
    assert len(out.groups) == 3 and [g.prompt_uid for g in out.surplus] == ["b1g1", "b1g2"]


def test_bound_hit_trains_on_what_is_there_with_a_message():
    sample, calls = _sampler([[[1, 1], [0, 1]], [[0, 0], [1, 1]], [[1, 1], [1, 1]]])
    out = fill_batch(sample, target_groups=2, max_extra_batches=1)
    assert calls == [0, 1]  # 1 + max_extra_batches batches, no more
    assert out.bound_hit and [g.prompt_uid for g in out.groups] == ["b0g1"]
    assert "1/2 groups" in out.message and "max_extra_batches = 1" in out.message
    assert "training on those" in out.message
    assert out.metrics() == {
        "rollout/dynamic_sampling_dropped_frac": pytest.approx(3 / 4),
        "rollout/dynamic_sampling_batches": 2.0,
        "rollout/groups_kept": 1.0,
    }


def test_nothing_informative_skips_the_step():
    sample, _ = _sampler([[[1, 1]], [[0, 0]]])
    out = fill_batch(sample, target_groups=1, max_extra_batches=1)
    assert out.groups == [] and "skipping this step" in out.message


def test_disabled_takes_one_batch_as_is():
    sample, calls = _sampler([[[1, 1], [0, 1]], [[0, 1]]])
    out = fill_batch(sample, target_groups=2, max_extra_batches=4, enabled=False)
    assert calls == [0] and len(out.groups) == 2 and out.dropped == [] and not out.bound_hit


def test_filler_is_usable_step_by_step():
    filler = BatchFiller(target_groups=1, max_extra_batches=0)
    assert filler.needs_more
    filler.add([_group("a", [0.0, 0.0])])
    assert not filler.needs_more  # bound of 1 batch reached
    assert filler.result().bound_hit
