"""The agent endpoint's CPU per trajectory, by how the agent reaches it, against an instant engine.

An ``AgentServer`` (the orchestrator's endpoint, real FastAPI app, real chat template and
tokenizer) in front of a rollout client that answers at once, so what is measured is the CPU the
orchestrator's process spends per one-call trajectory on the agent path itself: the agent's
``openai`` client, HTTP, the endpoint's handler. Three ways an agent gets its client:

- ``new-client``: ``openai.AsyncOpenAI(base_url=endpoint.base_url)`` built per trajectory (an agent
  written for any OpenAI-compatible server);
- ``shared-http``: one ``AsyncOpenAI`` per trajectory on one shared ``httpx.AsyncClient``, over
  HTTP through the endpoint's uvicorn server;
- ``endpoint-client``: ``endpoint.client()`` (the endpoint's in-process client; the baseline).

    .venv/bin/python benchmarks/bench_agent_endpoint.py              # 512 trajectories each
    .venv/bin/python benchmarks/bench_agent_endpoint.py --profile    # and where endpoint.client()'s CPU goes
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time

import httpx
from openai import AsyncOpenAI

from backends.models.tokenizer import build_char_tokenizer
from backends.rollout.agents import AgentServer
from backends.rollout.client import Completion, WeightSpan

TOKENIZER = build_char_tokenizer("abcdefgh")
MESSAGES = [{"role": "user", "content": "hbdca"}]


class InstantEngine:
    """A rollout client that answers every request at once with the same five letters."""

    max_model_len = 512

    async def generate(self, prompt_ids, session_id, max_tokens, temperature=1.0, n=1, **kwargs):
        ids = [*TOKENIZER.encode("abcdh", add_special_tokens=False), TOKENIZER.eos_token_id]
        return [Completion(ids, [-0.1] * len(ids), "stop", (WeightSpan("0", 0, len(ids)),))] * n

    async def finish_session(self, session_id):
        return True


async def trajectories(kind: str, count: int, profile: cProfile.Profile | None = None) -> tuple[float, float]:
    """(CPU ms, wall ms) per one-call trajectory, ``count`` of them in batches of 64 at once."""
    server = AgentServer(InstantEngine(), TOKENIZER, None, 8, [TOKENIZER.eos_token_id])
    await server.start()
    shared = httpx.AsyncClient()

    async def one(i: int) -> None:
        _, endpoint = server.open(f"g_{i}")
        if kind == "endpoint-client":
            client = endpoint.client()
        else:
            http_client = shared if kind == "shared-http" else None
            client = AsyncOpenAI(base_url=endpoint.base_url, api_key="k", max_retries=0, http_client=http_client)
        await client.chat.completions.create(model="policy", messages=MESSAGES)
        if kind == "new-client":
            await client.close()
        await server.close(f"g_{i}")

    try:
        await asyncio.gather(*(one(i) for i in range(16)))  # warm: imports, the template's compilation
        if profile is not None:
            profile.enable()
        cpu, wall = time.process_time(), time.perf_counter()
        for start in range(0, count, 64):
            await asyncio.gather(*(one(i) for i in range(start, min(count, start + 64))))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if profile is not None:
            profile.disable()
    finally:
        await shared.aclose()
        await server.stop()
    return cpu / count * 1e3, wall / count * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=512)
    parser.add_argument("--profile", action="store_true", help="cProfile of the endpoint-client path")
    args = parser.parse_args()
    results = {kind: asyncio.run(trajectories(kind, args.trajectories)) for kind in ("new-client", "shared-http")}
    profile = cProfile.Profile() if args.profile else None
    results["endpoint-client"] = asyncio.run(trajectories("endpoint-client", args.trajectories, profile))
    baseline = results["endpoint-client"][0]
    print(f"{args.trajectories} one-call trajectories each, instant engine; CPU of the orchestrator's process:")
    for kind, (cpu, wall) in results.items():
        print(f"  {kind:<16} {cpu:6.2f} ms CPU/trajectory  {wall:6.2f} ms wall  {cpu / baseline:5.2f}x endpoint-client")
    if profile is not None:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
