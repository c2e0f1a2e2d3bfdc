"""An engine pool's warm processes as planned: which runs fit them and what they preload (run, with
a keeper's generations: tests/integration/test_warm_processes.py)."""

from __future__ import annotations

from pathlib import Path

from skyrl_cli.engines.standby import launch_signature, misfit, ranks_of, split_command
from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.model import ProcessSpec
from skyrl_cli.plan.pool import STANDBY_MODULE, WARM_NAMES, plan_pool
from skyrl_contracts.schema import Recipe
from tests.unit.test_engine_pool import CPU2, recipe, write_model


def keeper_of(plan, role: str = "trainer") -> ProcessSpec:
    (keeper,) = [p for p in plan.processes if p.role == role]
    return keeper


def run_process(tmp_path: Path, r, role: str = "trainer") -> ProcessSpec:
    plan = build_plan(r, "rl", tmp_path / "run", machine=CPU2)
    (spec,) = [p for p in plan.processes if p.role == role]
    return spec


def test_the_warm_learner_is_the_runs_own_learner_command_with_the_standby_module(tmp_path):
    model = write_model(tmp_path / "m")
    keeper = keeper_of(plan_pool(recipe(model), tmp_path / "pool", CPU2))
    argv = list(keeper.argv)
    assert argv[argv.index("--dir") + 1] == str(tmp_path / "pool" / WARM_NAMES["trainer"])
    launcher, module, args = split_command(argv[argv.index("--") + 1 :])
    assert module == STANDBY_MODULE and args[2:4] == ["--kind", "learner"] and "--preload" not in args
    trainer = run_process(tmp_path, recipe(model))
    run_launcher, run_module, _ = split_command(trainer.argv)
    assert run_module == "backends.train.rl_learner"
    assert misfit(keeper, trainer) is None  # the same ranks, threads and devices: its runs fit
    assert launcher != run_launcher  # ... though the rendezvous ports differ


def test_a_run_that_would_start_its_learner_otherwise_does_not_fit(tmp_path):
    model = write_model(tmp_path / "m")
    keeper = keeper_of(plan_pool(recipe(model), tmp_path / "pool", CPU2))
    two_ranks = with_section(recipe(model), "trainer", ranks=2)
    assert misfit(keeper, run_process(tmp_path, two_ranks)) == "--nproc-per-node: pool 1, this run 2"
    threads = run_process(tmp_path, recipe(model))
    threads = threads.model_copy(update={"env": {**threads.env, "OMP_NUM_THREADS": "7"}})
    assert misfit(keeper, threads).startswith("OMP_NUM_THREADS: pool ")


def test_lora_and_qat_pools_preload_what_their_learners_import(tmp_path):
    model = write_model(tmp_path / "m")
    lora = with_section(recipe(model), "model", lora={"rank": 8})
    argv = list(keeper_of(plan_pool(lora, tmp_path / "pool", CPU2)).argv)
    assert argv[argv.index("--preload") + 1] == "peft"
    qat = with_section(recipe(model), "quantization", int4_qat=True)
    argv = list(keeper_of(plan_pool(qat, tmp_path / "pool", CPU2)).argv)
    assert argv[argv.index("--preload") + 1] == "torchao"


def with_section(r: Recipe, section: str, **keys) -> Recipe:
    raw = r.model_dump(exclude_none=True)
    raw[section] = {**raw.get(section, {}), **keys}
    return Recipe.model_validate(raw)


def test_the_warm_orchestrator_is_the_runs_interpreter_with_its_environment(tmp_path):
    model = write_model(tmp_path / "m")
    pool_plan = plan_pool(recipe(model), tmp_path / "pool", CPU2)
    keeper = keeper_of(pool_plan, "orchestrator")
    orchestrator = run_process(tmp_path, recipe(model), "orchestrator")
    assert misfit(keeper, orchestrator) is None and ranks_of(keeper) == 1 and ranks_of(keeper_of(pool_plan)) == 1
    assert split_command(orchestrator.argv)[1] == "backends.rollout.orchestrator"
    other = orchestrator.model_copy(update={"env": {**orchestrator.env, "OMP_NUM_THREADS": "2"}})
    assert misfit(keeper, other) == "OMP_NUM_THREADS: pool 1, this run 2"
    assert [p.role for p in plan_pool(recipe(model), tmp_path / "p", CPU2, warm=False).processes][-1] == "router"


def test_the_rendezvous_port_is_not_part_of_the_signature():
    a = ["py", "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-endpoint", "h:1", "-m", "x", "--a"]
    b = ["py", "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-endpoint", "h:2", "-m", "y", "--b"]
    assert launch_signature(a, {"K": "1"}) == launch_signature(b, {"K": "1"})
    assert launch_signature(a, {"K": "1"}) != launch_signature(a, {"K": "2"})
    assert split_command(["py", "-u", "-m", "mod", "--x"]) == (["py", "-u"], "mod", ["--x"])
