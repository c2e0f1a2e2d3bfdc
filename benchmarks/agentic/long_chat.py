"""``LongChat``: long multi-turn episodes whose context grows every turn, for the tiny char model.

The workload SkyRL v0.3's routing results are about (``README.md``, "Routing"): an agentic
trajectory of many model turns, each turn's prompt the whole conversation so far, so the engine that
served turn t holds turn t+1's prefix in its KV cache. Here every episode is ``turns`` model turns
(40 by default, at least 30 for the benchmark); after each turn but the last the environment waits
``env_delay_s`` (log-normal with that mean and sigma 0.5, as the routing simulator's environment
step) and answers with one short user message of ``observation_chars`` characters, so the context
grows by about ``observation_chars + 2 + rl.max_new_tokens`` tokens a turn (the char template
writes ``<|user|>`` before and ``<|assistant|>`` after the observation; the model's turn ends with
its own ``<eos>`` or at ``rl.max_new_tokens``).

Observations are sums like ``48+3+907+12=``: only digits, ``+`` and ``=``, the alphabet of the
built-in ``addition`` task, so the character tokenizer of a tiny model built for that task has a
token for every character (anything else would become ``<unk>``). They are drawn from a generator
seeded by the row's prompt: every sample of a group sees the same observations.

Reward: the share of the episode's planned turns answered with a digit first (each such turn
scores ``1 / turns``, so the episode's reward, the sum of its steps', is in [0, 1] and stays
defined when ``rl.max_turns`` stops an episode early). Cheap on purpose: the benchmark measures
generation, not the task.

Configuration, per row (``{"prompt": ..., "answer": ..., "turns": 40, "observation_chars": 12,
"env_delay_s": 0.1}``) or, for rows without those keys (a built-in task's), the class attributes
``TURNS``, ``OBSERVATION_CHARS`` and ``ENV_DELAY_S``. ``rl.max_turns`` must be at least ``turns``
or the episodes stop there; ``inference.max_model_len`` must hold the whole context (about
``prompt + turns * (observation_chars + 2 + max_new_tokens)`` tokens), or the last turns end with
``finish_reason = "length"``.

    rl.environment = "benchmarks.agentic.long_chat:LongChat"   # skyrl run from the repository root
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any, Mapping

from backends.rollout.environments import Environment, Messages, StepResult

ALPHABET = "0123456789+="  # the addition task's characters: what the tiny model's char tokenizer knows


def observation_text(rng: random.Random, chars: int) -> str:
    """A sum like ``48+3+907+12=`` of exactly ``chars`` characters (at least 2: a digit and ``=``)."""
    chars = max(2, int(chars))
    body: list[str] = []
    room = chars - 1  # the closing "="
    while room > 0:
        if body:
            if room < 2:  # no room for "+" and a digit: lengthen the last number instead
                body.append(str(rng.randint(0, 9)))
                break
            body.append("+")
            room -= 1
        size = min(room, rng.randint(1, 3))
        body.append(str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(size - 1)))
        room -= size
    return "".join(body) + "="


def env_delay(rng: random.Random, mean_s: float) -> float:
    """Log-normal with mean ``mean_s`` and sigma 0.5 (``skyrl_cli.routing.workload``'s environment step)."""
    if mean_s <= 0:
        return 0.0
    sigma = 0.5
    return rng.lognormvariate(math.log(mean_s) - sigma * sigma / 2, sigma)


class LongChat(Environment):
    """``turns`` model turns per episode, a short user message after each; reward: share of digit answers."""

    TURNS = 40
    OBSERVATION_CHARS = 12
    ENV_DELAY_S = 0.0

    def reset(self, row: Mapping[str, Any]) -> Messages:
        self.turns = max(1, int(row.get("turns", self.TURNS)))
        self.observation_chars = int(row.get("observation_chars", self.OBSERVATION_CHARS))
        self.delay_s = float(row.get("env_delay_s", self.ENV_DELAY_S))
        self.rng = random.Random(f"long_chat:{row['prompt']}")
        self.turn = 0
        self.digit_turns = 0
        return [{"role": "user", "content": str(row["prompt"])}]

    async def step(self, response: str) -> StepResult:
        self.turn += 1
        digit = response.strip()[:1].isdigit()
        self.digit_turns += digit
        reward = float(digit) / self.turns
        if self.turn >= self.turns:
            return StepResult(reward=reward, done=True, info={"digit_turns": self.digit_turns})
        text = observation_text(self.rng, self.observation_chars)
        delay = env_delay(self.rng, self.delay_s)
        if delay > 0:
            await asyncio.sleep(delay)
        return StepResult(observation=[{"role": "user", "content": text}], reward=reward, done=False)
