"""LoRA in the RL stage, the pure parts: how many adapters an engine holds (--max-loras), the
versioned adapter names and the token versions they give, the in-flight count that decides when an
old adapter is unloaded, and what the learner writes (adapter only, merged on request)."""

from __future__ import annotations

import asyncio
import json

import pytest

from backends.inference import weight_sync
from backends.inference.weight_sync import (
    EngineAdapters,
    adapter_name,
    adapter_version,
    read_current_weights,
    retirable,
)
from backends.rollout.client import Completion, RolloutClient, WeightSpan, adapter_spans
from skyrl_cli.plan.inference import Machine, engine_specs, max_loras
from skyrl_contracts.schema import Recipe

CPU = Machine(device="cpu", engine_cores=(0, 1), python="/venv/bin/python", cpu_bf16=True)


def lora_recipe(staleness: int = 1, **lora) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": "/models/m", "lora": {"rank": 8, **lora}},
            "data": {"task": "addition"},
            "rl": {"async": {"max_staleness": staleness}},
            "inference": {"engines": 1},
        }
    )


@pytest.mark.parametrize(
    ("async_mode", "staleness", "expected"), [(False, 3, 2), (True, 0, 2), (True, 1, 3), (True, 4, 6)]
)
def test_max_loras_holds_every_version_that_can_be_live(async_mode, staleness, expected):
    recipe = lora_recipe(staleness)
    assert max_loras(recipe, async_mode) == expected
    (spec,) = engine_specs(recipe, CPU, [8101], "/models/m", async_mode)
    assert spec.argv[spec.argv.index("--max-loras") + 1] == str(expected)


def test_adapter_names_round_trip_and_other_names_are_not_versions():
    assert adapter_name(7) == "policy-v7" and adapter_version("policy-v7") == 7
    assert [adapter_version(n) for n in ("policy", "policy-v", "policy-vx", "other-v1")] == [None] * 4


def test_token_versions_come_from_the_adapter_the_request_named():
    engine_label = (WeightSpan("5", 0, 2), WeightSpan("6", 2, 3))  # the engine-global label moved on meanwhile
    completions = [Completion([1, 2, 3], [-0.1] * 3, "stop", engine_label), Completion([], [], "length", ())]
    spans = [c.weight_spans for c in adapter_spans(completions, "policy-v4")]
    assert spans == [(WeightSpan("4", 0, 3),), ()]
    assert adapter_spans(completions, "policy-v4")[0].policy_versions == (4,)
    assert adapter_spans(completions, "policy") == completions  # full weights: the engine's spans


def test_in_flight_requests_are_counted_per_model_name():
    async def main():
        async with RolloutClient("http://127.0.0.1:9") as client:
            with client.counted("policy-v1"), client.counted("policy-v1"), client.counted("policy-v2"):
                assert client.in_flight == {"policy-v1": 2, "policy-v2": 1}
            with pytest.raises(RuntimeError), client.counted("policy-v3"):
                raise RuntimeError("request failed")
            assert client.in_flight == {}

    asyncio.run(main())


def test_only_idle_versions_other_than_the_current_one_are_retirable():
    assert retirable({1, 2, 3}, 3, {"policy-v1": 2}) == [2]
    assert retirable({1, 2, 3}, 3, {}) == [1, 2]
    assert retirable({3}, 3, {"policy-v3": 1}) == []


def test_engine_adapters_load_by_name_record_current_and_unload_idle_versions(tmp_path, monkeypatch):
    calls = []

    async def fake_load(urls, name, path, version, *, load_inplace=True, **kw):
        calls.append(("load", name, load_inplace))
        return weight_sync.WeightSyncResult(str(version), 0.0)

    async def fake_unload(urls, name, http=None):
        calls.append(("unload", name))

    monkeypatch.setattr(weight_sync, "sync_lora_adapter", fake_load)
    monkeypatch.setattr(weight_sync, "unload_lora_adapter", fake_unload)
    engines = EngineAdapters(["http://e0", "http://e1"], tmp_path)

    async def main():
        await engines.load(0, tmp_path / "v0")
        await engines.load(1, tmp_path / "v1")
        assert read_current_weights(tmp_path).lora_name == "policy-v1"
        assert await engines.retire({"policy-v0": 1}) == [] and engines.held() == {0, 1}  # v0 still in use
        assert await engines.retire({}) == [0] and engines.held() == {1}

    asyncio.run(main())
    assert calls == [("load", "policy-v0", False), ("load", "policy-v1", False), ("unload", "policy-v0")]


