"""The Tinker server's work: futures in per-model ``seq_id`` order, batched passes, checkpoints.

The API routes (``backends.tinker.app``) validate a request, persist it as a future (SQLite) and
hand it here. Training work runs on one trainer thread, which owns the ``LoraEngine``:

- each model's requests run in ``seq_id`` order (the SDK numbers them 1, 2, ... and may send a
  forward_backward's chunks in parallel, first chunk last); a request waits for its predecessor
  unless that has not arrived within ``GAP_WAIT_S`` (then the lowest pending one goes);
- every round takes, for each model, its ready run of consecutive forward_backward (or
  forward-only) requests, and runs those of **all** models as one batched pass (gradients sum in
  each adapter until its optim_step); other requests (create, optim_step, save, load) run singly;
- a result is committed to the store with its future, then the waiting long-poll is woken.

Sampling runs on the event loop (``backends.tinker.sampling``), not on the trainer thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.tinker import protocol as P
from backends.tinker.store import PENDING, Store
from backends.tinker.wire import ForwardBackward, encode_forward_backward_output
from skyrl_contracts.atomic import atomic_dir
from skyrl_contracts.engine_api import SERVED_MODEL_NAME

log = logging.getLogger(__name__)
GAP_WAIT_S = 5.0


@dataclass(frozen=True)
class ServerConfig:
    base_model: str  # the name clients use
    model_dir: str  # local HF directory: weights and tokenizer (tokenizer_id)
    storage_dir: str
    api_keys: frozenset[str]
    max_lora_rank: int = 32
    max_live_adapters: int = 8
    max_request_bytes: int = 64 * 2**20
    max_datums_per_request: int = 4096
    max_sequence_tokens: int = 512
    max_batch_tokens: int = 32768
    long_poll_s: float = 20.0
    sample_url: str | None = None  # router (or single engine); None: sampling refused
    engine_urls: tuple[str, ...] = ()
    served_base_name: str = SERVED_MODEL_NAME  # the engines' name for the base model
    max_samples_per_request: int = 128
    batch_adapters: bool = True  # False: one pass per adapter (the benchmark's baseline)
    session_timeout_s: float = 300.0  # no heartbeat for this long: the session ends, its adapters are freed

    def accepts_base(self, name: str | None) -> bool:
        return name in (self.base_model, self.model_dir)


@dataclass
class Job:
    request_id: int
    kind: str
    owner: str
    model_id: str
    seq_id: int  # 0: creation (runs before the model's seq 1)
    body: Any
    arrived: float = field(default_factory=time.monotonic)


class JobError(Exception):
    """A request that failed for a reason the client should see (category User)."""


class Notifier:
    """Wakes long-polls (on the event loop) when the trainer thread finishes a future."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.events: dict[int, asyncio.Event] = {}

    def event(self, request_id: int) -> asyncio.Event:
        return self.events.setdefault(request_id, asyncio.Event())

    def notify(self, request_id: int) -> None:
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self._set, request_id)
        except RuntimeError:  # loop closed
            pass

    def forget(self, request_id: int) -> None:
        """A poll that found its future finished without waiting lets its event go."""
        self.events.pop(request_id, None)

    def _set(self, request_id: int) -> None:
        event = self.events.pop(request_id, None)
        if event is not None:
            event.set()


class Results:
    """Where a request's answer goes: the store (the future's result) and a wake-up for its long poll."""

    def __init__(self, store: Store, notifier: Notifier):
        self.store, self.notifier = store, notifier

    def finish(self, request_id: int, data: bytes, result_type: str) -> None:
        self.store.complete(request_id, data, result_type)
        self.notifier.notify(request_id)

    def finish_json(self, request_id: int, result: dict) -> None:
        self.finish(request_id, json.dumps(result).encode(), "json")

    def finish_error(self, request_id: int, message: str, category: str = "User") -> None:
        self.store.fail(request_id, message, category)
        self.notifier.notify(request_id)


