"""One multi-turn trajectory over the rollout client, kept as tokens.

The session holds the token context itself (prompt, then model turns and environment observations)
so that what the trainer learns from is exactly what the engine saw and sampled: no re-tokenization
of text between turns. Every turn is sent with the session's id (sticky routing) and the router pin
is released when the session ends, also when it ends with an error::

    async with RolloutSession(client, prompt_ids, session_id) as s:
        turn = await s.generate(max_tokens=64, temperature=1.0)
        s.add_observation(tokenizer.encode(feedback))
        turn = await s.generate(max_tokens=64, temperature=1.0)
    s.response_ids, s.loss_mask, s.rollout_logprobs, s.policy_versions   # -> skyrl_contracts.samples.Sample

A turn that would exceed the engines' ``max_model_len`` is shortened to fit; when no room is left
the session reports ``finish_reason = "length"`` without a request.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Sequence

if TYPE_CHECKING:
    from backends.rollout.client import Completion, RolloutClient


class RolloutSession:
    def __init__(self, client: "RolloutClient", prompt_ids: Sequence[int], session_id: str):
        self.client = client
        self.session_id = session_id
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []  # 1: sampled by the model (trainable); 0: observation
        self.rollout_logprobs: list[float] = []  # sampling logprob; 0.0 on observation tokens
        self.weight_versions: list[str] = []  # version labels in order of appearance
        self.num_turns = 0
        self.finish_reason: str | None = None
        self.requested = False  # a router pin exists only after a request under this session id

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def policy_versions(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.weight_versions if v.lstrip("-").isdigit())

    def room(self, max_tokens: int) -> int:
        """Tokens the next turn may generate: ``max_tokens`` capped by what the engines' context holds."""
        if self.client.max_model_len is None:
            return max_tokens
        return min(max_tokens, self.client.max_model_len - len(self.context_ids))

    def out_of_room(self, max_tokens: int) -> bool:
        """True when no token of a next turn fits; the session then ends with ``"length"``."""
        if self.room(max_tokens) > 0:
            return False
        self.finish_reason = "length"
        return True

    async def generate(self, max_tokens: int, temperature: float = 1.0, **kwargs) -> "Completion | None":
        """One model turn appended to the context; ``None`` when the context is full."""
        if self.out_of_room(max_tokens):
            return None
        (turn,) = await self.client.generate(
            self.context_ids, self.session_id, self.room(max_tokens), temperature, n=1, **kwargs
        )
        self.requested = True
        self.add_turn(turn)
        return turn

    def add_turn(self, turn: "Completion") -> None:
        """A model turn sampled for this context (by ``generate`` or by a ``SharedFirstTurn``)."""
        self.response_ids += turn.token_ids
        self.loss_mask += [1] * len(turn.token_ids)
        self.rollout_logprobs += turn.logprobs
        for version in turn.weight_versions:
            if version not in self.weight_versions:
                self.weight_versions.append(version)
        self.num_turns += 1
        self.finish_reason = turn.finish_reason

    def add_observation(self, token_ids: Sequence[int]) -> None:
        """Environment tokens between turns: in the context, not in the loss."""
        ids = [int(t) for t in token_ids]
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)

    async def finish(self) -> None:
        if self.requested:
            await self.client.finish_session(self.session_id)

    async def __aenter__(self) -> "RolloutSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.finish()


