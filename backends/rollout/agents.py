"""Black-box agents: an agent program trained through an OpenAI-compatible endpoint.

``rl.agent = "module:function"`` names an async function ``agent(row, endpoint)`` that solves one
dataset row its own way, with any number of chat-completion calls, and returns its reward (or
``(reward, info)``). ``endpoint`` is this trajectory's ``AgentEndpoint``: ``base_url`` and
``api_key`` for any OpenAI client, or ``endpoint.client()`` for a ready ``openai.AsyncOpenAI``::

    async def solve(row, endpoint):
        client = endpoint.client()
        reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        return float(answer == row["answer"])

The endpoint (``AgentServer``, one per orchestrator, on 127.0.0.1) serves ``/v1/chat/completions``
(messages, tools, tool_choice ``auto`` / ``none``, temperature, top_p, max_tokens, stop; not
streaming) and ``/v1/models``; with ``rl.max_turns`` set, a trajectory's calls past it get a 400
(unset: not capped). A call renders the messages with the model's chat template
(``tools=``), generates through the router under the trajectory's session id (sticky routing: all
its calls reach one engine and its prefix cache), parses tool calls with ``rl.tool_parser`` and
records the prompt tokens, the sampled tokens, their logprobs and weight versions. Each response
also carries ``prompt_token_ids`` and ``token_ids`` (as vLLM's ``return_token_ids`` does).

Training samples from the recorded calls (``samples_from_calls``): when a call's prompt extends
the previous call's context (its prompt and completion) token for token, as it does when an agent
appends to its conversation, the two are one sample and what lies between the model's turns (tool
results, user turns) is masked; when the agent rewrote its history (a summary, a dropped turn),
the call starts a new sample. Every sample carries the trajectory's reward; GRPO's group statistics
count each trajectory once (``backends.train.rl.step.batch_advantages``). The metric
``rollout/samples_per_trajectory`` says how often histories were rewritten.

A prompt is tokenized as the previous context's tokens plus the new text when its rendering starts
with the previous context's text, so tokens the engine sampled are never re-tokenized differently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import httpx
import uvicorn
from fastapi import (
    FastAPI,
    Request,  # at module level: FastAPI resolves the handler's annotations in these globals
)
from fastapi.responses import JSONResponse

from backends.data.chat import encode_text, render
from backends.rollout.rewards import CallOutcome, GuardedCaller, as_reward
from backends.rollout.session import RolloutSession
from skyrl_contracts.ports import find_free_ports

log = logging.getLogger("skyrl.agents")

API_KEY = "skyrl"  # the endpoint is local to the orchestrator; the key only satisfies clients that need one
IN_PROCESS = ("in-process", 0)  # the client address the shared in-process HTTP client's requests carry
# Trajectories whose agent called over HTTP (not endpoint.client()) before the run says once what
# that costs: a client built per trajectory made a 20-step run 8.75x slower than the plain path.
HTTP_TRAJECTORIES_BEFORE_HINT = 32


@dataclass(frozen=True)
class RecordedCall:
    """One call: its prompt, and the turn the engine sampled (the fields ``RolloutSession.add_turn`` reads)."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_versions: tuple[str, ...]
    finish_reason: str | None


def samples_from_calls(calls: Sequence[RecordedCall]) -> list[RolloutSession]:
    """The recorded calls of one trajectory as training samples (see the module docs), each kept as a
    ``RolloutSession``'s token records, as an environment episode's are."""
    samples: list[RolloutSession] = []
    for call in calls:
        current = samples[-1] if samples else None
        context = current.context_ids if current else None
        if context is not None and list(call.prompt_ids[: len(context)]) == context:
            current.add_observation(call.prompt_ids[len(context) :])
        else:
            samples.append(RolloutSession(None, call.prompt_ids, session_id=""))
        samples[-1].add_turn(call)
    return samples


# ------------------------------------------------------------------------------ one trajectory


