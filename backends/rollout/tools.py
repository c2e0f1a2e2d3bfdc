"""Tools an episode's model may call: their JSON schemas, parsing a model turn for calls, running them.

A tool is a plain Python function (sync or ``async def``) whose type hints and Google-style
docstring become its JSON schema (``transformers.utils.get_json_schema``, the schema Hugging Face
chat templates take as ``tools=``), or an explicit schema ``{"type": "function", "function":
{"name", "description", "parameters"}}`` that the environment's ``call_tool`` answers.

A model turn is parsed by one of vLLM's tool parsers (``rl.tool_parser``: ``hermes`` for the
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` format of Qwen2.5 / Qwen3 and many
others, ``pythonic``, ``llama3_json``, ``mistral``, ...; by default the one the chat template's
format implies, ``default_parser_name``). The built-in character tokenizer's template writes calls
in the pythonic format, ``[lookup(key="abc")]``, short enough for the tiny models to learn.

Every failure is an outcome, never an exception: a turn that starts a call the parser cannot read
(malformed), a call of an unknown tool, arguments that do not fit its signature, a tool that raises
or runs past ``rl.tool_timeout_s`` each give ``ToolResult.error``, a one-line text the episode shows
the model as the tool's answer (or ends the episode with, ``rl.tool_errors = "end"``).
"""

from __future__ import annotations

import inspect
import json
import re
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from backends.rollout.rewards import GuardedCaller

# Text that shows a turn meant to call a tool in a parser's format: a turn with it that the parser
# cannot read is a malformed call, one without it is an answer.
CALL_MARKERS: dict[str, Callable[[str], bool]] = {
    "hermes": lambda text: "<tool_call>" in text,
    "pythonic": lambda text: re.match(r"\[\s*[A-Za-z_]\w*\(", text) is not None,  # "[name(": not "[1, 2]"
    "llama3_json": lambda text: text.lstrip().startswith(("{", "<|python_tag|>")),
    "mistral": lambda text: "[TOOL_CALLS]" in text,
}


@dataclass(frozen=True)
class Tool:
    """A callable tool: ``schema`` is what the chat template shows; ``fn`` is None for a declared
    schema the environment answers itself (``ToolEnvironment.call_tool``)."""

    name: str
    schema: dict[str, Any]
    fn: Callable[..., Any] | None = None


def as_tool(spec: Callable[..., Any] | Mapping[str, Any] | Tool) -> Tool:
    """A tool from a function (its schema from type hints and docstring) or an explicit schema."""
    if isinstance(spec, Tool):
        return spec
    if isinstance(spec, Mapping):
        function = spec.get("function", spec)
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool schema needs function.name, got {dict(spec)!r}")
        schema = dict(spec) if "function" in spec else {"type": "function", "function": dict(spec)}
        return Tool(name, schema)
    if not callable(spec):
        raise ValueError(f"a tool is a function or a JSON schema dict, got {type(spec).__name__}")
    # lazy: transformers (imports torch: seconds); only function tools need it
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(spec)
    except Exception as exc:  # noqa: BLE001 - transformers raises its own exception types
        name = getattr(spec, "__name__", spec)
        raise ValueError(f"tool {name}: {exc} (give every argument a type hint and an Args: line)") from None
    return Tool(schema["function"]["name"], schema, spec)


def as_tools(specs: Sequence[Any]) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = as_tool(spec)
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


# ------------------------------------------------------------------------------ parsing turns


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] | None  # None when the arguments are not a JSON object (``error`` says why)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The OpenAI / chat-template form of the call (arguments as a dict, as templates render them)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments or {}}}


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the text outside the calls (the whole turn when there are none)
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None  # a call was started but cannot be read


