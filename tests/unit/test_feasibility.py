"""What a machine must offer a recipe: checked once, when the recipe is loaded, with the facts the
planner uses (the broken-recipe corpus covers the file:line side; these cover the machine side)."""

from __future__ import annotations

import pytest

from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.feasibility import assert_feasible, feasibility_problems, load_feasible_recipe
from skyrl_cli.plan.machine import MachineFacts, detect_machine
from skyrl_contracts.errors import RecipeError, UsageError
from skyrl_contracts.schema import Recipe

NO_CORES = MachineFacts(cpu_cores=())
CPU2 = MachineFacts(cpu_cores=(0, 1))
GPU4 = MachineFacts(cpu_cores=(0, 1), gpus=(0, 1, 2, 3))


def recipe(**sections) -> Recipe:
    base = {"name": "t", "model": {"init": {}, "tokenizer": "char"}, "data": {"task": "addition"}, "rl": {}}
    return Recipe.model_validate({**base, **sections})


def messages(r: Recipe, machine: MachineFacts) -> list[str]:
    return [f"{'.'.join(map(str, p.path))}: {p.message}" for p in feasibility_problems(r, machine)]


def test_a_feasible_recipe_has_no_problems():
    assert messages(recipe(), CPU2) == []
    assert messages(recipe(inference={"engines": 3, "tensor_parallel": 1}), GPU4) == []


def test_no_cpu_cores_left(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('name = "t"\n[model]\ninit = {}\ntokenizer = "char"\n[data]\ntask = "addition"\n[rl]\n')
    with pytest.raises(RecipeError) as info:
        load_feasible_recipe(path, machine=NO_CORES)
    assert info.value.problems == [
        f"{path}:1: trainer.ranks: no CPU cores left for the trainer",
        f"{path}:1: inference.engines: no CPU cores left for the inference engines",
    ]


def test_engines_share_the_gpus_left_by_the_trainer():
    r = recipe(trainer={"ranks": 2, "gpus": [2, 3]}, inference={"engines": 3, "tensor_parallel": 1})
    assert messages(r, GPU4) == [
        "trainer.ranks: the layout needs 5 GPUs (2 trainer ranks + 3 for 3 engines) but 4 are visible"
    ]


def test_a_cpu_trainer_keeps_the_engines_on_cpu_even_with_gpus():
    r = recipe(trainer={"device": "cpu"}, inference={"tensor_parallel": 2})
    assert messages(r, GPU4) == [
        'inference.tensor_parallel: 2 GPUs per engine, but the engines run on CPU (trainer.device = "cpu")'
    ]


def test_remote_engines_need_no_local_devices():
    r = recipe(inference={"engines": 0, "urls": ["http://gpu:8000"], "tensor_parallel": 4})
    assert messages(r, CPU2) == []


def test_sft_only_recipes_skip_the_engine_checks():
    r = recipe(rl=None, sft={}, model={"init": {"heads": 8}, "tokenizer": "char"}, inference={"tensor_parallel": 2})
    assert messages(r, CPU2) == []


def test_mini_batches_split_over_ranks_only_when_there_are_several():
    one = recipe(rl={"prompts_per_step": 1, "samples_per_prompt": 2}, trainer={"ranks": 4})
    assert messages(one, CPU2) == ["rl.prompts_per_step: 2 sequences per step cannot be split over 4 trainer ranks"]
    many = recipe(rl={"prompts_per_step": 4, "samples_per_prompt": 2, "mini_batches": 4}, trainer={"ranks": 4})
    assert messages(many, CPU2) == ["rl.mini_batches: a mini-batch of 2 sequences cannot be split over 4 trainer ranks"]


def test_the_planner_asserts_the_same_problems_for_a_recipe_built_in_code(tmp_path):
    r = recipe(model={"init": {"heads": 8}, "tokenizer": "char"}, inference={"tensor_parallel": 2})
    expected = messages(r, CPU2)
    assert len(expected) == 2
    with pytest.raises(UsageError) as info:
        build_plan(r, "rl", tmp_path, machine=CPU2)
    assert str(info.value).splitlines() == expected
    assert_feasible(recipe(), CPU2)


def test_validate_gpus_replaces_only_the_gpus():
    here = detect_machine()
    other = detect_machine(gpu_count=8)
    assert other.gpus == tuple(range(8)) and other.cpu_cores == here.cpu_cores


def test_rl_across_nodes_is_refused_in_one_line_and_sft_across_nodes_plans(tmp_path):
    multi = {"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "10.0.0.1:29400"}
    with pytest.raises(UsageError) as info:
        build_plan(recipe(trainer=multi), "rl", tmp_path, machine=CPU2)
    assert str(info.value).startswith("trainer.nnodes = 2: RL across nodes takes its layout from a [cluster] section")
    assert len(str(info.value).splitlines()) == 1
    sft = recipe(trainer=multi, sft={}, rl=None)
    assert build_plan(sft, "sft", tmp_path, machine=CPU2).processes


# ------------------------------------------------------------------------ speculative decoding

NGRAM = {"speculative": {"method": "ngram"}}


def test_speculation_is_refused_on_cpu_engines_and_allowed_on_gpus():
    (message,) = messages(recipe(inference=NGRAM), CPU2)
    assert message.startswith("inference.speculative.method: 'ngram' cannot run on CPU engines: ")
    assert "rl.temperature = 1" in message and "\n" not in message
    assert messages(recipe(inference=NGRAM, trainer={"device": "cpu"}), GPU4) == [message]
    assert messages(recipe(inference=NGRAM), GPU4) == []
    # No engines here: remote ones (their hardware is theirs) or an SFT-only recipe.
    assert messages(recipe(inference={**NGRAM, "engines": 0, "urls": ["http://gpu:8000"]}), CPU2) == []
    assert messages(recipe(rl=None, sft={}, inference=NGRAM), CPU2) == []


def write_config(directory, **config):
    import json

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["X"], "vocab_size": 64, **config}))
    return str(directory)


