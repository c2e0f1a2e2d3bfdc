"""Tools: schemas from functions, vLLM's parsers on whole turns, running calls (every failure an
"error: ..." result, never an exception), and the char template's rendering of tools and calls."""

import asyncio
import json
import string
import time
from typing import Optional

import pytest

from backends.data.chat import continuation_text, encode_prompt, render
from backends.data.tasks import get_task
from backends.models.tokenizer import CHAR_CHAT_TEMPLATE, TOOL_MARKER, build_char_tokenizer
from backends.rollout.tools import (
    Tool,
    ToolCall,
    ToolCallParser,
    as_tool,
    as_tools,
    call_tool,
    default_parser_name,
    parsed_call,
    tool_message,
)

LOOKUP = get_task("lookup", 3)
TOOL_ALPHABET = LOOKUP.alphabet + "_"  # the tok fixture's (tests/unit/conftest.py)
ROW = {"prompt": "kqz?", "answer": "417"}


@pytest.fixture(scope="module")
def parsers(tok):
    # vLLM's parsers import torch (~9 s): built once for the module. Hermes reads text only; any
    # tokenizer with a vocabulary will do.
    wide = build_char_tokenizer(string.ascii_letters + string.digits + string.punctuation + " \n")
    return {"pythonic": ToolCallParser("pythonic", tok), "hermes": ToolCallParser("hermes", wide)}


# ------------------------------------------------------------------------------ schemas


def search(query: str, limit: int, exact: bool, weights: list[float], lang: Optional[str] = None) -> str:
    """Search the index.

    Args:
        query: what to look for
        limit: how many hits at most
        exact: whole words only
        weights: per-field weights
        lang: a language filter
    """
    return query


def test_schema_from_a_typed_documented_function():
    tool = as_tool(search)
    assert tool.name == "search" and tool.fn is search
    function = tool.schema["function"]
    assert tool.schema["type"] == "function"
    assert function["name"] == "search"
    assert function["description"] == "Search the index."
    props = function["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for"}
    assert props["limit"]["type"] == "integer"
    assert props["exact"]["type"] == "boolean"
    assert props["weights"]["type"] == "array" and props["weights"]["items"] == {"type": "number"}
    assert props["lang"]["type"] == "string"
    assert function["parameters"]["required"] == ["query", "limit", "exact", "weights"]  # lang has a default


def test_a_function_without_args_docstring_is_refused_by_name():
    def undocumented(key: str) -> str:
        """Looks a key up."""
        return key

    def no_docstring(key: str) -> str:
        return key

    def untyped(key):
        """Looks a key up.

        Args:
            key: the key
        """
        return key

    for fn in (undocumented, no_docstring, untyped):
        with pytest.raises(ValueError, match=rf"^tool {fn.__name__}: .*Args: line"):
            as_tool(fn)


def test_explicit_schemas_with_and_without_the_function_wrapper():
    function = {"name": "ping", "description": "is it up", "parameters": {"type": "object", "properties": {}}}
    wrapped = {"type": "function", "function": function}
    for spec in (function, wrapped):
        tool = as_tool(spec)
        assert tool == Tool("ping", wrapped, None)
    assert as_tool(tool) is tool
    for bad in ({"function": {"description": "no name"}}, {"name": ""}, 42):
        with pytest.raises(ValueError):
            as_tool(bad)


def test_tools_by_name_and_duplicates_refused():
    ping = {"name": "ping", "parameters": {"type": "object", "properties": {}}}
    tools = as_tools([search, ping])
    assert list(tools) == ["search", "ping"]
    with pytest.raises(ValueError, match="two tools are named 'search'"):
        as_tools([search, {"type": "function", "function": {"name": "search"}}])


# ------------------------------------------------------------------------------ parsing turns


def _calls(turn):
    return [(c.name, c.arguments, c.error) for c in turn.calls]


def test_pythonic_parser(parsers):
    p = parsers["pythonic"]
    one = p.parse('[lookup(key="kqz")]')
    assert (one.content, _calls(one), one.error) == ("", [("lookup", {"key": "kqz"}, None)], None)
    assert one.calls[0].id.startswith("call_")
    two = p.parse('[lookup(key="kqz"), lookup(key="abc")]')
    assert _calls(two) == [("lookup", {"key": "kqz"}, None), ("lookup", {"key": "abc"}, None)]
    assert two.calls[0].id != two.calls[1].id
    assert p.parse("417") == type(one)("417")  # an answer: no calls, no error
    assert _calls(p.parse("[f(flag=true, n=null, x=1.5)]")) == [("f", {"flag": True, "n": None, "x": 1.5}, None)]
    for malformed in ('[lookup(key="kqz"', '[lookup("kqz")]', "[lookup(key=kqz)]"):
        turn = p.parse(malformed)
        assert turn.calls == () and turn.content == malformed
        assert turn.error == "malformed tool call (the pythonic parser cannot read it)"


