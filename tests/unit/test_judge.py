"""A judge model as the reward (``rl.judge``): the schema and its checks, the judge's engines in the
plan beside a teacher's, the verdict parsers against hand-written replies, and the judge's requests,
records and counts against a recording HTTP transport."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from backends.rollout.environments import GuardedCaller, MathEnvironment, run_episode
from backends.rollout.judge import Judge, JudgedEnvironment, JudgeUnavailable, UnparsedVerdict, parse_verdict
from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.feasibility import feasibility_problems
from skyrl_cli.plan.fit import Hardware, estimate, memory_problems
from skyrl_cli.plan.fit_text import engine_lines
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.memory import GIB
from skyrl_cli.plan.shape import trained_shape
from skyrl_cli.recipe.loader import load_recipe
from skyrl_contracts.errors import RecipeError
from skyrl_contracts.schema import JudgeConfig, Recipe, RlConfig
from tests.unit.test_distillation import CPU2, VOCAB, model_dir

# ------------------------------------------------------------------------------------- schema


def judge_config(**fields) -> JudgeConfig:
    return JudgeConfig.model_validate({"model": "/models/judge", **fields})


def test_the_default_judge_asks_yes_or_no_and_reads_the_label():
    config = judge_config()
    assert config.verdict == "label" and config.labels == {"yes": 1.0, "no": 0.0}
    assert {"{question}", "{response}", "{answer}"} <= {f"{{{f}}}" for f in ("question", "response", "answer")}
    assert "{response}" in config.template and config.max_tokens == 16 and config.engines == 1


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"template": "Grade {reply}"}, "template names ['reply']"),
        ({"template": "Grade the answer"}, "template must contain {response}"),
        ({"template": "{response"}, "literal braces"),
        ({"verdict": "regex"}, 'verdict = "regex" needs a pattern'),
        ({"verdict": "regex", "pattern": "score"}, "has no group"),
        ({"verdict": "regex", "pattern": "(["}, "pattern '(['"),
        ({"pattern": "(\\d)"}, 'pattern acts only with verdict = "regex"'),
        ({"labels": {}}, 'verdict = "label" needs labels'),
        ({"max_tokens": 0}, "greater than or equal to 1"),
    ],
)
def test_the_schema_refuses_a_judge_that_cannot_act(fields, message):
    with pytest.raises(ValueError, match=None) as err:
        RlConfig.model_validate({"judge": {"model": "/j", **fields}})
    assert message in str(err.value)


# ------------------------------------------------------------------------------------- verdicts


@pytest.mark.parametrize(
    "reply, reward",
    [
        ("Yes.", 1.0),
        ("no, the sum is wrong", 0.0),
        ("NO", 0.0),
        ("The answer is correct: yes", 1.0),
        ("not sure... no. Actually yes", 0.0),  # the label said first
        ("yesterday it was no", 0.0),  # whole words only: "yesterday" is not "yes"
    ],
)
def test_label_verdicts(reply, reward):
    assert parse_verdict(reply, judge_config()) == reward


def test_a_label_that_contains_another_is_read_whole():
    config = judge_config(labels={"correct": 1.0, "incorrect": 0.0})
    assert parse_verdict("Incorrect.", config) == 0.0
    assert parse_verdict("It is correct", config) == 1.0


@pytest.mark.parametrize("reply, reward", [("8", 8.0), ("Score: 7.5/10", 7.5), ("-1 points", -1.0), (".5", 0.5)])
def test_number_verdicts(reply, reward):
    assert parse_verdict(reply, judge_config(verdict="number")) == reward


def test_regex_verdicts_read_a_number_or_a_label():
    config = judge_config(verdict="regex", pattern=r"VERDICT:\s*(\w+(?:\.\d+)?)", labels={"pass": 1.0, "fail": 0.0})
    assert parse_verdict("thinking... VERDICT: 0.25", config) == 0.25
    assert parse_verdict("VERDICT: PASS", config) == 1.0
    with pytest.raises(UnparsedVerdict, match="neither a number nor a label"):
        parse_verdict("VERDICT: maybe", config)
    with pytest.raises(UnparsedVerdict, match="does not match"):
        parse_verdict("I think it passes", config)


@pytest.mark.parametrize("verdict, reply", [("label", "perhaps"), ("number", "no idea"), ("number", "")])
def test_a_reply_without_a_verdict_is_unparsed(verdict, reply):
    with pytest.raises(UnparsedVerdict):
        parse_verdict(reply, judge_config(verdict=verdict))


# ------------------------------------------------------------------------------------- requests


class FakeJudgeEngine:
    """An OpenAI-compatible engine answering ``replies`` in order (a status code instead of a reply
    answers that status), recording every request body."""

    def __init__(self, replies):
        self.replies, self.bodies = list(replies), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append((request.url.path, body))
        reply = self.replies.pop(0)
        if isinstance(reply, int):
            return httpx.Response(reply, text="engine says no")
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, json={"choices": [{"message": {"content": reply}}]})
        return httpx.Response(200, json={"choices": [{"text": reply}]})


def make_judge(tmp_path, replies, chat=True, **config) -> tuple[Judge, FakeJudgeEngine]:
    engine = FakeJudgeEngine(replies)
    judge = Judge(["http://judge:1"], judge_config(**config), tmp_path / "verdicts.jsonl", chat=chat, backoff_s=0.0)
    judge.engines.http = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    return judge, engine


def records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "verdicts.jsonl").read_text().splitlines()]


def test_the_judge_reads_the_template_greedily_and_records_every_verdict(tmp_path):
    judge, engine = make_judge(tmp_path, ["yes", "perhaps"], template="Q: {question} A: {answer} R: {response}")
    assert asyncio.run(judge.verdict("1+1=", "2", "2", reference=1.0)) == 1.0
    with pytest.raises(UnparsedVerdict):
        asyncio.run(judge.verdict("1+2=", "4", "3", reference=0.0))
    path, body = engine.bodies[0]
    assert path == "/v1/chat/completions" and body["model"] == "judge"
    assert body["messages"] == [{"role": "user", "content": "Q: 1+1= A: 2 R: 2"}]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 16
    first, second = records(tmp_path)
    assert first["prompt"] == "Q: 1+1= A: 2 R: 2" and first["reply"] == "yes" and first["verdict"] == 1.0
    assert second["reply"] == "perhaps" and second["verdict"] is None and "none of the labels" in second["error"]
    assert judge.figures() == {"judge/verdicts": 1, "judge/unparsed": 1, "judge/errors": 0, "judge/agreement": 1.0}
    assert "judge/agreement" not in judge.figures()  # a window with no comparison reports none


def test_a_judge_without_a_chat_template_reads_plain_text(tmp_path):
    judge, engine = make_judge(tmp_path, ["7"], chat=False, verdict="number")
    assert asyncio.run(judge.verdict("q", "r", None)) == 7.0
    path, body = engine.bodies[0]
    assert path == "/v1/completions" and body["prompt"].endswith(
        "Response: r\nIs the response correct? Answer yes or no."
    )
    assert "Reference answer: \n" in body["prompt"]  # no reference answer: empty


def test_judge_requests_are_retried_and_a_refused_one_is_an_error(tmp_path):
    judge, engine = make_judge(tmp_path, [503, "yes", 400])
    assert asyncio.run(judge.verdict("q", "r", "a")) == 1.0 and len(engine.bodies) == 2
    with pytest.raises(JudgeUnavailable, match="HTTP 400"):
        asyncio.run(judge.verdict("q", "r", "a"))
    assert judge.figures()["judge/errors"] == 1 and "HTTP 400" in records(tmp_path)[-1]["error"]


def test_an_unparsed_verdict_scores_the_episode_zero_with_an_error(tmp_path):
    judge, _ = make_judge(tmp_path, ["maybe", "yes", "no"])
    caller = GuardedCaller(5.0)

    async def generate(history, new_messages, tools):
        from backends.rollout.environments import TurnText

        return TurnText("4", "4")

    async def episode(row):
        return await run_episode(lambda: JudgedEnvironment(judge, MathEnvironment()), row, generate, caller, 1)

    failed = asyncio.run(episode({"prompt": "2+2?", "answer": "4"}))
    assert failed.reward == 0.0 and "UnparsedVerdict" in failed.error and "none of the labels" in failed.error
    judged = asyncio.run(episode({"prompt": "2+2?", "answer": "4"}))
    assert judged.error is None and judged.reward == 1.0
    assert failed.env_metrics == judged.env_metrics == {"reference_reward": 1.0}  # math-verify's check
    unchecked = asyncio.run(episode({"prompt": "2+2?"}))  # no reference answer: nothing to compare
    assert unchecked.env_metrics == {} and "Reference answer: \n" in records(tmp_path)[-1]["prompt"]
    first, second, _ = records(tmp_path)
    assert "Question: 2+2?\nReference answer: 4\nResponse: 4" in first["prompt"]
    assert second["reference_reward"] == 1.0  # math-verify's check of the same response
    assert judge.figures()["judge/agreement"] == 1.0


# ------------------------------------------------------------------------------------- checks and plan


def rl_recipe(tmp_path, rl: dict, data: dict | None = None) -> Recipe:
    base = {"name": "t", "model": {"init": {}, "tokenizer": "char"}, "data": data or {"task": "addition"}}
    return Recipe.model_validate({**base, "rl": {"init_from": "/models/student", **rl}})


def write_recipe(tmp_path, rl_lines: str, data: str = 'task = "addition"', judge_lines: str = "") -> str:
    model_dir(tmp_path / "student", VOCAB)
    model_dir(tmp_path / "judge", {"x": 0, "y": 1})  # a judge reads text: any tokenizer
    path = tmp_path / "judge.toml"
    path.write_text(
        f'name = "j"\n[model]\ninit = {{}}\ntokenizer = "char"\n[data]\n{data}\n'
        f'[rl]\ninit_from = "student"\n{rl_lines}\n[rl.judge]\nmodel = "judge"\n{judge_lines}'
    )
    return str(path)


@pytest.mark.parametrize(
    "rl_lines, data, message",
    [
        ('reward = "mod:fn"', 'task = "addition"', "rl.reward: set rl.reward or [rl.judge], not both"),
        ('agent = "mod:fn"', 'task = "addition"', "rl.judge: the judge scores single-turn answers"),
        ("max_turns = 2", 'task = "lookup"', "these episodes are scored by the environment"),
    ],
)
def test_validation_refuses_a_judge_beside_another_scorer(tmp_path, rl_lines, data, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path, rl_lines, data))
    assert message in str(err.value)


def test_labels_beside_a_number_verdict_are_refused(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path, "", judge_lines='verdict = "number"\nlabels = { a = 1.0 }\n'))
    assert 'rl.judge.labels: labels act only with verdict = "label" or "regex"' in str(err.value)


def test_a_judge_with_any_vocabulary_loads(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path, ""))
    assert recipe.rl.judge.model == str(tmp_path / "judge")


def test_the_judge_engines_come_after_the_teachers(tmp_path):
    rl = {"distillation": {"teacher": "/models/teacher"}, "judge": {"model": str(model_dir(tmp_path / "j", VOCAB))}}
    recipe = rl_recipe(tmp_path, rl).model_copy(
        update={
            "inference": Recipe.model_fields["inference"].default_factory().model_copy(update={"max_model_len": 128})
        }
    )
    plan = build_plan(recipe, "rl", tmp_path / "run", machine=MachineFacts(cpu_cores=(0, 1, 2), python="/p"))
    names = [(p.name, p.devices) for p in plan.processes if p.role == "auxiliary"]
    assert names == [("teacher-0", ("cpu:1",)), ("judge-0", ("cpu:2",))]
    judge = next(p for p in plan.processes if p.name == "judge-0")
    argv = list(judge.argv)
    assert argv[argv.index("--served-model-name") + 1] == "judge"
    assert argv[argv.index("--max-model-len") + 1] == "256"  # twice the policy's, under the judge's 512 positions
    orchestrator = next(p for p in plan.processes if p.role == "orchestrator")
    given = [orchestrator.argv[i + 1] for i, a in enumerate(orchestrator.argv) if a == "--auxiliary-urls"]
    assert given == [f"{name}={plan.auxiliary_urls[name][0]}" for name in ("teacher", "judge")]


def test_judge_gpus_follow_the_teachers_and_a_layout_without_them_is_refused(tmp_path):
    rl = {"distillation": {"teacher": "/t", "tensor_parallel": 2}, "judge": {"model": "/j", "engines": 2}}
    recipe = rl_recipe(tmp_path, rl).model_copy(update={"trainer": Recipe.model_fields["trainer"].default_factory()})
    six = MachineFacts(cpu_cores=(0,), gpus=tuple(range(6)))
    plan = build_plan(recipe, "rl", tmp_path / "run", machine=six)
    devices = {p.name: p.devices for p in plan.processes if p.role in ("engine", "auxiliary")}
    assert devices == {
        "engine-0": ("cuda:1",),
        "teacher-0": ("cuda:2", "cuda:3"),
        "judge-0": ("cuda:4",),
        "judge-1": ("cuda:5",),
    }
    (problem,) = feasibility_problems(recipe, MachineFacts(cpu_cores=(0,), gpus=tuple(range(5))))
    assert (
        "needs 6 GPUs (1 trainer ranks + 1 for 1 engines + 2 for the teacher's engines + 2 for the judge's"
        in problem.message
    )


def test_cpu_judge_engines_take_no_tensor_parallelism(tmp_path):
    recipe = rl_recipe(tmp_path, {"judge": {"model": "/j", "tensor_parallel": 2}})
    problems = feasibility_problems(recipe, CPU2)
    assert [".".join(p.path) for p in problems] == ["rl.judge.tensor_parallel"]


# ------------------------------------------------------------------------------------- memory estimates

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "model_configs"


def config_dir(tmp_path, name: str) -> str:
    target = tmp_path / name
    target.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", target / "config.json")
    return str(target)


def test_the_estimates_count_a_teachers_and_a_judges_engines(tmp_path):
    student, teacher = config_dir(tmp_path, "qwen2.5-0.5b-instruct"), config_dir(tmp_path, "qwen2.5-7b-instruct")
    rl = {"init_from": student, "distillation": {"teacher": teacher}, "judge": {"model": student, "engines": 2}}
    recipe = Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": student},
            "data": {"task": "addition"},
            "rl": rl,
            "inference": {"max_model_len": 1024},
        }
    )
    shape = trained_shape(recipe, tmp_path)
    est = estimate(recipe, shape, Hardware(8, 80 * GIB, None))
    teacher_fit, judge_fit = est.auxiliaries
    assert (teacher_fit.model.name, judge_fit.model.name) == ("teacher", "judge")
    assert teacher_fit.memory.weights > 10 * est.engine.weights  # 7B beside 0.5B, both bf16
    assert judge_fit.memory.weights == est.engine.weights and judge_fit.memory.trajectory_tokens == 2048
    lines = engine_lines(est, Hardware(8, 80 * GIB, None))
    assert lines[1].startswith("1 teacher engine x tensor parallel 1: weights 14.2 GiB a GPU")
    assert lines[2].startswith("2 judge engines x tensor parallel 1:")
    assert memory_problems(recipe, est, Hardware(8, 80 * GIB, None)) == []
    small = Hardware(8, 12 * GIB, None)  # the 7B teacher's weights alone exceed 0.85 x 12 GiB
    problems = memory_problems(recipe, estimate(recipe, shape, small), small)
    assert [p.path for p in problems if "teacher" in p.message] == [("rl", "distillation", "tensor_parallel")]


def test_an_empty_plain_text_prompt_is_not_asked_and_gives_no_verdict(tmp_path):
    """A template of "{response}" alone and an empty response: an engine would refuse the request
    (HTTP 400); the judge asks nothing and the episode has no verdict, counted and recorded."""
    judge, engine = make_judge(tmp_path, [], chat=False, verdict="number", template="{response}")
    with pytest.raises(UnparsedVerdict, match="prompt is empty"):
        asyncio.run(judge.verdict("q", "", None))
    assert engine.bodies == [] and judge.figures()["judge/unparsed"] == 1
    (record,) = records(tmp_path)
    assert record["prompt"] == "" and record["reply"] is None and "prompt is empty" in record["error"]


def test_a_request_cancelled_at_the_end_of_a_run_is_neither_counted_nor_recorded(tmp_path):
    judge, _ = make_judge(tmp_path, [])

    async def cancelled() -> None:
        async def never_answers(path, body):
            await asyncio.sleep(3600)

        judge.engines.post = never_answers
        task = asyncio.create_task(judge.verdict("q", "r", "a"))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert judge.figures() == {"judge/verdicts": 0, "judge/unparsed": 0, "judge/errors": 0}
    assert not (tmp_path / "verdicts.jsonl").exists()
