"""The RL orchestrator process: rollouts through the router, rewards, batches, weight sync, eval.

``python -m backends.rollout.orchestrator --run-dir DIR --init-from MODEL --router-url URL
--engine-urls URL,URL [--async]``

``Orchestrator`` takes everything it talks to as arguments (a rollout client factory, the engines'
weight loader, the exchange, the event writer), so a unit test drives it with recording fakes, and
wires components with one job each, each in its own module: the run's ``EpisodeRunner``
(``backends.rollout.episodes``: environment episodes or agent programs, chosen once from the
recipe), ``Rollouts`` (trajectories and the generation workers), ``Evaluation`` (held-out
accuracy), ``EngineSync`` (versions into the engines) and ``TrainerFeed`` (batches to the learner);
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
from pathlib import Path
from typing import Any, AsyncContextManager, Callable, Mapping, Sequence

from backends.data.files import hold_out
from backends.data.files import load_rows as read_files
from backends.data.tasks import task_for
from backends.inference.transports import transport_module
from backends.models.tokenizer import load_tokenizer
from backends.rollout.buffer import AsyncGroupBuffer, PromptSampler
from backends.rollout.client import RolloutClient
from backends.rollout.engine_sync import EngineSync
from backends.rollout.episodes import episode_runner
from backends.rollout.evaluation import Evaluation
from backends.rollout.judge import Judge
from backends.rollout.rollouts import Rollouts
from backends.rollout.teacher import Teacher
from backends.rollout.trainer_feed import TrainerFeed
from skyrl_contracts.atomic import write_json
from skyrl_contracts.auxiliary import JUDGE, TEACHER
from skyrl_contracts.episodes import turn_problems
from skyrl_contracts.errors import UsageError
from skyrl_contracts.events import EventWriter
from skyrl_contracts.exchange import RunExchange, StopRequested
from skyrl_contracts.logs import StartupClock, setup_process_logging
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe
from skyrl_contracts.transports import DEFAULT_TRANSPORT, TRANSPORT_NAMES

PROCESS_NAME = "orchestrator"
log = logging.getLogger("skyrl.orchestrator")


def load_rows(recipe: Recipe) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows for the environment (built-in task rows or file rows)."""
    data = recipe.data
    if data.task is not None:
        task = task_for(data)
        return task.make_rows(recipe.seed, data.train_size, "train"), task.make_rows(
            recipe.seed, data.eval_size, "eval"
        )
    if data.train is None:  # a verifiers taskset's own tasks (the schema allows nothing else)
        from backends.rollout.episodes.verifiers import taskset_rows  # lazy: verifiers, an optional extra

        return hold_out(taskset_rows(recipe), data.eval_size, recipe.seed)
    train = read_files(data.train)
    if data.eval:
        return train, read_files(data.eval, limit=data.eval_size)
    return hold_out(train, data.eval_size, recipe.seed)  # the SFT stage's held-out rows, not trained on


