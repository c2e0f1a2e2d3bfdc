"""The teacher of on-policy distillation (``rl.distillation``): its logprobs of the tokens the policy
sampled, from the teacher's own engines (started by the plan beside the policy's, never weight-synced).

One request per trajectory, to the teacher engine with the fewest requests in flight: vLLM's
``/v1/completions`` with the token ids of the whole sequence but its last token as the prompt,
``prompt_logprobs = 0`` (the logprob of every prompt token given the ones before it) and
``max_tokens = 1`` with ``allowed_token_ids = [last token]``: the one generated token is forced to be
the sequence's last, and the engines' ``--logprobs-mode raw_logprobs`` report its logprob before the
forcing. So a whole trajectory is scored in one prefill, and a trajectory as long as the policy's
``inference.max_model_len`` fits the teacher's engines started with the same length (vLLM refuses a
prompt of ``max_model_len`` tokens: it must leave room for one generated token).

A request that fails is retried (connection errors, timeouts, 5xx, 429) like a rollout request; one
that still fails raises ``TeacherError``, which ends the run (not a ``RolloutError``, which only
redraws the group): without its teacher a distillation run has nothing to train on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

from backends.rollout.auxiliary import AuxiliaryEngines
from skyrl_contracts.auxiliary import TEACHER
from skyrl_contracts.errors import SkyrlError

COMPLETIONS_PATH = "/v1/completions"


class TeacherError(SkyrlError):
    """The teacher's engines did not score a trajectory (after retries, or a bad request)."""


def scoring_request(ids: Sequence[int]) -> dict:
    """The ``/v1/completions`` body that scores ``ids`` (at least 2 tokens) in one pass."""
    return {
        "model": TEACHER,
        "prompt": [int(t) for t in ids[:-1]],
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 0,
        "logprobs": 0,
        "allowed_token_ids": [int(ids[-1])],
        "return_token_ids": True,
    }


def parse_scores(body: dict, ids: Sequence[int]) -> list[float]:
    """log p_teacher(ids[t] | ids[:t]) for t = 1 .. len(ids) - 1, from a ``scoring_request`` answer."""
    choice = body["choices"][0]
    per_position = (choice.get("prompt_logprobs") or [])[1:]
    if len(per_position) != len(ids) - 2:
        raise TeacherError(f"teacher returned {len(per_position)} prompt logprobs for {len(ids) - 2} tokens")
    scores = []
    for entry, token in zip(per_position, ids[1:-1]):
        found = (entry or {}).get(str(token))
        if found is None:
            raise TeacherError(f"teacher's prompt logprobs lack token {token}")
        scores.append(float(found["logprob"]))
    last = list(choice.get("token_ids") or [])
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if last != [int(ids[-1])] or len(logprobs) != 1:
        raise TeacherError(f"teacher did not score the last token {ids[-1]} (returned {last})")
    return scores + [float(logprobs[0])]


class Teacher:
    """The teacher's engines, scored through ``score(samples)``. ``take_seconds()``: the wall-clock
    seconds during which some scoring was under way since the last call (groups scored at once
    count once)."""

    def __init__(self, urls: Sequence[str], **settings):
        """``settings``: ``AuxiliaryEngines``' (timeout, retries, backoff, concurrency)."""
        self.engines = AuxiliaryEngines(TEACHER, urls, TeacherError, **settings)
        self.seconds = 0.0
        self._active, self._since = 0, 0.0

    @classmethod
    def from_recipe(cls, urls: Sequence[str], recipe) -> "Teacher":
        return cls(urls, **AuxiliaryEngines.settings(recipe))

    async def aclose(self) -> None:
        await self.engines.aclose()

    def take_seconds(self) -> float:
        now = time.perf_counter()
        seconds = self.seconds + (now - self._since if self._active else 0.0)
        self.seconds, self._since = 0.0, now
        return seconds

    async def score(self, samples) -> None:
        """Fill ``teacher_logprobs`` of every sample (per response token; 0.0 on tokens the policy
        did not sample, and none for a sample without response tokens)."""
        if not self._active:
            self._since = time.perf_counter()
        self._active += 1
        try:
            await asyncio.gather(*(self.score_one(s) for s in samples if s.response_ids and s.prompt_ids))
        finally:
            self._active -= 1
            if not self._active:
                self.seconds += time.perf_counter() - self._since

    async def score_one(self, sample) -> None:
        ids = list(sample.prompt_ids) + list(sample.response_ids)
        scores = await self.logprobs(ids)
        response = scores[len(sample.prompt_ids) - 1 :]
        sample.teacher_logprobs = [lp if m else 0.0 for lp, m in zip(response, sample.loss_mask)]

    async def logprobs(self, ids: Sequence[int]) -> list[float]:
        """log p_teacher(ids[t] | ids[:t]) for t = 1 .. len(ids) - 1."""
        return parse_scores(await self.engines.post(COMPLETIONS_PATH, scoring_request(ids)), ids)
