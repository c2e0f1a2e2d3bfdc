"""INT4 rollouts in RL (``quantization.int4_rollouts``): the plan exports the initial policy before
any engine starts and the engines serve that export; each later version is the learner's W4A16
export, which only the disk path can carry; the recipe checks."""

from __future__ import annotations

import json

import pytest

from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.feasibility import feasibility_problems
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.weight_sync import nccl_obstacles, select_weight_sync
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe

CPU2 = MachineFacts(
    cpu_cores=(0, 1), python="py", torch_extensions_dir="/ext", port_finder=lambda n: [29500 + i for i in range(n)]
)


def recipe(quantization: dict | None = None, **sections) -> Recipe:
    base = {
        "name": "t",
        "model": {"init": {"hidden_size": 64, "heads": 2}, "tokenizer": "char"},
        "data": {"task": "addition"},
        "rl": {"init_from": "/models/policy"},
    }
    if quantization is not None:
        base["quantization"] = quantization
    return Recipe.model_validate({**base, **sections})


def messages(r: Recipe) -> list[str]:
    return [f"{'.'.join(map(str, p.path))}: {p.message}" for p in feasibility_problems(r, CPU2)]


def test_the_engines_start_from_the_int4_export_of_the_initial_policy(tmp_path):
    plan = build_plan(recipe({"int4_rollouts": True, "group_size": 32}), "rl", tmp_path / "run", machine=CPU2)
    setup, *rest = plan.processes
    assert setup.kind == "setup" and setup.role == "quantizer"
    assert setup.argv[1:] == (
        "-m",
        "backends.quant.export",
        "--run-dir",
        str(tmp_path / "run"),
        "--model",
        "/models/policy",
        "--setup",
    )
    assert all(p.kind != "setup" for p in rest)
    int4 = str(RunDir(tmp_path / "run").int4)
    engines = [p for p in rest if p.role == "engine"]
    assert engines and all(int4 in p.argv and "/models/policy" not in p.argv for p in engines)
    # the learner and the orchestrator still start from the full-precision policy
    learner, orchestrator = (next(p for p in rest if p.role == r) for r in ("trainer", "orchestrator"))
    assert "/models/policy" in learner.argv and "/models/policy" in orchestrator.argv
    assert plan.weight_sync == "int4"  # W4A16 versions through the disk reload
    json.loads(plan.model_dump_json())  # plan.json still serialises


def test_without_int4_rollouts_the_engines_start_from_the_engine_model(tmp_path):
    """The setup job before the engines links the initial policy (untied when tied: backends.models.tied)."""
    served = str(RunDir(tmp_path).engine_model)
    for quantization in (None, {"int4_qat": True}):
        plan = build_plan(recipe(quantization), "rl", tmp_path, machine=CPU2)
        (setup,) = [p for p in plan.processes if p.kind == "setup"]
        assert setup.argv[1:] == ("-m", "backends.models.tied", "--src", "/models/policy", "--out", served)
        engines = [p for p in plan.processes if p.role == "engine"]
        assert engines and all(served in p.argv and "/models/policy" not in p.argv for p in engines)


def test_int4_rollouts_never_take_the_nccl_path():
    r = recipe({"int4_rollouts": True}, trainer={"device": "cuda"})
    assert select_weight_sync(r, "cuda", transfer_available=True) == "int4"
    assert any("INT4" in why for why in nccl_obstacles(r, "cuda", True))
    assert select_weight_sync(recipe({"int4_qat": True}), "cuda", transfer_available=True) == "nccl"


def test_int4_rollouts_need_an_rl_stage_and_qat_in_rl_is_accepted():
    sft_only = recipe({"int4_rollouts": True}, rl=None, sft={})
    assert messages(sft_only) == [
        "quantization.int4_rollouts: INT4 rollouts act in the RL stage and the recipe has no [rl] section"
    ]
    assert messages(recipe({"int4_rollouts": True, "int4_qat": True})) == []
    # an RL-only recipe: quantization.init_from = "sft" is skyrl quantize's source, not the rollouts'
    assert messages(recipe({"int4_rollouts": True})) == []


@pytest.mark.parametrize("group", [32, 64])
def test_a_group_size_the_policy_cannot_take_is_refused(group):
    r = recipe(
        {"int4_rollouts": True, "group_size": group},
        model={"init": {"hidden_size": 48, "heads": 2}, "tokenizer": "char"},
    )
    assert any(m.startswith("quantization.group_size:") for m in messages(r))


def test_per_channel_quantization_takes_any_width():
    r = recipe(
        {"int4_rollouts": True, "group_size": "channel"},
        model={"init": {"hidden_size": 48, "heads": 2}, "tokenizer": "char"},
    )
    assert not any(m.startswith("quantization.group_size:") for m in messages(r))


def test_the_plan_states_the_start_order(tmp_path):
    """Setup, then the engines with the learner beside them (disk sync), the router, the orchestrator."""
    order = build_plan(recipe(None), "rl", tmp_path, machine=CPU2).start_order()
    names = [
        [p.name for p in phase]
        for phase in (order.setup, order.engines, order.beside_engines, order.router, order.after_router)
    ]
    assert names == [["engine-model"], ["engine-0"], ["trainer"], ["router"], ["orchestrator"]]


@pytest.mark.parametrize("resume", [False, True])
def test_only_a_fresh_run_orchestrator_starts_on_v0_without_the_learner(tmp_path, resume):
    """``--fresh`` (``Orchestrator.first_version``): a resumed learner may restart from a checkpoint."""
    plan = build_plan(recipe(None), "rl", tmp_path, resume=resume, machine=CPU2)
    (orchestrator,) = [p for p in plan.processes if p.role == "orchestrator"]
    assert ("--fresh" in orchestrator.argv) is (not resume)
