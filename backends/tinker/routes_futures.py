"""``retrieve_future``: a long-poll on one request's future, answered in JSON or protobuf."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from backends.tinker import protocol as P
from backends.tinker.routes_common import ApiContext, Ctx, HttpError
from backends.tinker.store import DONE, FAILED, PENDING
from backends.tinker.wire import PROTO_CONTENT_TYPE, proto_result_as_json

router = APIRouter()


async def _wait_for(ctx: ApiContext, rid: int, fut):
    """The future once finished, or None when it is still pending after ``tinker.long_poll_s``."""
    if fut.status != PENDING:
        return fut
    # the event first, then a second look: a future finished in between is not waited for
    event = ctx.service.notifier.event(rid)
    fut = ctx.store.future(rid)
    if fut.status != PENDING:
        ctx.service.notifier.forget(rid)  # its wake-up may have come before the event was made
        return fut
    try:
        await asyncio.wait_for(event.wait(), ctx.cfg.long_poll_s)
    except TimeoutError:
        return None
    return ctx.store.future(rid)


def _request_id(text: str) -> int:
    """A future's number: ASCII digits only (``int`` also takes "1_0", " 1" and other scripts'
    digits, naming another future) and within SQLite's integers (beyond, the lookup overflows)."""
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**63:
        raise HttpError(400, f"malformed request_id {text!r} (the decimal number of a future)")
    return int(text)


@router.post("/api/v1/retrieve_future")
async def retrieve_future(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.RetrieveFutureRequest)
    rid = _request_id(req.request_id)
    fut = ctx.store.future(rid)
    if fut is None or fut.owner != who:
        raise HttpError(404, f"future {req.request_id} not found")
    fut = await _wait_for(ctx, rid, fut)
    if fut is None:
        return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
    if fut.status == FAILED or fut.result_type == "json":
        return Response(fut.result, media_type="application/json")
    assert fut.status == DONE
    if PROTO_CONTENT_TYPE in request.headers.get("accept", ""):
        return Response(fut.result, media_type=PROTO_CONTENT_TYPE)
    return JSONResponse(proto_result_as_json(fut.kind, fut.result))
