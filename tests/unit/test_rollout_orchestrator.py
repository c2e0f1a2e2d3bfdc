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


# ---------------------------------------------------------------------------------------------
# The orchestrator end to end against recording fakes: a client that answers like an engine, the
# engines' weight loader, and a learner thread on the real run-directory exchange.

import threading  # noqa: E402

from backends.rollout.client import Completion, WeightSpan  # noqa: E402
from backends.rollout.orchestrator import Orchestrator, load_rows  # noqa: E402
from skyrl_contracts.exchange import RunExchange  # noqa: E402
from skyrl_contracts.schema import Recipe  # noqa: E402


class FakeEngines:
    """Records what the orchestrator loads; the fake client samples with the version loaded last."""

    loads_initial_version = False

    def __init__(self):
        self.version = "unlabelled"
        self.loads: list[tuple[int, str]] = []

    async def label_initial(self):
        self.version = "0"

    def model_name(self, version):
        return "policy"

    async def retire(self, in_flight):
        return []

    def held(self):
        return frozenset()

    async def load(self, version, weights_dir):
        self.loads.append((version, weights_dir.name))
        self.version = str(version)
        return type("Result", (), {"seconds": 0.0})()


class RecordingClient:
    """Answers each prompt ``a+b=`` with the sum on every other request, else with "0"."""

    max_model_len = None
    model = "policy"
    retries = 0  # the rollout client's count of retried requests (none here)

    def __init__(self, tokenizer, engines):
        self.in_flight: dict[str, int] = {}
        self.tokenizer, self.engines = tokenizer, engines
        self.requests: list[tuple[str, int]] = []  # (session id, samples asked)
        self.finished: list[str] = []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    def _answer(self, prompt_ids) -> Completion:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        a, b = text.rsplit("=", 1)[0].split("+")[-2:]
        right = len(self.requests) % 2 == 0
        ids = self.tokenizer.encode(str(int(a[-3:]) + int(b)) if right else "0", add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_id)
        return Completion(ids, [-0.5] * len(ids), "stop", (WeightSpan(self.engines.version, 0, len(ids)),))

    async def generate(self, prompt_ids, session_id, max_tokens, temperature=1.0, n=1, **kw):
        self.requests.append((session_id, n))
        return [self._answer(prompt_ids) for _ in range(n)]

    async def generate_batch(self, prompts, session_id, max_tokens, temperature=1.0, **kw):
        self.requests.append((session_id, len(prompts)))
        return [self._answer(p) for p in prompts]

    async def finish_session(self, session_id):
        self.finished.append(session_id)
        return True


def _learner(exchange: RunExchange, steps: int, seen: list):
    """Publishes v0, then v(k+1) after reading batch k, like the real learner."""
    for version in range(steps + 1):
        if version:
            seen.append(exchange.read_batch(version - 1, timeout_s=30))
        with exchange.publish_weights(version) as out:
            (out / "model.safetensors").write_text(f"v{version}")


def _orchestrator(tmp_path, async_mode: bool):
    from backends.models.tokenizer import build_char_tokenizer

    recipe = Recipe.model_validate(
        {
            "name": "orch",
            "seed": 3,
            "model": {"init": {"hidden_size": 32, "layers": 1, "heads": 2}, "tokenizer": "char"},
            "data": {"task": "addition", "digits": 2, "train_size": 64, "eval_size": 6},
            "rl": {
                "steps": 3,
                "prompts_per_step": 2,
                "samples_per_prompt": 2,
                "max_new_tokens": 4,
                "eval_every": 2,
                "save_every": 0,
                "async": {"max_staleness": 1},
            },
        }
    )
    from backends.data.tasks import get_task

    tokenizer = build_char_tokenizer(get_task("addition", 2).alphabet)
    engines = FakeEngines()
    client = RecordingClient(tokenizer, engines)
    events = []
    recorder = type(
        "Events", (), {"log": lambda self, step, m: events.append((step, dict(m))), "close": lambda self: None}
    )()
    exchange = RunExchange(tmp_path)
    orchestrator = Orchestrator(
        recipe,
        tokenizer=tokenizer,
        rows=load_rows(recipe),
        open_client=lambda: client,
        engines=engines,
        exchange=exchange,
        events=recorder,
        async_mode=async_mode,
    )
    return orchestrator, client, engines, events, exchange