def test_hermes_parser(parsers):
    p = parsers["hermes"]

    def call(name, arguments):
        return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"

    one = p.parse(call("lookup", {"key": "kqz"}))
    assert (one.content, _calls(one), one.error) == ("", [("lookup", {"key": "kqz"}, None)], None)
    two = p.parse("let me look\n" + call("lookup", {"key": "kqz"}) + "\n" + call("ping", {}))
    assert two.content == "let me look\n"
    assert _calls(two) == [("lookup", {"key": "kqz"}, None), ("ping", {}, None)]
    answer = p.parse("The value is 417.")
    assert (answer.content, answer.calls, answer.error) == ("The value is 417.", (), None)
    for malformed in ('<tool_call>{"name": "lookup", "argu', '<tool_call>{"name": "lookup"}</tool_call>'):
        turn = p.parse(malformed)
        assert turn.calls == () and turn.error == "malformed tool call (the hermes parser cannot read it)"
    # JSON, but the arguments are no object: a call whose error the tool answer will carry
    for arguments, kind in (([1, 2], "list"), ("kqz", "str"), (None, "NoneType")):
        turn = p.parse(call("lookup", arguments))
        assert turn.error is None
        assert _calls(turn) == [("lookup", None, f"arguments of lookup must be a JSON object, got {kind}")]


def test_unknown_parser_name(tok):
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        ToolCallParser("nope", tok)


def test_parsed_call_arguments():
    assert parsed_call("f", '{"key": "kqz"}').arguments == {"key": "kqz"}
    assert parsed_call("f", "  ").arguments == {}
    assert parsed_call("f", {"a": 1}).arguments == {"a": 1}
    bad_json = parsed_call("f", "{key: kqz}")
    assert bad_json.arguments is None and bad_json.error.startswith("arguments of f are not JSON (")
    assert parsed_call("f", 3).error == "arguments of f must be a JSON object, got int"


