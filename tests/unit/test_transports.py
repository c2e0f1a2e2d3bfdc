"""The weight transports as one table (``skyrl_contracts.transports``) and one module per transport
(``backends.inference.transports``): the table and its modules agree, the plan of each transport
is what it was when the transport was a string tested across the tree, and a new transport is a
module plus an entry."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import types
import typing
from pathlib import Path

import pytest

from backends.inference.transports import SIDES, TransportSides, transport_module
from skyrl_cli.plan.model import LaunchPlan
from skyrl_cli.plan.pool import unpoolable
from skyrl_cli.plan.rl import ENGINE_MODELS, learner_sync_args, plan_rl
from skyrl_contracts.rundir import RunDir
from skyrl_contracts.schema import Recipe
from skyrl_contracts.transports import (
    TRANSPORT_NAMES,
    TRANSPORTS,
    WORKER_EXTENSION,
    EngineModel,
    Transport,
    TransportName,
)
from tests.unit.test_nccl_sync import CPU2, GPU8  # the described machines the weight-sync plans use

INIT = "/models/m"


# ------------------------------------------------------------------------------ table and modules


def test_the_tables_names_are_the_literals():
    assert set(TRANSPORTS) == set(typing.get_args(TransportName)) == set(TRANSPORT_NAMES)
    assert all(name == spec.name for name, spec in TRANSPORTS.items())
    assert typing.get_args(LaunchPlan.model_fields["weight_sync"].annotation) == (TransportName, type(None))


def test_every_engine_model_a_transport_names_has_a_setup():
    assert set(ENGINE_MODELS) == set(typing.get_args(EngineModel))
    assert {spec.engine_model for spec in TRANSPORTS.values()} <= set(ENGINE_MODELS)


@pytest.mark.parametrize("name", TRANSPORT_NAMES)
def test_every_transports_module_has_both_sides_with_the_shared_signatures(name):
    module = transport_module(name)
    assert module.__name__ == TRANSPORTS[name].module
    for side in SIDES:
        wanted = [p for p in inspect.signature(getattr(TransportSides, side)).parameters if p != "self"]
        assert list(inspect.signature(getattr(module, side)).parameters) == wanted, (name, side)


@pytest.mark.parametrize("module", ["backends.train.rl_learner", "backends.rollout.orchestrator"])
def test_both_workers_accept_exactly_the_tables_names(module, capsys, monkeypatch):
    worker = importlib.import_module(module)
    monkeypatch.setattr(worker, "setup_process_logging", lambda: None)  # the test process's logging stays as it is
    with pytest.raises(SystemExit):
        worker.main(["--help"])
    assert "{" + ",".join(TRANSPORT_NAMES) + "}" in capsys.readouterr().out


# ------------------------------------------------------------------------------ the plans, as they were


def recipe(lora: bool = False, int4: bool = False, weight_sync: str = "auto") -> Recipe:
    data = {
        "name": "t",
        "model": {"path": INIT, **({"lora": {"rank": 8}} if lora else {})},
        "data": {"task": "addition"},
        "rl": {"init_from": INIT, "async": {"reset_prefix_cache": True}},
        "inference": {"engines": 2, "weight_sync": weight_sync},
        "trainer": {"ranks": 2},
    }
    if int4:
        data["quantization"] = {"int4_rollouts": True}
    return Recipe.model_validate(data)


def plan_of(name: str, run_dir: Path, monkeypatch) -> LaunchPlan:
    monkeypatch.setattr("skyrl_cli.plan.rl.vllm_weight_transfer_available", lambda: True)
    r = recipe(lora=name == "lora", int4=name == "int4", weight_sync="delta" if name == "delta" else "auto")
    return plan_rl(r, run_dir, resume=False, async_mode=False, machine=GPU8 if name == "nccl" else CPU2)


def _proc(plan, role):
    return next(p for p in plan.processes if p.role == role)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def served_and_setup(name: str, run_dir: Path) -> tuple[str, tuple[str, ...]]:
    """What the engines started from, and the setup job's module, before transports were specs."""
    if name == "lora":
        return INIT, ()
    if name == "int4":
        return str(RunDir(run_dir).int4), ("backends.quant.export",)
    return str(RunDir(run_dir).engine_model), ("backends.models.tied",)


