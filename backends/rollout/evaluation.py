"""Held-out accuracy at a policy version, by greedy decoding through the engines."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Mapping, Sequence

from backends.rollout.rollouts import Rollouts
from backends.rollout.session import SharedFirstTurn
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe

log = logging.getLogger("skyrl.orchestrator")


class Evaluation:
    """Greedy accuracy on the held-out rows, through the engines. Their first turns go in batches of
    an engine's ``max_num_seqs`` prompts (one request each: ~10x faster than a request per prompt on CPU)."""

    def __init__(
        self, recipe: Recipe, rollouts: Rollouts, eval_rows: Sequence[Mapping[str, Any]], events, paths: RunDir
    ):
        self.recipe, self.rl, self.rollouts, self.eval_rows = recipe, recipe.rl, rollouts, eval_rows
        self.events, self.paths = events, paths

    def due(self, version: int, first_version: int) -> bool:
        every = self.rl.eval_every
        return version == first_version or version == self.rl.steps or bool(every and version % every == 0)

    async def evaluate(self, version: int) -> float:
        t0 = time.perf_counter()
        first_turns = SharedFirstTurn(
            self.rollouts.client,
            len(self.eval_rows),
            f"eval-v{version}",
            self.rl.max_new_tokens,
            0.0,
            batch_size=self.recipe.inference.max_num_seqs,
            wait_s=self.rollouts.episodes.first_turn_wait_s,
            stop_token_ids=self.rollouts.stop_ids,
        )
        results = await asyncio.gather(
            *(
                self.rollouts.trajectory(row, f"eval-v{version}-{i}", 0.0, first_turns, i)
                for i, row in enumerate(self.eval_rows)
            )
        )
        accuracy = sum(ep.reward for _, ep in results) / max(1, len(results))
        failed = [(i, ep) for i, (_, ep) in enumerate(results) if ep.error]
        for i, episode in failed:  # recorded, not counted in rollout/errors (the training samples' count)
            self.rollouts.record_error(f"eval-v{version}-{i}", version, episode, count=False)
        for i, (_, episode) in enumerate(results):
            self.rollouts.record_tool_errors(f"eval-v{version}-{i}", version, episode, count=False)
        metrics = {"eval/accuracy": accuracy, "eval/errors": len(failed), "timing/eval_s": time.perf_counter() - t0}
        checked = [ep.env_metrics["reference_reward"] for _, ep in results if "reference_reward" in ep.env_metrics]
        if checked:  # rl.judge: the programmatic check's accuracy beside the judge's (docs/distillation.md)
            metrics["eval/reference_accuracy"] = sum(checked) / len(checked)
        if version == 0 or self.paths.initial_accuracy() is None:
            metrics["eval/accuracy_initial"] = accuracy
            self.paths.write_initial_accuracy(version, accuracy)
        self.events.log(version, metrics)
        log.info("eval at version %d: accuracy %.4f (%d prompts)", version, accuracy, len(results))
        return accuracy