def test_default_parser_name():
    assert default_parser_name(CHAR_CHAT_TEMPLATE) == "pythonic"
    qwen_like = "{% if tools %}<tools>{{ tools }}</tools> ... <tool_call>\n{{ call | tojson }}\n</tool_call>{% endif %}"
    assert default_parser_name(qwen_like) == "hermes"
    assert default_parser_name("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert default_parser_name("{{ '<|python_tag|>' }}") == "llama3_json"
    assert default_parser_name("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None
    assert default_parser_name(None) is None


# ------------------------------------------------------------------------------ running calls


def lookup(key: str) -> str:
    """The value under a key.

    Args:
        key: the key
    """
    return "417" if key == "kqz" else "not found"


async def alookup(key: str) -> str:
    """The value under a key, asynchronously.

    Args:
        key: the key
    """
    await asyncio.sleep(0)
    return "417" if key == "kqz" else "not found"


def explode() -> str:
    """Always fails."""
    raise RuntimeError("disk on fire\nsecond line")


async def aexplode() -> str:
    """Always fails, asynchronously."""
    raise KeyError("kqz")


def sleepy() -> str:
    """Blocks its thread past the timeout (the thread is abandoned, a daemon)."""
    time.sleep(1.5)
    return "late"


async def stall() -> str:
    """Never answers in time."""
    await asyncio.sleep(30)
    return "late"


def record() -> dict:
    """A structured answer."""
    return {"value": 417, "found": True, "note": None}


def count() -> int:
    """A number."""
    return 42


TOOLS = as_tools(
    [lookup, alookup, explode, aexplode, sleepy, stall, record, count, {"name": "weather", "parameters": {}}]
)


def _call(name, arguments=None, timeout_s=0.2, fallback=None):
    return asyncio.run(call_tool(TOOLS, parsed_call(name, arguments or {}), timeout_s, fallback))


def _failed(result, expected):
    assert result.error == expected
    assert result.content == f"error: {expected}"


def test_successful_sync_and_async_tools():
    for name in ("lookup", "alookup"):
        result = _call(name, {"key": "kqz"})
        assert (result.content, result.error, result.call.name) == ("417", None, name)
        assert _call(name, {"key": "abc"}).content == "not found"


def test_non_string_results_are_json_encoded():
    assert _call("record").content == '{"value": 417, "found": true, "note": null}'
    assert _call("count").content == "42"


def test_unknown_tool():
    _failed(
        _call("search", {"q": "x"}),
        "unknown tool 'search'; tools: aexplode, alookup, count, explode, lookup, record, sleepy, stall, weather",
    )
    empty = asyncio.run(call_tool({}, parsed_call("search", {}), 0.2))
    _failed(empty, "unknown tool 'search'; tools: none")


def test_wrong_arguments():
    _failed(_call("lookup"), "wrong arguments for lookup: missing a required argument: 'key'")
    _failed(
        _call("lookup", {"key": "kqz", "other": 1}),
        "wrong arguments for lookup: got an unexpected keyword argument 'other'",
    )
    _failed(_call("alookup", {"name": "kqz"}), "wrong arguments for alookup: missing a required argument: 'key'")
    _failed(_call("count", {"n": 1}), "wrong arguments for count: got an unexpected keyword argument 'n'")


def test_arguments_that_are_not_an_object():
    call = parsed_call("lookup", "[1]")
    _failed(asyncio.run(call_tool(TOOLS, call, 0.2)), "arguments of lookup must be a JSON object, got list")


def test_raising_tools():
    _failed(_call("explode"), "tool explode raised RuntimeError: disk on fire")  # first line only
    _failed(_call("aexplode"), "tool aexplode raised KeyError: 'kqz'")


def test_tools_past_the_timeout():
    start = time.monotonic()
    _failed(_call("sleepy"), "timeout: tool sleepy took longer than 0.2 s (rl.tool_timeout_s)")
    _failed(_call("stall"), "timeout: tool stall took longer than 0.2 s (rl.tool_timeout_s)")
    assert time.monotonic() - start < 1.2  # neither waited for its tool


def upstream() -> str:
    """Fails at once with its own (upstream) timeout."""
    raise TimeoutError("upstream did not answer")


async def aupstream() -> str:
    """Fails at once with its own (upstream) timeout, asynchronously."""
    raise TimeoutError("upstream did not answer")


@pytest.mark.parametrize("fn", [upstream, aupstream], ids=["sync", "async"])
def test_a_tool_raising_timeout_error_is_not_a_timeout(fn):
    result = asyncio.run(call_tool(as_tools([fn]), parsed_call(fn.__name__, {}), 10.0))
    assert result.error == f"tool {fn.__name__} raised TimeoutError: upstream did not answer"


def test_schema_only_tool_needs_a_fallback():
    _failed(
        _call("weather", {"city": "Oslo"}),
        "tool 'weather' is declared by schema only and the environment has no call_tool",
    )
    seen = []

    def fallback(name, arguments):
        seen.append((name, arguments))
        return {"temp": -3}

    result = _call("weather", {"city": "Oslo"}, fallback=fallback)
    assert (result.content, result.error) == ('{"temp": -3}', None)
    assert seen == [("weather", {"city": "Oslo"})]

    async def afallback(name, arguments):
        return f"{name}:{arguments['city']}"

    assert _call("weather", {"city": "Oslo"}, fallback=afallback).content == "weather:Oslo"

    def broken(name, arguments):
        raise ValueError("no such city")

    _failed(_call("weather", {"city": "X"}, fallback=broken), "tool weather raised ValueError: no such city")


def test_tool_message():
    call = ToolCall("lookup", {"key": "kqz"}, id="call_1")
    result = asyncio.run(call_tool(TOOLS, call, 0.2))
    assert tool_message(result) == {"role": "tool", "content": "417", "tool_call_id": "call_1", "name": "lookup"}
    assert call.as_message_call() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "lookup", "arguments": {"key": "kqz"}},
    }


# ------------------------------------------------------------------------------ templates


def test_char_template_renders_the_lookup_demonstration(tok):
    text = render(tok, LOOKUP.demonstration(ROW), tools=LOOKUP.tools)
    assert (
        text
        == '<bos><|system|>lookup(key)<|user|>kqz?<|assistant|>[lookup(key="kqz")]<eos><|tool|>417<|assistant|>417<eos>'
    )
    prompt = encode_prompt(tok, LOOKUP.prompt(ROW), tools=LOOKUP.tools)
    assert tok.decode(prompt) == "<bos><|system|>lookup(key)<|user|>kqz?<|assistant|>"
    assert len(prompt) == 1 + 1 + len("lookup(key)") + 1 + len("kqz?") + 1  # one token per character and marker
    # the demonstrator who gives up writes a plain answer
    gave_up = LOOKUP.demonstration({"prompt": "kqz?", "answer": "unknown"})
    assert gave_up == [{"role": "user", "content": "kqz?"}, {"role": "assistant", "content": "unknown"}]