@pytest.mark.parametrize("async_mode", [False, True])
def test_the_orchestrator_feeds_every_step_and_loads_every_version(tmp_path, async_mode):
    orchestrator, client, engines, events, exchange = _orchestrator(tmp_path, async_mode)
    batches: list[dict] = []
    learner = threading.Thread(target=_learner, args=(exchange, 3, batches), daemon=True)
    learner.start()
    asyncio.run(asyncio.wait_for(orchestrator.run(first_version_timeout_s=30), timeout=60))
    learner.join(timeout=30)

    assert [b["step"] for b in batches] == [0, 1, 2]
    assert all(len(b["samples"]) == 2 * 2 for b in batches)  # prompts_per_step x samples_per_prompt
    loaded = [v for v, _ in engines.loads]
    assert all(name == f"v{v}" for v, name in engines.loads)  # each version from its own directory
    if async_mode:  # generation runs ahead, so the learner may publish twice between two polls
        assert loaded == sorted(set(loaded)) and loaded[-1] == 3, loaded
    else:  # batch k needs version k on the engines: none is skipped
        assert loaded == [1, 2, 3]
    assert [v for v, _ in exchange.paths.weight_versions()] == [3]  # older versions pruned
    for batch in batches:  # sync: batch k sampled by version k only; async: at most 1 version behind
        for sample in batch["samples"]:
            lag = batch["step"] - min(sample["policy_versions"])
            assert lag == 0 if not async_mode else 0 <= lag <= 1, (batch["step"], sample["policy_versions"])
    # Evaluations at the start, at eval_every and at the end; the first one is kept as the baseline.
    assert [s for s, m in events if "eval/accuracy" in m] == ([0, 2, 3] if 2 in loaded else [0, 3])
    assert exchange.paths.initial_accuracy() == next(m["eval/accuracy"] for _, m in events if "eval/accuracy" in m)
    assert [m["weights/version"] for _, m in events if "weights/version" in m] == loaded
    assert sorted(s for s, m in events if "rollout/reward_mean" in m) == [1, 2, 3]
    # Every session the orchestrator opened through the router was released.
    opened = {sid for sid, _ in client.requests}
    assert opened <= set(client.finished)


def test_a_fresh_run_evaluates_and_generates_before_the_learner_is_up(tmp_path):
    """``resume=False`` with engines that started on the initial policy: the initial evaluation
    and the first batch are done while no version is published yet (the learner still starting);
    the learner's v0, published later, is not loaded again, and the run goes on as usual."""
    orchestrator, client, engines, events, exchange = _orchestrator(tmp_path, async_mode=False)
    orchestrator.resume = False
    batches: list[dict] = []

    def late_learner():
        exchange.read_batch(0, timeout_s=30)  # the first batch exists before anything is published
        assert exchange.latest_version() is None
        _learner(exchange, 3, batches)

    learner = threading.Thread(target=late_learner, daemon=True)
    learner.start()
    asyncio.run(asyncio.wait_for(orchestrator.run(first_version_timeout_s=30), timeout=60))
    learner.join(timeout=30)

    assert [b["step"] for b in batches] == [0, 1, 2]
    assert [v for v, _ in engines.loads] == [1, 2, 3]  # v0: the engines' own weights, labelled
    assert events[0] == (0, {"progress/total_steps": 3})
    assert [s for s, m in events if "eval/accuracy" in m][0] == 0


