"""`skyrl recipes ...` and the broken-recipe corpus."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from skyrl_cli.recipe.registry import builtin_recipes

from .conftest import REPO, run_console_script

BROKEN = sorted((REPO / "tests" / "recipes_broken").glob("*.toml"))
MODEL_CONFIGS = REPO / "benchmarks" / "model_configs"


@pytest.fixture
def fetched_assets(tmp_path, monkeypatch):
    """What ``scripts/fetch_assets.py`` puts under ``~/.cache/skyrl`` for the real-model recipes, in
    a home of its own: each model's real config.json (no weights: validation and plans read only
    the config) and a few GSM8K rows in the format of ``backends.data.gsm8k``."""
    from backends.data.gsm8k import gsm8k_row

    root = tmp_path / "home" / ".cache" / "skyrl"
    for size in ("0.5B", "1.5B"):
        model = root / "models" / f"Qwen2.5-{size}-Instruct"
        model.mkdir(parents=True)
        (model / "config.json").write_text((MODEL_CONFIGS / f"qwen2.5-{size.lower()}-instruct.json").read_text())
    data = root / "data" / "gsm8k"
    data.mkdir(parents=True)
    row = gsm8k_row(
        "Natalia sold 48 clips in April and half as many in May. How many in all?", "48/2 = <<48/2=24>>24\n#### 72"
    )
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return root


@pytest.fixture
def quickstart_sft_output(fetched_assets, tmp_path, monkeypatch):
    """The built-in recipes in a folder of their own, run from a directory whose runs/ holds what
    ``skyrl sft quickstart`` and ``skyrl rl quickstart`` write there for the tinker and distill recipes
    (run:quickstart/sft, run:quickstart/rl; only their config.json, as a real run of the quickstart
    writes it: validation and plans read no more)."""
    from skyrl_cli.recipe import registry

    recipes = tmp_path / "checkout" / "recipes"
    shutil.copytree(registry.recipes_dir(), recipes, ignore=shutil.ignore_patterns("__pycache__"))
    final = tmp_path / "checkout" / "runs" / "quickstart" / "sft" / "final"
    for stage in ("sft", "rl"):  # the distill recipe's student and teacher
        written = final.parent.parent / stage / "final"
        written.mkdir(parents=True)
        (written / "config.json").write_text(json.dumps(QUICKSTART_CONFIG))
    monkeypatch.setattr(registry, "recipes_dir", lambda: recipes)
    monkeypatch.chdir(tmp_path / "checkout")
    return final


# The config.json of the quickstart's model (recipes/quickstart.toml, model.init).
QUICKSTART_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "max_position_embeddings": 512,
    "vocab_size": 20,
    "tie_word_embeddings": False,
}
# The command that runs each stage of a built-in recipe.
STAGE_COMMAND = {"sft": ("sft",), "rl": ("rl",), "tinker": ("tinker", "serve")}


def expectations(path: Path) -> tuple[list[str], list[str]]:
    """The ``# expect:`` lines (``{file}`` = the path given) and ``# args:`` of a corpus file; the
    expectations hold on a machine without GPUs unless the args give ``--gpus N``."""
    text = path.read_text()
    rel = str(path.relative_to(REPO))
    expected = [
        line.removeprefix("# expect: ").replace("{file}", rel)
        for line in text.splitlines()
        if line.startswith("# expect: ")
    ]
    args = [a for line in text.splitlines() if line.startswith("# args:") for a in line.removeprefix("# args:").split()]
    return expected, args if "--gpus" in args else [*args, "--gpus", "0"]


def test_corpus_covers_every_kind_of_problem():
    names = {p.stem for p in BROKEN}
    assert {"syntax_error", "unknown_key", "wrong_type", "out_of_range", "missing_file", "impossible_layout"} <= names
    # Every check the planner used to be the first to make (skyrl_cli.plan.feasibility now).
    assert {
        "vllm_head_size",
        "model_length_over_config",
        "tensor_parallel_on_cpu",
        "cuda_without_gpu",
        "missing_gpu",
        "engines_need_gpus",
        "rl_batch_too_small",
        "batch_too_small",
        "lora_rank_too_high",
        "lora_target_vllm_cannot_serve",
        "lora_with_zero3",
    } <= names
    assert all(expectations(p)[0] for p in BROKEN)


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_recipe_gives_the_exact_error(skyrl, path, monkeypatch):
    monkeypatch.chdir(REPO)
    expected, args = expectations(path)
    result = skyrl("recipes", "validate", str(path.relative_to(REPO)), *args)
    assert result.code == 2
    assert result.err.splitlines() == [f"error: {line}" for line in expected]
    assert "Traceback" not in result.err + result.out


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_dry_run_refuses_a_broken_recipe_with_the_same_lines_as_validate(skyrl, path, monkeypatch):
    """One home for feasibility: what ``skyrl rl`` (``sft`` for a recipe without [rl]) refuses before
    starting, ``skyrl recipes validate`` refuses too, line for line."""
    monkeypatch.chdir(REPO)
    expected, args = expectations(path)
    assert args[:-2] == [] and args[-2] == "--gpus", "only --gpus translates to a run command"
    # The run command sees as many GPUs as validate is told of.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(int(args[-1]))))
    rel = str(path.relative_to(REPO))
    stage = "rl" if re.search(r"^\[rl\]", path.read_text(), re.MULTILINE) else "sft"
    validated = skyrl("recipes", "validate", rel, *args)
    planned = skyrl(stage, rel, "--dry-run")
    assert (validated.code, planned.code) == (2, 2)
    assert planned.err.splitlines() == validated.err.splitlines() == [f"error: {line}" for line in expected]
    assert planned.out == ""


def test_a_head_size_vllm_cannot_serve_is_refused_by_validate(skyrl):
    result = skyrl("recipes", "validate", "quickstart", "--set", "model.init.heads=8")
    assert result.code == 2
    assert result.err.startswith(
        "error: --set: model.init.heads: head size hidden_size / heads = 16 cannot be served by vLLM"
    )


@pytest.mark.parametrize("name", ["unknown_key", "syntax_error"])
def test_broken_recipe_through_the_console_script(name):
    path = REPO / "tests" / "recipes_broken" / f"{name}.toml"
    expected, _ = expectations(path)
    result = run_console_script("recipes", "validate", str(path.relative_to(REPO)))
    assert result.code == 2
    assert result.err.splitlines() == [f"error: {line}" for line in expected]
    assert "Traceback" not in result.err + result.out


@pytest.mark.parametrize("recipe", builtin_recipes(), ids=lambda r: r.name)
def test_every_builtin_recipe_validates(skyrl, recipe, quickstart_sft_output):
    for gpus in ("0", "8"):
        result = skyrl("recipes", "validate", recipe.name, "--gpus", gpus)
        assert result.code == 0, result.err
        assert result.out.strip() == f"ok: {recipe.name}"


@pytest.mark.parametrize("recipe", builtin_recipes(), ids=lambda r: r.name)
def test_every_builtin_recipe_plans_on_an_8_gpu_node_with_trainer_and_engines_apart(
    skyrl, recipe, quickstart_sft_output, monkeypatch, tmp_path
):
    """The dry-run plan of each stage on 8 GPUs: every process on its own GPUs (NCCL refuses two
    ranks of one group on one device), and full-weight RL syncing over NCCL."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(8))))
    for stage in recipe.stages:
        result = skyrl(*STAGE_COMMAND[stage], recipe.name, "--dry-run", "--json", "--run-dir", str(tmp_path / stage))
        assert result.code == 0, result.err
        plan = json.loads(result.out)
        assert plan["device"] == "cuda"
        owners = [d for p in plan["processes"] for d in p["devices"] if d.startswith("cuda:")]
        assert owners and len(owners) == len(set(owners)), owners
        if stage == "rl":
            trainer = {d for p in plan["processes"] if p["role"] == "trainer" for d in p["devices"]}
            engines = {d for p in plan["processes"] if p["role"] == "engine" for d in p["devices"]}
            assert trainer and engines and trainer.isdisjoint(engines)
            lora = "lora =" in recipe.path.read_text()
            assert plan["weight_sync"] == ("lora" if lora else "nccl")