def test_char_template_lists_several_tools_and_calls(tok):
    ping = {"name": "ping", "parameters": {"type": "object", "properties": {}}}
    two = {"name": "get", "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}
    calls = [
        {"type": "function", "function": {"name": "get", "arguments": {"a": "x", "b": 1}}},
        {"type": "function", "function": {"name": "ping", "arguments": {}}},
    ]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    tools = [as_tool(ping).schema, as_tool(two).schema]
    assert (
        render(tok, messages, tools=tools)
        == '<bos><|system|>ping();get(a,b)<|user|>q<|assistant|>[get(a="x", b=1), ping()]<eos>'
    )


def test_char_template_renders_a_tool_declared_without_parameters(tok):
    tools = [as_tool({"name": "ping"}).schema]
    assert render(tok, [{"role": "user", "content": "q"}], True, tools) == "<bos><|system|>ping()<|user|>q<|assistant|>"


def test_rendering_without_tools_is_unchanged():
    tok = build_char_tokenizer(get_task("addition", 2).alphabet)
    messages = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}]
    assert render(tok, messages) == "<bos><|user|>12+34=<|assistant|>46<eos>"
    assert render(tok, messages, tools=[]) == "<bos><|user|>12+34=<|assistant|>46<eos>"
    assert tok.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>"]) == list(range(6))


def test_tool_marker_is_one_token_after_the_alphabet(tok):
    marker = tok.convert_tokens_to_ids(TOOL_MARKER)
    alphabet_ids = tok.convert_tokens_to_ids(list(TOOL_ALPHABET))
    assert marker == len(tok) - 1 == 7 + len(set(TOOL_ALPHABET))
    assert marker > max(alphabet_ids)
    assert tok.tokenize("<|tool|>417") == ["<|tool|>", "4", "1", "7"]
    assert tok.decode(tok("<|tool|>", add_special_tokens=False)["input_ids"]) == TOOL_MARKER
    assert len(tok("<|tool|>", add_special_tokens=False)["input_ids"]) == 1


TOOL_RESULT = [{"role": "tool", "content": "417", "name": "lookup", "tool_call_id": "call_1"}]
HISTORY = [{"role": "user", "content": "kqz?"}, {"role": "assistant", "content": '[lookup(key="kqz")]'}]


def test_continuation_of_the_char_template(tok):
    assert continuation_text(tok, HISTORY, TOOL_RESULT) == "<|tool|>417<|assistant|>"
    assert continuation_text(tok, HISTORY, TOOL_RESULT, tools=LOOKUP.tools) == "<|tool|>417<|assistant|>"
    user_turn = [{"role": "user", "content": "again"}]
    assert continuation_text(tok, HISTORY, user_turn) == "<|user|>again<|assistant|>"


# Qwen2.5-style ChatML: every turn ends with the end-of-turn token (here the char tokenizer's eos)
# and a newline; tool results come back as a user turn wrapped in <tool_response>.
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' + eos_token + '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + eos_token + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_continuation_of_a_chatml_template_starts_after_the_eos():
    tok = build_char_tokenizer(LOOKUP.alphabet)
    tok.chat_template = CHATML
    assert render(tok, HISTORY) == '<|im_start|>user\nkqz?<eos>\n<|im_start|>assistant\n[lookup(key="kqz")]<eos>\n'
    text = continuation_text(tok, HISTORY, TOOL_RESULT)
    assert text == "\n<|im_start|>user\n<tool_response>\n417\n</tool_response><eos>\n<|im_start|>assistant\n"
    # the model's turn ends at its eos: the trajectory (history through eos + continuation) is the
    # template's rendering of the whole conversation
    before = render(tok, HISTORY)
    assert before[: before.rfind("<eos>") + len("<eos>")] + text == render(tok, HISTORY + TOOL_RESULT, True)


def test_continuation_is_none_when_the_template_rewrites_history():
    tok = build_char_tokenizer(LOOKUP.alphabet)
    # Qwen3-like: reasoning is dropped from assistant turns that are no longer the last
    tok.chat_template = CHATML.replace(
        "m['content'] + eos_token",
        "(m['content'] if loop.last or m['role'] != 'assistant' else m['content'].split('</think>')[-1]) + eos_token",
    )
    history = [{"role": "user", "content": "kqz?"}, {"role": "assistant", "content": "<think>hm</think>417"}]
    assert continuation_text(tok, history, [{"role": "user", "content": "sure?"}]) is None
