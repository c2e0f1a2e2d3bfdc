"""A library environment is checked before anything starts (``skyrl_cli.plan.preflight``): by
``skyrl recipes validate`` and by ``skyrl rl`` (``--dry-run`` included), in a child process that
runs the episode runner's own ``preflight``, its reason one line after the recipe file's name.
Recipes without a library environment start no child."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from .conftest import REPO

pytest.importorskip("verifiers")
pytest.importorskip("skyrl_gym")

RECIPE = """\
name = "preflight"
[model]
init = {{ arch = "llama", hidden_size = 64, layers = 2, heads = 2 }}
tokenizer = "char"
[data]
eval_size = 1
[rl]
environment = "verifiers:vf_echo"             # tests/fixtures/vf_echo.py, next to the recipe
env_args = {{ agent = {{ harness = {{ id = "{harness}" }} }} }}
"""


@pytest.fixture
def recipe_dir(tmp_path, monkeypatch):
    shutil.copy(REPO / "tests" / "fixtures" / "vf_echo.py", tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(folder, harness: str):
    path = folder / f"{harness}.toml"
    path.write_text(RECIPE.format(harness=harness))
    return path


def test_a_verifiers_environment_that_needs_a_sandbox_is_refused_by_validate_and_by_rl(skyrl, recipe_dir):
    sandboxed = write(recipe_dir, "bash")
    for argv in (("recipes", "validate", sandboxed), ("rl", sandboxed, "--dry-run")):
        result = skyrl(*argv)
        assert result.code == 2, result
        lines = [line for line in result.err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in result.err
        assert f"{sandboxed}: rl.environment 'verifiers:vf_echo' cannot run beside the trainer" in lines[0]
        assert "seat 'agent' runs harness 'bash' in a prime runtime (a sandbox)" in lines[0]
    assert skyrl("recipes", "validate", write(recipe_dir, "null")).code == 0


def test_an_unknown_taskset_and_an_unregistered_skyrl_gym_id_are_refused_by_validate(skyrl, recipe_dir):
    chat = write(recipe_dir, "null")
    result = skyrl("recipes", "validate", chat, "--set", 'rl.environment="verifiers:vf_ehco"')
    assert result.code == 2 and "rl.environment 'verifiers:vf_ehco': ModuleNotFoundError" in result.err
    gym = ["--set", "rl.env_args={}", "--set", 'data.train="rows.jsonl"']
    (recipe_dir / "rows.jsonl").write_text("".join(f'{{"prompt": "{i}+1?"}}\n' for i in range(20)))
    result = skyrl("recipes", "validate", chat, "--set", 'rl.environment="skyrl_gym:gsm8kk"', *gym)
    assert result.code == 2, result
    assert "skyrl-gym has no environment 'gsm8kk'; did you mean gsm8k?" in result.err


def test_a_recipe_without_a_library_environment_starts_no_child(skyrl, monkeypatch):
    def no_child(*args, **kwargs):
        raise AssertionError(f"a child process started: {args}")

    monkeypatch.setattr(subprocess, "run", no_child)
    assert skyrl("recipes", "validate", "tool_use").code == 0
