"""Black-box agents: training samples from recorded calls, the chat request's checks, stop strings,
the OpenAI-compatible endpoint over real HTTP (a real ``openai.AsyncOpenAI`` against a scripted
rollout client) and running an agent function (every failure an outcome, never an exception)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from backends.data.chat import encode_text
from backends.rollout.agents import (
    AgentEndpoint,
    AgentOutcome,
    AgentServer,
    ChatRequest,
    RecordedCall,
    RequestError,
    normalized_messages,
    run_agent,
    samples_from_calls,
    stop_cut,
)
from backends.rollout.client import Completion, WeightSpan

# ------------------------------------------------------------------------------ samples


def call(prompt, completion, version="0", finish="stop") -> RecordedCall:
    return RecordedCall(
        tuple(prompt), tuple(completion), tuple(-0.1 * (i + 1) for i in range(len(completion))), (version,), finish
    )


def test_one_call_is_one_sample():
    (sample,) = samples_from_calls([call([1, 2, 3], [7, 8])])
    assert sample.prompt_ids == [1, 2, 3]
    assert sample.response_ids == [7, 8]
    assert sample.loss_mask == [1, 1]
    assert sample.rollout_logprobs == pytest.approx([-0.1, -0.2])
    assert sample.weight_versions == ["0"] and sample.policy_versions == (0,)
    assert sample.num_turns == 1 and sample.finish_reason == "stop"
    assert sample.context_ids == [1, 2, 3, 7, 8]
    assert samples_from_calls([]) == []


def test_a_call_that_extends_the_context_joins_its_sample_with_the_tokens_between_masked():
    first = call([1, 2, 3], [7, 8], version="0")
    second = call([1, 2, 3, 7, 8, 20, 21, 22], [9], version="1", finish="length")
    (sample,) = samples_from_calls([first, second])
    assert sample.prompt_ids == [1, 2, 3]
    assert sample.response_ids == [7, 8, 20, 21, 22, 9]
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    assert sample.rollout_logprobs == pytest.approx([-0.1, -0.2, 0.0, 0.0, 0.0, -0.1])
    assert sample.weight_versions == ["0", "1"] and sample.policy_versions == (0, 1)
    assert sample.num_turns == 2
    assert sample.finish_reason == "length"  # the last call's


def test_a_repeated_version_is_listed_once_and_nothing_between_is_nothing_masked():
    first = call([1, 2], [3], version="4")
    second = call([1, 2, 3], [5, 6], version="4")  # the prompt is exactly the previous context
    (sample,) = samples_from_calls([first, second])
    assert sample.response_ids == [3, 5, 6] and sample.loss_mask == [1, 1, 1]
    assert sample.weight_versions == ["4"]


def test_a_rewritten_history_starts_a_new_sample():
    first = call([1, 2, 3], [7, 8])
    rewritten = call([1, 5, 3, 7, 8, 20], [9])  # differs at position 1
    one, two = samples_from_calls([first, rewritten])
    assert (one.prompt_ids, one.response_ids, one.num_turns) == ([1, 2, 3], [7, 8], 1)
    assert (two.prompt_ids, two.response_ids, two.loss_mask) == ([1, 5, 3, 7, 8, 20], [9], [1])
    assert two.num_turns == 1


def test_a_prompt_shorter_than_the_context_is_a_new_sample():
    first = call([1, 2, 3], [7, 8])
    shorter = call([1, 2, 3, 7], [9])  # a prefix of the context, not an extension of it
    assert len(samples_from_calls([first, shorter])) == 2


def test_extend_rewrite_extend_gives_two_samples_the_third_call_joining_the_second():
    calls = [
        call([1, 2], [3]),
        call([1, 2, 3, 4], [5]),  # extends
        call([1, 9], [6]),  # rewrite (a summary)
        call([1, 9, 6, 10, 11], [12, 13]),  # extends the rewrite
    ]
    one, two = samples_from_calls(calls)
    assert one.prompt_ids == [1, 2] and one.response_ids == [3, 4, 5] and one.loss_mask == [1, 0, 1]
    assert one.num_turns == 2
    assert two.prompt_ids == [1, 9]
    assert two.response_ids == [6, 10, 11, 12, 13]
    assert two.loss_mask == [1, 0, 0, 1, 1]
    assert two.rollout_logprobs == pytest.approx([-0.1, 0.0, 0.0, -0.1, -0.2])
    assert two.num_turns == 2


# ------------------------------------------------------------------------------ requests

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The value under a key.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
]
USER = [{"role": "user", "content": "kqz?"}]


def test_a_good_request_and_its_defaults():
    request = ChatRequest.parse({"model": "anything", "messages": USER})
    assert request.model == "anything"
    assert request.messages == USER
    assert request.tools is None and request.tool_choice == "auto"
    assert request.temperature is None  # the run's rl.temperature
    assert request.top_p == 1.0 and request.max_tokens is None and request.stop == ()
    assert ChatRequest.parse({"messages": USER}).model == "policy"

    full = ChatRequest.parse(
        {
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": "none",
            "temperature": 0,
            "top_p": 0.5,
            "max_tokens": 7,
            "stop": ";",
            "stream": False,
            "n": 1,
        }
    )
    assert full.tools == TOOLS and full.tool_choice == "none"
    assert full.temperature == 0.0 and full.top_p == 0.5 and full.max_tokens == 7 and full.stop == (";",)
    assert ChatRequest.parse({"messages": USER, "max_completion_tokens": 3}).max_tokens == 3
    assert ChatRequest.parse({"messages": USER, "stop": ["a", "b"]}).stop == ("a", "b")
    assert ChatRequest.parse({"messages": USER, "tools": []}).tools is None


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "kqz?"}, "messages"),
        ({"messages": [{"content": "kqz?"}]}, "messages[0]"),
        ({"messages": [*USER, {"role": "user", "content": 5}]}, "messages[1].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]}, "messages[0].content"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
        ({"tools": [*TOOLS, "lookup"]}, "tools[1]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "tool_choice"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3.0}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 5]}, "stop"),
    ],
)
def test_a_bad_field_is_refused_by_name(changes, field):
    with pytest.raises(RequestError) as raised:
        ChatRequest.parse({"messages": USER, **changes})
    message = str(raised.value)
    assert message.startswith(field + ":"), message


def test_a_body_that_is_not_an_object_is_refused():
    for body in ([USER], "hello", None):
        with pytest.raises(RequestError, match="JSON object"):
            ChatRequest.parse(body)


def test_messages_are_normalized_for_the_template():
    wire = [
        {"role": "user", "content": [{"type": "text", "text": "kq"}, {"type": "text", "text": "z?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "kqz"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": ""}},
                {"id": "call_3", "type": "function", "function": {"name": "get", "arguments": {"a": 1}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "417"},
    ]
    original = json.loads(json.dumps(wire))
    out = normalized_messages(wire)
    assert out[0] == {"role": "user", "content": "kqz?"}
    assert out[1]["content"] == ""
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"key": "kqz"}, {}, {"a": 1}]
    assert out[1]["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "lookup", "arguments": {"key": "kqz"}},
    }
    assert out[2] == wire[2]
    assert wire == original  # the request's own messages are not changed
    assert ChatRequest.parse({"messages": wire}).messages == out


def test_tool_call_arguments_that_are_not_json_are_refused_by_their_path():
    bad = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "lookup", "arguments": "{key"}}]},
    ]
    with pytest.raises(RequestError) as raised:
        ChatRequest.parse({"messages": bad})
    assert str(raised.value).startswith("messages[1].tool_calls[0].function.arguments:")
    nameless = [*USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]
    with pytest.raises(RequestError) as raised:
        ChatRequest.parse({"messages": nameless})
    assert str(raised.value).startswith("messages[1].tool_calls[0]:")


def test_n_null_is_the_default():
    assert ChatRequest.parse({"messages": USER, "n": None}).messages == USER


def test_max_tokens_beside_a_null_max_completion_tokens_counts():
    assert ChatRequest.parse({"messages": USER, "max_completion_tokens": None, "max_tokens": 5}).max_tokens == 5


# ------------------------------------------------------------------------------ stop strings


def test_stop_cut_on_characters(tok):
    ids = encode_text(tok, "abc;def")
    assert len(ids) == 7
    assert stop_cut(tok, ids, ()) is None
    assert stop_cut(tok, ids, ["zz"]) is None
    assert stop_cut(tok, ids, [";"]) == (4, "abc")  # the ";" token is kept (it was sampled); the text ends before
    assert stop_cut(tok, ids, ["c;d"]) == (5, "ab")  # a stop string over two tokens: cut after the one completing it
    assert stop_cut(tok, ids, ["e", "c"]) == (3, "ab")  # the first stop string to appear
    assert stop_cut(tok, ids, ["", "f"]) == (7, "abc;de")  # an empty stop string is ignored
    assert stop_cut(tok, ids, ["a"]) == (1, "")
    assert stop_cut(tok, [], [";"]) is None


# ------------------------------------------------------------------------------ the endpoint over HTTP

PROMPT_TEXT = "<bos><|system|>lookup(key)<|user|>kqz?<|assistant|>"
CALL_TEXT = '[lookup(key="kqz")]<eos>'


class ScriptedClient:
    """A rollout client that answers each generate call with the next scripted text (or (text, finish
    reason)): its tokens, fake logprobs, all sampled by weight version 0; it records what it was asked."""

    def __init__(self, tokenizer, script=(), max_model_len=4096):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.script = list(script)
        self.requests: list[dict] = []
        self.finished: list[str] = []
        self.fail_next: Exception | None = None

    async def generate(self, prompt_ids, session_id, max_tokens, temperature=1.0, n=1, *, top_p=1.0, **kw):
        self.requests.append(
            {
                "prompt_ids": list(prompt_ids),
                "session_id": session_id,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "n": n,
                **kw,
            }
        )
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        text = self.script.pop(0)
        text, finish = text if isinstance(text, tuple) else (text, "stop")
        ids = encode_text(self.tokenizer, text)
        return [Completion(ids, [-0.5] * len(ids), finish, (WeightSpan("0", 0, len(ids)),))] * n

    async def finish_session(self, session_id):
        self.finished.append(session_id)
        return True


@contextlib.asynccontextmanager
async def serving(tok, parser, script=(), max_new_tokens=32, temperature=0.7, **client_kw):
    client = ScriptedClient(tok, script, **client_kw)
    server = AgentServer(client, tok, parser, max_new_tokens, [tok.eos_token_id], temperature)
    await server.start()
    try:
        yield server, client
    finally:
        await server.stop()


def test_the_chat_route_takes_its_request(tok, parser):
    async def main():
        async with serving(tok, parser, ["417<eos>"]) as (server, fake):
            _, endpoint = server.open("unpatched")
            async with httpx.AsyncClient(base_url=endpoint.base_url) as http:
                r = await http.post("/chat/completions", json={"messages": USER})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "417"

    asyncio.run(main())


def test_a_tool_call_then_its_result_make_one_sample(tok, parser):
    async def main():
        async with serving(tok, parser, [CALL_TEXT, "417<eos>"]) as (server, fake):
            trajectory, endpoint = server.open("traj-1")
            assert endpoint.base_url == f"http://127.0.0.1:{server.port}/t/traj-1/v1"
            client = endpoint.client()
            messages = list(USER)
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            (tool_call,) = choice.message.tool_calls
            assert tool_call.type == "function" and tool_call.function.name == "lookup"
            assert json.loads(tool_call.function.arguments) == {"key": "kqz"}
            first_prompt = encode_text(tok, PROMPT_TEXT)
            first_completion = encode_text(tok, CALL_TEXT)
            assert reply.model_extra["prompt_token_ids"] == first_prompt
            assert choice.model_extra["token_ids"] == first_completion
            assert reply.usage.prompt_tokens == len(first_prompt)
            assert reply.usage.completion_tokens == len(first_completion)
            assert fake.requests[0]["prompt_ids"] == first_prompt
            assert fake.requests[0]["session_id"] == "traj-1"
            assert fake.requests[0]["stop_token_ids"] == [tok.eos_token_id]

            messages.append(choice.message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "417"})
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            assert reply.choices[0].message.content == "417"
            assert reply.choices[0].finish_reason == "stop"
            assert not reply.choices[0].message.tool_calls
            second_prompt = reply.model_extra["prompt_token_ids"]
            assert second_prompt[: len(first_prompt) + len(first_completion)] == first_prompt + first_completion
            between = encode_text(tok, "<|tool|>417<|assistant|>")
            assert second_prompt == first_prompt + first_completion + between
            assert tok.decode(second_prompt) == PROMPT_TEXT + CALL_TEXT + "<|tool|>417<|assistant|>"
            second_completion = encode_text(tok, "417<eos>")

            assert len(trajectory.calls) == 2
            (sample,) = samples_from_calls(trajectory.calls)
            assert sample.prompt_ids == first_prompt
            assert sample.response_ids == first_completion + between + second_completion
            assert sample.loss_mask == [1] * len(first_completion) + [0] * len(between) + [1] * len(second_completion)
            assert sample.rollout_logprobs == [-0.5] * len(first_completion) + [0.0] * len(between) + [-0.5] * len(
                second_completion
            )
            assert sample.weight_versions == ["0"] and sample.num_turns == 2

            await client.close()
            await server.close("traj-1")
            assert fake.finished == ["traj-1"]
            await server.close("traj-1")  # a second close finishes nothing
            assert fake.finished == ["traj-1"]

    asyncio.run(main())


def test_plain_answers_sampling_parameters_and_models(tok, parser):
    async def main():
        async with serving(tok, parser, ["417<eos>"] * 6, max_new_tokens=32, temperature=0.7) as (server, fake):
            _, endpoint = server.open("plain")
            client = endpoint.client()

            reply = await client.chat.completions.create(model="policy", messages=USER, max_tokens=1000)
            assert reply.choices[0].message.content == "417"  # the eos is not part of the content
            assert reply.choices[0].finish_reason == "stop"
            assert reply.choices[0].message.tool_calls is None
            assert reply.model_extra["prompt_token_ids"] == encode_text(tok, "<bos><|user|>kqz?<|assistant|>")
            assert fake.requests[-1]["max_tokens"] == 32  # capped at the run's max_new_tokens
            assert fake.requests[-1]["temperature"] == 0.7  # none asked: the run's temperature
            assert fake.requests[-1]["top_p"] == 1.0

            await client.chat.completions.create(model="x", messages=USER, max_tokens=5, temperature=1.3, top_p=0.9)
            assert fake.requests[-1]["max_tokens"] == 5
            assert fake.requests[-1]["temperature"] == 1.3
            assert fake.requests[-1]["top_p"] == 0.9

            # an evaluation trajectory samples greedily, whatever the agent asks
            _, greedy = server.open("eval", temperature=0.0)
            greedy_client = greedy.client()
            await greedy_client.chat.completions.create(model="policy", messages=USER, temperature=1.3)
            assert fake.requests[-1]["temperature"] == 0.0 and fake.requests[-1]["session_id"] == "eval"
            await greedy_client.chat.completions.create(model="policy", messages=USER)
            assert fake.requests[-1]["temperature"] == 0.0

            # the engines' context caps a call too
            fake.max_model_len = len(reply.model_extra["prompt_token_ids"]) + 3
            await client.chat.completions.create(model="policy", messages=USER)
            assert fake.requests[-1]["max_tokens"] == 3
            fake.max_model_len = None  # an engine without a known context: only max_new_tokens caps
            await client.chat.completions.create(model="policy", messages=USER)
            assert fake.requests[-1]["max_tokens"] == 32

            # tools with tool_choice none: the text is not parsed for calls
            fake.script.insert(0, CALL_TEXT)
            reply = await client.chat.completions.create(
                model="policy", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=20
            )
            assert reply.choices[0].message.content == '[lookup(key="kqz")]'
            assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls

            models = await client.models.list()
            assert [m.id for m in models.data] == ["policy"]
            await client.close()
            await greedy_client.close()

    asyncio.run(main())


def test_the_first_calls_of_a_group_are_one_n_sample_request(tok, parser):
    """As an environment's first turns: the group's trajectories asking the same first call get one
    request with n = k under the group's session; a call asking its own sampling goes alone and
    does not hold up the group; a second call is always the trajectory's own."""
    from backends.rollout.session import SharedFirstTurn

    async def main():
        async with serving(tok, parser, ["417<eos>"] * 8, max_new_tokens=32, temperature=0.7) as (server, fake):
            group = SharedFirstTurn(fake, 4, "g", 32, 0.7, wait_s=30.0, stop_token_ids=[tok.eos_token_id])
            opened = [server.open(f"g_{i}", None, group, i) for i in range(4)]

            async def agent(i, endpoint):
                client = endpoint.client()
                first = await client.chat.completions.create(
                    model="policy", messages=USER, top_p=0.5 if i == 3 else None
                )
                if i == 0:
                    await client.chat.completions.create(model="policy", messages=USER)
                return first.choices[0].message.content

            answers = await asyncio.gather(*(agent(i, endpoint) for i, (_, endpoint) in enumerate(opened)))
            assert answers == ["417"] * 4
            shared = [r for r in fake.requests if r["session_id"] == "g"]
            assert [(r["n"], r["temperature"], r["max_tokens"]) for r in shared] == [(3, 0.7, 32)]
            alone = sorted((r["session_id"], r["n"], r["top_p"]) for r in fake.requests if r["session_id"] != "g")
            assert alone == [("g_0", 1, 1.0), ("g_3", 1, 0.5)]
            assert [len(t.calls) for t, _ in opened] == [2, 1, 1, 1]
            assert all(t.calls[0].weight_versions == ("0",) for t, _ in opened)
            assert "g" in fake.finished  # the group's pin is released once its request is done

    asyncio.run(main())


