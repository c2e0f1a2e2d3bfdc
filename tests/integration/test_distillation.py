"""On-policy distillation (``rl.distillation``) end to end: ``skyrl rl`` on a tiny recipe whose teacher
is the tiny model trained for a few seconds on a pattern (``train_pattern_policy``), saved with the
same char tokenizer, served by an fp32 engine of its own.

Pure distillation (``task_reward = false``) from a random student: on 2-digit addition the student
earns reward 0 on every sample, so the task reward's advantage is zero everywhere and GRPO alone
would leave the weights as they are; the teacher's per-token term trains them. The test checks
that the teacher's engine started and is gone after the run, that the teacher logprobs recorded in
the batches equal a transformers forward of the teacher on the same tokens (fp32 engine: ~1e-6,
asserted 1e-4), only on the tokens the policy sampled, and that ``distill/reverse_kl`` and
``timing/teacher_s`` are reported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from tests.integration.cli_runs import events, run_skyrl
from tests.integration.conftest import train_pattern_policy
from tests.recipes import RL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration
BOUND = 1e-4  # fp32 engine against fp32 transformers (tests/integration/test_weight_sync_matrix.py)


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


def test_pure_distillation_run(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.models.loading import save_hf

    teacher_dir = tmp_path / "teacher"
    teacher = train_pattern_policy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    save_hf(teacher, AutoTokenizer.from_pretrained(tiny_model_dir), teacher_dir)
    recipe = tiny_recipe(
        RL,
        name="distill",
        data={"eval_size": 8},
        trainer={"ranks": 1},
        rl={
            "init_from": str(tiny_model_dir),
            "steps": 2,
            "keep_batches": True,
            "distillation": {"teacher": str(teacher_dir), "task_reward": False, "dtype": "float32"},
        },
    )
    run_dir = tmp_path / "run"
    run_skyrl("rl", write_recipe(tmp_path / "distill.toml", recipe), "--run-dir", run_dir, "--pool", "none")

    # the teacher's engine started, served, and is gone
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [p["name"] for p in plan["processes"] if p["role"] == "auxiliary"] == ["teacher-0"]
    assert "teacher" in (run_dir / "logs/teacher-0.log").read_text()
    assert processes_naming(str(teacher_dir)) == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plan['auxiliary_urls']['teacher'][0]}/health", timeout=2.0)

    # the recorded teacher logprobs are the teacher's, on the sampled tokens only
    checked = 0
    for step in (0, 1):
        for s in json.loads((run_dir / f"batches/step-{step}.json").read_text())["samples"]:
            assert s["reward"] == 0.0
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
    # every reward is 0, so the task reward's advantage is 0: only the teacher's term moved the weights
    trained = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), initial.parameters()))
    assert moved > 1e-4
