"""`skyrl quantize`: its plan (QAT: the SFT trainer; PTQ: the quantizer job), its refusals, and the
quantization checks of the broken-recipe corpus, which its --dry-run refuses line for line like
`skyrl recipes validate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_cli.plan.feasibility import feasibility_problems
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.quantize import stage_recipe
from skyrl_contracts.schema import Recipe

from .conftest import REPO
from .test_recipes_cli import expectations

QUANT_BROKEN = sorted((REPO / "tests" / "recipes_broken").glob("quant_*.toml"))
CPU2 = MachineFacts(cpu_cores=(0, 1))

RECIPE = """name = "q"
[model]
init = { hidden_size = 128, layers = 2, heads = 4 }
tokenizer = "char"
[data]
task = "addition"
[sft]
steps = 7
[trainer]
ranks = 1
[quantization]
group_size = 64
"""


@pytest.fixture
def recipe_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "q.toml"
    path.write_text(RECIPE)
    return path


def dry_run(skyrl, *args) -> dict:
    result = skyrl("quantize", *args, "--dry-run", "--json")
    assert result.code == 0, result.err
    return json.loads(result.out)


def test_int4_qat_plans_the_sft_trainer_on_the_sft_output(skyrl, recipe_file, tmp_path):
    plan = dry_run(skyrl, recipe_file, "--int4-qat")
    (trainer,) = plan["processes"]
    assert plan["stage"] == "quantize" and plan["run_dir"] == str(tmp_path / "runs" / "q" / "quantize")
    assert trainer["role"] == "trainer" and trainer["argv"][-3:] == ["backends.train.sft", "--run-dir", plan["run_dir"]]


def test_ptq_plans_one_quantizer_job(skyrl, recipe_file, tmp_path):
    plan = dry_run(skyrl, recipe_file, "--ptq", "--run-dir", tmp_path / "out")
    (job,) = plan["processes"]
    assert (job["role"], job["kind"]) == ("quantizer", "job")
    assert job["argv"][1:] == [
        "-m",
        "backends.quant.export",
        "--run-dir",
        str(tmp_path / "out"),
        "--model",
        str(tmp_path / "runs" / "q" / "sft" / "final"),
    ]


def test_the_stage_recipe_trains_the_source_with_its_own_tokenizer(tmp_path):
    model = {"init": {}, "tokenizer": "char"}
    recipe = Recipe.model_validate(
        {
            "name": "q",
            "model": model,
            "data": {"task": "addition"},
            "sft": {},
            "rl": {},
            "quantization": {"group_size": 64},
        }
    )
    staged = stage_recipe(recipe, tmp_path / "src", qat=True)
    assert (staged.model.path, staged.model.init, staged.model.tokenizer) == (str(tmp_path / "src"), None, "auto")
    assert staged.quantization.int4_qat and staged.quantization.group_size == 64
    assert not stage_recipe(recipe, tmp_path / "src", qat=False).quantization.int4_qat
    assert Recipe.model_validate_json(staged.model_dump_json(by_alias=True)) == staged  # what the process reads back


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "error: give one of --int4-qat (quantization-aware training) and --ptq (round-to-nearest)"),
        (
            ("--int4-qat", "--ptq"),
            "error: give one of --int4-qat (quantization-aware training) and --ptq (round-to-nearest)",
        ),
        (
            ("--ptq", "--resume", "--dry-run"),
            "error: --resume continues an --int4-qat run; --ptq has nothing to resume",
        ),
    ],
)
def test_flags_that_cannot_go_together(skyrl, recipe_file, args, message):
    result = skyrl("quantize", recipe_file, *args)
    assert (result.code, result.err.strip()) == (2, message)


def test_a_recipe_needs_a_quantization_section(skyrl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "q.toml"
    path.write_text(RECIPE.split("[quantization]")[0])
    result = skyrl("quantize", path, "--ptq", "--dry-run")
    assert (result.code, result.err) == (2, f"error: recipe {path} has no [quantization] section\n")
    assert skyrl("quantize", path, "--ptq", "--dry-run", "--set", "quantization.group_size=32").code == 0


def test_qat_needs_sft_steps_and_a_source_that_exists(skyrl, recipe_file, tmp_path):
    model = REPO / "tests" / "recipes_broken" / "models" / "positions_256"
    recipe_file.write_text(RECIPE.replace("[sft]\nsteps = 7\n", "[rl]\n") + f'init_from = "{model}"\n')
    refused = skyrl("quantize", recipe_file, "--int4-qat", "--dry-run")
    assert (
        refused.err == "error: --int4-qat fine-tunes for the recipe's sft.steps, but the recipe has no [sft] section\n"
    )
    recipe_file.write_text(RECIPE)
    missing = skyrl("quantize", recipe_file, "--ptq")
    final = tmp_path / "runs" / "q" / "sft" / "final"
    assert (missing.code, missing.err) == (
        2,
        f"error: quantization.init_from: no model at {final}; run `skyrl sft {recipe_file}` first\n",
    )


@pytest.mark.parametrize("path", QUANT_BROKEN, ids=lambda p: p.stem)
def test_quantize_dry_run_refuses_the_quantization_corpus_like_validate(skyrl, path, monkeypatch):
    monkeypatch.chdir(REPO)
    expected, args = expectations(path)
    rel = str(path.relative_to(REPO))
    validated = skyrl("recipes", "validate", rel, *args)
    planned = skyrl("quantize", rel, "--int4-qat", "--dry-run")
    assert (validated.code, planned.code) == (2, 2)
    assert planned.err.splitlines() == validated.err.splitlines() == [f"error: {line}" for line in expected]


def hf_model(directory: Path, model_type: str = "llama", **config) -> Path:
    directory.mkdir(parents=True)
    base = {
        "model_type": model_type,
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
    }
    (directory / "config.json").write_text(json.dumps({**base, **config}))
    return directory


def messages(recipe: Recipe, base_dir: Path) -> list[str]:
    return [f"{'.'.join(map(str, p.path))}: {p.message}" for p in feasibility_problems(recipe, CPU2, base_dir)]


def test_group_sizes_are_checked_against_the_checkpoint_that_is_quantized(tmp_path):
    hf_model(tmp_path / "m")  # down_proj's input: intermediate_size 352 = 11 x 32

    def make(**q):
        return Recipe.model_validate(
            {"name": "q", "model": {"path": "m"}, "data": {"task": "addition"}, "sft": {}, "quantization": q}
        )

    assert messages(make(group_size=32), tmp_path) == []
    assert messages(make(group_size=64), tmp_path) == [
        "quantization.group_size: 64 does not divide the input width 352 of down_proj"
    ]
    assert messages(make(group_size=64, targets=["self_attn"]), tmp_path) == []  # down_proj is not a target
    hf_model(tmp_path / "other", hidden_size=96, num_attention_heads=3, intermediate_size=256)
    assert messages(make(group_size=64, init_from="other"), tmp_path) == [
        "quantization.group_size: 64 does not divide the input width 96 of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj"
    ]
    hf_model(tmp_path / "gpt", model_type="gpt2")  # other layer names: the quantizer checks them when it starts
    assert messages(make(group_size=128, init_from="gpt"), tmp_path) == []
    assert messages(make(targets=["lm_head"]), tmp_path) == [
        "quantization.targets: lm_head stays in full precision (the W4A16 export quantizes the decoder's Linear layers); remove it"
    ]


def test_int4_qat_and_int4_rollouts_validate_with_an_rl_stage(skyrl):
    for sets in (["quantization.int4_qat=true"], ["quantization.int4_rollouts=true", "quantization.int4_qat=true"]):
        result = skyrl("recipes", "validate", "quickstart", *(a for s in sets for a in ("--set", s)))
        assert result.code == 0, result.err
    result = skyrl("rl", "quickstart", "--dry-run", "--set", "quantization.int4_rollouts=true")
    assert result.code == 0 and "quantizer" in result.out, result.err
    assert skyrl("recipes", "validate", "quickstart", "--set", "quantization.group_size=32").code == 0