def test_a_first_call_that_comes_late_goes_alone(tok, parser):
    """A group whose trajectories do not all call within the wait is sampled without the late one,
    which then generates on its own; an agent that never calls only ends the wait (skip)."""
    from backends.rollout.session import SharedFirstTurn

    async def main():
        async with serving(tok, parser, ["417<eos>"] * 4) as (server, fake):
            group = SharedFirstTurn(fake, 3, "g", 32, 0.7, wait_s=0.2, stop_token_ids=[tok.eos_token_id])
            (_, first), (_, late), _ = [server.open(f"g_{i}", None, group, i) for i in range(3)]

            async def call(endpoint, delay):
                await asyncio.sleep(delay)
                reply = await endpoint.client().chat.completions.create(model="policy", messages=USER)
                return reply.choices[0].message.content

            assert await asyncio.gather(call(first, 0.0), call(late, 0.6)) == ["417", "417"]
            assert [(r["session_id"], r["n"]) for r in fake.requests] == [("g", 1), ("g_1", 1)]
            assert not group.accepts(2)
            group.skip(2)  # the third never called: its skip after the dispatch changes nothing

    asyncio.run(main())


def test_a_trajectory_that_closes_its_client_leaves_the_shared_one_open(tok, parser):
    async def main():
        async with serving(tok, parser, ["417<eos>"] * 2) as (server, fake):
            _, one = server.open("one")
            _, two = server.open("two")
            assert one.http_client is two.http_client is server.http_client
            async with one.client() as client:
                await client.chat.completions.create(model="policy", messages=USER)
            reply = await two.client().chat.completions.create(model="policy", messages=USER)
            assert reply.choices[0].message.content == "417"

    asyncio.run(main())


