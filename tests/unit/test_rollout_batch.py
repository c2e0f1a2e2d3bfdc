"""Trajectory records: JSON round trip, versions, staleness, and the trainer tensor layout."""

import json

import pytest

from backends.rollout.batch import Group, Sample, rewards_all_equal, staleness


def _sample(uid="0-3", index=1, **kw):
    base = dict(
        prompt_uid=uid,
        index=index,
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9, 10],
        loss_mask=[1, 1, 0, 1],
        rollout_logprobs=[-0.5, -0.25, 0.0, -1.0],
        reward=1.0,
        policy_versions=(4, 3, 4),
    )
    base.update(kw)
    return Sample(**base)


def test_sample_round_trip_and_session_id():
    s = _sample()
    assert s.policy_versions == (3, 4) and s.session_id == "0-3_1" and s.num_loss_tokens == 3
    assert Sample.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_sample_rejects_misaligned_lists():
    with pytest.raises(ValueError, match="same length"):
        _sample(loss_mask=[1, 1])


def test_group_versions_and_round_trip():
    g = Group("0-3", [_sample(index=0, policy_versions=(2,)), _sample(index=1)], start_version=2)
    assert g.policy_versions == (2, 3, 4) and g.oldest_version == 2
    assert Group.from_dict(json.loads(json.dumps(g.to_dict()))) == g
    assert staleness([g, Group("x", [], 4)], trained_version=5) == (2.0, 3)


def test_rewards_all_equal():
    assert rewards_all_equal([1.0, 1.0]) and rewards_all_equal([])
    assert not rewards_all_equal([1.0, 0.0])


def test_whole_sequence_views_align_with_tokens():
    s = _sample(rollout_logprobs=[-0.5, -0.25, -9.0, -1.0])  # -9 on an observation token is ignored
    assert s.input_ids == [5, 6, 7, 8, 9, 10]
    assert s.full_loss_mask == [0, 0, 1, 1, 0, 1]
    assert s.full_rollout_logprobs == [0.0, 0.0, -0.5, -0.25, 0.0, -1.0]