class Checkpoints:
    """Checkpoint directories under the storage directory, and the owner's right to read them."""

    def __init__(self, storage: Path, store: Store):
        self.storage, self.store = storage, store

    def directory(self, run_id: str, kind: str, name: str) -> Path:
        directory = self.storage / "checkpoints" / run_id / kind / name
        directory.parent.mkdir(parents=True, exist_ok=True)
        return directory

    def inside(self, directory: str | Path) -> bool:
        """Whether ``directory``, symlinks followed, is under the storage's checkpoints: a row never
        leads elsewhere, whatever happened to the files since they were saved."""
        return Path(directory).resolve().is_relative_to((self.storage / "checkpoints").resolve())

    def resolve(self, owner: str, path: str) -> Path:
        """The directory of ``tinker://run/kind/name`` if ``owner`` may read it."""
        return Path(self.row(owner, path)["dir"])

    def row(self, owner: str, path: str):
        run_id, kind, name = P.parse_tinker_path(path)
        row = self.store.checkpoint(run_id, kind, name)
        if row is None or row["owner"] != owner:
            raise JobError(f"checkpoint {path} not found")
        if not self.inside(row["dir"]):
            raise JobError(f"checkpoint {path} is outside the storage directory (a symlink?): refused")
        if not (Path(row["dir"]) / "adapter_model.safetensors").exists():
            raise JobError(f"checkpoint {path} has lost its files")
        return row


