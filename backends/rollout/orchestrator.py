"""The RL orchestrator process: rollouts through the router, rewards, batches, weight sync, eval.

``python -m backends.rollout.orchestrator --run-dir DIR --init-from MODEL --router-url URL
--engine-urls URL,URL [--async]``

``Orchestrator`` takes everything it talks to as arguments (a rollout client factory, the engines'
weight loader, the exchange, the event writer), so a unit test drives it with recording fakes, and
runs four components with one job each: ``Rollouts`` (trajectories and the generation workers),
``Evaluation`` (held-out accuracy), ``EngineSync`` (versions into the engines) and ``TrainerFeed``
(batches to the learner);
``build_orchestrator`` wires the real ones from the run directory. It starts from the version the
learner publishes first (``weights/LATEST``: 0, or a resumed checkpoint's step). Progress goes to
the ``skyrl.orchestrator`` logger and to metric events, never to ``print``.

One code path for sync and fully-async RL: generation workers draw prompts from an
``AsyncGroupBuffer`` whose staleness bound is ``rl.async.max_staleness`` with ``--async`` and 0
without it (0 is the synchronous schedule: B groups, train, sync, B groups, ...). The trainer feed
takes batches from the buffer and writes them to ``batches/step-<k>.json`` for the learner. A weight
watcher waits for each version the learner publishes (``weights/v<k>``), pushes it to every engine
(pause in ``keep`` mode, reload, label, resume: in-flight trajectories continue under the new
weights and record both versions; with ``--weight-sync nccl`` the learner broadcasts the weights
between that pause and resume instead of the reload, ``backends.inference.nccl_sync``; with LoRA
each version is an adapter loaded under its own name and requests name the current one, see
``EngineSync``), then opens the buffer to that version,
and evaluates on the held-out split by greedy decoding through the engines when an evaluation is due.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, AsyncContextManager, Callable, Mapping, Sequence

from skyrl_contracts.atomic import write_json
from skyrl_contracts.episodes import turn_limit, turn_problems
from skyrl_contracts.errors import UsageError
from skyrl_contracts.events import EventWriter
from skyrl_contracts.logs import StartupClock, setup_process_logging
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe

PROCESS_NAME = "orchestrator"
ENGINES_BACK_TIMEOUT_S = 900.0  # an engine restart (start-up ~20 s, minutes on a busy machine)
# How long the first calls of a group's agent programs wait for the group's next first call, to be
# sampled as one request (SharedFirstTurn): an agent may call late, or never.
AGENT_FIRST_CALL_WAIT_S = 0.5
log = logging.getLogger("skyrl.orchestrator")


def load_rows(recipe: Recipe) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows for the environment (built-in task rows or file rows)."""
    data = recipe.data
    if data.task is not None:
        from backends.data.tasks import get_task

        task = get_task(data.task, data.digits)
        return task.make_rows(recipe.seed, data.train_size, "train"), task.make_rows(
            recipe.seed, data.eval_size, "eval"
        )
    from backends.data.files import hold_out
    from backends.data.files import load_rows as read_rows

    train = read_rows(data.train)
    if data.eval:
        return train, read_rows(data.eval, limit=data.eval_size)
    return hold_out(train, data.eval_size, recipe.seed)  # the SFT stage's held-out rows, not trained on


def report_user_code(ref: str | None) -> None:
    """Say which file a recipe's ``module:name`` came from: a module of the same name elsewhere on
    the import path would otherwise be used silently."""
    if ref:
        module = sys.modules.get(ref.partition(":")[0])
        log.info("user code: %s from %s", ref, getattr(module, "__file__", None) or module)


def encode_observation(tokenizer, history, messages, tools=()) -> list[int]:
    """Tokens of an environment observation appended after the model's turn, ending with the
    assistant's generation prompt: what the chat template writes after that turn when the
    observation follows it (``continuation_text``). A template that renders the history differently
    once more follows gets the observation's messages rendered alone, less a leading BOS."""
    from backends.data.chat import continuation_text, encode_prompt, encode_text

    text = continuation_text(tokenizer, history, messages, tools)
    if text is not None:
        return encode_text(tokenizer, text)
    if not encode_observation.warned:  # once per run: it holds for every observation of this template
        log.warning("the chat template rewrites the conversation before an observation; it is rendered alone")
        encode_observation.warned = True
    ids = encode_prompt(tokenizer, messages)
    if tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]:
        ids = ids[1:]
    return ids


encode_observation.warned = False


