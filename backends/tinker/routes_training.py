"""Training routes: create/load/unload a LoRA model, forward_backward, optim_step, saves, get_info.

Each validates what it can up front (so a bad request is a 4xx now rather than a failed future
later) and queues a job for the trainer thread; the client polls the returned future.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request

from backends.tinker import protocol as P
from backends.tinker.losses import LossInputError, check_loss
from backends.tinker.routes_common import (
    UNLOAD_SEQ,
    ApiContext,
    Ctx,
    HttpError,
    check_adamw,
    checkpoint_errors,
    future_response,
)
from backends.tinker.wire import (
    PROTO_CONTENT_TYPE,
    WireError,
    decode_forward_backward,
    decompress,
)

router = APIRouter()


def _check_lora_config(ctx: ApiContext, req: P.CreateModelRequest) -> None:
    lora = req.lora_config
    if lora is None:
        raise HttpError(400, "lora_config is required: this server trains LoRA adapters only (no full fine-tuning)")
    if lora.rank > ctx.cfg.max_lora_rank:
        raise HttpError(400, f"lora_config.rank {lora.rank} is above this server's maximum {ctx.cfg.max_lora_rank}")
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise HttpError(400, "lora_config trains nothing: set one of train_attn, train_mlp, train_unembed")


@router.post("/api/v1/create_model")
async def create_model(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.CreateModelRequest)
    ctx.own_session(who, req.session_id)
    ctx.check_base(req.base_model)
    _check_lora_config(ctx, req)
    if req.optimizer_config is not None:
        check_adamw(req.optimizer_config.type)
    model_id = P.model_id_for(req.session_id, req.model_seq_id)
    if ctx.store.model(model_id) is None:  # a retried create_model reuses the model
        config = {"lora_config": req.lora_config.model_dump()}
        ctx.add_pending_model(who, model_id, req.session_id, req.lora_config.rank, config, req.user_metadata)
    rid = ctx.submit_model_job(who, "create_model", model_id, 0, req)
    return future_response(rid, model_id=model_id)


@router.post("/api/v1/get_info")
async def get_info(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.ModelRequest)
    row = ctx.own_model(who, req.model_id, live=False)
    return {
        "type": "get_info",
        "model_id": req.model_id,
        "model_data": {"arch": ctx.arch, "model_name": ctx.cfg.base_model, "tokenizer_id": ctx.cfg.model_dir},
        "is_lora": True,
        "lora_rank": row["lora_rank"],
        "model_name": ctx.cfg.base_model,
    }


async def _decode_forward_backward(request: Request, ctx: ApiContext):
    ctype = request.headers.get("content-type", "").split(";")[0].strip()
    if ctype != PROTO_CONTENT_TYPE:
        raise HttpError(415, f"forward_backward takes a {PROTO_CONTENT_TYPE} body (tinker SDK >= 0.25), got {ctype!r}")
    body = await ctx.raw_body(request)
    cfg, encoding = ctx.cfg, request.headers.get("content-encoding")

    def decode():
        data = decompress(body, encoding, cfg.max_request_bytes)
        return decode_forward_backward(
            data, max_datums=cfg.max_datums_per_request, max_tokens=cfg.max_sequence_tokens, vocab_size=ctx.vocab_limit
        )

    try:
        # always in a worker thread: a small zstd body may expand to tinker.max_request_bytes
        return await asyncio.to_thread(decode)
    except WireError as err:
        raise HttpError(err.status, str(err)) from None


@router.post("/api/v1/forward_backward")
async def forward_backward(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    fb = await _decode_forward_backward(request, ctx)
    ctx.own_model(who, fb.model_id)
    for index, datum in enumerate(fb.data):
        try:
            check_loss(fb.loss_fn, fb.config, set(datum.inputs))
        except LossInputError as err:
            raise HttpError(400, f"datum {index}: {err}") from None
    rid = ctx.submit_model_job(who, "forward_backward", fb.model_id, fb.seq_id, fb)
    return future_response(rid, model_id=fb.model_id)


@router.post("/api/v1/optim_step")
async def optim_step(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.OptimStepRequest)
    ctx.own_model(who, req.model_id)
    if req.optimizer_params is not None:
        check_adamw(req.optimizer_params.get("type", "adamw"))
    if req.adam_params is None and req.optimizer_params is None:
        raise HttpError(400, "adam_params is required")
    rid = ctx.submit_model_job(who, "optim_step", req.model_id, req.seq_id, req)
    return future_response(rid, model_id=req.model_id)


@router.post("/api/v1/save_weights")
async def save_weights(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.SaveWeightsRequest)
    ctx.own_model(who, req.model_id)
    if req.path is None:
        raise HttpError(400, "path (the checkpoint name) is required")
    with checkpoint_errors():
        P.check_name(req.path)
    rid = ctx.submit_model_job(who, "save_weights", req.model_id, req.seq_id, req)
    return future_response(rid, model_id=req.model_id)


@router.post("/api/v1/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.SaveWeightsForSamplerRequest)
    ctx.own_model(who, req.model_id)
    if req.path is None and req.sampling_session_seq_id is None:
        raise HttpError(400, "give path (a named sampler checkpoint) or sampling_session_seq_id")
    if req.path is not None:
        with checkpoint_errors():
            P.check_name(req.path)
    rid = ctx.submit_model_job(who, "save_weights_for_sampler", req.model_id, req.seq_id, req)
    return future_response(rid, model_id=req.model_id)


def _check_load_request(ctx: ApiContext, who: str, req: P.LoadWeightsRequest) -> str:
    """The checkpoint's training run id, once the checkpoint and the request's options are valid."""
    with checkpoint_errors():
        run_id, kind, _ = P.parse_tinker_path(req.path)
        ctx.service.checkpoints.resolve(who, req.path)
    if req.optimizer and kind != "weights":
        raise HttpError(400, f"{req.path} is a sampler checkpoint: it has no optimizer state (use a save_state path)")
    if req.optimizer_config is not None:
        check_adamw(req.optimizer_config.type)
    ctx.check_base(req.base_model)
    return run_id


def _model_from_checkpoint(ctx: ApiContext, who: str, req: P.LoadWeightsRequest, run_id: str) -> str:
    """create-via-load: a new model (in ``req``'s session) that takes the checkpoint's LoRA config."""
    if req.model_seq_id is None:
        raise HttpError(400, "model_seq_id is required with session_id")
    ctx.own_session(who, req.session_id)
    model_id = P.model_id_for(req.session_id, req.model_seq_id)
    if ctx.store.model(model_id) is None:
        source = ctx.store.model_by_run(run_id)
        rank = int(source["lora_rank"]) if source is not None else 0
        config = json.loads(source["config"]) if source is not None else {}
        config["loaded_from"] = req.path
        ctx.add_pending_model(who, model_id, req.session_id, rank, config, req.user_metadata)
    return model_id


@router.post("/api/v1/load_weights")
async def load_weights(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.LoadWeightsRequest)
    run_id = _check_load_request(ctx, who, req)
    if req.session_id is not None:
        model_id, seq_id = _model_from_checkpoint(ctx, who, req, run_id), 0
    elif req.model_id is None or req.seq_id is None:
        raise HttpError(400, "load_weights needs model_id and seq_id, or session_id and model_seq_id")
    else:
        ctx.own_model(who, req.model_id)
        model_id, seq_id = req.model_id, req.seq_id
    rid = ctx.submit_model_job(who, "load_weights", model_id, seq_id, req)
    return future_response(rid, model_id=model_id)


@router.post("/api/v1/unload_model")
async def unload_model(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.ModelRequest)
    ctx.own_model(who, req.model_id)
    rid = ctx.submit_model_job(who, "unload", req.model_id, UNLOAD_SEQ, None)
    return future_response(rid, model_id=req.model_id)