@pytest.mark.parametrize("recipe", builtin_recipes(), ids=lambda r: r.name)
def test_every_builtin_recipe_has_a_header(recipe):
    assert recipe.purpose and recipe.hardware != "?" and recipe.time != "?" and recipe.expected != "?"
    assert recipe.stages
    assert f"skyrl {' '.join(STAGE_COMMAND[recipe.stages[0]])} recipes/{recipe.name}.toml" in recipe.path.read_text()


def test_the_tinker_recipe_says_to_run_the_quickstart_first(skyrl, tmp_path, monkeypatch):
    """Without the quickstart's SFT output the tinker recipe names the command that makes it."""
    from skyrl_cli.recipe import registry

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    for name in ("tinker.toml", "quickstart.toml"):
        shutil.copy(REPO / "recipes" / name, recipes)
    monkeypatch.setattr(registry, "recipes_dir", lambda: recipes)
    monkeypatch.chdir(tmp_path)
    line = next(
        i for i, text in enumerate((recipes / "tinker.toml").read_text().splitlines(), 1) if text.startswith("path =")
    )
    for args in (("recipes", "validate", "tinker"), ("tinker", "serve", "tinker", "--dry-run")):
        result = skyrl(*args)
        assert result.code == 2
        assert result.err == (
            f"error: {recipes / 'tinker.toml'}:{line}: model.path: file not found: run:quickstart/sft; "
            "run `skyrl sft quickstart` first (it writes runs/quickstart/sft/final)\n"
        )


