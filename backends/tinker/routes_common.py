"""What every Tinker API route shares: the error type, authentication, body parsing, ownership.

Route handlers are module-level functions on an ``APIRouter`` per concern (``routes_*.py``);
they take the ``ApiContext`` through the ``Ctx`` dependency, which ``create_app`` puts on
``app.state.api``. Each handler starts with ``ctx.owner(request)`` itself (not a dependency) so
that FastAPI still checks query parameters before authentication, as the SDK expects.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from backends.tinker import protocol as P
from backends.tinker.service import Job, JobError, TinkerService

UNLOAD_SEQ = 2**62  # after every request of the model
NO_VOCAB_LIMIT = 2**31 - 1  # before the trainer has loaded the tokenizer
# A body at least this big is decoded in a worker thread: decoding a 64 MiB body takes about 0.7 s,
# and on the event loop that would stall every other client's requests and long-polls meanwhile.
OFF_LOOP_BYTES = 256 * 1024


async def off_the_loop(body: bytes, decode):
    """``decode()``, in a worker thread when ``body`` is big enough to stall the event loop."""
    if len(body) < OFF_LOOP_BYTES:
        return decode()
    return await asyncio.to_thread(decode)


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat()


def refuse_if(problem: str | None) -> None:
    """Helpers of ``protocol`` describe a problem (or None) rather than raise; this answers it."""
    if problem:
        raise HttpError(400, problem)


def check_adamw(optimizer_type: str) -> None:
    if optimizer_type != "adamw":
        raise HttpError(400, f"optimizer {optimizer_type!r} is not supported (adamw only)")


@contextlib.contextmanager
def checkpoint_errors():
    """A malformed ``tinker://`` path is the client's mistake (400); an absent checkpoint is 404."""
    try:
        yield
    except P.ProtocolError as err:
        raise HttpError(400, str(err)) from None
    except JobError as err:
        raise HttpError(404, str(err)) from None


def _model_arch(model_dir: str) -> str | None:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


_UNAVAILABLE = {
    "lost": "its in-memory state was lost when the server restarted; create a client from a saved checkpoint",
    "unloaded": "its session finished (or sent no heartbeat for tinker's session timeout)",
    "failed": "its creation failed",
}


class ApiContext:
    """The service behind the routes, and the checks more than one route makes."""

    def __init__(self, service: TinkerService):
        self.service = service
        self.cfg = service.config
        self.store = service.store
        self.arch = _model_arch(self.cfg.model_dir)
        self.background: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references

    def spawn(self, coro) -> asyncio.Task:
        """Run ``coro`` in the background, referenced until it finishes (an unreferenced task may be
        garbage-collected mid-way, and its future would then never finish)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    @property
    def vocab_limit(self) -> int:
        return self.service.vocab_size or NO_VOCAB_LIMIT

    # ---------------------------------------------------------------------- request

    def owner(self, request: Request) -> str:
        key = request.headers.get("x-api-key", "")
        if not key or not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.cfg.api_keys):
            raise HttpError(401, "invalid or missing API key (X-API-Key)")
        return P.owner_of(key)

    async def raw_body(self, request: Request) -> bytes:
        limit = self.cfg.max_request_bytes
        too_big = HttpError(413, f"request body over the limit of {limit} bytes (tinker.max_request_bytes)")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        parts, size = [], 0
        async for chunk in request.stream():  # a chunked body without a length is cut off at the limit
            size += len(chunk)
            if size > limit:
                raise too_big
            parts.append(chunk)
        return b"".join(parts)

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        body = await self.raw_body(request)
        return await off_the_loop(body, lambda: self._parse(body, model))

    @staticmethod
    def _parse(body: bytes, model: type[BaseModel]) -> Any:
        try:
            data = json.loads(body or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise HttpError(400, f"body is not valid JSON: {err}") from None
        except RecursionError:  # not a JSONDecodeError: "[[[[..." a few thousand deep
            raise HttpError(400, "body is not valid JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise HttpError(400, "body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ())) or "body"
            raise HttpError(400, f"{where}: {first.get('msg')} ({err.error_count()} problem(s))") from None

    # ---------------------------------------------------- ownership (others' rows are 404)

    def own_session(self, who: str, session_id: str):
        row = self.store.session(session_id)
        if row is None or row["owner"] != who:
            raise HttpError(404, f"session {session_id} not found")
        return row

    def own_model(self, who: str, model_id: str, live: bool = True):
        row = self.store.model(model_id)
        if row is None or row["owner"] != who:
            raise HttpError(404, f"model {model_id} not found")
        if live and row["state"] not in ("pending", "live"):
            why = _UNAVAILABLE.get(row["state"], row["state"])
            raise HttpError(400, f"model {model_id} is not available: {why}")
        return row

    def own_sampler(self, who: str, sampler_id: str):
        row = self.store.sampler(sampler_id)
        if row is None or row["owner"] != who:
            raise HttpError(404, f"sampler {sampler_id} not found")
        return row

    def own_run(self, who: str, run_id: str):
        row = self.store.model_by_run(run_id)
        if row is None or row["owner"] != who:
            raise HttpError(404, f"training run {run_id} not found")
        return row

    def own_checkpoint(self, who: str, run_id: str, kind: str, name: str, shown_as: str):
        row = self.store.checkpoint(run_id, kind, name)
        if row is None or row["owner"] != who:
            raise HttpError(404, f"checkpoint {shown_as} not found")
        return row

    # ----------------------------------------------------------------------- models, jobs

    def check_base(self, name: str | None) -> None:
        if name is not None and not self.cfg.accepts_base(name):
            raise HttpError(400, f"base_model {name!r} is not served here (this server serves {self.cfg.base_model!r})")

    def add_pending_model(
        self, who: str, model_id: str, session_id: str, rank: int, config: dict, user_metadata
    ) -> None:
        """Registers a new model in a free adapter slot; the trainer makes it live."""
        if self.store.live_model_count() >= self.cfg.max_live_adapters:
            raise HttpError(
                400, f"all {self.cfg.max_live_adapters} adapter slots are in use (tinker.max_live_adapters)"
            )
        self.store.add_model(
            model_id, P.run_id_for(model_id), who, session_id, self.cfg.base_model, rank, config, user_metadata
        )
        self.store.set_model_state(model_id, "pending")

    def submit_model_job(self, who: str, kind: str, model_id: str, seq_id: int, body) -> int:
        """The future of a model request; a repeated (model, seq_id) gets the first one's future."""
        if self.service.scheduler.failed is not None:
            raise HttpError(503, f"the trainer failed to start: {self.service.scheduler.failed}")
        rid, new = self.store.submit(who, kind, None, model_id=model_id, seq_id=seq_id, dedup=f"{model_id}#{seq_id}")
        if new:
            self.service.scheduler.submit(Job(rid, kind, who, model_id, seq_id, body))
        return rid


def future_response(rid: int, **extra) -> dict:
    return {"request_id": str(rid), **extra}


def api_context(request: Request) -> ApiContext:
    return request.app.state.api


Ctx = Annotated[ApiContext, Depends(api_context)]