POOL_REFUSALS = {
    "nccl": 'the NCCL weight sync opens its group with the trainer when the engines start; set inference.weight_sync = "disk" '
    "to use a pool",
    "int4": "quantization.int4_rollouts: the engines serve the INT4 export from start-up; this run starts its own",
    "disk": None,
    "delta": None,
    "lora": None,
}


@pytest.mark.parametrize("name", TRANSPORT_NAMES)
def test_each_transports_plan_is_what_it_was(name, tmp_path, monkeypatch):
    plan = plan_of(name, tmp_path, monkeypatch)
    assert plan.weight_sync == name
    engines = [p for p in plan.processes if p.role == "engine"]
    transfer = [
        json.loads(_flag(e.argv, "--weight-transfer-config")) for e in engines if "--weight-transfer-config" in e.argv
    ]
    assert transfer == ([{"backend": "nccl"}] * len(engines) if name == "nccl" else [])
    served, setup_modules = served_and_setup(name, tmp_path)
    assert all(e.argv[e.argv.index("backends.inference.serve") + 1] == served for e in engines)
    assert all(
        _flag(e.argv, "--worker-extension-cls") == WORKER_EXTENSION for e in engines
    )  # deltas apply in any engine
    assert tuple(p.argv[2] for p in plan.processes if p.kind == "setup") == setup_modules
    trainer, orchestrator = _proc(plan, "trainer"), _proc(plan, "orchestrator")
    assert _flag(trainer.argv, "--weight-sync") == _flag(orchestrator.argv, "--weight-sync") == name
    assert ("--nccl-address" in trainer.argv) == (name == "nccl")
    assert trainer.start_with_engines == (name != "nccl")
    assert unpoolable(name) == POOL_REFUSALS[name]


# ------------------------------------------------------------------------------ worker sides


@pytest.mark.parametrize(
    "name, loader, resets",
    [
        ("disk", "EngineWeights", True),
        ("int4", "EngineWeights", True),  # W4A16 versions, reloaded as full ones
        ("lora", "EngineAdapters", None),  # takes no reset
        ("nccl", "NcclEngineWeights", True),
    ],
)
def test_the_orchestrator_gets_each_transports_engine_loader(name, loader, resets, tmp_path):
    from backends.rollout.orchestrator import engine_weights

    r = recipe(lora=name == "lora", int4=name == "int4", weight_sync="delta" if name == "delta" else "auto")
    engines = engine_weights(r, tmp_path, ["http://e:1"], name)
    assert type(engines).__name__ == loader and engines.engine_urls == ["http://e:1"]
    assert getattr(engines, "reset_prefix_cache", None) == resets  # rl.async.reset_prefix_cache


# ------------------------------------------------------------------------------ adding one


def test_a_new_transport_is_one_module_and_one_entry(monkeypatch, tmp_path):
    from backends.rollout.orchestrator import engine_weights
    from backends.train.publish import weight_publisher
    from skyrl_cli.plan.inference import Machine, engine_specs

    spec = Transport("delta", engine_flags=("--delta", "on"))  # type: ignore[arg-type]
    module = types.ModuleType(spec.module)
    module.publisher = lambda exchange, dist, export, recipe, first_version, sender: ("publisher", first_version)
    module.engine_loader = lambda recipe, run_dir, engine_urls: ("loader", tuple(engine_urls))
    monkeypatch.setitem(TRANSPORTS, "delta", spec)
    monkeypatch.setitem(sys.modules, spec.module, module)

    assert weight_publisher("delta", None, None, None, recipe(), 3) == ("publisher", 3)
    assert engine_weights(recipe(), tmp_path, ["http://e:1"], "delta") == ("loader", ("http://e:1",))
    engines = engine_specs(
        recipe(), Machine(device="cpu", engine_cores=(0, 1), python="py"), [1, 2], "m", weight_sync="delta"
    )
    assert [_flag(e.argv, "--delta") for e in engines] == ["on", "on"]
    assert learner_sync_args(recipe(), "delta", [], "h", 1) == ("--weight-sync", "delta")
    assert unpoolable("delta") is None
