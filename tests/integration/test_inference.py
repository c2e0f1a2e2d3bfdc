"""The inference layer against real engines: 2 vLLM engines + vllm-router (sticky_least_loaded),
shared through the session fixture ``engines_and_router``.

How a test knows which engine answered: every choice of ``/inference/v1/generate`` carries the
weight-version label of the engine that sampled it, so labelling the two engines differently
("e0", "e1") makes each completion name its engine, with no access to engine internals.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import httpx
import pytest

from tests.integration.conftest import hf_greedy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPTS = [[10, 11, 12], [20, 21], [30, 31, 32, 33], [14, 40, 17, 19, 22], [9], [25, 26, 27, 28, 29, 30]]
OBSERVATION = [12, 13, 14]


def run(coro):
    return asyncio.run(coro)


async def multi_turn(
    client, session_id: str, prompt, turns: int, max_tokens: int, temperature: float = 1.0, **sampling
):
    from backends.rollout.session import RolloutSession

    async with RolloutSession(client, prompt, session_id) as session:
        completions = []
        for turn in range(turns):
            if turn:
                session.add_observation(OBSERVATION)
            completions.append(await session.generate(max_tokens=max_tokens, temperature=temperature, **sampling))
    return session, completions


def label_engines(live, labels):
    from backends.inference.weight_sync import run_blocking, set_weight_version

    for url, label in zip(live.engine_urls, labels):
        run_blocking(set_weight_version([url], label))


# --------------------------------------------------------------------------------------------- (a)


def test_every_turn_of_a_session_reaches_the_same_engine(engines_and_router):
    live = engines_and_router
    label_engines(live, ["e0", "e1"])
    try:

        async def batch():
            async with live.client() as client:
                return await asyncio.gather(
                    *(
                        multi_turn(client, f"sticky-{i}", PROMPTS[i % len(PROMPTS)], turns=3, max_tokens=8)
                        for i in range(12)
                    )
                )

        results = run(batch())
    finally:
        label_engines(live, ["0", "0"])

    engine_of_session = {}
    for session, completions in results:
        labels = {label for c in completions for label in c.weight_versions}
        assert len(labels) == 1, f"{session.session_id} was served by {labels}"
        engine_of_session[session.session_id] = labels.pop()
        # The trajectory record: prompt, 3 sampled turns with 2 observations between them.
        assert session.num_turns == 3
        assert session.loss_mask.count(0) == 2 * len(OBSERVATION)
        assert len(session.rollout_logprobs) == len(session.response_ids) == len(session.loss_mask)
        assert all(lp <= 0 for lp in session.rollout_logprobs)
    per_engine = Counter(engine_of_session.values())
    assert set(per_engine) == {"e0", "e1"}, f"sessions not spread: {per_engine}"
    # The router logs warnings only: not a line per session (a long run's router.log grew by MBs).
    router_log = live.supervisor.processes["router"].log_path.read_text()
    assert "finished session" not in router_log and "INFO" not in router_log
    # Least-loaded placement of 12 concurrent sessions on 2 engines: close to 6/6.
    assert min(per_engine.values()) >= 4, per_engine


def test_n_samples_and_greedy_through_the_router(engines_and_router):
    live = engines_and_router

    async def go():
        async with live.client() as client:
            samples = await client.generate(PROMPTS[0], "n-samples", max_tokens=16, temperature=1.0, n=4)
            greedy_a = await client.generate(PROMPTS[1], "greedy-a", max_tokens=16, temperature=0.0)
            greedy_b = await client.generate(PROMPTS[1], "greedy-b", max_tokens=16, temperature=0.0)
            batch = await client.generate_batch(
                [PROMPTS[1], PROMPTS[0]], "greedy-batch", max_tokens=16, temperature=0.0
            )
            return samples, greedy_a, greedy_b, batch

    samples, (greedy_a,), (greedy_b,), batch = run(go())
    assert batch[0].token_ids == greedy_a.token_ids and len(batch) == 2  # one request, same greedy answers
    assert len(batch[1].logprobs) == len(batch[1].token_ids) > 0
    assert len(samples) == 4 and len({tuple(s.token_ids) for s in samples}) > 1
    assert all(s.weight_versions == ("0",) and s.policy_versions == (0,) for s in samples)
    assert greedy_a.token_ids == greedy_b.token_ids  # whichever engine: same weights, same greedy path
    assert greedy_a.finish_reason in ("length", "stop")


def test_idle_engine_does_not_spin_a_core(engines_and_router):
    """After a request, vLLM's worker would busy-wait for 1 s (a whole core of a 2-core machine
    between RL steps); the CPU plan's SKYRL_ENGINE_IDLE_SPIN_S must bring that to about nothing."""
    import psutil

    live = engines_and_router

    async def one_request():
        async with live.client() as client:
            await client.generate(PROMPTS[0], "idle-spin", max_tokens=4, temperature=0.0)

    procs = live.supervisor.processes
    engines = [psutil.Process(procs[name].popen.pid) for name in live.engine_names]
    family = [c for e in engines for c in [e, *e.children(recursive=True)]]
    run(one_request())
    time.sleep(0.05)
    before = sum(p.cpu_times().user + p.cpu_times().system for p in family)
    time.sleep(0.9)
    used = sum(p.cpu_times().user + p.cpu_times().system for p in family) - before
    assert used < 0.3 * len(engines), f"idle engines used {used:.2f} CPU-seconds in 0.9 s"


# --------------------------------------------------------------------------------------------- (b)