class AgentTrajectory:
    """What one trajectory's calls share: the session id, the recorded calls, the last context, and
    its group's ``SharedFirstTurn`` (its place ``index`` in it), where its first call may go."""

    def __init__(self, session_id: str, temperature: float | None, first_turn=None, index: int = 0):
        self.session_id = session_id
        self.temperature = temperature  # set: every call samples at it (evaluation: 0, greedy)
        self.first_turn, self.index = first_turn, index
        self.over_http = False  # a call came over HTTP, not through endpoint.client()
        self.calls: list[RecordedCall] = []
        self.context_text = ""
        self.context_ids: list[int] = []
        self.lock = asyncio.Lock()  # calls of one trajectory run one after the other


class SharedHttpClient(httpx.AsyncClient):
    """The endpoint's in-process HTTP client (an ASGI transport: no socket, no HTTP server between
    the agent and the endpoint), shared by every trajectory. A trajectory that closes its client
    (``async with endpoint.client()``, ``await client.close()``) must not close everyone's, so
    closing is the server's alone (``close_shared``)."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def close_shared(self) -> None:
        await super().aclose()


@dataclass(frozen=True)
class AgentEndpoint:
    """The OpenAI-compatible endpoint of one trajectory, as the agent function receives it.
    ``http_client``: the endpoint's shared in-process ``httpx.AsyncClient``, for any client library
    that takes one (``endpoint.client()`` uses it); None where the endpoint is only reachable over
    HTTP."""

    base_url: str
    api_key: str = API_KEY
    model: str = "policy"  # any name is accepted; this one is what the endpoint reports
    http_client: httpx.AsyncClient | None = field(default=None, repr=False, compare=False)

    def client(self, **kwargs):
        """A ready ``openai.AsyncOpenAI`` for this trajectory (no client-side retries: the rollout
        client retries engine failures itself). It is built on the endpoint's shared in-process
        HTTP client: about 0.1 ms, where a new ``AsyncOpenAI`` of its own (a connection pool and
        an SSL context, even for an http URL) costs 20-40 ms of the orchestrator's CPU."""
        # lazy: openai (1.4 s); imported on an agent's first call, not at the orchestrator's start
        from openai import AsyncOpenAI

        kwargs.setdefault("http_client", self.http_client)
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, **kwargs)


class RequestError(ValueError):
    """A malformed chat request: answered with HTTP 400 naming the field."""


