"""Environment calls in parallel: N episodes whose ``step`` waits on I/O, one round of steps.

Each episode's ``step`` waits ``--wait-s`` (``asyncio.sleep`` in an ``async def`` step, ``time.sleep``
in a synchronous one, which runs in a thread); the model turn is scripted, so only the
environment's calls are timed. Run serially, a round would take N x wait; ``rl.env_concurrency``
bounds how many run at once, so a round takes about ceil(N / concurrency) x wait.

    .venv/bin/python benchmarks/bench_async_env.py [--episodes 64] [--wait-s 0.5] [--concurrency 256 8]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from backends.rollout.environments import Environment, StepResult, TurnText, run_episode
from backends.rollout.rewards import GuardedCaller


def environments(wait_s: float) -> dict[str, type[Environment]]:
    class AsyncIO(Environment):
        async def reset(self, row):
            return [{"role": "user", "content": "q"}]

        async def step(self, response):
            await asyncio.sleep(wait_s)
            return StepResult(reward=1.0, done=True)

    class BlockingIO(Environment):
        def reset(self, row):
            return [{"role": "user", "content": "q"}]

        def step(self, response):
            time.sleep(wait_s)
            return StepResult(reward=1.0, done=True)

    return {"async def step": AsyncIO, "sync step (threads)": BlockingIO}


async def one_round(env, episodes: int, concurrency: int) -> float:
    async def generate(history, new_messages, tools):
        return TurnText("a", "a")

    caller = GuardedCaller(60.0, concurrency)
    started = time.perf_counter()
    done = await asyncio.gather(*(run_episode(env, {}, generate, caller, 1) for _ in range(episodes)))
    elapsed = time.perf_counter() - started
    assert all(ep.reward == 1.0 for ep in done), [ep.error for ep in done if ep.error]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--wait-s", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 8])
    args = parser.parse_args()
    serial = args.episodes * args.wait_s
    print(f"{args.episodes} episodes, step waits {args.wait_s:g} s; serial would take {serial:.1f} s")
    for name, env in environments(args.wait_s).items():
        for concurrency in args.concurrency:
            elapsed = asyncio.run(one_round(env, args.episodes, concurrency))
            print(
                f"{name:22s} rl.env_concurrency={concurrency:<5d} {elapsed:6.2f} s  ({serial / elapsed:5.1f}x serial)"
            )


if __name__ == "__main__":
    main()
