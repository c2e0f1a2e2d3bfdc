"""Rollout client response parsing and the weight-state record (pure parts; the HTTP paths run
against real engines in tests/integration/test_inference.py)."""

from __future__ import annotations

import pytest

from backends.inference.weight_sync import CurrentWeights, read_current_weights, record_current_weights
from backends.rollout.client import (
    Completion,
    RolloutError,
    WeightSpan,
    parse_completions_response,
    parse_generate_response,
)


def choice(index, tokens, logprobs, spans, finish="length"):
    return {
        "index": index,
        "finish_reason": finish,
        "token_ids": tokens,
        "weight_versions": [{"version": v, "start": s, "end": e} for v, s, e in spans],
        "logprobs": {
            "content": [
                {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []} for t, lp in zip(tokens, logprobs)
            ]
        },
    }


def test_parse_orders_choices_and_keeps_sampled_logprobs():
    body = {
        "choices": [
            choice(1, [7, 8], [-0.5, -1.5], [("3", 0, 2)], finish="stop"),
            choice(0, [5, 6, 9], [-0.1, -0.2, -0.3], [("2", 0, 1), ("3", 1, 3)]),
        ]
    }
    first, second = parse_generate_response(body)
    assert first.token_ids == [5, 6, 9] and first.logprobs == [-0.1, -0.2, -0.3]
    assert first.weight_spans == (WeightSpan("2", 0, 1), WeightSpan("3", 1, 3))
    assert first.weight_versions == ("2", "3") and first.policy_versions == (2, 3)
    assert first.finish_reason == "length"
    assert second.token_ids == [7, 8] and second.finish_reason == "stop" and second.policy_versions == (3,)


def test_non_numeric_version_labels_are_not_policy_versions():
    c = Completion([1], [-1.0], "length", (WeightSpan("default", 0, 1),))
    assert c.weight_versions == ("default",) and c.policy_versions == ()


def test_missing_logprobs_is_an_error():
    body = {"choices": [{"index": 0, "token_ids": [1, 2], "logprobs": None, "finish_reason": "length"}]}
    with pytest.raises(RolloutError, match="0 logprobs for 2 tokens"):
        parse_generate_response(body)


def test_parse_completions_in_prompt_order_without_spans():
    body = {
        "choices": [
            {
                "index": 1,
                "text": "7",
                "token_ids": [7, 2],
                "finish_reason": "stop",
                "logprobs": {"token_logprobs": [-0.3, -0.1]},
            },
            {
                "index": 0,
                "text": "56",
                "token_ids": [5, 6],
                "finish_reason": "length",
                "logprobs": {"token_logprobs": [-0.2, -0.4]},
            },
        ]
    }
    first, second = parse_completions_response(body)
    assert (first.token_ids, first.logprobs, first.finish_reason) == ([5, 6], [-0.2, -0.4], "length")
    assert (second.token_ids, second.finish_reason, second.weight_spans) == ([7, 2], "stop", ())
    body["choices"][0]["logprobs"] = None
    with pytest.raises(RolloutError, match="0 logprobs for 2 tokens"):
        parse_completions_response(body)


def test_current_weights_record_roundtrip(tmp_path):
    assert read_current_weights(tmp_path) is None
    record_current_weights(tmp_path, CurrentWeights("/w/step-3", "3"))
    assert read_current_weights(tmp_path) == CurrentWeights("/w/step-3", "3")
    record_current_weights(tmp_path, CurrentWeights("/w/lora-4", "4", lora_name="policy-lora"))
    assert read_current_weights(tmp_path) == CurrentWeights("/w/lora-4", "4", "policy-lora")
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["current.json"]  # no temp files left