class AgentServer:
    """The chat-completions endpoint every trajectory's agent talks to (``/t/<session id>/v1``)."""

    def __init__(
        self,
        client,
        tokenizer,
        tool_parser,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        temperature: float = 1.0,
        max_calls: int | None = None,
    ):
        """``max_new_tokens`` caps a call's ``max_tokens`` (``rl.max_new_tokens``); ``temperature``
        is a call's when it names none (``rl.temperature``); ``max_calls``: calls per trajectory
        (``skyrl_contracts.episodes.turn_limit``; None: not capped)."""
        self.client, self.tokenizer, self.tool_parser = client, tokenizer, tool_parser
        self.max_new_tokens, self.stop_ids, self.temperature = max_new_tokens, list(stop_ids), temperature
        self.max_calls = max_calls
        self.trajectories: dict[str, AgentTrajectory] = {}
        self.port: int | None = None
        self.http_client: SharedHttpClient | None = None
        self.http_trajectories = 0  # trajectories whose agent called over HTTP
        self._server = None
        self._task: asyncio.Task | None = None

    # -------------------------------------------------------------- lifetime

    async def start(self) -> None:
        for noisy in ("httpx", "httpx2", "openai"):  # an agent's client logs every request at INFO
            logging.getLogger(noisy).setLevel(logging.WARNING)
        (self.port,) = find_free_ports(1)
        app = self.app()
        # endpoint.client() reaches the app in process; other clients over HTTP, through uvicorn
        self.http_client = SharedHttpClient(transport=httpx.ASGITransport(app=app, client=IN_PROCESS), timeout=None)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise RuntimeError("the agent endpoint stopped before it started")
            await asyncio.sleep(0.02)
        log.info("agent endpoint on http://127.0.0.1:%d", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
        if self.http_client is not None:
            await self.http_client.close_shared()

    def open(
        self, session_id: str, temperature: float | None = None, first_turn=None, index: int = 0
    ) -> tuple[AgentTrajectory, AgentEndpoint]:
        """A trajectory's endpoint. ``first_turn``: its group's ``SharedFirstTurn``, which samples the
        first calls of the group's trajectories together where they are the same request."""
        trajectory = AgentTrajectory(session_id, temperature, first_turn, index)
        self.trajectories[session_id] = trajectory
        return trajectory, AgentEndpoint(
            f"http://127.0.0.1:{self.port}/t/{session_id}/v1", http_client=self.http_client
        )

    async def close(self, session_id: str) -> None:
        if self.trajectories.pop(session_id, None) is not None:
            await self.client.finish_session(session_id)

    # -------------------------------------------------------------- HTTP

    def app(self):
        app = FastAPI(title="skyrl agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def error(status: int, message: str, kind: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)

        @app.get("/t/{session_id}/v1/models")
        async def models(session_id: str):
            return {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "skyrl"}]}

        @app.post("/t/{session_id}/v1/chat/completions")
        async def chat(session_id: str, request: Request):
            trajectory = self.trajectories.get(session_id)
            if trajectory is None:
                return error(
                    404, f"no trajectory {session_id!r} is running (it ended, or the URL is wrong)", "not_found"
                )
            if request.client is None or (request.client.host, request.client.port) != IN_PROCESS:
                self.note_call_over_http(trajectory)
            try:
                body = await request.json()
            except ValueError:
                return error(400, "the request body is not JSON", "invalid_request_error")
            try:
                chat_request = ChatRequest.parse(body)
            except RequestError as exc:
                return error(400, str(exc), "invalid_request_error")
            try:
                return await self.complete(trajectory, chat_request)
            except RequestError as exc:
                return error(400, str(exc), "invalid_request_error")
            except Exception as exc:  # noqa: BLE001 - an engine failure is the agent's error to see
                log.warning("trajectory %s: %s: %s", session_id, type(exc).__name__, exc)
                return error(502, f"generation failed: {type(exc).__name__}: {exc}", "server_error")

        return app

    def note_call_over_http(self, trajectory: AgentTrajectory) -> None:
        """Count trajectories whose agent reaches the endpoint over HTTP, and say once what that
        costs when many do: most likely the agent builds its own client per trajectory."""
        if trajectory.over_http:
            return
        trajectory.over_http = True
        self.http_trajectories += 1
        if self.http_trajectories == HTTP_TRAJECTORIES_BEFORE_HINT:
            log.warning(
                "%d trajectories' agents called the endpoint over HTTP: an openai client built per trajectory "
                "costs 20-40 ms of the orchestrator's CPU each (an SSL context, a connection pool), and each call "
                "goes through a socket and an HTTP server; use endpoint.client(), or pass endpoint.http_client "
                "to your client (docs/agents.md, 'Keep the agent cheap')",
                self.http_trajectories,
            )

    # -------------------------------------------------------------- one call

    async def complete(self, trajectory: AgentTrajectory, request: "ChatRequest") -> dict[str, Any]:
        if self.max_calls is not None and len(trajectory.calls) >= self.max_calls:
            raise RequestError(f"this trajectory made its {self.max_calls} calls (rl.max_turns)")
        if request.tools and request.tool_choice != "none" and self.tool_parser is None:
            raise RequestError("tools: the run has no tool parser for this model (set rl.tool_parser)")
        async with trajectory.lock:
            prompt_text, prompt_ids = self.encode(trajectory, request)
            room = self.room(len(prompt_ids), request.max_tokens)
            temperature = trajectory.temperature
            if temperature is None:
                temperature = self.temperature if request.temperature is None else request.temperature
            turn = await self.sample(trajectory, request, prompt_ids, room, temperature)
            token_ids, logprobs, finish = list(turn.token_ids), list(turn.logprobs), turn.finish_reason
            text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
            cut = stop_cut(self.tokenizer, token_ids, request.stop)
            if cut is not None:
                token_ids, logprobs, finish = token_ids[: cut[0]], logprobs[: cut[0]], "stop"
                text = cut[1]
            trajectory.calls.append(
                RecordedCall(tuple(prompt_ids), tuple(token_ids), tuple(logprobs), turn.weight_versions, finish)
            )
            trajectory.context_text = prompt_text + self.tokenizer.decode(token_ids, skip_special_tokens=False)
            trajectory.context_ids = prompt_ids + token_ids
        return self.response(request, prompt_ids, token_ids, text, finish)

    async def sample(self, trajectory: AgentTrajectory, request: "ChatRequest", prompt_ids, room: int, temperature):
        """The engine's turn for one call. A trajectory's first call joins its group's shared first
        turn (one ``n``-sample request for the group, as environment episodes' first turns) when it
        asks what the group samples: the run's length cap and temperature, no ``top_p``; any other
        call is a request of its own."""
        shared = trajectory.first_turn
        if shared is not None and not trajectory.calls and shared.accepts(trajectory.index):
            if (
                (request.max_tokens is None or request.max_tokens >= self.max_new_tokens)
                and temperature == shared.temperature
                and request.top_p == 1.0
            ):
                session = RolloutSession(self.client, prompt_ids, trajectory.session_id)
                turn = await shared.take(trajectory.index, session)
                if turn is not None:
                    return turn
            shared.skip(trajectory.index)  # the group does not wait for a call it cannot share
        (turn,) = await self.client.generate(
            prompt_ids, trajectory.session_id, room, temperature, top_p=request.top_p, stop_token_ids=self.stop_ids
        )
        return turn

    def encode(self, trajectory: AgentTrajectory, request: "ChatRequest") -> tuple[str, list[int]]:
        try:
            text = render(self.tokenizer, request.messages, add_generation_prompt=True, tools=request.tools)
        except Exception as exc:  # noqa: BLE001 - jinja errors on odd messages are the request's fault
            raise RequestError(f"messages: the chat template cannot render them ({type(exc).__name__}: {exc})")
        if trajectory.context_text and text.startswith(trajectory.context_text):
            return text, trajectory.context_ids + encode_text(self.tokenizer, text[len(trajectory.context_text) :])
        return text, encode_text(self.tokenizer, text)

    def room(self, prompt_len: int, max_tokens: int | None) -> int:
        room = min(max_tokens or self.max_new_tokens, self.max_new_tokens)
        if self.client.max_model_len is not None:
            room = min(room, self.client.max_model_len - prompt_len)
        if room <= 0:
            raise RequestError(
                f"messages: the prompt ({prompt_len} tokens) fills the engines' context "
                f"(inference.max_model_len = {self.client.max_model_len})"
            )
        return room

    def response(self, request, prompt_ids, token_ids, text: str, finish: str | None) -> dict[str, Any]:
        eos = self.tokenizer.eos_token or ""
        if eos and text.endswith(eos):
            text = text[: -len(eos)]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish_reason = "length" if finish == "length" else "stop"
        if request.tools and request.tool_choice != "none":
            parsed = self.tool_parser.parse(text)
            if parsed.calls:
                message["content"] = parsed.content or None
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": json.dumps(call.arguments or {})},
                    }
                    for call in parsed.calls
                ]
                finish_reason = "tool_calls"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason,
                    "logprobs": None,
                    "token_ids": list(token_ids),
                }
            ],
            "prompt_token_ids": list(prompt_ids),
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(token_ids),
                "total_tokens": len(prompt_ids) + len(token_ids),
            },
        }


