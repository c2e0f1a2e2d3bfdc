"""Handshake (client config, capabilities, telemetry), sessions, heartbeats and the session reaper."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import APIRouter, Request

from backends.tinker import protocol as P
from backends.tinker.routes_common import UNLOAD_SEQ, ApiContext, Ctx, refuse_if

log = logging.getLogger(__name__)
router = APIRouter()

# What the SDK may use: no JWT, compressed forward_backward bodies, everything else the plain way.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "proto_compress_fwdbwd": True,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


@router.get("/api/v1/healthz")
async def healthz(ctx: Ctx):
    return {"status": "ok" if ctx.service.scheduler.failed is None else "trainer failed"}


@router.post("/api/v1/client/config")
async def client_config(request: Request, ctx: Ctx):
    ctx.owner(request)
    req = await ctx.parse(request, P.ClientConfigRequest)
    refuse_if(P.sdk_version_problem(req.sdk_version or request.headers.get("x-sdk-version")))
    return dict(CLIENT_CONFIG)


@router.post("/api/v1/client/dynamic_config")
async def dynamic_config(request: Request, ctx: Ctx):
    ctx.owner(request)
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/api/v1/get_server_capabilities")
async def capabilities(request: Request, ctx: Ctx):
    ctx.owner(request)
    cfg = ctx.cfg
    return {
        "supported_models": [
            {
                "model_name": cfg.base_model,
                "max_context_length": cfg.max_sequence_tokens,
                "trainable": True,
                "sampleable": cfg.sample_url is not None,
            }
        ]
    }


@router.post("/api/v1/telemetry")
async def telemetry(request: Request, ctx: Ctx):
    ctx.owner(request)
    await ctx.raw_body(request)  # read (and size-checked), not kept
    return {"status": "accepted"}


@router.post("/api/v1/create_session")
async def create_session(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.CreateSessionRequest)
    refuse_if(P.sdk_version_problem(req.sdk_version))
    session_id = uuid.uuid4().hex[:20]
    ctx.store.create_session(session_id, who, {"tags": req.tags, "user_metadata": req.user_metadata or {}})
    out = {"session_id": session_id, "type": "create_session"}
    if ctx.cfg.sample_url is None:
        out["warning_message"] = "this server has no inference engines: sampling is refused"
    return out


@router.post("/api/v1/session_heartbeat")
async def heartbeat(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.SessionRequest)
    ctx.own_session(who, req.session_id)
    ctx.store.heartbeat(req.session_id)
    return {"type": "session_heartbeat"}


@router.post("/api/v1/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.FinishSessionRequest)
    ctx.own_session(who, session_id)
    release_session(ctx, who, session_id, {"reason": req.reason, "detail": req.detail})
    return {"status": "finished"}


@router.get("/api/v1/sessions")
async def list_sessions(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    return {"sessions": [r["session_id"] for r in ctx.store.sessions(who)]}


@router.get("/api/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request, ctx: Ctx):
    who = ctx.owner(request)
    ctx.own_session(who, session_id)
    return {
        "training_run_ids": [P.run_id_for(m) for m in ctx.store.session_models(session_id)],
        "sampler_ids": ctx.store.session_samplers(session_id),
    }


def release_session(ctx: ApiContext, who: str, session_id: str, reason: dict) -> None:
    ctx.store.finish_session(session_id, reason)
    for model_id in ctx.store.session_models(session_id, live_only=True):
        # frees the adapter slot once the model's earlier requests have run
        ctx.submit_model_job(who, "unload", model_id, UNLOAD_SEQ, None)


async def reap_sessions(ctx: ApiContext) -> None:
    """Sessions whose client stopped sending heartbeats end, and their adapters are freed."""
    timeout = ctx.cfg.session_timeout_s
    period = max(0.1, min(30.0, timeout / 2))
    while True:
        await asyncio.sleep(period)
        try:
            for row in ctx.store.stale_sessions(time.time() - timeout):
                log.info("session %s: no heartbeat for %.0f s; ending it", row["session_id"], timeout)
                release_session(ctx, row["owner"], row["session_id"], {"reason": {"type": "timeout"}})
        except Exception:
            log.exception("session reaper")