def test_validate_reports_every_file(skyrl, monkeypatch):
    monkeypatch.chdir(REPO)
    result = skyrl(
        "recipes", "validate", "recipes/quickstart.toml", "tests/recipes_broken/unknown_key.toml", "nope.toml"
    )
    assert result.code == 2
    assert result.out == "ok: recipes/quickstart.toml\n"
    assert result.err.splitlines()[-1] == "error: recipe file not found: nope.toml"


def test_validate_with_set(skyrl):
    assert skyrl("recipes", "validate", "quickstart", "--set", "sft.steps=5").code == 0
    result = skyrl("recipes", "validate", "quickstart", "--set", "sft.steps=-5")
    assert result.code == 2
    assert result.err == "error: --set: sft.steps: Input should be greater than 0 (got -5)\n"


def test_ls_lists_builtin_recipes(skyrl):
    result = skyrl("recipes", "ls")
    assert result.code == 0
    assert "quickstart" in result.out and "sft + rl" in result.out


def test_show_prints_the_toml(skyrl):
    result = skyrl("recipes", "show", "quickstart")
    assert result.code == 0
    assert result.out == (REPO / "recipes" / "quickstart.toml").read_text()


def test_show_unknown_name_suggests(skyrl):
    result = skyrl("recipes", "show", "quikstart")
    assert result.code == 2
    assert result.err == "error: no built-in recipe named 'quikstart'; did you mean 'quickstart'?\n"


def test_cp_refuses_to_overwrite_without_force(skyrl, tmp_path):
    dest = tmp_path / "my.toml"
    assert skyrl("recipes", "cp", "quickstart", dest).code == 0
    assert dest.read_text() == (REPO / "recipes" / "quickstart.toml").read_text()
    dest.write_text("# mine\n")
    refused = skyrl("recipes", "cp", "quickstart", dest)
    assert refused.code == 2 and "exists; pass --force" in refused.err
    assert dest.read_text() == "# mine\n"
    assert skyrl("recipes", "cp", "quickstart", dest, "--force").code == 0
    assert dest.read_text().startswith("# Quickstart")
    assert skyrl("recipes", "cp", "quickstart", tmp_path).code == 0  # into a directory
    assert (tmp_path / "quickstart.toml").exists()


def test_cp_of_a_recipe_with_its_own_files_copies_them_next_to_it_and_the_copy_validates(skyrl, tmp_path):
    dest = tmp_path / "my_task.toml"
    done = skyrl("recipes", "cp", "own_task", dest)
    assert done.code == 0 and "own_task/" in done.out
    for name in ("train.jsonl", "eval.jsonl", "reward.py", "make_data.py", "__init__.py"):
        assert (tmp_path / "own_task" / name).read_bytes() == (REPO / "recipes/own_task" / name).read_bytes()
    assert skyrl("recipes", "validate", dest).code == 0
    dest.unlink()
    refused = skyrl("recipes", "cp", "own_task", dest)  # the folder is there: not overwritten silently
    assert refused.code == 2 and f"{tmp_path / 'own_task'} exists; pass --force" in refused.err
    assert skyrl("recipes", "cp", "own_task", dest, "--force").code == 0


def test_schema_is_json_schema_with_toml_keys(skyrl):
    result = skyrl("recipes", "schema")
    schema = json.loads(result.out)
    assert schema["title"] == "Recipe"
    assert "async" in json.dumps(schema["$defs"]["RlConfig"]["properties"])
    assert "async_" not in result.out


def test_version(skyrl):
    result = skyrl("--version")
    assert result.code == 0 and re.fullmatch(r"skyrl \d+\.\d+\.\d+\S*\n", result.out)
