"""`skyrl doctor` on this machine without --quick: DeepSpeed and vLLM import, vllm-router starts, a
gloo all-reduce runs, and with --smoke a real vLLM engine starts on the quickstart's model and
generates."""

from __future__ import annotations

import pytest

from tests.integration.cli_runs import REPO, run_skyrl

pytestmark = pytest.mark.integration


def test_doctor_with_the_engine_smoke_test_passes_on_a_set_up_machine():
    proc = run_skyrl("doctor", REPO / "recipes" / "quickstart.toml", "--smoke", "--smoke-timeout", "400", timeout=600)
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if line.startswith("fail")], proc.stdout
    names = {line[6:].split(":")[0] for line in lines if line.startswith("pass")}
    assert {
        "deepspeed imports",
        "vllm imports",
        "vllm-router starts",
        "layout",
        "ports",
        "disk",
        "engine smoke test",
    } <= names
    assert {"gloo", "nccl"} & names
    (smoke,) = [line for line in lines if line.startswith("pass  engine smoke test: ")]
    assert "started and generated" in smoke
    assert "a weight-sync round trip (untied head) gave logprobs" in smoke  # the quickstart's model is untied
    assert lines[-1].startswith("doctor: all ")