def load_agent(ref: str):
    """The recipe's black-box agent (``rl.agent``): an ``async def agent(row, endpoint)``."""
    import inspect

    from backends.rollout.rewards import load_object

    agent = load_object(ref, "rl.agent")
    if not inspect.iscoroutinefunction(agent):
        raise UsageError(f"rl.agent {ref!r} must be an async function: async def agent(row, endpoint) -> reward")
    return agent


def tool_use(recipe: Recipe, tokenizer, make_env=None):
    """How episodes run tool calls (``ToolUse``), or None when the environment declares no tools
    and the recipe names no parser. An agent run (``make_env`` None) gets the parser its calls'
    ``tools`` need, where the recipe or the chat template names one. The parser is vLLM's (its
    import takes several seconds)."""
    from backends.rollout.environments import ToolUse, declares_tools
    from backends.rollout.tools import ToolCallParser, default_parser_name

    rl = recipe.rl
    agent = make_env is None
    if not agent and rl.tool_parser is None and not declares_tools(make_env):
        return None
    if not agent and declares_tools(make_env) and turn_limit(recipe) < 2:
        raise UsageError("rl.max_turns: the environment offers tools, and a tool's answer needs a turn after the call")
    name = rl.tool_parser or default_parser_name(tokenizer.chat_template)
    if name is None and agent:
        return None  # an agent that sends tools gets a 400 naming rl.tool_parser
    if name is None:
        raise UsageError(
            "rl.tool_parser: the chat template's tool-call format is not one skyrl recognises; "
            "name vLLM's parser for the model (hermes, llama3_json, mistral, pythonic, ...)"
        )
    try:
        parser = ToolCallParser(name, tokenizer)
    except ValueError as exc:
        raise UsageError(f"rl.tool_parser: {exc}") from None
    return ToolUse(parser, rl.tool_timeout_s, end_on_error=rl.tool_errors == "end")