def test_mtp_needs_a_policy_with_mtp_layers(tmp_path):
    mtp = {"speculative": {"method": "mtp"}}
    (message,) = messages(recipe(inference=mtp), GPU4)  # model.init: a Llama without MTP layers
    assert message == (
        "inference.speculative.method: 'mtp' needs a policy with multi-token-prediction layers, and model.init "
        "has none (no num_nextn_predict_layers or mtp_num_hidden_layers > 0); use ngram or draft_model"
    )
    plain = write_config(tmp_path / "plain", num_nextn_predict_layers=0)
    assert "rl.init_from has none" in messages(recipe(inference=mtp, rl={"init_from": plain}), GPU4)[0]
    for name, config in {
        "deepseek": {"num_nextn_predict_layers": 1},
        "qwen3next": {"mtp_num_hidden_layers": 1},
        "qwen35": {"text_config": {"mtp_num_hidden_layers": 1}},
        "mimo-v2": {"architectures": ["MiMoV2FlashForCausalLM"]},
    }.items():
        policy = write_config(tmp_path / name, **config)
        assert messages(recipe(inference=mtp, rl={"init_from": policy}), GPU4) == [], name
    # A policy whose config cannot be read here (a hub id) is left to vLLM.
    assert messages(recipe(inference=mtp, model={"path": "org/model"}, rl={"init_from": "sft"}), GPU4) == []


def test_a_draft_must_share_the_policys_vocabulary(tmp_path):
    policy = write_config(tmp_path / "policy", vocab_size=64)
    for method in ("draft_model", "eagle"):
        draft = write_config(tmp_path / f"{method}-ok", vocab_size=64)
        spec = {"speculative": {"method": method, "model": draft}}
        assert messages(recipe(inference=spec, rl={"init_from": policy}), GPU4) == []
        other = write_config(tmp_path / f"{method}-other", vocab_size=32000)
        spec = {"speculative": {"method": method, "model": other}}
        assert messages(recipe(inference=spec, rl={"init_from": policy}), GPU4) == [
            "inference.speculative.model: the draft's vocab_size is 32000, the policy's (rl.init_from) 64: "
            "a draft model must share the policy's tokenizer"
        ]