def test_a_stop_string_cuts_the_turn(tok, parser):
    async def main():
        async with serving(tok, parser, ["41;7<eos>"]) as (server, fake):
            trajectory, endpoint = server.open("stops")
            async with httpx.AsyncClient(base_url=endpoint.base_url) as http:
                r = await http.post("/chat/completions", json={"messages": USER, "stop": [";"]})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["message"]["content"] == "41" and choice["finish_reason"] == "stop"
            assert choice["token_ids"] == encode_text(tok, "41;")
            (recorded,) = trajectory.calls
            assert recorded.token_ids == tuple(encode_text(tok, "41;")) and recorded.logprobs == (-0.5,) * 3
            assert recorded.weight_versions == ("0",)

    asyncio.run(main())


def test_a_rewritten_history_and_a_cut_off_turn(tok, parser):
    async def main():
        async with serving(tok, parser, ["ab<eos>", ("417", "length")]) as (server, fake):
            trajectory, endpoint = server.open("rewrite")
            client = endpoint.client()
            reply = await client.chat.completions.create(model="policy", messages=USER)
            assert reply.choices[0].message.content == "ab"
            # the agent drops its history and asks afresh (a summary): a new sample
            summary = [{"role": "user", "content": "summary kqz?"}]
            reply = await client.chat.completions.create(model="policy", messages=summary)
            assert reply.choices[0].finish_reason == "length"
            assert reply.choices[0].message.content == "417"
            assert reply.model_extra["prompt_token_ids"] == encode_text(tok, "<bos><|user|>summary kqz?<|assistant|>")
            await client.close()
            one, two = samples_from_calls(trajectory.calls)
            assert one.response_ids == encode_text(tok, "ab<eos>") and one.finish_reason == "stop"
            assert two.prompt_ids == reply.model_extra["prompt_token_ids"]
            assert two.response_ids == encode_text(tok, "417") and two.finish_reason == "length"

    asyncio.run(main())