def test_pruning_keeps_the_versions_the_engines_still_hold(tmp_path):
    from skyrl_contracts.exchange import RunExchange

    exchange = RunExchange(tmp_path)
    for version in range(4):
        with exchange.publish_weights(version) as out:
            (out / "adapter_config.json").write_text("{}")
    exchange.prune_weights_before(3, keep={1})
    assert [v for v, _ in exchange.paths.weight_versions()] == [1, 3]


@pytest.fixture(scope="module")
def peft_policy():
    import torch

    from backends.models.lora import apply_lora
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import LoraConfig, TinyModelInit

    tokenizer = build_char_tokenizer("0123456789+=")
    model = apply_lora(
        build_tiny_model(TinyModelInit(hidden_size=32, layers=1, heads=2), tokenizer, 0), LoraConfig(rank=4)
    )
    with torch.no_grad():  # a non-zero adapter (peft starts B at 0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model, tokenizer


class _Engine:
    def __init__(self, module):
        self.module = module


class _Rank0:
    is_main = True


@pytest.mark.parametrize("merge", [False, True])
def test_lora_export_holds_the_adapter_and_the_merged_model_only_on_request(tmp_path, peft_policy, merge):
    from backends.train.common import HFExporter

    model, tokenizer = peft_policy
    exporter = HFExporter(_Engine(model), tokenizer, _Rank0(), zero_stage=2, merge=merge)
    exporter(tmp_path / "model")
    files = {p.name for p in (tmp_path / "model").iterdir()}
    assert {"adapter", "tokenizer_config.json"} <= files
    assert ("model.safetensors" in files) == merge and ("config.json" in files) == merge
    assert {p.name for p in (tmp_path / "model/adapter").iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    exporter.adapter(tmp_path / "version")  # what weights/v<k>/ holds: the adapter alone
    written = {p.name for p in (tmp_path / "version").iterdir()} - {"README.md"}  # peft's model card
    assert written == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((tmp_path / "version/adapter_config.json").read_text())["r"] == 4


def test_the_kl_reference_is_the_base_model_with_the_adapter_disabled(peft_policy):
    import torch

    from backends.models.tiny import build_tiny_model
    from skyrl_contracts.schema import TinyModelInit

    model, tokenizer = peft_policy
    initial = build_tiny_model(TinyModelInit(hidden_size=32, layers=1, heads=2), tokenizer, 0)  # same seed: the base
    ids = torch.randint(3, 12, (2, 6))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            reference = model(input_ids=ids).logits
        assert not torch.allclose(adapted, reference)
        assert torch.allclose(reference, initial(input_ids=ids).logits, atol=1e-6)
        assert torch.equal(model(input_ids=ids).logits, adapted)  # the adapter is back on afterwards


def test_a_restarted_engine_gets_the_current_adapter_back(monkeypatch):
    from backends.inference.weight_sync import CurrentWeights, bring_up_to_date

    calls = []

    async def fake_load(urls, name, path, version, *, load_inplace=True, **kw):
        calls.append((tuple(urls), name, path, version, load_inplace))

    monkeypatch.setattr(weight_sync, "sync_lora_adapter", fake_load)
    asyncio.run(bring_up_to_date(["http://e1"], CurrentWeights("/run/weights/v7", "7", lora_name="policy-v7")))
    assert calls == [(("http://e1",), "policy-v7", "/run/weights/v7", "7", False)]
