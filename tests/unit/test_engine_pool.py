"""Engine pools without engines: the pool's plan, what a run must match to use one, the state file
and the lock (a supervisor that adopts processes it must not tear down:
tests/integration/test_engine_pool_processes.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from skyrl_cli.engines.pool import Pool, PoolProcess, choose_pool, fit_problem, leased, list_pools
from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.model import PoolAttachment
from skyrl_cli.plan.pool import engine_signature, first_difference, model_signature, plan_pool
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe

CPU2 = MachineFacts(cpu_cores=(0, 1), port_finder=lambda n: list(range(20000, 20000 + n)))


def write_model(path: Path, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    base = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 40,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps({**base, **config}))
    return path


def recipe(init_from: Path, rl: dict | None = None, **inference) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"init": {}, "tokenizer": "char"},
            "data": {"task": "addition"},
            "rl": {"init_from": str(init_from), **(rl or {})},
            "inference": {"engines": 1, **inference},
        }
    )


def pool_from(plan, path: Path, model: Path, alive_pid: int) -> Pool:
    engines = [p for p in plan.processes if p.role == "engine"]
    auxiliaries = [p for p in plan.processes if p.role == "auxiliary"]
    (router,) = [p for p in plan.processes if p.role == "router"]
    return Pool(
        name=path.name,
        path=path,
        recipe="t",
        created_at=time.time(),
        async_mode=plan.async_mode,
        weight_sync=plan.weight_sync,
        served_model=str(model),
        model_signature=model_signature(model),
        engines=[PoolProcess(e, alive_pid, "log") for e in engines],
        router=PoolProcess(router, alive_pid, "log"),
        router_url=plan.router_url,
        auxiliaries=[PoolProcess(a, alive_pid, "log") for a in auxiliaries],
    )


def test_a_pool_plan_is_the_rl_plans_inference_half_detached(tmp_path):
    model = write_model(tmp_path / "m")
    r = recipe(model)
    pool_plan = plan_pool(r, tmp_path / "pool", CPU2)
    roles = [p.role for p in pool_plan.processes]
    # then the keepers of the warm learner and orchestrator (tests/unit/test_warm_processes.py)
    assert roles == ["setup", "engine", "router", "trainer", "orchestrator"] and pool_plan.stage == "pool"
    (engine,) = [p for p in pool_plan.processes if p.role == "engine"]
    assert "SKYRL_DIE_WITH_PARENT" not in engine.env
    run_plan = build_plan(r, "rl", tmp_path / "run", machine=CPU2)
    (own,) = [p for p in run_plan.processes if p.role == "engine"]
    assert engine_signature(engine) == engine_signature(own)  # ports, seed, model dir, core differ


def test_a_run_on_a_pool_starts_no_engines_and_talks_to_the_pools(tmp_path):
    model = write_model(tmp_path / "m")
    attachment = PoolAttachment(name="p", engine_urls=("http://127.0.0.1:9001",), router_url="http://127.0.0.1:9000")
    plan = build_plan(recipe(model), "rl", tmp_path / "run", machine=CPU2, pool=attachment)
    assert [p.role for p in plan.processes] == ["setup", "orchestrator", "trainer"]
    assert plan.pool == "p" and plan.router_url == "http://127.0.0.1:9000"
    (orchestrator,) = [p for p in plan.processes if p.role == "orchestrator"]
    argv = list(orchestrator.argv)
    assert argv[argv.index("--router-url") + 1] == "http://127.0.0.1:9000"
    assert argv[argv.index("--engine-urls") + 1] == "http://127.0.0.1:9001"


def test_first_difference_names_the_setting():
    a = {"argv": ["serve", "--max-model-len", "512", "--enforce-eager"], "env": {"X": "1"}}
    assert first_difference(a, a) is None
    b = {"argv": ["serve", "--max-model-len", "256", "--enforce-eager"], "env": {"X": "1"}}
    assert first_difference(a, b) == "--max-model-len: pool 512, this run 256"
    c = {"argv": ["serve", "--max-model-len", "512"], "env": {"X": "1"}}
    assert first_difference(a, c) == "--enforce-eager: pool on, this run None"
    assert first_difference({"hidden_size": 64}, {"hidden_size": 128}) == "hidden_size: pool 64, this run 128"


def test_what_keeps_a_run_off_a_pool(tmp_path):
    model = write_model(tmp_path / "m")
    pool = pool_from(plan_pool(recipe(model), tmp_path / "pool", CPU2), tmp_path / "pool", model, os.getpid())

    def why(r: Recipe, init: Path = model, async_mode: bool = False) -> str | None:
        plan = build_plan(r, "rl", tmp_path / "run", machine=CPU2, async_mode=async_mode)
        return fit_problem(pool, plan, r.inference.engines, init)

    assert why(recipe(model)) is None
    assert (
        why(recipe(model, max_model_len=256))
        == "engines started with other settings (--max-model-len: pool 512, this run 256)"
    )
    assert why(recipe(model, engines=2)) == "inference.engines: pool 1, this run 2"
    assert why(recipe(model), async_mode=True).startswith("its engines are set up for sync runs")
    wider = write_model(tmp_path / "wide", hidden_size=128)
    assert why(recipe(wider), wider) == "another model shape (hidden_size: pool 64, this run 128)"
    other_run_same_shape = write_model(tmp_path / "other", torch_dtype="bfloat16", _name_or_path="x")
    assert why(recipe(other_run_same_shape), other_run_same_shape) is None  # its own weights get loaded
    assert why(recipe(model, weight_sync="disk"), tmp_path / "not-yet") is None  # SFT writes it later
    pool.engines[0].pid = pool.router.pid = 2**22 + 12345  # nothing runs there
    assert why(recipe(model)).startswith("its processes have all exited")


def test_pools_are_listed_from_their_state_files_and_chosen_by_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYRL_POOLS_DIR", str(tmp_path / "pools"))
    model = write_model(tmp_path / "m")
    for name, max_len in (("short", 256), ("fits", 512)):
        path = tmp_path / "pools" / name
        path.mkdir(parents=True)
        pool_from(plan_pool(recipe(model, max_model_len=max_len), path, CPU2), path, model, os.getpid()).write()
    assert [p.name for p in list_pools()] == ["fits", "short"]
    run_plan = build_plan(recipe(model), "rl", tmp_path / "run", machine=CPU2)
    chosen, reasons = choose_pool("auto", run_plan, 1, model)
    assert chosen.name == "fits" and reasons == []
    assert choose_pool("none", run_plan, 1, model) == (None, [])
    with pytest.raises(UsageError, match="--pool short: the pool does not fit this run: engines started"):
        choose_pool("short", run_plan, 1, model)
    with pytest.raises(UsageError, match="no engine pool named 'nope'"):
        choose_pool("nope", run_plan, 1, model)
    with leased(Pool.read(tmp_path / "pools" / "fits"), tmp_path / "busy-run"):
        chosen, reasons = choose_pool("auto", run_plan, 1, model)
    assert chosen is None and reasons[0] == f"pool fits: in use by the run in {tmp_path / 'busy-run'}"


def test_the_lease_refuses_a_second_holder_and_frees_on_exit(tmp_path):
    path = tmp_path / "p"
    path.mkdir()
    model = write_model(tmp_path / "m")
    pool = pool_from(plan_pool(recipe(model), path, CPU2), path, model, os.getpid())
    pool.write()
    with leased(pool, tmp_path / "run-a"):
        assert pool.holder()["run_dir"] == str(tmp_path / "run-a")
        with pytest.raises(UsageError) as info:
            with leased(Pool.read(path), tmp_path / "run-b"):
                pass
        assert str(info.value).startswith(
            f"engine pool 'p' is in use by the run in {tmp_path / 'run-a'} (pid {os.getpid()})"
        )
        assert pool.holder()["run_dir"] == str(tmp_path / "run-a")  # a refused run leaves the record alone
    assert pool.holder() is None
    with leased(pool, tmp_path / "run-b"):
        pass


# ------------------------------------------------------------------------ auxiliary models


def teacher_recipe(model: Path, teacher: Path | None, **distillation) -> Recipe:
    rl = {} if teacher is None else {"distillation": {"teacher": str(teacher), **distillation}}
    return recipe(model, rl)


def test_a_pool_of_a_recipe_with_a_teacher_holds_the_teachers_engines_detached(tmp_path):
    model, teacher = write_model(tmp_path / "m"), write_model(tmp_path / "teacher")
    r = teacher_recipe(model, teacher, engines=2)
    pool_plan = plan_pool(r, tmp_path / "pool", CPU2, warm=False)
    assert [(p.role, p.name) for p in pool_plan.processes if p.role in ("engine", "auxiliary")] == [
        ("engine", "engine-0"),
        ("auxiliary", "teacher-0"),
        ("auxiliary", "teacher-1"),
    ]
    run_plan = build_plan(r, "rl", tmp_path / "run", machine=CPU2)
    own = [p for p in run_plan.processes if p.role == "auxiliary"]
    for pooled, mine in zip([p for p in pool_plan.processes if p.role == "auxiliary"], own):
        assert "SKYRL_DIE_WITH_PARENT" not in pooled.env
        assert engine_signature(pooled) == engine_signature(mine)  # placed and started as the run's own
        assert pooled.argv[pooled.argv.index("backends.inference.serve") + 1] == str(teacher)
    assert list(pool_plan.auxiliary_urls) == ["teacher"] and len(pool_plan.auxiliary_urls["teacher"]) == 2


def test_pool_json_records_the_auxiliary_engines_and_a_run_takes_their_urls_from_it(tmp_path):
    model, teacher = write_model(tmp_path / "m"), write_model(tmp_path / "teacher")
    r = teacher_recipe(model, teacher)
    path = tmp_path / "pool"
    path.mkdir()
    pool = pool_from(plan_pool(r, path, CPU2, warm=False), path, model, os.getpid())
    pool.write()
    raw = json.loads((path / "pool.json").read_text())
    assert [a["spec"]["name"] for a in raw["auxiliaries"]] == ["teacher-0"]
    again = Pool.read(path)
    assert [p.spec for p in again.auxiliaries] == [p.spec for p in pool.auxiliaries]
    assert [p.spec.name for p in again.processes()] == ["engine-0", "teacher-0", "router"]  # adopted, restarted
    (url,) = again.auxiliary_engine_urls
    assert again.auxiliary_urls == {"teacher": (url,)}
    plan = build_plan(r, "rl", tmp_path / "run", machine=CPU2, pool=again.attachment())
    assert [p.role for p in plan.processes] == ["setup", "orchestrator", "trainer"]  # no teacher of its own
    assert plan.auxiliary_urls == {"teacher": (url,)}
    (orchestrator,) = [p for p in plan.processes if p.role == "orchestrator"]
    argv = list(orchestrator.argv)
    assert argv[argv.index("--auxiliary-urls") + 1] == f"teacher={url}"
    # A pool.json from before auxiliary models were pooled reads as a pool without them.
    del raw["auxiliaries"]
    (path / "pool.json").write_text(json.dumps(raw))
    assert Pool.read(path).auxiliaries == [] and Pool.read(path).auxiliary_urls == {}


def test_a_run_attaches_only_to_a_pool_serving_its_auxiliary_models(tmp_path):
    model, teacher = write_model(tmp_path / "m"), write_model(tmp_path / "teacher")
    other = write_model(tmp_path / "other-teacher")
    with_teacher = pool_from(
        plan_pool(teacher_recipe(model, teacher), tmp_path / "p1", CPU2), tmp_path / "p1", model, os.getpid()
    )
    without = pool_from(plan_pool(recipe(model), tmp_path / "p2", CPU2), tmp_path / "p2", model, os.getpid())

    def why(pool: Pool, r: Recipe) -> str | None:
        return fit_problem(pool, build_plan(r, "rl", tmp_path / "run", machine=CPU2), 1, model)

    assert why(with_teacher, teacher_recipe(model, teacher)) is None
    assert why(without, teacher_recipe(model, teacher)) == (
        "the run serves a teacher and the pool does not (skyrl engines up on a recipe with it starts one)"
    )
    assert why(with_teacher, recipe(model)) == "the pool serves a teacher and the run does not"
    assert why(with_teacher, teacher_recipe(model, teacher, engines=2)) == "teacher engines: pool 1, this run 2"
    assert why(with_teacher, teacher_recipe(model, other)) == f"teacher model: pool {teacher}, this run {other}"
    assert why(with_teacher, teacher_recipe(model, teacher, dtype="bfloat16")) == (
        "teacher engines started with other settings (--dtype: pool float32, this run bfloat16)"
    )
    judge = {"judge": {"model": str(teacher)}}
    assert why(with_teacher, recipe(model, {"distillation": {"teacher": str(teacher)}, **judge})).startswith(
        "the run serves a judge and the pool does not"
    )
