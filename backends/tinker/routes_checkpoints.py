"""Training runs and checkpoints: listing, details, deletion, ``weights_info``."""

from __future__ import annotations

import json
import shutil

from fastapi import APIRouter, Request

from backends.tinker import protocol as P
from backends.tinker.routes_common import (
    ApiContext,
    Ctx,
    HttpError,
    checkpoint_errors,
    iso,
)

router = APIRouter()
MAX_OFFSET = 2**62


def checkpoint_json(row) -> dict:
    kind = row["kind"]
    return {
        "checkpoint_id": f"{kind}/{row['name']}",
        "checkpoint_type": "training" if kind == "weights" else "sampler",
        "time": iso(row["created"]),
        "tinker_path": P.tinker_path(row["run_id"], kind, row["name"]),
        "size_bytes": row["size_bytes"],
        "public": False,
    }


def run_json(ctx: ApiContext, row) -> dict:
    ckpts = ctx.store.checkpoints(row["owner"], row["run_id"])
    last = [c for c in ckpts if c["kind"] == "weights"]
    last_s = [c for c in ckpts if c["kind"] == "sampler_weights"]
    meta = json.loads(row["user_metadata"] or "{}")
    return {
        "training_run_id": row["run_id"],
        "base_model": row["base_model"],
        "model_owner": row["owner"],
        "is_lora": True,
        "corrupted": row["state"] == "failed",
        "lora_rank": row["lora_rank"],
        "last_request_time": iso(row["last_request"]),
        "last_checkpoint": checkpoint_json(last[-1]) if last else None,
        "last_sampler_checkpoint": checkpoint_json(last_s[-1]) if last_s else None,
        "user_metadata": {str(k): str(v) for k, v in meta.items()} or None,
    }


@router.get("/api/v1/training_runs")
async def training_runs(request: Request, ctx: Ctx, limit: int = 20, offset: int = 0):
    who = ctx.owner(request)
    if not (1 <= limit <= 1000 and 0 <= offset <= MAX_OFFSET):  # beyond, SQLite's OFFSET overflows
        raise HttpError(400, f"limit must be in 1..1000 and offset in 0..{MAX_OFFSET}")
    rows = ctx.store.models(who, limit, offset)
    return {
        "training_runs": [run_json(ctx, r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": ctx.store.count_models(who)},
    }


@router.get("/api/v1/training_runs/{run_id}")
async def training_run(run_id: str, request: Request, ctx: Ctx):
    who = ctx.owner(request)
    return run_json(ctx, ctx.own_run(who, run_id))


@router.get("/api/v1/training_runs/{run_id}/checkpoints")
async def run_checkpoints(run_id: str, request: Request, ctx: Ctx):
    who = ctx.owner(request)
    ctx.own_run(who, run_id)
    return {"checkpoints": [checkpoint_json(c) for c in ctx.store.checkpoints(who, run_id)]}


@router.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request, ctx: Ctx):
    who = ctx.owner(request)
    path = P.tinker_path(run_id, kind, name)
    with checkpoint_errors():
        P.parse_tinker_path(path)  # the same checks as a path in a request body
    row = ctx.own_checkpoint(who, run_id, kind, name, shown_as=path)
    ctx.store.delete_checkpoint(run_id, kind, name)
    if ctx.service.checkpoints.inside(row["dir"]):  # never delete through a symlink out of storage
        shutil.rmtree(row["dir"], ignore_errors=True)
    return {"deleted": path}


@router.get("/api/v1/checkpoints")
async def all_checkpoints(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    return {"checkpoints": [checkpoint_json(c) for c in ctx.store.checkpoints(who)]}


@router.post("/api/v1/weights_info")
async def weights_info(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.TinkerPathRequest)
    with checkpoint_errors():
        run_id, kind, name = P.parse_tinker_path(req.tinker_path)
    ctx.own_checkpoint(who, run_id, kind, name, shown_as=req.tinker_path)
    run = ctx.store.model_by_run(run_id)
    return {"base_model": ctx.cfg.base_model, "is_lora": True, "lora_rank": run["lora_rank"] if run else None}
