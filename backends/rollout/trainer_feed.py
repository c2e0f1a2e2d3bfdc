"""Batches from the buffer to the learner, with each step's rollout figures."""

from __future__ import annotations

import logging
import time
from typing import Callable

from backends.rollout.batch import flatten
from skyrl_contracts.schema import Recipe

log = logging.getLogger("skyrl.orchestrator")


class TrainerFeed:
    """Batches from the buffer to the learner (``batches/step-<k>.json``), with the step's rollout figures."""

    def __init__(self, recipe: Recipe, exchange, events, generation_figures: Callable[[], dict[str, float]]):
        self.rl, self.exchange, self.events, self.generation_figures = recipe.rl, exchange, events, generation_figures

    async def run(self, buffer, first_step: int) -> None:
        for step in range(first_step, self.rl.steps):
            t0 = time.perf_counter()
            taken = await self.take_batch(buffer)
            if taken is None:
                return
            samples = flatten(taken.groups)
            self.exchange.write_batch(step, {"step": step, "samples": [s.to_dict() for s in samples]})
            # The data order, for a reader of the log (a resumed run draws the same prompts).
            log.info("batch %d: prompts %s", step, " ".join(sorted(g.prompt_uid for g in taken.groups)))
            rewards = [s.reward for s in samples]
            metrics = {
                **taken.metrics(),
                **buffer.fill(),
                **self.generation_figures(),
                "rollout/reward_mean": sum(rewards) / max(1, len(rewards)),
                "rollout/response_len": sum(len(s.response_ids) for s in samples) / max(1, len(samples)),
                "rollout/turns_mean": sum(s.num_turns for s in samples) / max(1, len(samples)),
                "rollout/tokens_per_trajectory": sum(len(s.input_ids) for s in samples) / max(1, len(samples)),
                "rollout/groups": len(taken.groups),
                "timing/take_batch_s": time.perf_counter() - t0,  # the learner's wait is timing/wait_for_batch_s
            }
            if samples and "agent_samples" in samples[0].info:
                trajectories = {(s.prompt_uid, s.index): s.info for s in samples}.values()
                metrics["rollout/agent_calls_mean"] = sum(t["agent_calls"] for t in trajectories) / len(trajectories)
                metrics["rollout/samples_per_trajectory"] = len(samples) / len(trajectories)
            if samples and "tool_calls" in samples[0].info:
                metrics["rollout/tool_calls_mean"] = sum(s.info["tool_calls"] for s in samples) / len(samples)
                metrics["rollout/tool_errors_mean"] = sum(s.info["tool_errors"] for s in samples) / len(samples)
            metrics |= environment_metrics(samples)
            metrics |= distillation_metrics(samples)
            if self.rl.dynamic_sampling.enabled:
                seen = taken.dropped_since_last + len(taken.groups)
                metrics["rollout/dropped_frac"] = taken.dropped_since_last / max(1, seen)
            self.events.log(step + 1, metrics)

    async def take_batch(self, buffer):
        """The next batch; with dynamic sampling, a partial one once too many groups were dropped."""
        ds = self.rl.dynamic_sampling
        if not ds.enabled:
            return await buffer.take_batch()
        taken = await buffer.take_batch(partial_after_drops=ds.max_extra_batches * self.rl.prompts_per_step)
        if taken is not None and buffer.last_batch_partial:
            log.info(
                "dynamic sampling: %d groups with equal rewards dropped, more than "
                "rl.dynamic_sampling.max_extra_batches = %d batches' worth; training step %d on %d groups",
                taken.dropped_since_last,
                ds.max_extra_batches,
                taken.step + 1,
                len(taken.groups),
            )
        return taken


def environment_metrics(samples) -> dict[str, float]:
    """``rollout/env/<name>``: each environment metric (``Environment.metrics``) averaged over the
    trajectories that report it, each trajectory once however many samples it left."""
    sums: dict[str, list[float]] = {}
    for info in {(s.prompt_uid, s.index): s.info for s in samples}.values():
        for key, value in info.items():
            if key.startswith("env/"):
                sums.setdefault(key, []).append(value)
    return {f"rollout/{key}": sum(values) / len(values) for key, values in sums.items()}


def distillation_metrics(samples) -> dict[str, float]:
    """``distill/reverse_kl``: the mean over the batch's sampled tokens of sampling logprob minus
    the teacher's (the per-token estimate of KL(policy || teacher) whose negative, times
    ``rl.distillation.coef``, is the distillation advantage); none without a teacher."""
    total = count = 0.0
    for s in samples:
        if s.teacher_logprobs is None:
            continue
        for mine, theirs, trained in zip(s.rollout_logprobs, s.teacher_logprobs, s.loss_mask):
            if trained:
                total, count = total + mine - theirs, count + 1
    return {"distill/reverse_kl": total / count} if count else {}