def _hf_sampling_logprobs(model, prompt, tokens, temperature: float) -> list[float]:
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_weight_sync_matches_transformers_greedy(engines_and_router, pattern_policy):
    from backends.inference.weight_sync import (
        CurrentWeights,
        engine_weight_version,
        record_current_weights,
        run_blocking,
        sync_weights,
    )
    from backends.rollout.client import RolloutClient

    live = engines_and_router
    model, weights_dir = pattern_policy.model, pattern_policy.weights_dir  # a trainer step's output
    expected = {tuple(p): hf_greedy(model, p, 24) for p in PROMPTS}

    async def greedy_from(url: str):
        async with RolloutClient(url, max_retries=0) as client:
            return {tuple(p): (await client.generate(p, f"greedy-{i}", 24, 0.0))[0] for i, p in enumerate(PROMPTS)}

    before = run(greedy_from(live.engine_urls[0]))
    assert any(before[k].token_ids != v for k, v in expected.items()), "new weights must change greedy output"
    try:
        record_current_weights(live.run_dir, CurrentWeights(str(weights_dir), "1"))
        result = run_blocking(sync_weights(live.engine_urls, weights_dir, 1))
        assert set(result.synced) == set(live.engine_urls) and not result.unreachable
        print(f"weight sync: {result.seconds * 1000:.1f} ms for {len(result.synced)} engines")
        for url in live.engine_urls:  # every engine, addressed directly
            assert run(engine_weight_version(url)) == "1"
            got = run(greedy_from(url))
            for prompt, tokens in expected.items():
                assert got[prompt].token_ids == tokens, f"{url} prompt {prompt}"
                assert got[prompt].weight_versions == ("1",)

        # Sampling logprobs are those of the temperature-scaled distribution the token came from.
        async def sampled():
            async with live.client() as client:
                return await client.generate(PROMPTS[2], "lp", max_tokens=16, temperature=0.7, n=2)

        for completion in run(sampled()):
            reference = _hf_sampling_logprobs(model, PROMPTS[2], completion.token_ids, 0.7)
            worst = max(abs(a - b) for a, b in zip(completion.logprobs, reference))
            assert worst < 0.1, f"engine vs transformers sampling logprob gap {worst:.4f}"
    finally:
        live.restore()
    assert all(run(engine_weight_version(u)) == "0" for u in live.engine_urls)


# --------------------------------------------------------------------------------------------- (c)


async def _running_requests(http: httpx.AsyncClient, url: str) -> float:
    """Awaited, so polling never stalls the event loop that carries the batch's own requests."""
    from skyrl_cli.engines.metrics import parse_prometheus

    try:
        text = (await http.get(f"{url}/metrics", timeout=5)).text
    except httpx.HTTPError:
        return 0.0
    return parse_prometheus(text).get("vllm:num_requests_running", 0.0)


def _router_retries(live) -> float:
    from skyrl_cli.engines.metrics import parse_prometheus

    prometheus_port = live.supervisor.processes["router"].spec.ports[1]
    text = httpx.get(f"http://127.0.0.1:{prometheus_port}/metrics", timeout=5).text
    return parse_prometheus(text).get("vllm_router_retries_total", 0.0)


def test_sigkill_engine_mid_batch_batch_completes_and_engine_returns(engines_and_router):
    from skyrl_cli.engines.router import RouterAdmin

    live = engines_and_router
    victim_name, victim_url = live.engine_names[1], live.engine_urls[1]
    victim = live.supervisor.processes[victim_name]
    sessions, turns = 16, 4

    async def batch_with_kill():
        # ignore_eos: every turn runs its full length, so the batch cannot end (a policy that
        # stops early did, once in CI) before the victim is seen busy.
        async with live.client(max_retries=6) as client, httpx.AsyncClient() as http:
            work = asyncio.gather(
                *(
                    multi_turn(
                        client, f"kill-{i}", PROMPTS[i % len(PROMPTS)], turns=turns, max_tokens=48, ignore_eos=True
                    )
                    for i in range(sessions)
                )
            )
            task = asyncio.ensure_future(work)
            deadline = time.monotonic() + 30
            while await _running_requests(http, victim_url) == 0 and time.monotonic() < deadline and not task.done():
                await asyncio.sleep(0.05)
            assert not task.done(), "batch finished before the engine could be killed"
            os.killpg(victim.popen.pid, signal.SIGKILL)  # the API server and its EngineCore
            results = await task
            return results, client.retries

    router_retries_before = _router_retries(live)
    results, client_retries = run(batch_with_kill())
    assert len(results) == sessions
    for session, completions in results:
        assert session.num_turns == turns and all(c is not None and c.token_ids for c in completions)
    # Requests in flight on the killed engine were retried: by the router itself (it re-sends a
    # failed request, to another worker once the dead one's circuit opens) or by the client.
    assert client_retries + _router_retries(live) - router_retries_before >= 1

    router = RouterAdmin(live.router_url)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if (
            live.stack.recovery.restarts.get(victim_name)
            and victim_url in router.list_workers()
            and not live.stack.recovery.recovering.is_set()
        ):
            break
        time.sleep(0.5)
    assert victim_url in router.list_workers(), "killed engine is not back in the router"
    assert live.supervisor.processes[victim_name].popen.pid != victim.popen.pid  # a new process
    assert httpx.get(f"{victim_url}/weight_info", timeout=10).json()["weight_version"] == "0"
    router.close()

    # And it serves: a fresh batch of sessions is spread over both engines again.
    label_engines(live, ["e0", "e1"])
    try:

        async def batch():
            async with live.client() as client:
                return await asyncio.gather(*(multi_turn(client, f"after-{i}", PROMPTS[0], 1, 4) for i in range(6)))

        labels = Counter(c.weight_versions[0] for _, (c,) in run(batch()))
    finally:
        label_engines(live, ["0", "0"])
    assert set(labels) == {"e0", "e1"}, labels
