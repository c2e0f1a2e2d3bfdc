"""Trajectories for training and evaluation, through the router, by the run's ``EpisodeRunner``.

``Rollouts.worker`` fills the buffer with groups (``samples_per_prompt`` trajectories of one
prompt, their first turns sampled together by a ``SharedFirstTurn``), counts the samples whose user
code failed (``sample_errors.jsonl``) and the tokens the model sampled since ``window``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Mapping, Sequence

from backends.rollout.batch import Group, Sample
from backends.rollout.client import RolloutError
from backends.rollout.session import SharedFirstTurn
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe

log = logging.getLogger("skyrl.orchestrator")


class Rollouts:
    """Trajectories under the rollout client it was given, each run by ``episodes`` (the run's
    ``EpisodeRunner``, started): a group per prompt for training and single episodes for evaluation."""

    def __init__(
        self,
        recipe: Recipe,
        tokenizer,
        train_rows: Sequence[Mapping[str, Any]],
        client,
        paths: RunDir,
        episodes,
        teacher=None,
    ):
        """``teacher``: ``backends.rollout.teacher.Teacher`` (``rl.distillation``), which scores every
        group's samples before the group goes to the buffer; None without distillation."""
        self.teacher = teacher
        self.rl, self.train_rows, self.client, self.paths, self.episodes = (
            recipe.rl,
            train_rows,
            client,
            paths,
            episodes,
        )
        self.stop_ids = [t for t in (tokenizer.eos_token_id,) if t is not None]
        self.tool_calls = self.tool_errors = 0
        self.errors = 0
        self.window_tokens = 0
        self.window_started = time.perf_counter()

    async def trajectory(self, row, session_id: str, temperature: float, first_turn=None, index=0):
        """(samples' token records, episode) of one trajectory. Whatever its kind, a trajectory that
        ended before its first turn (an environment's error, an agent that never called) releases
        its place in the group's shared first turn, so that the group does not wait for it."""
        try:
            return await self.episodes.trajectory(row, session_id, temperature, first_turn, index)
        finally:
            if first_turn is not None:
                first_turn.skip(index)

    async def generate_group(self, ref, start_version: int) -> Group:
        started = time.monotonic()
        row = self.train_rows[ref.index]
        k = self.rl.samples_per_prompt
        first_turn = SharedFirstTurn(
            self.client,
            k,
            ref.uid,
            self.rl.max_new_tokens,
            self.rl.temperature,
            wait_s=self.episodes.first_turn_wait_s,
            stop_token_ids=self.stop_ids,
        )
        results = await asyncio.gather(
            *(self.trajectory(row, f"{ref.uid}_{i}", self.rl.temperature, first_turn, i) for i in range(k))
        )
        samples = []
        for i, (parts, episode) in enumerate(results):
            self.record_tool_errors(f"{ref.uid}_{i}", start_version, episode)
            if episode.error:
                self.record_error(f"{ref.uid}_{i}", start_version, episode)
            info = self.episodes.sample_info(episode, parts)
            for part in parts or [None]:
                samples.append(
                    Sample(
                        prompt_uid=ref.uid,
                        index=i,
                        prompt_ids=part.prompt_ids if part else [],
                        response_ids=part.response_ids if part else [],
                        loss_mask=part.loss_mask if part else [],
                        rollout_logprobs=part.rollout_logprobs if part else [],
                        reward=episode.reward,
                        policy_versions=(part.policy_versions if part else ()) or (start_version,),
                        num_turns=self.episodes.sample_turns(part, episode),
                        finish_reason=part.finish_reason if part else "error",
                        error=episode.error,
                        info=info,
                    )
                )
                self.window_tokens += samples[-1].num_loss_tokens  # sampled: observations are not generation
        generated = time.monotonic()  # timing/generate_s ends here: the teacher's pass is timing/teacher_s
        if self.teacher is not None:  # before the buffer: with --async this overlaps the learner's step
            await self.teacher.score(samples)
        return Group(ref.uid, samples, start_version, started_s=started, finished_s=generated)

    def record_error(self, sample: str, version: int, episode, count: bool = True) -> None:
        """Count a sample whose user code failed and append its record to ``sample_errors.jsonl``
        (one short line per sample; appends of one line each, as events.jsonl)."""
        self.errors += count
        log.warning("sample %s: %s", sample, episode.error)
        self.append_error_record(sample, version, episode.turns, episode.error)

    def record_tool_errors(self, sample: str, version: int, episode, count: bool = True) -> None:
        """An episode's failed tool calls: the model saw each as the tool's answer and the episode
        went on (unless ``rl.tool_errors = "end"``); each gets a record, and the counts go to metrics."""
        self.tool_calls += episode.tool_calls * count
        self.tool_errors += len(episode.tool_errors) * count
        for error in episode.tool_errors:
            self.append_error_record(sample, version, episode.turns, error, kind="tool")

    def append_error_record(self, sample: str, version: int, turns: int, error: str, kind: str = "sample") -> None:
        record = {"time": time.time(), "version": version, "sample": sample, "turns": turns, "error": error}
        if kind != "sample":
            record["kind"] = kind
        with open(self.paths.sample_errors, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")

    async def worker(self, buffer) -> None:
        while (slot := await buffer.start_group()) is not None:
            ref, version = slot
            try:
                group = await self.generate_group(ref, version)
            except RolloutError as err:
                log.warning("group %s failed, drawn again later: %s", ref.uid, err)
                await buffer.abort_group(ref, version)
                await asyncio.sleep(1.0)
                continue
            await buffer.finish_group(group)

    def window(self) -> dict[str, float]:
        """Generation figures since the last call (rollout tokens/s: tokens the model sampled, not the
        observations between its turns), and the run's totals."""
        elapsed = time.perf_counter() - self.window_started
        figures = {
            "rollout/tokens_per_s": self.window_tokens / max(elapsed, 1e-9),
            "rollout/errors": self.errors,
            "rollout/retries": self.client.retries,  # retried requests (RolloutClient counts them)
        }
        if self.teacher is not None:
            figures["timing/teacher_s"] = self.teacher.take_seconds()  # summed over groups scored at once
        judge = getattr(self.episodes, "judge", None)
        if judge is not None:
            figures |= judge.figures()
        if self.episodes.tool_use is not None:
            figures["rollout/tool_calls"] = self.tool_calls  # the run's totals, as rollout/errors
            figures["rollout/tool_errors"] = self.tool_errors
        self.window_tokens, self.window_started = 0, time.perf_counter()
        return figures