def test_malformed_requests_are_answered_with_an_error_naming_the_cause(tok, parser):
    async def main():
        async with serving(tok, parser, ["417<eos>"] * 3, max_model_len=40) as (server, fake):
            trajectory, endpoint = server.open("bad")
            async with httpx.AsyncClient(base_url=endpoint.base_url) as http:
                r = await http.post(
                    "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
                )
                assert r.status_code == 400
                assert r.json()["error"]["message"] == "the request body is not JSON"
                assert r.json()["error"]["type"] == "invalid_request_error"

                r = await http.post("/chat/completions", json={"messages": USER, "stream": True})
                assert r.status_code == 400 and r.json()["error"]["message"].startswith("stream:")

                r = await http.post("/chat/completions", json={"messages": USER, "temperature": "hot"})
                assert r.status_code == 400 and r.json()["error"]["message"].startswith("temperature:")

                long = [{"role": "user", "content": "k" * 60}]
                r = await http.post("/chat/completions", json={"messages": long})
                assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages:")
                assert "max_model_len = 40" in r.json()["error"]["message"]

                fake.fail_next = RuntimeError("engine went away")
                r = await http.post("/chat/completions", json={"messages": USER})
                assert r.status_code == 502
                assert r.json()["error"]["message"] == "generation failed: RuntimeError: engine went away"
                assert r.json()["error"]["type"] == "server_error"
                assert fake.script == ["417<eos>"] * 3 and trajectory.calls == []  # nothing was recorded

                r = await http.post("/chat/completions", json={"messages": USER})  # it keeps serving
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "417"
                assert len(trajectory.calls) == 1

                other = f"http://127.0.0.1:{server.port}/t/no-such-trajectory/v1/chat/completions"
                r = await http.post(other, json={"messages": USER})
                assert r.status_code == 404 and "no-such-trajectory" in r.json()["error"]["message"]

                await server.close("bad")  # an ended trajectory is unknown too
                r = await http.post("/chat/completions", json={"messages": USER})
                assert r.status_code == 404

                r = await http.get("/models")
                assert r.status_code == 200
                assert [m["id"] for m in r.json()["data"]] == ["policy"]

    asyncio.run(main())


