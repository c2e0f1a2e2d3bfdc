"""Sampling routes: sampling sessions and ``asample``, which runs on the vLLM engines as a task.

``asample`` also serves prompt logprobs (``compute_logprobs``: ``max_tokens=1`` and
``prompt_logprobs``), their top k (``topk_prompt_logprobs``) and ``prompt_logprobs_last_n``, from a
sampler checkpoint or from the base model itself (a teacher for on-policy distillation).

``backends.tinker.sampling`` is imported where it is used: a server without inference engines
never needs it (nor its HTTP client).
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from backends.tinker import protocol as P
from backends.tinker.routes_common import (
    ApiContext,
    Ctx,
    HttpError,
    checkpoint_errors,
    future_response,
    refuse_if,
)
from backends.tinker.sampling import SampleJob, SamplingError, adapter_name
from backends.tinker.wire import encode_sample_result

log = logging.getLogger(__name__)
router = APIRouter()


@router.post("/api/v1/create_sampling_session")
async def create_sampling_session(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.CreateSamplingSessionRequest)
    ctx.own_session(who, req.session_id)
    if (req.base_model is None) == (req.model_path is None):
        raise HttpError(400, "give exactly one of base_model and model_path")
    ctx.check_base(req.base_model)
    if req.model_path is not None:
        with checkpoint_errors():
            ctx.service.checkpoints.resolve(who, req.model_path)
    sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
    if ctx.store.sampler(sampler_id) is None:
        ctx.store.add_sampler(sampler_id, who, req.session_id, ctx.cfg.base_model, req.model_path)
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/api/v1/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request, ctx: Ctx):
    who = ctx.owner(request)
    row = ctx.own_sampler(who, sampler_id)
    return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": row["model_path"]}


def _sampling_target(ctx: ApiContext, who: str, req: P.SampleRequest) -> tuple[str | None, str | None]:
    """(the sampler checkpoint's path or None for the base model, the dedup key of the request)."""
    if req.sampling_session_id is not None:
        row = ctx.own_sampler(who, req.sampling_session_id)
        dedup = f"{req.sampling_session_id}#{req.seq_id}" if req.seq_id is not None else None
        return row["model_path"], dedup
    if req.model_path is None:
        ctx.check_base(req.base_model)
        if req.base_model is None:
            raise HttpError(400, "give sampling_session_id, model_path or base_model")
    return req.model_path, None


def _engine_model(ctx: ApiContext, who: str, model_path: str | None) -> tuple[str | None, str]:
    """(the adapter directory or None, the model name the engines know it by)."""
    if model_path is None:
        return None, ctx.cfg.served_base_name

    with checkpoint_errors():
        row = ctx.service.checkpoints.row(who, model_path)
    # the save time in the name: a checkpoint saved again (overwrite) is a new vLLM adapter
    return row["dir"], adapter_name(row["run_id"], row["kind"], row["name"], row["created"])


def _prompt_and_max_tokens(ctx: ApiContext, req: P.SampleRequest) -> tuple[list[int], int]:
    prompt = [token for chunk in req.prompt.chunks for token in (chunk.tokens or [])]
    if not prompt:
        raise HttpError(400, "prompt: empty prompt (no tokens)")
    vocab = ctx.vocab_limit
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise HttpError(400, f"prompt token ids must be in 0..{vocab - 1}")
    limit = ctx.cfg.max_sequence_tokens
    room = limit - len(prompt)
    max_tokens = req.sampling_params.max_tokens if req.sampling_params.max_tokens is not None else room
    if max_tokens > room or room < 1:
        raise HttpError(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) is over the limit of {limit}")
    if req.num_samples > ctx.cfg.max_samples_per_request:
        raise HttpError(400, f"num_samples {req.num_samples} is over the limit of {ctx.cfg.max_samples_per_request}")
    refuse_if(P.prompt_scoring_problem(req, len(prompt), vocab))
    return prompt, max_tokens


@router.post("/api/v1/asample")
async def asample(request: Request, ctx: Ctx):
    who = ctx.owner(request)
    req = await ctx.parse(request, P.SampleRequest)
    if ctx.service.sampler is None:
        raise HttpError(400, "sampling is not available: this server was started without inference engines")
    refuse_if(P.unsupported_sampling(req))
    model_path, dedup = _sampling_target(ctx, who, req)
    adapter_dir, model_name = _engine_model(ctx, who, model_path)
    prompt, max_tokens = _prompt_and_max_tokens(ctx, req)

    sp = req.sampling_params
    job = SampleJob(
        model_name,
        adapter_dir,
        prompt,
        req.num_samples,
        max_tokens,
        sp.temperature,
        sp.top_p,
        sp.top_k,
        sp.seed,
        sp.stop,
        bool(req.prompt_logprobs),
        req.topk_prompt_logprobs,
        req.prompt_logprobs_last_n,
    )
    rid, new = ctx.store.submit(who, "sample", None, dedup=dedup)
    if new:
        ctx.spawn(_run_sample(ctx, rid, job))
    return future_response(rid, sample_sequence_ids=[f"{rid}-{i}" for i in range(req.num_samples)])


async def _run_sample(ctx: ApiContext, rid: int, job) -> None:
    service = ctx.service
    try:
        sequences, prompt_scores = await service.sampler.sample(job)
        service.results.finish(rid, encode_sample_result(sequences, prompt_scores), "proto")
    except SamplingError as err:
        service.results.finish_error(rid, f"sampling failed: {err}", "Server")
    except Exception as err:
        log.exception("sampling failed")
        service.results.finish_error(rid, f"sampling failed: {type(err).__name__}", "Server")
