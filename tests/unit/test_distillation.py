"""On-policy distillation (``rl.distillation``): the schema and its checks, the teacher's engines in
the plan, the teacher's scoring requests, and the per-token advantage against hand-computed values."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest
import torch

from backends.rollout.teacher import Teacher, TeacherError, parse_scores, scoring_request
from backends.rollout.trainer_feed import distillation_metrics
from backends.train.rl.advantages import reverse_kl_advantages
from backends.train.rl.step import batch_advantages
from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.feasibility import feasibility_problems, load_feasible_recipe
from skyrl_cli.plan.machine import MachineFacts
from skyrl_contracts.errors import RecipeError
from skyrl_contracts.samples import Sample
from skyrl_contracts.schema import AdvantageConfig, Recipe, RlConfig

CPU2 = MachineFacts(cpu_cores=(0, 1), python="/venv/bin/python", port_finder=lambda n: list(range(9000, 9000 + n)))
GPU4 = MachineFacts(cpu_cores=(0, 1), gpus=(0, 1, 2, 3))


def model_dir(path: Path, vocab: dict[str, int], positions: int = 512) -> Path:
    """A model directory as validation reads it: config.json and tokenizer.json only."""
    path.mkdir(parents=True)
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1}
    config |= {"max_position_embeddings": positions, "vocab_size": len(vocab), "intermediate_size": 128}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer = {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": []}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


VOCAB = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "a": 3, "b": 4}


def write(path: Path, rl_extra: str = "", extra: str = "") -> Path:
    path.write_text(
        'name = "t"\n[model]\ninit = {}\ntokenizer = "char"\n[data]\ntask = "addition"\n'
        f'[rl]\ninit_from = "student"\n{rl_extra}\n[rl.distillation]\nteacher = "teacher"\n{extra}'
    )
    return path


def recipe(distillation: dict | None = None, **sections) -> Recipe:
    rl = {"init_from": "/models/student", **sections.pop("rl", {})}
    if distillation is not None:
        rl["distillation"] = {"teacher": "/models/teacher", **distillation}
    base = {"name": "t", "model": {"init": {}, "tokenizer": "char"}, "data": {"task": "addition"}, "rl": rl}
    return Recipe.model_validate({**base, **sections})


# ------------------------------------------------------------------------------------- schema


def test_the_schema_defaults_and_limits():
    rl = RlConfig.model_validate({"distillation": {"teacher": "/t"}})
    assert (rl.distillation.coef, rl.distillation.task_reward, rl.distillation.engines) == (1.0, True, 1)
    assert RlConfig().distillation is None
    for bad in ({}, {"teacher": "/t", "coef": 0}, {"teacher": "/t", "engines": 0}, {"teacher": "/t", "x": 1}):
        with pytest.raises(ValueError):
            RlConfig.model_validate({"distillation": bad})


def test_same_tokenizer_passes_and_another_is_refused_naming_both(tmp_path):
    model_dir(tmp_path / "student", VOCAB)
    model_dir(tmp_path / "teacher", VOCAB)
    loaded = load_feasible_recipe(write(tmp_path / "r.toml"), machine=CPU2)
    assert loaded.rl.distillation.teacher == str(tmp_path / "teacher")

    other = tmp_path / "other"
    model_dir(other / "teacher", {**VOCAB, "c": 5})
    model_dir(other / "student", VOCAB)
    path = write(other / "r.toml")
    with pytest.raises(RecipeError) as info:
        load_feasible_recipe(path, machine=CPU2)
    assert info.value.problems == [
        f"{path}:11: rl.distillation.teacher: not the policy's tokenizer: vocabularies differ: 5 tokens in "
        f"{other / 'student'}, 6 in {other / 'teacher'}"
    ]


def test_swapped_ids_of_the_same_tokens_are_another_vocabulary(tmp_path):
    model_dir(tmp_path / "student", VOCAB)
    model_dir(tmp_path / "teacher", {**VOCAB, "a": 4, "b": 3})
    with pytest.raises(RecipeError, match="vocabularies differ: the same size"):
        load_feasible_recipe(write(tmp_path / "r.toml"), machine=CPU2)


def test_pure_distillation_refuses_the_keys_of_the_task_reward(tmp_path):
    model_dir(tmp_path / "student", VOCAB)
    model_dir(tmp_path / "teacher", VOCAB)
    rl = 'advantage = { kind = "rloo" }\ndynamic_sampling = { enabled = true }'
    path = write(tmp_path / "r.toml", rl, "task_reward = false\n")
    with pytest.raises(RecipeError) as info:
        load_feasible_recipe(path, machine=CPU2)
    assert [line.split(": ", 2)[1] for line in info.value.problems] == ["rl.advantage", "rl.dynamic_sampling.enabled"]
    # the same keys act beside the task reward
    load_feasible_recipe(write(tmp_path / "r.toml", rl), machine=CPU2)


def test_a_missing_teacher_is_a_missing_file(tmp_path):
    model_dir(tmp_path / "student", VOCAB)
    with pytest.raises(RecipeError, match=r":11: rl.distillation.teacher: file not found: teacher"):
        load_feasible_recipe(write(tmp_path / "r.toml"), machine=CPU2)


def test_a_teacher_the_recipes_own_sft_stage_writes_passes_until_the_rl_stage_starts(tmp_path, monkeypatch):
    """``teacher = "run:t/sft"`` in recipe "t" with an [sft] section: `skyrl sft` writes it, so
    validation lets it through (it said "run skyrl sft first", and `skyrl sft` refused the recipe);
    the RL stage checks it is there when it starts."""
    from skyrl_cli.stages.local import ensure_auxiliary_models
    from skyrl_contracts.errors import UsageError

    monkeypatch.chdir(tmp_path)
    model_dir(tmp_path / "student", VOCAB)
    own = write(tmp_path / "r.toml").read_text().replace('teacher = "teacher"', 'teacher = "run:t/sft"')
    (tmp_path / "r.toml").write_text(own + "[sft]\nsteps = 10\n")
    loaded = load_feasible_recipe(tmp_path / "r.toml", machine=CPU2)
    with pytest.raises(UsageError, match=r"rl.distillation.teacher: no model at .*runs/t/sft/final; run `skyrl sft`"):
        ensure_auxiliary_models(loaded)
    model_dir(tmp_path / "runs/t/sft/final", VOCAB)
    ensure_auxiliary_models(loaded)  # written by then
    # without an [sft] section nothing would write it: a missing file, as before
    (tmp_path / "other.toml").write_text(own.replace('name = "t"', 'name = "u"').replace("run:t/sft", "run:u/sft"))
    with pytest.raises(RecipeError, match=r"rl.distillation.teacher: file not found: run:u/sft"):
        load_feasible_recipe(tmp_path / "other.toml", machine=CPU2)


def test_feasibility_counts_the_teacher_engines_and_its_positions(tmp_path):
    messages = lambda r, m: [f"{'.'.join(p.path)}: {p.message}" for p in feasibility_problems(r, m, tmp_path)]  # noqa: E731
    r = recipe({"engines": 2, "tensor_parallel": 1}, trainer={"ranks": 1}, inference={"engines": 2})
    assert messages(r, GPU4) == [
        "trainer.ranks: the layout needs 5 GPUs (1 trainer ranks + 2 for 2 engines + 2 for the teacher's engines) "
        "but 4 are visible"
    ]
    assert messages(recipe({"tensor_parallel": 2}), CPU2) == [
        "rl.distillation.tensor_parallel: 2 GPUs per teacher engine, but the engines run on CPU"
    ]
    model_dir(tmp_path / "short", VOCAB, positions=128)
    r = recipe({"teacher": str(tmp_path / "short")}, inference={"max_model_len": 256})
    assert messages(r, CPU2) == [
        "rl.distillation.teacher: the teacher has 128 positions, fewer than a trajectory may hold "
        "(inference.max_model_len = 256); lower inference.max_model_len to 128"
    ]


# --------------------------------------------------------------------------------------- plan


def test_the_plan_starts_the_teacher_engines_beside_the_policys(tmp_path):
    r = recipe({"engines": 1, "dtype": "float32"}, inference={"engines": 1, "max_model_len": 128})
    plan = build_plan(r, "rl", tmp_path, machine=CPU2)
    (teacher,) = [p for p in plan.processes if p.role == "auxiliary"]
    assert teacher.name == "teacher-0" and teacher.devices == ("cpu:1",)  # the core after engine-0's
    argv = list(teacher.argv)
    assert argv[3] == "/models/teacher"
    assert argv[argv.index("--served-model-name") + 1] == "teacher"
    assert argv[argv.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--max-model-len") + 1] == "128"
    assert "--enable-lora" not in argv and "--worker-extension-cls" not in argv
    assert plan.auxiliary_urls == {"teacher": (f"http://127.0.0.1:{teacher.ports[0]}",)}
    orchestrator = next(p for p in plan.processes if p.role == "orchestrator")
    assert (
        orchestrator.argv[orchestrator.argv.index("--auxiliary-urls") + 1]
        == f"teacher={plan.auxiliary_urls['teacher'][0]}"
    )
    order = plan.start_order()
    assert [p.name for p in order.auxiliaries] == ["teacher-0"] and [p.name for p in order.engines] == ["engine-0"]
    assert teacher.ports[0] not in {port for p in plan.processes if p is not teacher for port in p.ports}


def test_without_a_teacher_the_plan_is_unchanged(tmp_path):
    plan = build_plan(recipe(), "rl", tmp_path, machine=CPU2)
    assert plan.auxiliary_urls == {} and not [p for p in plan.processes if p.role == "auxiliary"]
    orchestrator = next(p for p in plan.processes if p.role == "orchestrator")
    assert "--auxiliary-urls" not in orchestrator.argv


def test_teacher_engines_take_the_gpus_after_the_policy_engines(tmp_path):
    r = recipe({"engines": 1, "tensor_parallel": 2}, trainer={"ranks": 1}, inference={"engines": 1})
    plan = build_plan(r, "rl", tmp_path, machine=MachineFacts(cpu_cores=(0,), gpus=(0, 1, 2, 3)))
    engine = next(p for p in plan.processes if p.role == "engine")
    teacher = next(p for p in plan.processes if p.role == "auxiliary")
    assert engine.devices == ("cuda:1",) and teacher.devices == ("cuda:2", "cuda:3")


# ---------------------------------------------------------------------------------- advantages


def sample(uid="p", index=0, reward=0.0, rollout=(-1.0, -2.0, -0.5), teacher=(-0.5, -3.0, -0.5), mask=(1, 1, 1)):
    n = len(rollout)
    return Sample(
        uid,
        index,
        [1, 2],
        list(range(3, 3 + n)),
        list(mask),
        list(rollout),
        reward=reward,
        teacher_logprobs=list(teacher),
    )


def test_reverse_kl_advantage_by_hand():
    teacher = torch.tensor([[-0.5, -3.0, -0.5]])
    sampling = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert reverse_kl_advantages(teacher, sampling, mask, 2.0).tolist() == [[1.0, -2.0, 0.0]]


def distill_rl(task_reward: bool, coef: float = 1.0) -> RlConfig:
    return RlConfig.model_validate(
        {
            "distillation": {"teacher": "/t", "coef": coef, "task_reward": task_reward},
            "advantage": {"std_normalize": False},
        }
    )


def test_pure_distillation_trains_without_the_task_reward():
    # rewards 1 and 0 would give GRPO advantages +0.5 / -0.5; with task_reward = false only the teacher counts
    samples = [sample(reward=1.0), sample(index=1, reward=0.0, teacher=(-1.0, -2.0, -1.5), mask=(1, 0, 1))]
    adv = batch_advantages(samples, distill_rl(task_reward=False, coef=0.5))
    assert adv.tolist() == [[0.25, -0.5, 0.0], [0.0, 0.0, -0.5]]  # 0.5 x (teacher - sampling), masked


def test_the_mix_adds_the_teacher_term_to_the_task_advantage():
    samples = [sample(reward=1.0), sample(index=1, reward=0.0, mask=(1, 0, 1))]
    adv = batch_advantages(samples, distill_rl(task_reward=True))
    assert adv.tolist() == [[1.0, -0.5, 0.5], [0.0, 0.0, -0.5]]  # GRPO +-0.5 plus (0.5, -1, 0) under each mask


def test_without_a_teacher_the_advantages_are_the_task_reward_s():
    samples = [sample(reward=1.0), sample(index=1, reward=0.0)]
    rl = RlConfig(advantage=AdvantageConfig(std_normalize=False))
    assert batch_advantages(samples, rl).tolist() == [[0.5, 0.5, 0.5], [-0.5, -0.5, -0.5]]


def test_a_sampled_token_without_a_teacher_logprob_is_an_error():
    bare = Sample("p", 0, [1], [3], [1], [-1.0])
    with pytest.raises(ValueError, match="no teacher logprobs"):
        batch_advantages([bare, sample(index=1)], distill_rl(task_reward=False))


def test_teacher_logprobs_round_trip_and_must_match_the_response():
    s = sample()
    assert Sample.from_dict(json.loads(json.dumps(s.to_dict()))).teacher_logprobs == [-0.5, -3.0, -0.5]
    with pytest.raises(ValueError, match="teacher_logprobs"):
        Sample("p", 0, [1], [3, 4], [1, 1], [-1.0, -1.0], teacher_logprobs=[-1.0])


def test_reverse_kl_metric_is_the_mean_over_sampled_tokens():
    samples = [sample(mask=(1, 1, 0)), sample(index=1, teacher=(-1.0, -1.0, -1.0))]
    # (-1 + 0.5) + (-2 + 3) over the first's 2 tokens, then 0 + (-1) + 0.5 over the second's 3
    assert math.isclose(distillation_metrics(samples)["distill/reverse_kl"], (-0.5 + 1.0 + 0.0 - 1.0 + 0.5) / 5)
    assert distillation_metrics([Sample("p", 0, [1], [3], [1], [-1.0])]) == {}


# ------------------------------------------------------------------------------------- scoring


def engine_answer(ids: list[int], prompt_lps: list[float], last_lp: float) -> dict:
    """A /v1/completions answer to ``scoring_request(ids)`` as vLLM writes it."""
    per_position = [None] + [{str(t): {"logprob": lp, "rank": 1}} for t, lp in zip(ids[1:-1], prompt_lps)]
    return {
        "choices": [
            {
                "index": 0,
                "prompt_logprobs": per_position,
                "token_ids": [ids[-1]],
                "logprobs": {"token_logprobs": [last_lp]},
            }
        ]
    }


def test_scoring_request_forces_the_last_token():
    body = scoring_request([5, 6, 7, 8])
    assert body["prompt"] == [5, 6, 7] and body["allowed_token_ids"] == [8] and body["max_tokens"] == 1
    assert body["prompt_logprobs"] == 0 and body["temperature"] == 1.0
    assert parse_scores(engine_answer([5, 6, 7, 8], [-0.1, -0.2], -0.3), [5, 6, 7, 8]) == [-0.1, -0.2, -0.3]
    with pytest.raises(TeacherError, match="last token"):
        parse_scores(engine_answer([5, 6, 7, 9], [-0.1, -0.2], -0.3), [5, 6, 7, 8])


def test_teacher_scores_response_tokens_only_where_the_policy_sampled():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        ids = body["prompt"] + body["allowed_token_ids"]
        seen.append((str(request.url), ids))
        return httpx.Response(200, json=engine_answer(ids, [-float(t) / 10 for t in ids[1:-1]], -float(ids[-1]) / 10))

    async def run():
        teacher = Teacher(["http://a", "http://b"], max_retries=0)
        teacher.engines.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        s = Sample("p", 0, [1, 2], [3, 4, 5], [1, 0, 1], [-1.0, 0.0, -1.0])
        empty = Sample("p", 1, [1, 2], [], [], [])
        await teacher.score([s, empty])
        await teacher.aclose()
        return s, empty, teacher.take_seconds()

    s, empty, seconds = asyncio.run(run())
    assert seen == [("http://a/v1/completions", [1, 2, 3, 4, 5])]
    assert s.teacher_logprobs == [-0.3, 0.0, -0.5] and empty.teacher_logprobs is None and seconds > 0


def test_a_teacher_that_keeps_failing_ends_the_run():
    async def run():
        teacher = Teacher(["http://a"], max_retries=1, backoff_s=0.0)
        teacher.engines.http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503)))
        try:
            await teacher.score([sample()])
        finally:
            await teacher.aclose()

    with pytest.raises(TeacherError, match="after 2 attempts"):
        asyncio.run(run())
