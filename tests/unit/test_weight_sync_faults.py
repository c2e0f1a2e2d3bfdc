"""The weight sync's handling of engines that fail mid-update, against a mock transport: an engine
that went away (refused, reset, cut off) is "unreachable" (the recovery loop updates it when it is
back, and the run waits for it), any other failure is an error that names what happened."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from backends.inference.weight_sync import NoEngineReachable, WeightSyncError, sync_weights

URLS = ["http://e0:1", "http://e1:1"]


def client(fail: dict[str, Exception | int]) -> httpx.AsyncClient:
    """Engines that answer 200 to everything but the (host, path) pairs in ``fail``."""

    def handler(request: httpx.Request) -> httpx.Response:
        what = fail.get(f"{request.url.host}{request.url.path}")
        if isinstance(what, Exception):
            raise what
        if isinstance(what, int):
            return httpx.Response(what, text="engine error")
        return httpx.Response(200, json={})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def sync(fail):
    async def go():
        async with client(fail) as http:
            return await sync_weights(URLS, "/w", 3, http=http)

    return asyncio.run(go())


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused"),
        httpx.ReadError(""),
        httpx.WriteError("broken pipe"),
        httpx.RemoteProtocolError(""),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_engine_that_went_away_mid_update_is_unreachable_not_an_error(error):
    # A SIGKILLed engine resets the connection of the update in flight (ReadError): the run used to
    # fail on it while the recovery loop was already restarting the engine.
    result = sync({"e1/collective_rpc": error})
    assert list(result.unreachable) == ["http://e1:1"] and list(result.synced) == ["http://e0:1"]
    with pytest.raises(NoEngineReachable):
        sync({"e0/collective_rpc": error, "e1/collective_rpc": error})


def test_an_engine_that_answers_with_an_error_fails_the_sync_with_its_answer():
    with pytest.raises(WeightSyncError, match="HTTP 500: engine error"):
        sync({"e1/collective_rpc": 500})