def test_a_resumed_or_lora_run_waits_for_the_learner_first_version(tmp_path):
    orchestrator, _, engines, _, _ = _orchestrator(tmp_path, async_mode=False)
    for resume, loads_initial in ((True, False), (False, True)):
        orchestrator.resume, engines.loads_initial_version = resume, loads_initial
        with pytest.raises(TimeoutError):
            asyncio.run(orchestrator.first_version(timeout_s=0.2))
    orchestrator.resume, engines.loads_initial_version = False, False
    assert asyncio.run(orchestrator.first_version(timeout_s=0.2)) == 0


class AdapterClient(RecordingClient):
    """Samples with the adapter its requests name (the client's ``model`` at request time), and
    counts requests in flight per name like ``RolloutClient``."""

    async def generate(self, prompt_ids, session_id, max_tokens, temperature=1.0, n=1, **kw):
        from backends.rollout.client import adapter_spans

        model = self.model
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        try:
            await asyncio.sleep(0.001)  # a request in flight while the next version may load
            self.requests.append((session_id, n))
            assert model in self.loaded_names(), f"request for {model}, not loaded"
            return adapter_spans([self._answer(prompt_ids) for _ in range(n)], model)
        finally:
            self.in_flight[model] -= 1
            if not self.in_flight[model]:
                del self.in_flight[model]

    def loaded_names(self):
        from backends.inference.weight_sync import adapter_name

        return {adapter_name(v) for v in self.engines.loaded}


@pytest.mark.parametrize("async_mode", [False, True])
def test_lora_versions_are_adapters_loaded_by_name_and_unloaded_when_idle(tmp_path, monkeypatch, async_mode):
    """The real ``EngineAdapters`` bookkeeping over fake admin calls: every version (v0 too) is loaded
    under its own name, requests name the current one, old ones are unloaded once idle and their
    directories deleted only after that, and the tokens' versions are the adapters' versions."""
    from pathlib import Path

    from backends.inference import weight_sync
    from backends.inference.weight_sync import EngineAdapters, read_current_weights

    calls: list[tuple[str, str]] = []

    async def fake_load(urls, name, path, version, *, load_inplace=True, **kw):
        assert not load_inplace and Path(path).is_dir()
        calls.append(("load", name))
        return weight_sync.WeightSyncResult(str(version), 0.0)

    async def fake_unload(urls, name, http=None):
        calls.append(("unload", name))

    monkeypatch.setattr(weight_sync, "sync_lora_adapter", fake_load)
    monkeypatch.setattr(weight_sync, "unload_lora_adapter", fake_unload)
    orchestrator, _, _, _, exchange = _orchestrator(tmp_path, async_mode)
    engines = EngineAdapters(["http://e0"], tmp_path)
    engines.version = "99"  # the engine-global label the fake reports: the adapter's name must win
    client = AdapterClient(orchestrator.tokenizer, engines)
    orchestrator.engines, orchestrator.open_client = engines, lambda: client
    batches: list[dict] = []
    learner = threading.Thread(target=_learner, args=(exchange, 3, batches), daemon=True)
    learner.start()
    asyncio.run(asyncio.wait_for(orchestrator.run(first_version_timeout_s=30), timeout=60))
    learner.join(timeout=30)

    loads = [name for op, name in calls if op == "load"]
    assert loads[0] == "policy-v0" and loads[-1] == "policy-v3" and client.model == "policy-v3"
    unloaded = [name for op, name in calls if op == "unload"]
    assert set(unloaded) | {"policy-v3"} >= set(loads) - {f"policy-v{v}" for v in engines.loaded}
    assert len(engines.loaded) <= (1 if async_mode else 0) + 2  # the plan's --max-loras
    # A directory is gone only once its adapter is unloaded; the loaded ones stay.
    assert {v for v, _ in exchange.paths.weight_versions()} == engines.loaded | {3}
    assert read_current_weights(tmp_path).lora_name == "policy-v3"
    for batch in batches:  # versions as exact as with full weights
        for sample in batch["samples"]:
            lag = batch["step"] - min(sample["policy_versions"])
            assert lag == 0 if not async_mode else 0 <= lag <= 1, (batch["step"], sample["policy_versions"])