class JobScheduler(threading.Thread):
    """The one thread that runs model requests on the LoRA engine: it orders each model's jobs by
    ``seq_id``, batches ready forward_backward passes across models, and runs every other job
    through its handler (``self.handlers``, one per job kind)."""

    def __init__(
        self,
        config: ServerConfig,
        store: Store,
        results: Results,
        checkpoints: Checkpoints,
        engine_factory: Callable[[], Any],
    ):
        super().__init__(name="tinker-scheduler", daemon=True)
        self.config, self.store, self.results, self.checkpoints = config, store, results, checkpoints
        self.vocab_size: int | None = None  # the engine's, once it is up
        self.engine_factory = engine_factory
        self.engine = None
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.cond = threading.Condition()
        self.queues: dict[str, dict[int, Job]] = {}
        self.last_seq: dict[str, int] = {}
        self.stopping = False
        # adapters per batched pass, the latest ones (for tests and benchmarks; bounded: the server runs for weeks)
        self.batch_sizes: deque[int] = deque(maxlen=1024)
        self.handlers: dict[str, Callable[[Job], dict]] = {
            "create_model": self._create_model,
            "optim_step": self._optim_step,
            "save_weights": self._save_weights,
            "save_weights_for_sampler": self._save_weights_for_sampler,
            "unload": self._unload,
            "load_weights": self._load_weights,
        }

    def submit(self, job: Job) -> None:
        with self.cond:
            self.queues.setdefault(job.model_id, {})[job.seq_id] = job
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def run(self) -> None:
        try:
            self.engine = self.engine_factory()
        except BaseException as err:  # reported by /healthz and every request
            self.failed = err
            log.exception("the LoRA engine failed to start")
            self.ready.set()
            return
        self.vocab_size = getattr(self.engine, "vocab_size", None)
        self.ready.set()
        while True:
            with self.cond:
                while not self.stopping and not self._ready_jobs():
                    self.cond.wait(timeout=0.5)
                if self.stopping:
                    return
                rounds = self._take_round()
            self._execute(rounds)

    # --------------------------------------------------------------------------- scheduling

    def _next(self, model_id: str, queue: dict[int, Job]) -> int | None:
        if not queue:
            return None
        expected = self.last_seq.get(model_id, 0) + 1
        if 0 in queue:
            return 0
        if expected in queue:
            return expected
        lowest = min(queue)
        if queue[lowest].kind == "unload":  # only the unload is left
            return lowest
        if lowest < expected or time.monotonic() - queue[lowest].arrived > GAP_WAIT_S:
            return lowest
        return None

    def _ready_jobs(self) -> bool:
        return any(self._next(m, q) is not None for m, q in self.queues.items())

    def _take_round(self) -> list[list[Job]]:
        """Groups to run: one group holding every model's ready forward_backward runs (batched),
        one holding forward-only runs, and single jobs for everything else."""
        grad, nograd, singles = [], [], []
        for model_id, queue in list(self.queues.items()):
            seq = self._next(model_id, queue)
            if seq is None:
                continue
            job = queue.pop(seq)
            self._advance(model_id, seq)
            if job.kind != "forward_backward":
                singles.append([job])
                continue
            run = [job]
            forward_only = job.body.forward_only
            # consecutive chunks of the same kind join the same pass
            while (
                (nxt := self.last_seq[model_id] + 1) in queue
                and queue[nxt].kind == "forward_backward"
                and queue[nxt].body.forward_only == forward_only
            ):
                run.append(queue.pop(nxt))
                self._advance(model_id, nxt)
            if not self.config.batch_adapters:
                singles.append(run)
            else:
                (nograd if forward_only else grad).extend(run)
            if not queue:
                self.queues.pop(model_id, None)
        for model_id in [m for m, q in self.queues.items() if not q]:
            self.queues.pop(model_id, None)
        return [g for g in (grad, nograd) if g] + sorted(singles, key=lambda g: g[0].request_id)

    def _advance(self, model_id: str, seq: int) -> None:
        if seq > 0:
            self.last_seq[model_id] = max(self.last_seq.get(model_id, 0), seq)

    # ---------------------------------------------------------------------------- execution

    def _execute(self, rounds: list[list[Job]]) -> None:
        for group in rounds:
            try:
                self._execute_group(group)
            except Exception:  # never kill the thread: the group's jobs get an error, the others run
                log.exception("a scheduler round failed")
                for job in group:
                    self._fail(job, "internal error in the LoRA engine (see server log)", "Server")

    def _execute_group(self, group: list[Job]) -> None:
        if group[0].kind == "forward_backward":
            self._forward_backward(group)
            return
        job = group[0]
        try:
            result = self.handlers[job.kind](job)
        except (JobError, ValueError) as err:
            self._fail(job, str(err))
            return
        self.results.finish_json(job.request_id, result)

    def _fail(self, job: Job, message: str, category: str = "User") -> None:
        """The job's future fails; a model it was creating fails too (else it would hold its
        adapter slot, 'pending', for ever). A finished future or a live model is left as it is."""
        if self.store.future(job.request_id).status != PENDING:
            return
        self.results.finish_error(job.request_id, message, category)
        if job.kind in ("create_model", "load_weights") and job.seq_id == 0:
            self.store.set_model_state(job.model_id, "failed")

    def _forward_backward(self, jobs: list[Job]) -> None:
        # lazy: lora_engine imports torch; the service is imported without it (HTTP side, fake-engine tests)
        from backends.tinker.lora_engine import DatumIn, EngineError, WorkItem

        runnable, items = [], []
        for job in jobs:
            fb: ForwardBackward = job.body
            if fb.model_id not in self.engine.adapters:
                self.results.finish_error(job.request_id, f"model {fb.model_id} is not loaded")
                continue
            datums = [
                DatumIn(
                    d.tokens,
                    d.inputs["target_tokens"].tolist(),
                    {k: v for k, v in d.inputs.items() if k != "target_tokens"},
                )
                for d in fb.data
            ]
            config = {k: v for k, v in fb.config.items()}
            runnable.append(job)
            items.append(WorkItem(fb.model_id, datums, fb.loss_fn, config))
        if not items:
            return
        self.batch_sizes.append(len({i.model_id for i in items}))
        try:
            results = self.engine.run(items, with_grad=not jobs[0].body.forward_only)
        except EngineError as err:
            for job in runnable:
                self.results.finish_error(job.request_id, str(err))
            return
        for job, res in zip(runnable, results):
            out = encode_forward_backward_output(
                {"logprobs": res.logprobs, "elementwise_loss": res.elementwise_loss},
                len(res.logprobs),
                {"loss:sum": res.loss_sum},
            )
            self.results.finish(job.request_id, out, "proto")
            self.store.touch_model(job.model_id)

    def _create_model(self, job: Job) -> dict:
        # lazy: lora_engine imports torch; the service is imported without it (HTTP side, fake-engine tests)
        from backends.tinker.lora_engine import LoraEngine

        req: P.CreateModelRequest = job.body
        lora = req.lora_config
        modules = LoraEngine.modules_for(lora.train_attn, lora.train_mlp, lora.train_unembed)
        self.engine.create_adapter(job.model_id, lora.rank, modules, lora.seed)
        self.store.set_model_state(job.model_id, "live")
        return {"model_id": job.model_id, "type": "create_model"}

    def _optim_step(self, job: Job) -> dict:
        req: P.OptimStepRequest = job.body
        adam = req.adam_params or P.AdamParams()
        metrics = self.engine.optim_step(
            job.model_id, adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm
        )
        self.store.touch_model(job.model_id)
        return {"metrics": metrics, "type": "optim_step"}

    def _save(self, job: Job, kind: str, name: str) -> str:
        model = self.store.model(job.model_id)
        run_id = model["run_id"]
        directory = self.checkpoints.directory(run_id, kind, name)
        existing = self.store.checkpoint(run_id, kind, name)
        overwrite = getattr(job.body, "overwrite", False)
        if existing is not None and not overwrite:
            raise JobError(f"checkpoint tinker://{run_id}/{kind}/{name} exists (pass overwrite=True to replace it)")
        # Published whole (a SIGKILL mid-save leaves the previous checkpoint, never half of one).
        with atomic_dir(directory) as tmp:
            self.engine.save(job.model_id, tmp, with_optimizer=(kind == "weights"))
        size = sum(f.stat().st_size for f in directory.iterdir() if f.is_file())
        self.store.add_checkpoint(run_id, kind, name, job.owner, str(directory), size, kind == "weights")
        self.store.touch_model(job.model_id)
        return P.tinker_path(run_id, kind, name)

    def _save_weights(self, job: Job) -> dict:
        return {"path": self._save(job, "weights", job.body.path), "type": "save_weights"}

    def _save_weights_for_sampler(self, job: Job) -> dict:
        req: P.SaveWeightsForSamplerRequest = job.body
        if req.path is not None:
            return {"path": self._save(job, "sampler_weights", req.path), "type": "save_weights_for_sampler"}
        # ephemeral: a sampler checkpoint named after the step, and a sampling session on it
        name = f"ephemeral-{req.seq_id}-{req.sampling_session_seq_id}"
        path = self._save(job, "sampler_weights", name)
        model = self.store.model(job.model_id)
        sampler_id = f"{model['session_id']}:sample:{req.sampling_session_seq_id}"
        self.store.add_sampler(sampler_id, job.owner, model["session_id"], model["base_model"], path)
        return {"path": path, "sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

    def _unload(self, job: Job) -> dict:
        self.engine.drop_adapter(job.model_id)
        self.store.set_model_state(job.model_id, "unloaded")
        with self.cond:  # an unloaded model takes no more requests: its place in the order goes too
            self.last_seq.pop(job.model_id, None)
        return {"model_id": job.model_id, "type": "unload_model"}

    def _load_weights(self, job: Job) -> dict:
        req: P.LoadWeightsRequest = job.body
        directory = self.checkpoints.resolve(job.owner, req.path)
        self.engine.load(job.model_id, directory, with_optimizer=req.optimizer)
        self.store.set_model_state(job.model_id, "live")
        return {"path": req.path, "model_id": job.model_id, "type": "load_weights"}


class TinkerService:
    def __init__(self, config: ServerConfig, engine_factory: Callable[[], Any] | None = None):
        self.config = config
        self.storage = Path(config.storage_dir)
        self.storage.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.storage / "tinker.sqlite")
        lost = self.store.mark_live_models_lost()
        dropped = self.store.fail_all_pending("the server restarted before this request ran; submit it again")
        if lost or dropped:
            log.warning("restart: %d models lost their in-memory adapters, %d pending requests failed", lost, dropped)
        self.notifier = Notifier()
        self.results = Results(self.store, self.notifier)
        self.checkpoints = Checkpoints(self.storage, self.store)
        self.scheduler = JobScheduler(
            config, self.store, self.results, self.checkpoints, engine_factory or self._default_engine
        )
        self.sampler = None

    @property
    def vocab_size(self) -> int | None:
        return self.scheduler.vocab_size

    def _default_engine(self):
        # lazy: lora_engine imports torch; the service is imported without it (HTTP side, fake-engine tests)
        from backends.tinker.lora_engine import LoraEngine

        return LoraEngine(
            self.config.model_dir,
            self.config.max_lora_rank,
            self.config.max_live_adapters,
            self.config.max_batch_tokens,
        )

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.scheduler.join(timeout=10)
        self.store.close()