def default_parser_name(chat_template: str | None) -> str | None:
    """The tool-call format a chat template writes, as a vLLM parser name; None when unknown."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template:
        return "llama3_json"
    if "PYTHONIC_TOOL_CALLS" in template:  # the character tokenizer's template (backends.models.tokenizer)
        return "pythonic"
    return None


class ToolCallParser:
    """One of vLLM's tool parsers, for whole (non-streamed) turns.

    vLLM's parsers are imported on first use (the import takes torch with it: several seconds)."""

    def __init__(self, name: str, tokenizer):
        try:
            # lazy: vllm (imports torch: seconds); on first use, see the docstring
            from vllm.tool_parsers import ToolParserManager
        except ImportError:  # older vLLM versions keep them under the OpenAI server
            # lazy: vllm (imports torch: seconds); on first use, see the docstring
            from vllm.entrypoints.openai.tool_parsers import ToolParserManager

        try:
            cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(f"unknown tool parser {name!r} (vLLM's tool parsers: hermes, pythonic, ...)") from None
        self.name = name
        self.parser = cls(tokenizer)
        self.looks_like_call = CALL_MARKERS.get(name, lambda text: False)
        self._request = None

    def request(self):
        """The request object vLLM's parsers take; they read nothing of it for whole turns but its tools."""
        if self._request is None:
            try:  # where vLLM 0.32 keeps it; other versions move it
                # lazy: vllm (imports torch: seconds); on first use, see the docstring
                from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

                self._request = ChatCompletionRequest(model="policy", messages=[])
            except ImportError:
                self._request = SimpleNamespace(tools=None, tool_choice="auto", skip_special_tokens=False)
        return self._request

    def parse(self, text: str) -> ParsedTurn:
        try:
            info = self.parser.extract_tool_calls(text, self.request())
        except Exception as exc:  # noqa: BLE001 - a parser bug on odd text is a malformed call, not a crash
            return ParsedTurn(text, (), f"malformed tool call ({type(exc).__name__}: {exc})")
        if not info.tools_called:
            if self.looks_like_call(text):
                return ParsedTurn(text, (), f"malformed tool call (the {self.name} parser cannot read it)")
            return ParsedTurn(text)
        calls = tuple(parsed_call(c.function.name, c.function.arguments) for c in info.tool_calls)
        return ParsedTurn(info.content or "", calls)


def parsed_call(name: str, arguments: Any) -> ToolCall:
    """A call whose arguments come as a JSON string (vLLM, OpenAI clients) or a dict."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            return ToolCall(name, None, error=f"arguments of {name} are not JSON ({exc})")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, error=f"arguments of {name} must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)


# ------------------------------------------------------------------------------ running calls


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall
    content: str  # what the model sees as the tool's answer (the error text when it failed)
    error: str | None = None


def argument_error(fn: Callable[..., Any], arguments: Mapping[str, Any]) -> str | None:
    """Why ``fn(**arguments)`` cannot be called, or None."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as exc:
        return str(exc)
    except ValueError:  # no signature (a builtin): let the call itself decide
        return None
    return None


async def call_tool(
    tools: Mapping[str, Tool],
    call: ToolCall,
    timeout_s: float,
    fallback: Callable[[str, dict], Any] | None = None,
) -> ToolResult:
    """Run one call under ``timeout_s`` (``GuardedCaller``: sync tools in a daemon thread, async ones
    on the event loop); ``fallback(name, arguments)`` answers tools declared by schema only."""

    def failed(error: str) -> ToolResult:
        return ToolResult(call, f"error: {error}", error)

    if call.error:
        return failed(call.error)
    tool = tools.get(call.name)
    if tool is None:
        return failed(f"unknown tool {call.name!r}; tools: {', '.join(sorted(tools)) or 'none'}")
    fn = tool.fn
    if fn is None:
        if fallback is None:
            return failed(f"tool {call.name!r} is declared by schema only and the environment has no call_tool")
        fn, args, kwargs = fallback, (call.name, dict(call.arguments)), {}
    else:
        problem = argument_error(fn, call.arguments)
        if problem:
            return failed(f"wrong arguments for {call.name}: {problem}")
        args, kwargs = (), dict(call.arguments)
    outcome = await GuardedCaller(timeout_s).acall(fn, *args, **kwargs)
    if outcome.error:
        if outcome.error.startswith("timeout:"):
            return failed(f"timeout: tool {call.name} took longer than {timeout_s:g} s (rl.tool_timeout_s)")
        return failed(f"tool {call.name} raised {outcome.error}")
    value = outcome.value
    return ToolResult(call, value if isinstance(value, str) else json.dumps(value, default=str))


def tool_message(result: ToolResult) -> dict[str, Any]:
    """The ``tool`` chat message the template renders for a result."""
    return {"role": "tool", "content": result.content, "tool_call_id": result.call.id, "name": result.call.name}
