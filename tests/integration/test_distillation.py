"""A second model in the run, end to end: ``skyrl rl --async`` on a tiny recipe with both a teacher
(``rl.distillation``) and a judge (``rl.judge``) served by engines of their own (one run, for the
suite's time: each model's checks are its own test; the sync path with a teacher, its engine pool
and its restart: ``tests/integration/test_engine_pool.py``).

Both are the tiny model trained for a few seconds on a cyclic pattern (``train_pattern_policy``: its
greedy next character follows the last one, 0-9 then a-z), saved with the same char tokenizer, in
fp32. The judge's copy has no chat template, so it reads its template as plain text.

- The teacher: the teacher logprobs recorded in the batches equal a transformers forward of the
  teacher on the same tokens (fp32 engine: ~1e-6, asserted 1e-4), only on the tokens the policy
  sampled, and ``distill/reverse_kl`` and ``timing/teacher_s`` are reported.
- The judge: the template ends with the response, the judge writes one token and the verdict is a
  number: its reply is a digit (parsed) for most responses and a letter (unparseable) for others.
  Every verdict is recorded with its prompt and reply and agrees with the parser, every unparsed
  reply is counted (``judge/unparsed``) with a record in ``sample_errors.jsonl`` and a reward of 0,
  and the rewards the learner trained on are the judge's verdicts.
- Both engines started and are gone after the run.

Pure distillation (``task_reward = false``, no reward at all) is the built-in ``distill`` recipe's
mode; here the task reward is the judge's, so the learner's advantage is GRPO's on the verdicts
plus the teacher's per-token term (``tests/unit/test_distillation.py`` checks the sum by hand).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from backends.rollout.judge import EMPTY_PROMPT, UnparsedVerdict, parse_verdict
from skyrl_contracts.schema import JudgeConfig
from tests.integration.cli_runs import events, run_skyrl
from tests.integration.conftest import train_pattern_policy
from tests.recipes import RL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration
BOUND = 1e-4  # fp32 engine against fp32 transformers (tests/integration/test_weight_sync_matrix.py)
JUDGE = {"template": "{response}", "verdict": "number", "max_tokens": 1}


def processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line holds ``text`` (this test's own model path)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def second_model_run(tmp_path_factory, tiny_model_dir):
    """(run dir, teacher model in transformers, teacher dir, judge dir): two --async RL steps of the
    tiny recipe from the tiny model, with the teacher and the judge (the sync path with a teacher:
    tests/integration/test_engine_pool.py)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.models.loading import save_hf

    root = tmp_path_factory.mktemp("second-model")
    teacher_dir, judge_dir = root / "teacher", root / "judge"
    teacher = train_pattern_policy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    save_hf(teacher, AutoTokenizer.from_pretrained(tiny_model_dir), teacher_dir)
    shutil.copytree(teacher_dir, judge_dir)
    drop_chat_template(judge_dir)
    recipe = tiny_recipe(
        RL,
        name="second-model",
        data={"eval_size": 8},
        trainer={"ranks": 1},
        rl={
            "init_from": str(tiny_model_dir),
            "steps": 2,
            "keep_batches": True,
            "distillation": {"teacher": str(teacher_dir), "dtype": "float32"},
            "judge": {"model": str(judge_dir), "dtype": "float32", **JUDGE},
        },
    )
    run_dir = root / "run"
    run_skyrl("rl", write_recipe(root / "second-model.toml", recipe), "--run-dir", run_dir, "--pool", "none", "--async")
    return run_dir, teacher, teacher_dir, judge_dir


def drop_chat_template(model_dir: Path) -> None:
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)


def batch_samples(run_dir: Path) -> list[dict]:
    return [s for step in (0, 1) for s in json.loads((run_dir / f"batches/step-{step}.json").read_text())["samples"]]


def test_both_engines_started_served_and_are_gone(second_model_run):
    run_dir, _, teacher_dir, judge_dir = second_model_run
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [p["name"] for p in plan["processes"] if p["role"] == "auxiliary"] == ["teacher-0", "judge-0"]
    assert "teacher" in (run_dir / "logs/teacher-0.log").read_text()
    for model_dir in (teacher_dir, judge_dir):
        assert processes_naming(str(model_dir)) == []
    for name in ("teacher", "judge"):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{plan['auxiliary_urls'][name][0]}/health", timeout=2.0)


def test_recorded_teacher_logprobs_are_the_teachers_on_the_sampled_tokens(second_model_run):
    import torch

    run_dir, teacher, _, _ = second_model_run
    checked = 0
    for s in batch_samples(run_dir):
        ids = s["prompt_ids"] + s["response_ids"]
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([ids])).logits[0].float()
        expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        expected = expected[len(s["prompt_ids"]) - 1 :].tolist()
        for got, want, sampled in zip(s["teacher_logprobs"], expected, s["loss_mask"]):
            assert abs(got - want) < BOUND if sampled else got == 0.0
            checked += sampled
    assert checked > 0
    assert len(events(run_dir, "distill/reverse_kl")) == 2
    assert all(t > 0 for _, t in events(run_dir, "timing/teacher_s"))


def test_judge_verdicts_are_recorded_counted_and_are_the_rewards(second_model_run, tiny_model_dir):
    from transformers import AutoTokenizer

    run_dir, _, _, judge_dir = second_model_run
    config = JudgeConfig.model_validate({"model": str(judge_dir), **JUDGE})
    records = [json.loads(line) for line in (run_dir / "judge_verdicts.jsonl").read_text().splitlines()]
    unparsed = 0
    for record in records:
        if record["prompt"] == "":  # an empty response: the plain-text judge is not asked
            assert record["reply"] is None and record["error"] == EMPTY_PROMPT
            unparsed += 1
            continue
        try:
            assert record["verdict"] == parse_verdict(record["reply"], config)
        except UnparsedVerdict:
            assert record["verdict"] is None and record["error"]
            unparsed += 1
    parsed = len(records) - unparsed
    assert unparsed > 0 and parsed > 0, f"{unparsed} unparsed of {len(records)}: the test needs both"
    assert events(run_dir, "judge/unparsed")[-1][1] == unparsed
    assert events(run_dir, "judge/verdicts")[-1][1] == parsed
    errors = [json.loads(line) for line in (run_dir / "sample_errors.jsonl").read_text().splitlines()]
    assert sum("UnparsedVerdict" in e["error"] for e in errors) == unparsed
    # the run ends with a warning where most replies gave no verdict (skyrl_contracts.health)
    health = json.loads((run_dir / "summary.json").read_text()).get("health", {})
    assert ("judge_no_verdict_share" in health) == (unparsed > parsed), health

    # the learner trained on the judge's verdicts (0 where the reply was unparsed)
    verdicts = {r["prompt"]: r["verdict"] or 0.0 for r in records}  # the template is the response alone
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trained = batch_samples(run_dir)
    assert trained
    for s in trained:
        assert s["reward"] == verdicts[tokenizer.decode(s["response_ids"], skip_special_tokens=True)]