def stop_cut(tokenizer, token_ids: Sequence[int], stops: Sequence[str]) -> tuple[int, str] | None:
    """(tokens kept, text before the stop string) at the first of ``stops`` in the decoded turn; the
    token that completes the stop string is kept (it was sampled), the text ends before it."""
    if not stops:
        return None
    for end in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:end], skip_special_tokens=False)
        hits = [text.find(s) for s in stops if s and s in text]
        if hits:
            return end, text[: min(hits)]
    return None


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str
    temperature: float | None  # None: the run's rl.temperature
    top_p: float
    max_tokens: int | None
    stop: tuple[str, ...]

    @classmethod
    def parse(cls, body: Any) -> "ChatRequest":
        """A request body checked field by field (a ``RequestError`` names the field at fault)."""
        if not isinstance(body, Mapping):
            raise RequestError("the request body must be a JSON object")
        if body.get("stream"):
            raise RequestError("stream: streaming is not supported by the agent endpoint; send stream = false")
        if body.get("n") not in (None, 1):
            raise RequestError("n: the agent endpoint samples one choice per call (n = 1)")
        return cls(
            model=str(body.get("model") or "policy"),
            messages=normalized_messages(body.get("messages")),
            tools=checked_tools(body.get("tools")),
            tool_choice=checked_tool_choice(body.get("tool_choice")),
            temperature=number(body, "temperature", None, 0.0, 2.0),
            top_p=number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
            max_tokens=max_tokens(body),
            stop=stops(body.get("stop")),
        )


