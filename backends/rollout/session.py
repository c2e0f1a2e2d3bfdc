"""One multi-turn trajectory over the rollout client, kept as tokens.

The session holds the token context itself (prompt, then model turns and environment observations)
so that what the trainer learns from is exactly what the engine saw and sampled: no re-tokenization
of text between turns. Every turn is sent with the session's id (sticky routing) and the router pin
is released when the session ends, also when it ends with an error::

    async with client.session(prompt_ids, session_id) as s:
        turn = await s.generate(max_tokens=64, temperature=1.0)
        s.add_observation(tokenizer.encode(feedback))
        turn = await s.generate(max_tokens=64, temperature=1.0)
    s.response_ids, s.loss_mask, s.rollout_logprobs, s.policy_versions   # -> backends.rollout.batch.Sample

A turn that would exceed the engines' ``max_model_len`` is shortened to fit; when no room is left
the session reports ``finish_reason = "length"`` without a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

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

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def policy_versions(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.weight_versions if v.lstrip("-").isdigit())

    async def generate(self, max_tokens: int, temperature: float = 1.0, **kwargs) -> "Completion | None":
        """One model turn appended to the context; ``None`` when the context is full."""
        from backends.rollout.client import Completion

        room = max_tokens
        if self.client.max_model_len is not None:
            room = min(max_tokens, self.client.max_model_len - len(self.context_ids))
        if room <= 0:
            self.finish_reason = "length"
            return None
        (turn,) = await self.client.generate(self.context_ids, self.session_id, room, temperature, n=1, **kwargs)
        assert isinstance(turn, Completion)
        self.response_ids += turn.token_ids
        self.loss_mask += [1] * len(turn.token_ids)
        self.rollout_logprobs += turn.logprobs
        for version in turn.weight_versions:
            if version not in self.weight_versions:
                self.weight_versions.append(version)
        self.num_turns += 1
        self.finish_reason = turn.finish_reason
        return turn

    def add_observation(self, token_ids: Sequence[int]) -> None:
        """Environment tokens between turns: in the context, not in the loss."""
        ids = [int(t) for t in token_ids]
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)

    async def finish(self) -> None:
        await self.client.finish_session(self.session_id)

    async def __aenter__(self) -> "RolloutSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.finish()