def test_the_openai_client_sees_a_bad_request_error(tok, parser):
    import openai

    async def main():
        async with serving(tok, parser) as (server, fake):
            _, endpoint = server.open("sdk")
            client = endpoint.client()
            with pytest.raises(openai.BadRequestError, match="tool_choice"):
                await client.chat.completions.create(model="policy", messages=USER, tools=TOOLS, tool_choice="required")
            await client.close()
            assert fake.requests == []

    asyncio.run(main())


def test_tools_without_a_parser_are_refused_before_generating(tok):
    async def main():
        async with serving(tok, None, [CALL_TEXT]) as (server, fake):
            trajectory, endpoint = server.open("noparser")
            async with httpx.AsyncClient(base_url=endpoint.base_url) as http:
                r = await http.post("/chat/completions", json={"messages": USER, "tools": TOOLS})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools:")
            assert trajectory.calls == [] and fake.requests == []

    asyncio.run(main())


# ------------------------------------------------------------------------------ running agents

ENDPOINT = AgentEndpoint("http://127.0.0.1:1/t/none/v1")


def test_run_agent_outcomes():
    seen = []

    async def solves(row, endpoint):
        seen.append((row, endpoint))
        row["mutated"] = True
        return 1.0

    async def with_info(row, endpoint):
        return 0.5, {"k": 1}

    async def raises(row, endpoint):
        raise RuntimeError("bad answer\nmore")

    async def hangs(row, endpoint):
        await asyncio.sleep(30)
        return 1.0

    async def says_yes(row, endpoint):
        return "yes"

    async def says_true(row, endpoint):
        return True

    async def main():
        row = {"prompt": "kqz?"}
        assert await run_agent(solves, row, ENDPOINT, 5) == AgentOutcome(1.0, {}, None)
        assert seen == [({"prompt": "kqz?", "mutated": True}, ENDPOINT)] and row == {"prompt": "kqz?"}
        assert await run_agent(with_info, row, ENDPOINT, 5) == AgentOutcome(0.5, {"k": 1}, None)
        assert await run_agent(says_true, row, ENDPOINT, 5) == AgentOutcome(1.0, {}, None)

        failed = await run_agent(raises, row, ENDPOINT, 5)
        assert failed.error == "agent: RuntimeError: bad answer" and failed.reward == 0.0

        started = asyncio.get_running_loop().time()
        late = await run_agent(hangs, row, ENDPOINT, 0.2)
        assert asyncio.get_running_loop().time() - started < 5
        assert late.error.startswith("agent: timeout") and "0.2 s" in late.error and late.reward == 0.0

        wrong = await run_agent(says_yes, row, ENDPOINT, 5)
        assert wrong.error == "agent: reward must be a number, got str" and wrong.reward == 0.0

    asyncio.run(main())