def report_user_code(ref: str | None) -> None:
    """Say which file a recipe's ``module:name`` came from: a module of the same name elsewhere on
    the import path would otherwise be used silently."""
    if ref:
        module = sys.modules.get(ref.partition(":")[0])
        log.info("user code: %s from %s", ref, getattr(module, "__file__", None) or module)


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
        teacher=None,
        judge=None,
    ):
        """``teacher``: the ``Teacher`` that scores every group (``rl.distillation``), or None;
        ``judge``: the ``Judge`` whose verdicts are the reward (``rl.judge``), or None.
        ``resume``: the learner may restart from a checkpoint, so the first version is the one it
        publishes; a fresh run (False) starts on version 0 at once (``first_version``).
        ``open_client()``: an async context manager yielding a ``RolloutClient`` (through the
        router); ``engines``: the plan's ``EngineWeightLoader`` (admin calls to every engine);
        ``exchange``: the ``RunExchange`` with the learner; ``events``: an ``EventWriter``;
        ``rows``: (train, eval). The recipe's episodes are chosen here and their user code (an
        environment, a reward, an agent program) imported, so that code that cannot load fails the
        process at start, before any engine work."""
        for key, message in turn_problems(recipe):  # recipes validate refuses these too
            raise UsageError(f"{'.'.join(key)}: {message}")
        if (judge is None) != (recipe.rl.judge is None):
            raise UsageError(
                "rl.judge: the orchestrator needs the judge's engines (--auxiliary-urls judge=...), and only then"
            )
        self.judge = judge
        self.episodes = episode_runner(recipe, tokenizer, judge)
        self.recipe, self.rl = recipe, recipe.rl
        self.staleness = self.rl.async_.max_staleness if async_mode else 0
        self.tokenizer = tokenizer
        self.train_rows, self.eval_rows = list(rows[0]), list(rows[1])
        self.episodes.check_rows(self.train_rows, "training data")
        self.episodes.check_rows(self.eval_rows, "held-out data")
        self.open_client, self.engines, self.exchange, self.events = open_client, engines, exchange, events
        self.paths: RunDir = exchange.paths
        self.resume = resume
        if (teacher is None) != (self.rl.distillation is None):
            raise UsageError(
                "rl.distillation: the orchestrator needs the teacher's engines (--auxiliary-urls teacher=...), and only then"
            )
        self.teacher = teacher
        self.startup = None  # main's StartupClock (skyrl_contracts.logs): where the start-up went

    def restore_buffer(self, first_version: int):
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
                self.recipe, self.tokenizer, self.train_rows, client, self.paths, self.episodes, self.teacher
            )
            await self.episodes.start(client, rollouts.stop_ids)
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
                await self.episodes.stop()
                for auxiliary in (self.teacher, self.judge):
                    if auxiliary is not None:
                        await auxiliary.aclose()
        if self.judge is not None:  # the run's totals, with the final evaluation's verdicts
            self.events.log(self.rl.steps, self.judge.figures())
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
    auxiliary_urls: Mapping[str, Sequence[str]] | None = None,
) -> Orchestrator:
    """The orchestrator of the run in ``run_dir``, wired to the real router, engines and learner;
    ``weight_sync``: the plan's choice (``skyrl_cli.plan.weight_sync``); ``auxiliary_urls``: the
    engines of each auxiliary model by its name (``skyrl_contracts.auxiliary``)."""
    paths = RunDir(run_dir)
    recipe = paths.read_recipe()
    tokenizer = load_tokenizer(str(init_from))
    auxiliary_urls = auxiliary_urls or {}
    teacher = judge = None
    if recipe.rl.distillation is not None and auxiliary_urls.get(TEACHER):
        check_same_vocabulary(tokenizer, str(init_from), recipe.rl.distillation.teacher)
        teacher = Teacher.from_recipe(auxiliary_urls[TEACHER], recipe)
    if recipe.rl.judge is not None and auxiliary_urls.get(JUDGE):
        chat = load_tokenizer(recipe.rl.judge.model, require_chat_template=False).chat_template is not None
        judge = Judge.from_recipe(auxiliary_urls[JUDGE], recipe, paths.judge_verdicts, chat)
    orchestrator = Orchestrator(
        recipe,
        tokenizer=tokenizer,
        rows=load_rows(recipe),
        open_client=lambda: RolloutClient.from_recipe(router_url, recipe),
        engines=engine_weights(recipe, run_dir, engine_urls, weight_sync),
        exchange=RunExchange(run_dir),
        events=EventWriter(paths.events, PROCESS_NAME),
        async_mode=async_mode,
        resume=resume,
        teacher=teacher,
        judge=judge,
    )
    report_user_code(recipe.rl.agent or recipe.rl.environment or recipe.rl.reward)  # imported above
    return orchestrator


def check_same_vocabulary(tokenizer, student: str, teacher: str) -> None:
    """The teacher scores the policy's token ids: both tokenizers must map every id to the same
    token (``skyrl recipes validate`` compares the files where the policy's exist before the run;
    here the loaded tokenizers are compared, a char tokenizer an SFT stage built included)."""
    if load_tokenizer(teacher).get_vocab() != tokenizer.get_vocab():
        raise UsageError(f"rl.distillation.teacher: {teacher} does not use the policy's tokenizer ({student})")


def parse_auxiliary_urls(values: Sequence[str]) -> dict[str, list[str]]:
    """``["teacher=URL,URL", ...]`` as ``{"teacher": [URL, URL]}``."""
    parsed = {}
    for value in values:
        name, _, urls = value.partition("=")
        parsed[name] = [u for u in urls.split(",") if u]
    return parsed


def engine_weights(recipe: Recipe, run_dir: Path, engine_urls: Sequence[str], weight_sync: str):
    """The engines' weight loader for the plan's transport (its module's engine side)."""
    return transport_module(weight_sync).engine_loader(recipe, run_dir, engine_urls)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m backends.rollout.orchestrator", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--init-from", required=True, type=Path)
    parser.add_argument("--router-url", required=True)
    parser.add_argument("--engine-urls", required=True, help="comma-separated; admin calls go to each directly")
    parser.add_argument("--async", dest="async_mode", action="store_true")
    parser.add_argument(
        "--auxiliary-urls",
        action="append",
        default=[],
        metavar="NAME=URL,URL",
        help="an auxiliary model's engines (teacher: rl.distillation, judge: rl.judge); once per model",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="the run starts at version 0 (not --resume): no wait for the learner's v0"
    )
    parser.add_argument(
        "--weight-sync", choices=TRANSPORT_NAMES, default=DEFAULT_TRANSPORT, help="the plan's transport"
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
        args.run_dir.resolve(),
        args.init_from,
        args.router_url,
        urls,
        args.async_mode,
        args.weight_sync,
        not args.fresh,
        auxiliary_urls=parse_auxiliary_urls(args.auxiliary_urls),
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
