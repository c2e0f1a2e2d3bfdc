"""A judge model as the reward (``rl.judge``) end to end: ``skyrl rl`` on a tiny recipe whose judge
is the tiny model trained for a few seconds on a cyclic pattern (``train_pattern_policy``: its greedy
next character follows the last one, 0-9 then a-z), saved without a chat template so it reads the
template as plain text, served by an engine of its own.

The template ends with the response, the judge writes one token and the verdict is a number: the
judge's reply is a digit (parsed) for most responses and a letter (unparseable) for others. The test
checks that the judge's engine started and is gone after the run, that every verdict is recorded
with its prompt and reply and agrees with the parser, that every unparsed reply is counted
(``judge/unparsed``) with a record in ``sample_errors.jsonl`` and a reward of 0, and that the rewards
the learner trained on are the judge's verdicts.
"""

from __future__ import annotations

import json

import httpx
import pytest

from backends.rollout.judge import UnparsedVerdict, parse_verdict
from skyrl_contracts.schema import JudgeConfig
from tests.integration.cli_runs import events, run_skyrl
from tests.integration.conftest import train_pattern_policy
from tests.integration.test_distillation import processes_naming
from tests.recipes import RL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration


def save_plain_text_judge(tiny_model_dir, judge_dir) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.models.loading import save_hf

    judge = train_pattern_policy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    save_hf(judge, AutoTokenizer.from_pretrained(tiny_model_dir), judge_dir)
    config_file = judge_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))
    (judge_dir / "chat_template.jinja").unlink(missing_ok=True)


def test_judge_reward_run(tmp_path, tiny_model_dir):
    judge_dir = tmp_path / "judge"
    save_plain_text_judge(tiny_model_dir, judge_dir)
    judge = {"model": str(judge_dir), "template": "{response}", "verdict": "number", "max_tokens": 1}
    recipe = tiny_recipe(
        RL,
        name="judged",
        data={"eval_size": 8},
        trainer={"ranks": 1},
        rl={"init_from": str(tiny_model_dir), "steps": 2, "keep_batches": True, "judge": judge},
    )
    run_dir = tmp_path / "run"
    run_skyrl("rl", write_recipe(tmp_path / "judged.toml", recipe), "--run-dir", run_dir, "--pool", "none")

    # the judge's engine started, served, and is gone
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [p["name"] for p in plan["processes"] if p["role"] == "auxiliary"] == ["judge-0"]
    assert processes_naming(str(judge_dir)) == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plan['auxiliary_urls']['judge'][0]}/health", timeout=2.0)

    # every verdict is recorded, and is what the parser reads in the judge's reply
    config = JudgeConfig.model_validate(judge)
    records = [json.loads(line) for line in (run_dir / "judge_verdicts.jsonl").read_text().splitlines()]
    unparsed = 0
    for record in records:
        assert record["reply"] is not None
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

    # the learner trained on the judge's verdicts (0 where the reply was unparsed)
    verdicts = {r["prompt"]: r["verdict"] or 0.0 for r in records}  # the template is the response alone
    trained = [s for step in (0, 1) for s in json.loads((run_dir / f"batches/step-{step}.json").read_text())["samples"]]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert trained
    for s in trained:
        assert s["reward"] == verdicts[tokenizer.decode(s["response_ids"], skip_special_tokens=True)]
