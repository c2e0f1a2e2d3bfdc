"""The FastAPI app of the Tinker API (what SDK 0.38 calls): routes, error answers, background tasks.

Every route but ``/api/v1/healthz`` needs ``X-API-Key`` with one of the configured keys; the key
is the client's identity (``owner``), and a client only ever sees its own sessions, models,
samplers, checkpoints and futures (others' are answered 404, as if absent). Malformed, oversized
or out-of-range bodies get a 4xx whose message names the problem; features this server does not
implement are refused the same way, by name.

The routes live in ``routes_*.py`` by concern, and share ``routes_common.ApiContext``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.tinker import (
    routes_checkpoints,
    routes_futures,
    routes_sampling,
    routes_session,
    routes_training,
    routes_unsupported,
)
from backends.tinker.routes_common import UNLOAD_SEQ, ApiContext, HttpError
from backends.tinker.sampling import Sampler
from backends.tinker.service import TinkerService

__all__ = ["UNLOAD_SEQ", "HttpError", "create_app"]

log = logging.getLogger(__name__)
ROUTERS = (routes_session, routes_training, routes_unsupported, routes_sampling, routes_futures, routes_checkpoints)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    """Binds the service to the server's event loop, opens the sampler and runs the session reaper."""
    ctx: ApiContext = app.state.api
    service, cfg = ctx.service, ctx.cfg
    service.notifier.loop = asyncio.get_running_loop()
    if cfg.sample_url and service.sampler is None:
        service.sampler = Sampler(cfg.sample_url, cfg.engine_urls)
    reaper = asyncio.get_running_loop().create_task(routes_session.reap_sessions(ctx))
    try:
        yield
    finally:
        reaper.cancel()
        if service.sampler is not None:
            await service.sampler.aclose()
            service.sampler = None


def _error(status: int, message: str, headers=None) -> JSONResponse:
    return JSONResponse({"detail": message, "error": message}, status_code=status, headers=headers)


async def _http_error(request: Request, err: HttpError):
    return _error(err.status, err.message)


async def _invalid_query(request: Request, err: RequestValidationError):
    """A path or query parameter of the wrong type: a 400 naming it, in the shape of every other
    error (FastAPI's own answer is a 422 whose detail is a list)."""
    first = err.errors()[0] if err.errors() else {}
    where = ".".join(str(x) for x in first.get("loc", ())) or "request"
    return _error(400, f"{where}: {first.get('msg', 'invalid')} ({len(err.errors())} problem(s))")


async def _no_route(request: Request, err: StarletteHTTPException):
    """Starlette's bare "Not Found" / "Method Not Allowed", saying which route was asked for."""
    path = request.url.path
    if err.status_code == 404:
        message = f"no route {path} (this server speaks the tinker API under /api/v1)"
    elif err.status_code == 405:
        message = f"{request.method} is not allowed on {path} (allowed: {err.headers.get('Allow', '?')})"
    else:
        message = str(err.detail)
    return _error(err.status_code, message, err.headers)


async def _internal_error(request: Request, err: Exception):
    log.exception("internal error on %s", request.url.path)
    return JSONResponse({"detail": f"internal error: {type(err).__name__}"}, status_code=500)


def create_app(service: TinkerService) -> FastAPI:
    # No redirect of a trailing slash (FastAPI's 307 to the path without it): the SDK never sends
    # one, and a 307 to an id with its slash cut off ("tinker://" -> "tinker:/") answered nothing;
    # such a path is an unknown route, a 404 that names it.
    app = FastAPI(
        title="skyrl tinker",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=_lifespan,
        redirect_slashes=False,
    )
    app.state.service = service
    app.state.api = ApiContext(service)
    app.add_exception_handler(HttpError, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid_query)
    app.add_exception_handler(StarletteHTTPException, _no_route)
    app.add_exception_handler(Exception, _internal_error)
    for module in ROUTERS:
        app.include_router(module.router)
    return app
