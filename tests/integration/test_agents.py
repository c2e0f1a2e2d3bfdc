"""Agents on the real stack (vLLM engine + vllm-router + orchestrator + 2-rank DeepSpeed learner):
a tool environment over two turns, and a black-box agent written with the ``openai`` package
against the orchestrator's endpoint. Both check the learner's batch itself (``rl.keep_batches``).

The policy is the ``lookup`` task's SFT model (demonstrations that always call the tool, a short
run): it writes ``[lookup(key="..")]`` calls, so the tool paths run for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli_runs import events, run_skyrl
from tests.recipes import RL, SFT, SMALL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration

RECIPE = tiny_recipe(
    SMALL,
    SFT,
    RL,
    name="tooltest",
    seed=3,
    data={"task": "lookup", "train_size": 4000, "eval_size": 8},
    sft={"steps": 150, "warmup_steps": 10},
    rl={"init_from": "sft", "steps": 1, "max_turns": 2, "max_new_tokens": 24, "keep_batches": True},
)

AGENT = '''
"""Lookup agents over the OpenAI API: index 0-1 of a group append to their conversation, index 2
rewrites it (the second call sees a new prompt), index 3 raises (even keys) or hangs (odd keys)."""

import asyncio
import json
from pathlib import Path

LOG = Path(__file__).with_name("agent_calls.jsonl")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The value stored under a key.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "description": "the key"}},
                "required": ["key"],
            },
        },
    }
]


def record(session, kind, reply):
    entry = {
        "session": session,
        "kind": kind,
        "prompt": reply.model_extra["prompt_token_ids"],
        "tokens": reply.choices[0].model_extra["token_ids"],
        "tool_calls": len(reply.choices[0].message.tool_calls or []),
    }
    with LOG.open("a") as fh:
        fh.write(json.dumps(entry) + "\\n")


async def solve(row, endpoint):
    session = endpoint.base_url.rstrip("/").split("/")[-2]
    index = int(session.rsplit("_", 1)[-1]) if not session.startswith("eval") else 0
    key, value = row["prompt"][:-1], row["answer"]
    if index == 3:
        if ord(key[0]) % 2 == 0:
            raise RuntimeError("the agent fell over")
        await asyncio.sleep(3600)
    kind = "rewrite" if index == 2 else "extend"
    client = endpoint.client()
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=24)
    record(session, kind, first)
    message = first.choices[0].message
    if kind == "rewrite":
        messages = [{"role": "user", "content": value + row["prompt"]}]
    else:
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            found = json.loads(call.function.arguments).get("key") == key
            messages.append({"role": "tool", "tool_call_id": call.id, "content": value if found else "not found"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "?"})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=24)
    record(session, kind, second)
    return float((second.choices[0].message.content or "").strip() == value)
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("agents")
    write_recipe(root / "recipe.toml", RECIPE)
    (root / "lookup_agents.py").write_text(AGENT)
    run_skyrl("sft", "recipe.toml", "--quiet", cwd=root, timeout=900)
    return root


def load_tokenizer(run: Path):
    from backends.models.tokenizer import load_tokenizer as load

    return load(str(run / "engine-model"))


def batch_samples(run: Path) -> list[dict]:
    return json.loads((run / "batches/step-0.json").read_text())["samples"]


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a loss mask."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def on_policy_gap_within_bound(run: Path) -> None:
    bound = events(run, "health/sync_gap_bound")[0][1]
    (step, diff), *_ = events(run, "train/logprob_diff")
    assert step == 1 and diff < bound, (diff, bound)


def test_tool_environment_batch_masks_tool_results_and_matches_the_template(workdir):
    run = workdir / "runs/tooltest/rl-tools"
    run_skyrl("rl", "recipe.toml", "--run-dir", run, "--quiet", cwd=workdir, timeout=900)
    from backends.data.chat import render
    from backends.data.tasks import get_task

    tokenizer = load_tokenizer(run)
    tools = get_task("lookup", 2).tools
    samples = batch_samples(run)
    two_turn = [s for s in samples if s["num_turns"] == 2]
    assert two_turn, "the SFT policy calls its tool: some episodes take two turns"
    rendered = 0
    for s in two_turn:
        runs = segments(s["loss_mask"])
        assert [value for value, _, _ in runs] == [1, 0, 1], runs
        (_, _, a), (_, _, b), (_, _, c) = runs
        call, result, answer = s["response_ids"][:a], s["response_ids"][a:b], s["response_ids"][b:c]
        # the model's tokens carry the engine's sampling logprobs; the tool's answer carries none
        assert all(lp <= 0 for lp in s["rollout_logprobs"][:a] + s["rollout_logprobs"][b:])
        assert all(lp == 0 for lp in s["rollout_logprobs"][a:b])
        observation = tokenizer.decode(result, skip_special_tokens=False)
        assert observation.startswith("<|tool|>") and observation.endswith("<|assistant|>"), observation
        content = observation[len("<|tool|>") : -len("<|assistant|>")]
        # the value, a wrong key's answer, or the error a malformed call gets
        assert content == "not found" or (len(content) == 3 and content.isdigit()) or content.startswith("error")
        # the whole trajectory is the chat template's rendering of the conversation
        raw = lambda ids: tokenizer.decode(ids, skip_special_tokens=False).removesuffix("<eos>")  # noqa: E731
        user = tokenizer.decode(s["prompt_ids"], skip_special_tokens=False).split("<|user|>")[1]
        conversation = [
            {"role": "user", "content": user.removesuffix("<|assistant|>")},
            {"role": "assistant", "content": raw(call)},
            {"role": "tool", "content": content},
            {"role": "assistant", "content": raw(answer)},
        ]
        if call[-1:] == answer[-1:] == [tokenizer.eos_token_id]:  # both turns ended, not cut at max_new_tokens
            expected = render(tokenizer, conversation, tools=tools)
            assert tokenizer.decode(s["prompt_ids"] + s["response_ids"], skip_special_tokens=False) == expected
            rendered += 1
    assert rendered, "some two-turn episodes end both turns themselves"
    assert any(lp < 0 for s in two_turn for lp, m in zip(s["rollout_logprobs"], s["loss_mask"]) if m)
    assert [v for _, v in events(run, "rollout/errors")] == [0.0]
    assert events(run, "rollout/tool_calls_mean")[0][1] > 0
    on_policy_gap_within_bound(run)


def test_openai_agent_trains_on_exactly_the_sampled_tokens(workdir):
    """Fully async (``--async``), as agents are meant to run."""
    run = workdir / "runs/tooltest/rl-agent"
    run_skyrl(
        "rl",
        "recipe.toml",
        "--run-dir",
        run,
        "--quiet",
        "--async",
        "--set",
        "rl.agent=lookup_agents:solve",
        "--set",
        "rl.agent_timeout_s=5",
        cwd=workdir,
        timeout=900,
    )
    calls: dict[str, list[dict]] = {}
    for line in (workdir / "agent_calls.jsonl").read_text().splitlines():
        entry = json.loads(line)
        calls.setdefault(entry["session"], []).append(entry)
    by_trajectory: dict[str, list[dict]] = {}
    for s in batch_samples(run):
        by_trajectory.setdefault(f"{s['prompt_uid']}_{s['index']}", []).append(s)
    assert len(by_trajectory) == 16
    joined = 0  # appending trajectories whose two calls are one sample
    for session, samples in by_trajectory.items():
        index = int(session.rsplit("_", 1)[1])
        if index == 3:  # raised or hung: one empty sample, reward 0, an error record
            assert len(samples) == 1 and samples[0]["error"] and samples[0]["reward"] == 0
            assert samples[0]["response_ids"] == []
            continue
        first, second = calls[session]
        context = first["prompt"] + first["tokens"]
        # An appending agent's second prompt extends the first call's context, unless the model's
        # call does not survive the round trip through the parser and the template (a sampled
        # '[lookup(key=="[l")]' comes back as '[lookup()]'): a rewritten history, as index 2's.
        if index == 2 or second["prompt"][: len(context)] != context:
            assert [(s["prompt_ids"], s["response_ids"]) for s in samples] == [
                (first["prompt"], first["tokens"]),
                (second["prompt"], second["tokens"]),
            ]
            assert all(s["loss_mask"] == [1] * len(s["response_ids"]) for s in samples)
            assert samples[0]["reward"] == samples[1]["reward"]
            continue
        joined += 1
        (sample,) = samples
        between = second["prompt"][len(context) :]
        assert sample["prompt_ids"] == first["prompt"]
        assert sample["response_ids"] == first["tokens"] + between + second["tokens"]
        assert sample["loss_mask"] == [1] * len(first["tokens"]) + [0] * len(between) + [1] * len(second["tokens"])
        n1 = len(first["tokens"])
        assert all(lp == 0 for lp in sample["rollout_logprobs"][n1 : n1 + len(between)])
        assert all(lp <= 0 for lp in sample["rollout_logprobs"][:n1] + sample["rollout_logprobs"][n1 + len(between) :])
    assert joined >= 4, joined  # of the 8 appending trajectories, most round-trip their calls
    assert any(entry["tool_calls"] for entries in calls.values() for entry in entries), "tool calls parsed"
    errors = [json.loads(line)["error"] for line in (run / "sample_errors.jsonl").read_text().splitlines()]
    assert any("agent: RuntimeError: the agent fell over" in e for e in errors) or any(
        "agent: timeout" in e for e in errors
    ), errors
    assert events(run, "rollout/errors")[0][1] >= 4.0  # --async: groups of the next batch may have run already
    assert events(run, "rollout/samples_per_trajectory")[0][1] > 1.0
    on_policy_gap_within_bound(run)


# ------------------------------------------------------------------------------ a user's data, several calls

# A two-call retry agent: asks, and on a wrong answer asks again in a new user turn. The recipe
# that trains it leaves rl.max_turns unset: its second calls must not be refused.
RETRY_AGENT = """
async def solve(row, endpoint):
    client = endpoint.client()
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        answer = reply.choices[0].message.content or ""
        if answer.strip() == row["answer"]:
            return 1.0
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": row["prompt"]}]
    return 0.0
