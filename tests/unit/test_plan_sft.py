"""The SFT launch plan is a pure function of recipe, flags and machine facts."""

from __future__ import annotations

import pytest

from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.machine import MachineFacts, detect_machine, find_free_ports
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe

CPU2 = MachineFacts(
    cpu_cores=(0, 1), python="py", torch_extensions_dir="/ext", port_finder=lambda n: [29500 + i for i in range(n)]
)
GPU4 = MachineFacts(
    cpu_cores=tuple(range(16)),
    gpus=(0, 1, 2, 3),
    python="py",
    torch_extensions_dir="/ext",
    port_finder=lambda n: [29500 + i for i in range(n)],
)


def recipe(**trainer) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"init": {}, "tokenizer": "char"},
            "data": {"task": "addition"},
            "sft": {},
            "trainer": trainer,
        }
    )


def test_cpu_plan_is_one_torchrun_job(tmp_path):
    plan = build_plan(recipe(ranks=2), "sft", tmp_path / "run", resume=True, machine=CPU2)
    assert plan.stage == "sft" and plan.device == "cpu" and plan.world_size == 2 and plan.resume
    (trainer,) = plan.processes
    assert trainer.kind == "job" and trainer.role == "trainer" and trainer.name == "trainer"
    assert trainer.argv == (
        "py",
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--rdzv-endpoint",
        "127.0.0.1:29500",
        "-m",
        "backends.train.sft",
        "--run-dir",
        str(tmp_path / "run"),
        "--resume",
    )
    assert trainer.env["OMP_NUM_THREADS"] == "1"
    assert trainer.env["DS_ACCELERATOR"] == "cpu" and trainer.env["TORCH_EXTENSIONS_DIR"] == "/ext"
    assert trainer.env["HF_HUB_OFFLINE"] == "1" and "CUDA_VISIBLE_DEVICES" not in trainer.env
    assert trainer.devices == ("cpu:0", "cpu:1") and trainer.ports == (29500,)


def test_threads_per_rank(tmp_path):
    one = build_plan(recipe(ranks=1), "sft", tmp_path, machine=CPU2).processes[0]
    assert one.env["OMP_NUM_THREADS"] == "2"
    fixed = build_plan(recipe(ranks=2, threads_per_rank=3), "sft", tmp_path, machine=CPU2).processes[0]
    assert fixed.env["OMP_NUM_THREADS"] == "3"


def test_gpu_plan_owns_its_gpus(tmp_path):
    plan = build_plan(recipe(ranks=2), "sft", tmp_path, machine=GPU4)
    trainer = plan.processes[0]
    assert plan.device == "cuda" and trainer.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "DS_ACCELERATOR" not in trainer.env and trainer.devices == ("cuda:0", "cuda:1")
    chosen = build_plan(recipe(ranks=2, gpus=[2, 3]), "sft", tmp_path, machine=GPU4).processes[0]
    assert chosen.env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_recipe_built_in_code_gets_the_loaders_feasibility_checks(tmp_path):
    # The loader reports these first, as file:line problems; the planner only re-asserts them.
    with pytest.raises(
        UsageError,
        match=r"^trainer\.ranks: the layout needs 8 GPUs \(8 trainer ranks \+ 0 for 0 engines\) but 4 are visible$",
    ):
        build_plan(recipe(ranks=8), "sft", tmp_path, machine=GPU4)
    with pytest.raises(UsageError, match=r"^trainer\.device"):
        build_plan(recipe(device="cuda"), "sft", tmp_path, machine=CPU2)
    with pytest.raises(UsageError, match=r"^trainer\.gpus: GPU 7 does not exist"):
        build_plan(recipe(ranks=2, gpus=[0, 7]), "sft", tmp_path, machine=GPU4)


def test_multi_node_uses_the_recipe_rendezvous(tmp_path):
    r = recipe(ranks=4, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400")
    plan = build_plan(r, "sft", tmp_path, machine=GPU4)
    argv = plan.processes[0].argv
    assert plan.world_size == 8
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"
    assert plan.processes[0].ports == ()


def test_plan_needs_the_stage(tmp_path):
    r = Recipe.model_validate(
        {"name": "t", "model": {"init": {}, "tokenizer": "char"}, "data": {"task": "addition"}, "rl": {}}
    )
    with pytest.raises(UsageError, match="no \\[sft\\] section"):
        build_plan(r, "sft", tmp_path, machine=CPU2)


def test_machine_detection_is_light():
    facts = detect_machine()
    assert facts.cores >= 1
    a, b = find_free_ports(2)
    assert a != b


def test_free_ports_avoid_the_ephemeral_range(monkeypatch):
    from skyrl_contracts import ports as machine

    low = machine.ephemeral_port_floor()
    ports = find_free_ports(5)
    assert len(set(ports)) == 5 and all(machine.PORT_FLOOR <= p < low for p in ports)
    monkeypatch.setattr(machine, "ephemeral_port_floor", lambda: machine.PORT_FLOOR + 2)
    assert len(set(find_free_ports(3))) == 3  # no room below it: the kernel chooses
