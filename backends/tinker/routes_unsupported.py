"""Endpoints of the protocol this server does not implement: refused by name (400), not a bare 404,
so that a client sees which feature it asked for (after authentication, like every other route)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from backends.tinker.routes_common import Ctx, HttpError

router = APIRouter()

NOT_SUPPORTED = {
    "/api/v1/copy_weights": "copy_weights",
    "/api/v1/create_custom_loss": "server-side custom losses (create_custom_loss)",
    "/api/v1/retrieve_futures": "retrieve_futures (session completion queues)",
    "/api/v1/join_sampling_session": "join_sampling_session",
    "/api/v1/cancel_future": "cancel_future",
    "/api/v1/auth/token": "JWT auth (auth/token)",
    "/api/v1/training_runs/{run_id}/publish": "publishing checkpoints",
    "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish": "publishing checkpoints",
    "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl": "checkpoint TTLs",
    "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls": "external weight URLs",
}

# Refusals that point to what to use instead (POST only, as the SDK sends them).
USE_INSTEAD = {
    "/api/v1/forward": "/api/v1/forward (JSON) is not served: use forward_backward with forward_only (tinker SDK >= 0.25)",
    "/api/v1/save_weights_external": "save_weights_external is not supported; use save_weights_for_sampler (PEFT directories under the server's storage)",
}


def _refusal(message: str):
    async def refuse(request: Request, ctx: Ctx):
        ctx.owner(request)
        raise HttpError(400, message)

    return refuse


for _path, _message in USE_INSTEAD.items():
    router.add_api_route(_path, _refusal(_message), methods=["POST"])
for _path, _what in NOT_SUPPORTED.items():
    router.add_api_route(
        _path,
        _refusal(f"{_what} is not supported by this server"),
        methods=["GET", "POST", "PUT", "DELETE"],
        include_in_schema=False,
    )