class Rollouts:
    """Trajectories through the router under the rollout client it was given: a group of
    ``samples_per_prompt`` per prompt for training (``worker`` fills the buffer with them) and single
    episodes for evaluation; it counts the failed samples and the tokens generated since ``window``."""

    def __init__(
        self,
        recipe: Recipe,
        tokenizer,
        train_rows: Sequence[Mapping[str, Any]],
        client,
        paths: RunDir,
        make_env,
        tools=None,
    ):
        from backends.rollout.rewards import GuardedCaller

        self.rl, self.tokenizer, self.train_rows, self.client, self.paths = (
            recipe.rl,
            tokenizer,
            train_rows,
            client,
            paths,
        )
        self.stop_ids = [t for t in (tokenizer.eos_token_id,) if t is not None]
        self.make_env, self.tools = make_env, tools
        self.max_turns = turn_limit(recipe)
        self.agent, self.agent_server = None, None  # set by use_agent (rl.agent)
        self.caller = GuardedCaller(self.rl.reward_timeout_s, self.rl.env_concurrency)
        self.eos = tokenizer.eos_token or ""
        self.tool_calls = self.tool_errors = 0
        self.errors = 0
        self.window_tokens = 0
        self.window_started = time.perf_counter()

    async def rollout(self, row: Mapping[str, Any], session_id: str, temperature: float, first_turn=None, index=0):
        """One trajectory: (session, episode). ``first_turn``: the group's ``SharedFirstTurn``, which
        samples turn 0 of all its trajectories together. The session's router pin is always released."""
        from backends.data.chat import encode_prompt
        from backends.rollout.environments import run_episode
        from backends.rollout.session import RolloutSession

        session: RolloutSession | None = None

        async def generate(history, new_messages, tools):
            nonlocal session
            if not history:
                session = RolloutSession(self.client, encode_prompt(self.tokenizer, new_messages, tools), session_id)
                if first_turn is not None:
                    return self.decode(await first_turn.take(index, session))
            else:
                session.add_observation(encode_observation(self.tokenizer, history, new_messages, tools))
            completion = await session.generate(
                max_tokens=self.rl.max_new_tokens, temperature=temperature, stop_token_ids=self.stop_ids
            )
            return self.decode(completion)

        try:
            episode = await run_episode(self.make_env, row, generate, self.caller, self.max_turns, self.tools)
        finally:
            if first_turn is not None:
                first_turn.skip(index)  # an episode that ended before turn 0 must not hold up the group
            if session is not None:
                await session.finish()
        return session, episode

    def use_agent(self, agent, server) -> None:
        """Trajectories run ``agent`` (``rl.agent``) against ``server`` (an ``AgentServer``) instead of an environment."""
        self.agent, self.agent_server = agent, server

    async def trajectory(self, row, session_id: str, temperature: float, first_turn=None, index=0):
        """(samples' token records, episode) of one trajectory: an environment episode's session,
        or the samples built from an agent's recorded calls."""
        if self.agent is None:
            session, episode = await self.rollout(row, session_id, temperature, first_turn, index)
            return ([session] if session is not None else []), episode
        from backends.rollout.agents import run_agent, samples_from_calls
        from backends.rollout.environments import Episode

        trajectory, endpoint = self.agent_server.open(
            session_id, temperature if temperature == 0.0 else None, first_turn, index
        )
        try:
            outcome = await run_agent(self.agent, row, endpoint, self.rl.agent_timeout_s)
        finally:
            if first_turn is not None:
                first_turn.skip(index)  # an agent that made no call must not hold up the group
            await self.agent_server.close(session_id)
        parts = samples_from_calls(trajectory.calls)
        error = outcome.error or (None if parts else "agent: it made no call to the endpoint")
        episode = Episode(reward=0.0 if error else outcome.reward, turns=len(trajectory.calls), done=True, error=error)
        episode.step_infos.append(outcome.info)
        return parts, episode

    def decode(self, completion):
        from backends.rollout.environments import TurnText

        if completion is None:
            return TurnText("", "")
        raw = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
        if self.eos and raw.endswith(self.eos):
            raw = raw[: -len(self.eos)]
        return TurnText(self.tokenizer.decode(completion.token_ids, skip_special_tokens=True), raw)

    async def generate_group(self, ref, start_version: int):
        from backends.rollout.batch import Group, Sample
        from backends.rollout.session import SharedFirstTurn

        row = self.train_rows[ref.index]
        k = self.rl.samples_per_prompt
        first_turn = SharedFirstTurn(
            self.client,
            k,
            ref.uid,
            self.rl.max_new_tokens,
            self.rl.temperature,
            wait_s=None if self.agent is None else AGENT_FIRST_CALL_WAIT_S,
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
            info = {"tool_calls": episode.tool_calls, "tool_errors": len(episode.tool_errors)} if self.tools else {}
            if self.agent is not None:
                info = {"agent_calls": episode.turns, "agent_samples": len(parts)}
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
                        num_turns=part.num_turns if part and self.agent is not None else episode.turns,
                        finish_reason=part.finish_reason if part else "error",
                        error=episode.error,
                        info=info,
                    )
                )
                self.window_tokens += samples[-1].num_loss_tokens  # sampled: observations are not generation
        return Group(ref.uid, samples, start_version)

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
        from backends.rollout.client import RolloutError

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
        if self.tools:
            figures["rollout/tool_calls"] = self.tool_calls  # the run's totals, as rollout/errors
            figures["rollout/tool_errors"] = self.tool_errors
        self.window_tokens, self.window_started = 0, time.perf_counter()
        return figures


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
        from backends.rollout.session import SharedFirstTurn

        t0 = time.perf_counter()
        first_turns = SharedFirstTurn(
            self.rollouts.client,
            len(self.eval_rows),
            f"eval-v{version}",
            self.rl.max_new_tokens,
            0.0,
            batch_size=self.recipe.inference.max_num_seqs,
            wait_s=None if self.rollouts.agent is None else AGENT_FIRST_CALL_WAIT_S,
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
        if version == 0 or self.paths.initial_accuracy() is None:
            metrics["eval/accuracy_initial"] = accuracy
            self.paths.write_initial_accuracy(version, accuracy)
        self.events.log(version, metrics)
        log.info("eval at version %d: accuracy %.4f (%d prompts)", version, accuracy, len(results))
        return accuracy


class EngineSync:
    """Every engine onto a version the learner published, through the plan's loader
    (``EngineWeightLoader``); older published versions the engines no longer hold are deleted.

    LoRA: versions that no request in flight names are unloaded before the load (so no more than
    ``--max-loras`` are ever loaded) and again after it (the previous one, once idle); a version
    still in use keeps its adapter and directory until a later sync finds it idle."""

    def __init__(self, engines, exchange, events):
        self.engines, self.exchange, self.events = engines, exchange, events

    async def start(self, version: int, in_flight: Mapping[str, int]) -> str:
        """The run's first version: loaded, or (the engines started on it) only labelled."""
        if version > 0 or self.engines.loads_initial_version:  # LoRA: v0 is an adapter too
            return await self.load(version, in_flight)
        await self.engines.label_initial()
        return self.engines.model_name(version)

    async def load(self, version: int, in_flight: Mapping[str, int]) -> str:
        """Load ``version``; returns the model name requests sample it with."""
        t0 = time.perf_counter()
        await self.engines.retire(in_flight)
        result = await self.load_when_reachable(version)
        await self.engines.retire(in_flight)
        log.info("engines on policy version %d (%.3f s)", version, result.seconds)
        self.events.log(version, {"timing/sync_weights_s": time.perf_counter() - t0, "weights/version": version})
        self.exchange.prune_weights_before(version, keep=self.engines.held())
        return self.engines.model_name(version)

    async def load_when_reachable(self, version: int, timeout_s: float = ENGINES_BACK_TIMEOUT_S):
        """``engines.load``, again every few seconds while no engine answers: engine recovery is
        restarting them (a single engine that died), and the run goes on once one is back."""
        from backends.inference.weight_sync import NoEngineReachable

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.engines.load(version, self.exchange.weights_dir(version))
            except NoEngineReachable as err:
                if time.monotonic() > deadline:
                    raise
                log.warning("%s; waiting for engine recovery", err)
                await asyncio.sleep(2.0)


class TrainerFeed:
    """Batches from the buffer to the learner (``batches/step-<k>.json``), with the step's rollout figures."""

    def __init__(self, recipe: Recipe, exchange, events, generation_figures: Callable[[], dict[str, float]]):
        self.rl, self.exchange, self.events, self.generation_figures = recipe.rl, exchange, events, generation_figures

    async def run(self, buffer, first_step: int) -> None:
        from backends.rollout.batch import flatten

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


class Orchestrator:
    """Wires the components of one run and runs them: generation workers (``Rollouts``) fill the
    buffer, ``TrainerFeed`` hands its batches to the learner, and the weight watcher here puts each
    version the learner publishes into the engines (``EngineSync``), evaluates when due
    (``Evaluation``), saves the buffer's state at checkpoints and opens the buffer to that version."""

    def __init__(
        self,
        recipe: Recipe,
        *,
        tokenizer,
        rows: tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]],
        open_client: Callable[[], AsyncContextManager],
        engines,
        exchange,
        events,
        async_mode: bool,
        resume: bool = True,
    ):
        """``resume``: the learner may restart from a checkpoint, so the first version is the one it
        publishes; a fresh run (False) starts on version 0 at once (``first_version``).
        ``open_client()``: an async context manager yielding a ``RolloutClient`` (through the
        router); ``engines``: the plan's ``EngineWeightLoader`` (admin calls to every engine);
        ``exchange``: the ``RunExchange`` with the learner; ``events``: an ``EventWriter``;
        ``rows``: (train, eval). The recipe's environment (or reward) is imported here, so that user
        code that cannot load fails the process at start, before any engine work. An agent run
        builds no environment: the agent program is its episode."""
        from backends.rollout.environments import environment_factory

        for key, message in turn_problems(recipe):  # recipes validate refuses these too
            raise UsageError(f"{'.'.join(key)}: {message}")
        self.agent = load_agent(recipe.rl.agent) if recipe.rl.agent else None
        self.make_env = environment_factory(recipe) if self.agent is None else None
        self.tool_use = tool_use(recipe, tokenizer, self.make_env)
        self.recipe, self.rl = recipe, recipe.rl
        self.staleness = self.rl.async_.max_staleness if async_mode else 0
        self.tokenizer = tokenizer
        self.train_rows, self.eval_rows = list(rows[0]), list(rows[1])
        self.open_client, self.engines, self.exchange, self.events = open_client, engines, exchange, events
        self.paths: RunDir = exchange.paths
        self.resume = resume
        self.startup = None  # main's StartupClock (skyrl_contracts.logs): where the start-up went

    def restore_buffer(self, first_version: int):
        from backends.rollout.buffer import AsyncGroupBuffer, PromptSampler

        drop = self.rl.dynamic_sampling.enabled
        batch = self.rl.prompts_per_step
        state_file = self.paths.orchestrator_state_at(first_version)
        if first_version > 0 and state_file.exists():
            return AsyncGroupBuffer.from_state(
                json.loads(state_file.read_text()), batch, self.staleness, drop_zero_variance=drop
            )
        sampler = PromptSampler(len(self.train_rows), self.recipe.seed)
        return AsyncGroupBuffer(sampler, batch, self.staleness, drop_zero_variance=drop, version=first_version)

    def save_state(self, buffer, version: int) -> None:
        """Buffer state for a checkpoint the learner writes at the same version."""
        every = self.rl.save_every
        if not ((every and version % every == 0) or version == self.rl.steps):
            return
        write_json(self.paths.orchestrator_state_at(version), buffer.state_dict(trained_batches=version), indent=None)
        # One more than the learner's checkpoints: this state may be written before its checkpoint is.
        self.paths.prune_orchestrator_states(self.rl.keep_last + 1)

    async def watch_weights(self, client, sync: EngineSync, evaluation: Evaluation, buffer, first_version: int) -> None:
        """Push every version the learner publishes to the engines, then admit generation on it."""
        served = first_version
        while served < self.rl.steps:
            latest = self.exchange.latest_version()
            if latest is None or latest <= served:
                if self.exchange.stop_reason():
                    return
                await asyncio.sleep(0.05)
                continue
            client.model = await sync.load(latest, client.in_flight)
            served = latest
            if evaluation.due(latest, first_version):
                await evaluation.evaluate(latest)
            self.save_state(buffer, latest)
            await buffer.publish_version(latest)

    async def start_agent_server(self, client, rollouts: Rollouts):
        """The agents' OpenAI-compatible endpoint (``rl.agent``), or None."""
        if self.agent is None:
            return None
        from backends.rollout.agents import AgentServer

        server = AgentServer(
            client,
            self.tokenizer,
            self.tool_use.parser if self.tool_use else None,
            self.rl.max_new_tokens,
            rollouts.stop_ids,
            self.rl.temperature,
        )
        server.max_calls = turn_limit(self.recipe)  # None: not capped (skyrl_contracts.episodes)
        await server.start()
        rollouts.use_agent(self.agent, server)
        return server

    async def first_version(self, timeout_s: float) -> int:
        """The version the run starts from. A fresh run whose engines started on the initial policy
        starts on 0 at once: the initial evaluation and the first batch's generation then overlap
        the learner's start-up (its imports, DeepSpeed's set-up), which is most of a run's start-up
        on engines that are already up (an engine pool). Otherwise the learner's first publication
        says it: a resumed checkpoint's step, or LoRA's v0 adapter the engines must load."""
        if not self.resume and not self.engines.loads_initial_version:
            return 0
        await asyncio.to_thread(self.exchange.wait_version, 0, timeout_s)
        return self.exchange.latest_version()

    def lap(self, name: str) -> None:
        if self.startup is not None:
            self.startup.lap(name)

    async def run(self, first_version_timeout_s: float = 1800) -> None:
        first_version = await self.first_version(first_version_timeout_s)
        self.lap("first version")
        self.events.log(first_version, {"progress/total_steps": self.rl.steps})
        buffer = self.restore_buffer(first_version)
        async with self.open_client() as client:
            rollouts = Rollouts(
                self.recipe, self.tokenizer, self.train_rows, client, self.paths, self.make_env, self.tool_use
            )
            agent_server = await self.start_agent_server(client, rollouts)
            evaluation = Evaluation(self.recipe, rollouts, self.eval_rows, self.events, self.paths)
            sync = EngineSync(self.engines, self.exchange, self.events)
            feed = TrainerFeed(self.recipe, self.exchange, self.events, rollouts.window)
            client.model = await sync.start(first_version, client.in_flight)
            self.lap(f"v{first_version} on the engines")
            await evaluation.evaluate(first_version)
            self.lap("initial evaluation")
            if self.startup is not None:
                log.info("%s", self.startup.line("orchestrator ready"))
                self.events.log(first_version, self.startup.figures())
            n_workers = max(1, self.recipe.inference.max_concurrency // self.rl.samples_per_prompt)
            workers = [asyncio.create_task(rollouts.worker(buffer)) for _ in range(n_workers)]
            watcher = asyncio.create_task(self.watch_weights(client, sync, evaluation, buffer, first_version))
            feeder = asyncio.create_task(feed.run(buffer, first_version))
            try:
                # The run ends when the last batch is written and the last version synced and
                # evaluated; a failure of any task (a weight sync the engines refused) ends it at once.
                await until_done_or_failed({feeder, watcher}, others=set(workers))
            finally:
                await buffer.close()
                for task in (*workers, watcher, feeder):
                    task.cancel()
                await asyncio.gather(*workers, watcher, feeder, return_exceptions=True)
                if agent_server is not None:
                    await agent_server.stop()
        self.events.close()


async def until_done_or_failed(required: set[asyncio.Task], others: set[asyncio.Task] = frozenset()) -> None:
    """Wait until every task in ``required`` has finished; the first exception raised by any task
    (``others`` too) is raised here at once instead of leaving the rest waiting on it forever."""
    pending = set(required) | set(others)
    while required & pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()


def build_orchestrator(
    run_dir: Path,
    init_from: Path,
    router_url: str,
    engine_urls: Sequence[str],
    async_mode: bool,
    weight_sync: str = "disk",
    resume: bool = True,
) -> Orchestrator:
    """The orchestrator of the run in ``run_dir``, wired to the real router, engines and learner;
    ``weight_sync``: the plan's choice (``skyrl_cli.plan.weight_sync``)."""
    from backends.models.tokenizer import load_tokenizer
    from backends.rollout.client import RolloutClient
    from skyrl_contracts.exchange import RunExchange

    paths = RunDir(run_dir)
    recipe = paths.read_recipe()
    orchestrator = Orchestrator(
        recipe,
        tokenizer=load_tokenizer(str(init_from)),
        rows=load_rows(recipe),
        open_client=lambda: RolloutClient.from_recipe(router_url, recipe),
        engines=engine_weights(recipe, run_dir, engine_urls, weight_sync),
        exchange=RunExchange(run_dir),
        events=EventWriter(paths.events, PROCESS_NAME),
        async_mode=async_mode,
        resume=resume,
    )
    report_user_code(recipe.rl.agent or recipe.rl.environment or recipe.rl.reward)  # imported above
    return orchestrator


def engine_weights(recipe: Recipe, run_dir: Path, engine_urls: Sequence[str], weight_sync: str):
    """The engines' weight loader for the plan's transport (``backends.rollout.orchestrator.engine_weights``)."""
    from backends.inference.nccl_sync import NcclEngineWeights
    from backends.inference.weight_sync import EngineAdapters, EngineWeights
    from skyrl_contracts.exchange import RunExchange

    reset = recipe.rl.async_.reset_prefix_cache
    loaders = {
        "disk": lambda: EngineWeights(engine_urls, run_dir, reset_prefix_cache=reset),
        "int4": lambda: EngineWeights(engine_urls, run_dir, reset_prefix_cache=reset),  # W4A16 versions, reloaded
        "lora": lambda: EngineAdapters(engine_urls, run_dir),
        "nccl": lambda: NcclEngineWeights(engine_urls, run_dir, RunExchange(run_dir), reset_prefix_cache=reset),
    }
    return loaders[weight_sync]()


def main(argv: list[str] | None = None) -> None:
    from skyrl_contracts.exchange import RunExchange, StopRequested

    parser = argparse.ArgumentParser(
        prog="python -m backends.rollout.orchestrator", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--init-from", required=True, type=Path)
    parser.add_argument("--router-url", required=True)
    parser.add_argument("--engine-urls", required=True, help="comma-separated; admin calls go to each directly")
    parser.add_argument("--async", dest="async_mode", action="store_true")
    parser.add_argument(
        "--fresh", action="store_true", help="the run starts at version 0 (not --resume): no wait for the learner's v0"
    )
    parser.add_argument(
        "--weight-sync", choices=("nccl", "disk", "lora", "int4"), default="disk", help="the plan's transport"
    )
    parser.add_argument(
        "--import-path",
        action="append",
        default=[],
        help="searched first for rl.reward / rl.environment / rl.agent (the recipe's directory)",
    )
    args = parser.parse_args(argv)
    sys.path[:0] = [p for p in args.import_path if p not in sys.path]
    setup_process_logging()
    startup = StartupClock(PROCESS_NAME)
    startup.lap("imports")
    urls = [u for u in args.engine_urls.split(",") if u]
    orchestrator = build_orchestrator(
        args.run_dir.resolve(), args.init_from, args.router_url, urls, args.async_mode, args.weight_sync, not args.fresh
    )
    startup.lap("recipe, data and tokenizer")
    orchestrator.startup = startup
    try:
        asyncio.run(orchestrator.run())
    except StopRequested as stop:
        log.warning("stopping: %s", stop)
        raise SystemExit(1)
    except BaseException as err:
        RunExchange(args.run_dir).request_stop(f"orchestrator failed: {type(err).__name__}: {err}")
        raise


if __name__ == "__main__":
    sys.exit(main())