class SharedFirstTurn:
    """The first turns of one GRPO group's ``k`` trajectories as ``n``-sample requests.

    The samples of a group usually start from the same prompt, and one request with ``n = k`` costs
    the engine one prefill and one scheduling slot instead of ``k`` (on the CPU quickstart an RL step
    of 32 x 8 samples went from ~12 s to ~2 s: per-request overhead dominates short answers). Each trajectory calls
    ``take(i, session)`` with its own session at turn 0, or ``skip(i)`` when it ends before
    generating (an environment error). Once all ``k`` have arrived, the last one sends one request
    per distinct prompt (``n`` = how many trajectories share it) under the group's session id and
    hands every trajectory its own completion. Later turns of multi-turn trajectories go through
    their own sessions as usual.

    With ``batch_size`` the trajectories may start from different prompts (an evaluation set): their
    first turns go as ``generate_batch`` requests of up to ``batch_size`` prompts, each under its own
    session id (``<session_id>-<chunk>``) so that the router spreads the chunks over the engines.
    Those completions carry no weight spans, so this is for a fixed policy version only.

    With ``wait_s`` (agent programs, whose first call may come late or never) the requests also go
    once ``wait_s`` passed without an arrival, even if some trajectories have not arrived (a wait
    from the latest arrival, not the first: 200 evaluation trajectories take longer than that to
    arrive on a busy event loop, yet keep arriving); those no longer ``accepts`` and generate alone.
    """

    def __init__(
        self,
        client: "RolloutClient",
        k: int,
        session_id: str,
        max_tokens: int,
        temperature: float,
        batch_size: int | None = None,
        wait_s: float | None = None,
        **kwargs,
    ):
        self.client = client
        self.wait_s = wait_s
        self._timer: asyncio.TimerHandle | None = None
        self.k = k
        self.batch_size = batch_size
        self.session_id = session_id
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.kwargs = kwargs
        self._sessions: dict[int, RolloutSession | None] = {}
        self._turns: dict[int, "Completion"] = {}
        self._error: BaseException | None = None
        self._done = asyncio.Event()
        self._request: asyncio.Task | None = None  # held so the running task is not garbage-collected

    async def take(self, index: int, session: RolloutSession) -> "Completion | None":
        """Sample turn 0 for ``session``; ``None`` when its context has no room (as ``generate``)."""
        if session.out_of_room(self.max_tokens):
            self.skip(index)
            return None
        self._arrive(index, session)
        await self._done.wait()
        if self._error is not None:
            raise self._error
        turn = self._turns[index]
        session.add_turn(turn)
        return turn

    def accepts(self, index: int) -> bool:
        """Whether trajectory ``index`` may still ``take`` its first turn here."""
        return self._request is None and index not in self._sessions

    def skip(self, index: int) -> None:
        """Trajectory ``index`` will not take a first turn here (idempotent)."""
        if index not in self._sessions and self._request is None:
            self._arrive(index, None)

    def _arrive(self, index: int, session: RolloutSession | None) -> None:
        self._sessions[index] = session
        if len(self._sessions) == self.k:
            self._dispatch()
        elif self.wait_s is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(self.wait_s, self._dispatch)

    def _dispatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._request is None:
            self._request = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        requests = self._batched_requests() if self.batch_size else self._grouped_requests()
        try:
            results = await asyncio.gather(*(request for _, _, request in requests))
            for (_, indices, _), turns in zip(requests, results):
                self._turns.update(zip(indices, turns))
        except BaseException as err:  # every waiting trajectory sees the failure
            self._error = err
        finally:
            await asyncio.gather(*(self.client.finish_session(sid) for sid in dict.fromkeys(r[0] for r in requests)))
            self._done.set()

    def _grouped_requests(self) -> list[tuple[str, list[int], Awaitable]]:
        """(session id, trajectory indices, request): one ``n``-sample request per distinct prompt."""
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for index, session in sorted(self._sessions.items()):
            if session is not None:
                by_prompt.setdefault(tuple(session.context_ids), []).append(index)
        return [
            (
                self.session_id,
                indices,
                self.client.generate(
                    list(prompt),
                    self.session_id,
                    self._sessions[indices[0]].room(self.max_tokens),
                    self.temperature,
                    n=len(indices),
                    **self.kwargs,
                ),
            )
            for prompt, indices in by_prompt.items()
        ]

    def _batched_requests(self) -> list[tuple[str, list[int], Awaitable]]:
        """(session id, trajectory indices, request): ``batch_size`` prompts per request; one
        ``max_tokens`` per request, the smallest room among its prompts."""
        live = [(i, s) for i, s in sorted(self._sessions.items()) if s is not None]
        requests = []
        for chunk, start in enumerate(range(0, len(live), self.batch_size)):
            part = live[start : start + self.batch_size]
            sid = f"{self.session_id}-{chunk}"
            room = min(s.room(self.max_tokens) for _, s in part)
            request = self.client.generate_batch(
                [s.context_ids for _, s in part], sid, room, self.temperature, **self.kwargs
            )
            requests.append((sid, [i for i, _ in part], request))
        return requests