def test_a_timeout_error_the_agent_raises_is_its_own_error():
    async def own_timeout(row, endpoint):
        raise TimeoutError("the tool took too long")

    outcome = asyncio.run(run_agent(own_timeout, {}, ENDPOINT, 30))
    assert outcome.error == "agent: TimeoutError: the tool took too long"


def test_agents_that_call_over_http_are_counted_and_told_once(tok, parser, monkeypatch, caplog):
    import backends.rollout.agents as agents

    monkeypatch.setattr(agents, "HTTP_TRAJECTORIES_BEFORE_HINT", 2)

    async def main():
        async with serving(tok, parser, ["417<eos>"] * 5) as (server, fake):
            _, shared = server.open("shared")
            await shared.client().chat.completions.create(model="policy", messages=USER)
            assert server.http_trajectories == 0  # endpoint.client() stays in process
            for name in ("http-1", "http-2", "http-3"):
                _, endpoint = server.open(name)
                async with httpx.AsyncClient(base_url=endpoint.base_url) as http:
                    r = await http.post("/chat/completions", json={"messages": USER})
                assert r.status_code == 200, r.text
            assert server.http_trajectories == 3

    with caplog.at_level("WARNING", logger="skyrl.agents"):
        asyncio.run(main())
    hints = [r for r in caplog.records if "over HTTP" in r.getMessage()]
    assert len(hints) == 1 and "endpoint.client()" in hints[0].getMessage()