"""


def docs_agent_source() -> str:
    """The agent program docs/agents.md shows (the block that defines ``solve``), as written."""
    from tests.docs_blocks import blocks

    (block,) = [b for b in blocks(REPO_DOCS / "agents.md") if b.lang == "python" and "async def solve" in b.code]
    return block.code


REPO_DOCS = Path(__file__).resolve().parents[2] / "docs"


def user_data_recipe(workdir: Path, name: str, agent: str) -> Path:
    """An RL-only recipe on the user's own JSONL rows (not a built-in task), from the SFT model of
    this module, naming ``agent``, with no rl.max_turns. Rows carry the fields the docs' agent
    reads (``prompt``, ``answer``, ``table``)."""
    from backends.data.tasks import get_task

    folder = workdir / name
    folder.mkdir(exist_ok=True)
    task = get_task("lookup", 2)
    for split, size in (("train", 64), ("eval", 8)):
        rows = [{**r, "table": {r["prompt"][:-1]: r["answer"]}} for r in task.make_rows(11, size, split)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tiny_recipe(
        SMALL,
        RL,
        name=name,
        seed=5,
        data={"task": None, "digits": None, "train": "train.jsonl", "eval": "eval.jsonl", "eval_size": 8},
        rl={
            "init_from": str(workdir / "runs/tooltest/sft/final"),
            "agent": agent,
            "steps": 1,
            "max_new_tokens": 24,
            "keep_batches": True,
        },
        trainer={"ranks": 1},  # one learner rank: what is tested is the orchestrator's side
    )
    return write_recipe(folder / "recipe.toml", recipe)


def several_calls_trained(run: Path) -> None:
    """Calls past the first were answered and trained: more than one call per trajectory on
    average, one sample per trajectory (both agents append to their conversation), no errors."""
    calls = [v for _, v in events(run, "rollout/agent_calls_mean")]
    assert calls and all(c > 1.0 for c in calls), calls
    assert [v for _, v in events(run, "rollout/samples_per_trajectory")] == [1.0] * len(calls)
    assert [v for _, v in events(run, "rollout/errors")] == [0.0] * len(calls)
    errors = run / "sample_errors.jsonl"
    assert not errors.exists() or not errors.read_text().strip(), errors.read_text()
    samples = batch_samples(run)
    assert any(s["num_turns"] > 1 and 0 in s["loss_mask"] for s in samples)  # the turns between carry no loss
    on_policy_gap_within_bound(run)


def test_the_docs_tool_agent_trains_on_a_users_data(workdir):
    recipe = user_data_recipe(workdir, "docs_agent", "my_agent:solve")
    (recipe.parent / "my_agent.py").write_text(docs_agent_source())
    run = recipe.parent / "run"
    run_skyrl("rl", recipe, "--run-dir", run, "--quiet", cwd=recipe.parent, timeout=900)
    several_calls_trained(run)
    tokenizer = load_tokenizer(run)
    between = [
        tokenizer.decode([t for t, m in zip(s["response_ids"], s["loss_mask"]) if not m], skip_special_tokens=False)
        for s in batch_samples(run)
    ]
    assert any("<|tool|>" in text for text in between), "the model's tool calls were parsed and answered"


def test_a_retry_agent_without_max_turns_makes_its_second_calls(workdir):
    """Sync; a recipe that leaves rl.max_turns unset: the second calls are answered, not refused."""
    recipe = user_data_recipe(workdir, "retry_agent", "retry_agent:solve")
    (recipe.parent / "retry_agent.py").write_text(RETRY_AGENT)
    run = recipe.parent / "run"
    run_skyrl("recipes", "validate", recipe, cwd=recipe.parent)
    run_skyrl("rl", recipe, "--run-dir", run, "--quiet", cwd=recipe.parent, timeout=900)
    several_calls_trained(run)