def number(body: Mapping, key: str, default, low: float, high: float, open_low: bool = False):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{key}: must be a number, got {type(value).__name__}")
    if not (low < value <= high if open_low else low <= value <= high):
        raise RequestError(f"{key}: must be in {'(' if open_low else '['}{low:g}, {high:g}], got {value!r}")
    return float(value)


def max_tokens(body: Mapping) -> int | None:
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"max_tokens: must be a positive integer, got {value!r}")
    return value


def stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise RequestError("stop: must be a string or a list of strings")
    return tuple(values)


def checked_tool_choice(value: Any) -> str:
    if value is None or value in ("auto", "none"):
        return value or "auto"
    raise RequestError(
        f"tool_choice: {value!r} is not supported (the endpoint does not constrain decoding); use 'auto' or 'none'"
    )


def checked_tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError("tools: must be a list of {'type': 'function', 'function': {...}} objects")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
    return value or None


def normalized_messages(value: Any) -> list[dict[str, Any]]:
    """Messages as chat templates take them: content parts joined into text, tool-call arguments
    (JSON strings on the wire) as dicts."""
    if not isinstance(value, list) or not value:
        raise RequestError("messages: must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}]: must be an object with a string 'role'")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported")
            message["content"] = "".join(str(p.get("text", "")) for p in content)
        elif content is None:
            message["content"] = ""
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: must be a string, a list of text parts or null")
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [normalized_call(i, j, call) for j, call in enumerate(calls)]
        out.append(message)
    return out


def normalized_call(i: int, j: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise RequestError(f"messages[{i}].tool_calls[{j}]: must have function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise RequestError(f"messages[{i}].tool_calls[{j}].function.arguments: not JSON") from None
    return {**call, "function": {**function, "arguments": arguments}}


# ------------------------------------------------------------------------------ running agents


@dataclass
class AgentOutcome:
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


async def run_agent(agent, row: Mapping[str, Any], endpoint: AgentEndpoint, timeout_s: float) -> AgentOutcome:
    """One agent run under ``timeout_s``; an agent that raises, hangs or returns no number is an
    error outcome (reward 0), never an exception."""
    called = await GuardedCaller(timeout_s, timeout_key="rl.agent_timeout_s").acall(agent, dict(row), endpoint)
    if called.error:
        return AgentOutcome(error=f"agent: {called.error}")
    value = called.value
    info: dict[str, Any] = {}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
        value, info = value[0], dict(value[1])
    scored = as_reward(CallOutcome(value=value))
    if scored.error:
        return AgentOutcome(error=f"agent: {scored.error}")
    return AgentOutcome(scored.reward, info)
