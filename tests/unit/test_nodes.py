"""Runs across nodes: the [cluster] layout and its checks, what each node runs (skyrl_cli.plan.nodes),
the node rank's sources, the recipe hash, the sbatch script (skyrl_cli.plan.slurm) and the run
directory rendezvous with its heartbeat (skyrl_cli.launch.nodes)."""

from __future__ import annotations

import re
import shlex
import subprocess
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from skyrl_cli.launch.nodes import Rendezvous
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.nodes import (
    NodeContext,
    cluster_address,
    cluster_layout,
    engine_seed_offset,
    node_rank,
    plan_cluster,
    plan_node,
)
from skyrl_cli.plan.slurm import gpus_per_node
from skyrl_contracts.errors import LaunchError, UsageError
from skyrl_contracts.rundir import RunDir, recipe_hash
from skyrl_contracts.schema import Recipe

MACHINE = MachineFacts(cpu_cores=(0, 1), python="/py", port_finder=lambda n: list(range(20000, 20000 + n)))


def recipe(cluster: dict | None = None, trainer: dict | None = None, rl: bool = True, **inference) -> Recipe:
    data = {
        "name": "mn",
        "model": {"init": {"hidden_size": 64, "layers": 2, "heads": 2}, "tokenizer": "char"},
        "data": {"task": "addition"},
        "sft": {"batch_size": 32},
        "inference": {"engines": 1, **inference},
        "trainer": {"ranks": 1, **(trainer or {})},
    }
    if rl:
        data["rl"] = {"init_from": "/models/sft", "prompts_per_step": 4, "samples_per_prompt": 4}
    if cluster is not None:
        data["cluster"] = {"address": "10.0.0.1", **cluster}
    return Recipe.model_validate(data)


def node_plan(r: Recipe, stage: str, rank: int, remote=None, own=None):
    layout = cluster_layout(r)
    context = NodeContext(rank, "10.0.0.1", own or ("10.0.0.1" if rank == 0 else f"10.0.0.{rank + 1}"))
    return plan_node(r, stage, layout, context, Path("/shared/run"), machine=MACHINE, remote_urls=remote)


def names(plan) -> list[str]:
    return [p.name for p in plan.processes]


def arg(argv, flag: str) -> str:
    return argv[list(argv).index(flag) + 1]


# ------------------------------------------------------------------------------------------ layout


def test_split_layout_trainers_first_inference_last():
    layout = cluster_layout(recipe({"nodes": 4, "trainer_nodes": 2, "inference_nodes": 2}))
    assert [layout.roles(n, "rl") for n in range(4)] == [
        ("coordinator", "trainer"),
        ("trainer",),
        ("inference",),
        ("inference",),
    ]
    assert [layout.roles(n, "sft") for n in range(4)] == [("coordinator", "trainer"), ("trainer",), (), ()]
    assert layout.stage_nodes("sft") == 2 and layout.stage_nodes("rl") == 4 and not layout.overlap


def test_default_layout_every_node_trains_and_serves():
    layout = cluster_layout(recipe({"nodes": 2}))
    assert layout.roles(1, "rl") == ("trainer", "inference") and layout.overlap


@pytest.mark.parametrize(
    ("cluster", "trainer", "message"),
    [
        ({"nodes": 3, "trainer_nodes": 1, "inference_nodes": 1}, {}, "nodes 1..1 neither train nor serve"),
        ({"nodes": 2, "trainer_nodes": 3}, {}, "trainer_nodes (3) must be <= nodes (2)"),
        ({"nodes": 2}, {"nnodes": 2, "rdzv_endpoint": "h:1"}, "trainer.nnodes is derived from [cluster]"),
        ({"nodes": 2, "inference_nodes": 0}, {}, "the RL stage needs engines on at least one node"),
        ({"nodes": 1}, {}, "greater than or equal to 2"),
    ],
)
def test_layouts_that_cannot_act_are_refused(cluster, trainer, message):
    with pytest.raises(ValidationError) as info:
        recipe(cluster, trainer)
    assert message in str(info.value)


def test_resolved_recipe_reads_back():
    r = recipe({"nodes": 2, "trainer_nodes": 1, "inference_nodes": 1})
    assert Recipe.model_validate_json(r.model_dump_json(by_alias=True)) == r


def test_legacy_trainer_nnodes_is_an_sft_layout_and_refused_for_rl():
    r = recipe(trainer={"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "10.0.0.1:29400"})
    layout = cluster_layout(r)
    assert layout.legacy and layout.address == "10.0.0.1" and layout.port == 29400
    assert node_rank(r, layout, None, {}) == 1  # trainer.node_rank, as before
    plan = node_plan(r, "sft", 1)
    assert arg(plan.processes[0].argv, "--node-rank") == "1"
    with pytest.raises(UsageError, match=r"RL across nodes takes its layout from a \[cluster\] section"):
        node_plan(r, "rl", 0)


# ------------------------------------------------------------------------------------------ node rank


def test_node_rank_from_flag_then_slurm_then_zero():
    r = recipe({"nodes": 3})
    layout = cluster_layout(r)
    assert node_rank(r, layout, 2, {"SLURM_NODEID": "1"}) == 2
    assert node_rank(r, layout, None, {"SLURM_NODEID": "1", "SLURM_PROCID": "2"}) == 1
    assert node_rank(r, layout, None, {"SLURM_PROCID": "2"}) == 2
    assert node_rank(r, layout, None, {}) == 0
    with pytest.raises(UsageError, match=r"^SLURM_NODEID = 5: the layout has nodes 0\.\.2 \(cluster\.nodes = 3\)$"):
        node_rank(r, layout, None, {"SLURM_NODEID": "5"})


def test_cluster_address_from_recipe_or_environment():
    r = recipe({"nodes": 2, "address": None})
    layout = cluster_layout(r)
    assert cluster_address(layout, {"SKYRL_CLUSTER_ADDRESS": "gpu-001"}) == "gpu-001"
    with pytest.raises(UsageError, match="^cluster.address: set node 0's address"):
        cluster_address(layout, {})


def test_recipe_hash_ignores_the_node_rank_only():
    base = recipe(trainer={"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "10.0.0.1:1"})
    other_node = recipe(trainer={"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "10.0.0.1:1"})
    other_steps = Recipe.model_validate({**base.model_dump(by_alias=True), "seed": 5})
    assert recipe_hash(base) == recipe_hash(other_node) != recipe_hash(other_steps)


# ------------------------------------------------------------------------------------------ plans


def test_split_rl_node_0_runs_router_orchestrator_trainer_and_node_1_an_engine():
    r = recipe({"nodes": 2, "trainer_nodes": 1, "inference_nodes": 1}, engines=2)
    node0 = node_plan(r, "rl", 0, remote=["http://10.0.0.2:8001", "http://10.0.0.2:8002"])
    assert names(node0) == ["engine-model", "router", "orchestrator", "trainer"]
    router = next(p for p in node0.processes if p.role == "router")
    assert router.argv[router.argv.index("--worker-urls") + 1 : router.argv.index("--policy")] == (
        "http://10.0.0.2:8001",
        "http://10.0.0.2:8002",
    )
    orchestrator = next(p for p in node0.processes if p.role == "orchestrator")
    assert arg(orchestrator.argv, "--engine-urls") == "http://10.0.0.2:8001,http://10.0.0.2:8002"
    trainer = next(p for p in node0.processes if p.role == "trainer")
    assert arg(trainer.argv, "--nnodes") == "1"
    assert node0.roles == ("coordinator", "trainer") and node0.node == 0 and node0.nodes == 2

    node1 = node_plan(r, "rl", 1)
    assert names(node1) == ["engine-0", "engine-1"] and node1.roles == ("inference",)
    assert [arg(p.argv, "--host") for p in node1.processes] == ["10.0.0.2", "10.0.0.2"]
    assert [arg(p.argv, "--seed") for p in node1.processes] == ["0", "1"]  # the first inference node
    assert arg(node1.processes[0].argv, "backends.inference.serve") == "/shared/run/engine-model"
    assert node1.engine_urls == ("http://10.0.0.2:20000", "http://10.0.0.2:20001")


def test_engines_of_every_inference_node_sample_with_seeds_of_their_own():
    r = recipe({"nodes": 3, "trainer_nodes": 1, "inference_nodes": 3}, engines=2)
    layout = cluster_layout(r)
    assert [engine_seed_offset(r, layout, n) for n in range(3)] == [0, 2, 4]
    node0 = node_plan(r, "rl", 0, remote=[])
    assert [arg(p.argv, "--seed") for p in node0.processes if p.role == "engine"] == ["0", "1"]
    assert [arg(p.argv, "--seed") for p in node_plan(r, "rl", 2).processes] == ["4", "5"]


def test_trainer_ranks_on_two_nodes_rendezvous_on_node_0():
    r = recipe({"nodes": 2, "port": 29555}, trainer={"ranks": 2})
    node1 = node_plan(r, "rl", 1)
    assert names(node1) == ["engine-0", "trainer"] and node1.world_size == 4
    argv = next(p for p in node1.processes if p.role == "trainer").argv
    assert (arg(argv, "--nnodes"), arg(argv, "--node-rank"), arg(argv, "--rdzv-endpoint")) == (
        "2",
        "1",
        "10.0.0.1:29555",
    )
    assert "--resume" not in argv


def test_sft_on_an_inference_only_node_runs_nothing():
    r = recipe({"nodes": 2, "trainer_nodes": 1, "inference_nodes": 1})
    assert names(node_plan(r, "sft", 1)) == []
    assert names(node_plan(r, "sft", 0)) == ["trainer"]


def test_dry_run_lists_every_node_with_placeholders_for_the_engines_not_yet_reported():
    r = recipe({"nodes": 2, "trainer_nodes": 1, "inference_nodes": 1})
    data = plan_cluster(r, "rl", cluster_layout(r), "10.0.0.1", Path("/shared/run"), machine=MACHINE)
    assert [n["node"] for n in data["nodes"]] == [0, 1]
    assert data["nodes"][0]["engine_urls"] == ["http://<node-1-engine-0>"]
    assert data["nodes"][1]["processes"][0]["argv"][data["nodes"][1]["processes"][0]["argv"].index("--host") + 1] == (
        "<node-1>"
    )


# ------------------------------------------------------------------------------------------ slurm

# Every long option of sbatch (Slurm 23.11 man page, sbatch(1)) that a script may set: a script
# whose #SBATCH lines use others is rejected by sbatch ("unrecognized option").
SBATCH_OPTIONS = {
    "account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir", "cluster-constraint", "clusters",
    "comment", "constraint", "container", "container-id", "contiguous", "core-spec", "cores-per-socket", "cpu-freq",
    "cpus-per-gpu", "cpus-per-task", "deadline", "delay-boot", "dependency", "distribution", "error", "exclude",
    "exclusive", "export", "export-file", "extra", "extra-node-info", "get-user-env", "gid", "gpu-bind", "gpu-freq",
    "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres", "gres-flags", "hint", "hold",
    "ignore-pbs", "input", "job-name", "kill-on-invalid-dep", "licenses", "mail-type", "mail-user", "mcs-label",
    "mem", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mincpus", "network", "nice", "no-kill", "no-requeue",
    "nodefile", "nodelist", "nodes", "ntasks", "ntasks-per-core", "ntasks-per-gpu", "ntasks-per-node",
    "ntasks-per-socket", "open-mode", "output", "overcommit", "oversubscribe", "parsable", "partition", "power",
    "prefer", "priority", "profile", "propagate", "qos", "quiet", "reboot", "requeue", "reservation", "signal",
    "sockets-per-node", "spread-job", "switches", "test-only", "thread-spec", "threads-per-core", "time",
    "time-min", "tmp", "tres-per-task", "uid", "use-min-nodes", "verbose", "wait", "wait-all-nodes", "wckey", "wrap",
}  # fmt: skip
SRUN_OPTIONS = {"nodes", "ntasks-per-node", "kill-on-bad-exit", "output"}


def check_sbatch_syntax(script: str) -> dict[str, str]:
    """What can be checked without Slurm: a bash script (``bash -n``) whose #SBATCH lines all come
    before the first command and are known ``--key=value`` options of sbatch; returns them."""
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    options = {}
    for index, line in enumerate(lines):
        if line.startswith("#SBATCH"):
            assert index < first_command, f"sbatch ignores #SBATCH after the first command: {line}"
            match = re.fullmatch(r"#SBATCH --([a-z-]+)=(\S+)", line)
            assert match, line
            assert match.group(1) in SBATCH_OPTIONS, line
            options[match.group(1)] = match.group(2)
    return options


def srun_command(script: str) -> list[str]:
    text = script.replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.startswith("srun ")]
    words = shlex.split(line)
    for word in words[1:]:
        if word.startswith("--"):
            assert word[2:].split("=")[0] in SRUN_OPTIONS, word
    return words


def test_gpus_per_node_is_the_busiest_node():
    shared = recipe({"nodes": 2}, trainer={"ranks": 4}, engines=2, tensor_parallel=2)
    assert gpus_per_node(shared, cluster_layout(shared), "rl") == 8
    assert gpus_per_node(shared, cluster_layout(shared), "sft") == 4
    cpu = recipe({"nodes": 2}, trainer={"device": "cpu"})
    assert gpus_per_node(cpu, cluster_layout(cpu), "rl") == 0


# ------------------------------------------------------------------------------------------ rendezvous


def rendezvous(run_dir, node, nodes=2, hash_="h", flags=None, heartbeat_timeout_s=30.0, arrival_timeout_s=10.0):
    return Rendezvous(
        run_dir,
        node,
        nodes,
        hash_,
        "rl",
        flags or {"resume": False},
        arrival_timeout_s=arrival_timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )


def join_in_thread(rdv) -> dict:
    result: dict = {}

    def go():
        try:
            rdv.join()
            result["ok"] = True
        except Exception as err:  # noqa: BLE001 - handed to the test
            result["error"] = err

    thread = threading.Thread(target=go)
    thread.start()
    result["thread"] = thread
    return result


def test_nodes_meet_watch_each_other_and_a_silent_node_ends_the_run(tmp_path):
    with rendezvous(tmp_path, 0, heartbeat_timeout_s=2.0) as zero, rendezvous(tmp_path, 1) as one:
        meeting = join_in_thread(zero)
        one.join()
        meeting["thread"].join(10)
        assert meeting == {"ok": True, "thread": meeting["thread"]}
        assert one.marker.launch == zero.marker.launch
        one.set(phase="ready", engines=["http://10.0.0.2:1"])
        assert zero.check()[1].engines == ["http://10.0.0.2:1"]
        one._stop.set()  # node 1 dies: its marker stops changing
        one._thread.join()
        start = time.monotonic()
        with pytest.raises(LaunchError) as info:
            while True:
                zero.check()
                time.sleep(0.1)
        assert 2.0 <= time.monotonic() - start < 4.0
        assert re.fullmatch(
            r"node 1 \(\S+\) stopped: no heartbeat for 2 s \(cluster.heartbeat_timeout_s = 2\); log: .*/logs/node-1",
            str(info.value),
        )


def test_a_node_with_another_recipe_is_refused_by_both_sides(tmp_path):
    with rendezvous(tmp_path, 0) as zero, rendezvous(tmp_path, 1, hash_="other") as one:
        meeting = join_in_thread(zero)
        expected = "nodes 0 and 1 were started with different recipes (hash h on node 0, other on node 1)"
        with pytest.raises(UsageError) as info:
            one.join()
        meeting["thread"].join(10)
        assert str(info.value).startswith(expected) and str(meeting["error"]).startswith(expected)


def test_a_node_started_without_resume_is_refused(tmp_path):
    with rendezvous(tmp_path, 0, flags={"resume": True}) as zero, rendezvous(tmp_path, 1) as one:
        meeting = join_in_thread(zero)
        with pytest.raises(UsageError, match=r"different flags \(resume=True on node 0, resume=False on node 1\)"):
            one.join()
        meeting["thread"].join(10)


def test_a_stale_marker_of_an_earlier_launch_is_not_joined(tmp_path):
    with rendezvous(tmp_path, 0):  # written once, never beating: a dead earlier launch
        pass
    assert RunDir(tmp_path).node_marker(0).exists()  # it is there, but not live
    with pytest.raises(UsageError) as info:
        with rendezvous(tmp_path, 1, arrival_timeout_s=1.5) as one:
            one.join()
    assert "the run directory must be on a shared file system" in str(info.value)


def test_node_0_names_the_node_that_never_arrives(tmp_path):
    with pytest.raises(UsageError) as info:
        with rendezvous(tmp_path, 0, nodes=3, arrival_timeout_s=1.0) as zero:
            zero.join()
    assert str(info.value).startswith("node 1 did not appear within 1 s (cluster.arrival_timeout_s)")
    assert f"node 1's log: {tmp_path}/logs/node-1" in str(info.value)
    assert "\n" not in str(info.value)


def test_doctor_checks_the_rendezvous_of_the_layout(monkeypatch):
    from skyrl_cli.doctor.network import check_rendezvous

    here = recipe({"nodes": 2, "address": "127.0.0.1"})
    (check,) = check_rendezvous(here)
    assert check.status == "pass" and "node 0 of 2: hosts 127.0.0.1:29500" in check.detail
    (check,) = check_rendezvous(recipe({"nodes": 2, "address": "10.255.255.1"}))
    assert check.status == "fail" and "is not an address of this host" in check.detail
    monkeypatch.setenv("SLURM_NODEID", "1")
    (check,) = check_rendezvous(recipe({"nodes": 2, "address": "127.0.0.1", "port": 1025}))
    assert check.status == "fail" and check.detail.startswith("127.0.0.1:1025: ")
    (check,) = check_rendezvous(recipe({"nodes": 2, "trainer_nodes": 1, "inference_nodes": 1}))
    assert check.status == "pass" and "no rendezvous across nodes" in check.detail


def test_trainer_ranks_across_nodes_open_their_collectives_on_the_nodes_interface():
    r = recipe({"nodes": 2})
    layout = cluster_layout(r)
    context = NodeContext(1, "10.0.0.1", "10.0.0.2", interface="eth1")
    plan = plan_node(r, "rl", layout, context, Path("/shared/run"), machine=MACHINE)
    trainer = next(p for p in plan.processes if p.role == "trainer")
    assert trainer.env["GLOO_SOCKET_IFNAME"] == trainer.env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert "GLOO_SOCKET_IFNAME" not in next(p for p in plan.processes if p.role == "engine").env
    one_trainer_node = recipe({"nodes": 2, "trainer_nodes": 1})
    plan = plan_node(
        one_trainer_node, "rl", cluster_layout(one_trainer_node), NodeContext(0, "a", "a", "eth1"),
        Path("/r"), machine=MACHINE, remote_urls=[],
    )  # fmt: skip
    assert all("GLOO_SOCKET_IFNAME" not in p.env for p in plan.processes)  # nothing spans the nodes


def test_interface_of_finds_loopback():
    from skyrl_cli.plan.nodes import interface_of

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: no interface here has it


def test_gpu_layout_checks_count_per_node_role():
    from skyrl_cli.plan.feasibility import feasibility_problems

    gpus8 = MachineFacts(cpu_cores=(0, 1), gpus=tuple(range(8)))
    split = recipe({"nodes": 2, "trainer_nodes": 1, "inference_nodes": 1}, trainer={"ranks": 8}, engines=8)
    assert feasibility_problems(split, gpus8) == []  # node 0: 8 trainer ranks; node 1: 8 engines
    shared = recipe({"nodes": 2}, trainer={"ranks": 8}, engines=8)  # every node trains and serves: 16
    assert [p.message for p in feasibility_problems(shared, gpus8)] == [
        "the layout needs 16 GPUs (8 trainer ranks + 8 for 8 engines) but 8 are visible"
    ]
    big = recipe(
        {"nodes": 2, "trainer_nodes": 1, "inference_nodes": 1}, trainer={"ranks": 4}, engines=5, tensor_parallel=2
    )
    assert [(p.path, p.message) for p in feasibility_problems(big, gpus8)] == [
        (("inference", "engines"), "an inference node needs 10 GPUs (5 engines x tensor_parallel 2) but 8 are visible")
    ]


def test_the_other_nodes_stop_when_node_0_falls_silent_or_fails(tmp_path):
    with rendezvous(tmp_path, 0) as zero, rendezvous(tmp_path, 1, heartbeat_timeout_s=2.0) as one:
        meeting = join_in_thread(zero)
        one.join()
        meeting["thread"].join(10)
        assert not one.coordinator_finished()
        zero.set(phase="failed", message="the trainer failed (exit code 1)")
        with pytest.raises(
            LaunchError, match=r"^node 0 \(\S+\) failed: the trainer failed \(exit code 1\); log: .*/logs$"
        ):
            one.check()
        zero.set(phase="running")
        zero._stop.set()
        zero._thread.join()
        with pytest.raises(LaunchError, match=r"^node 0 \(\S+\) stopped: no heartbeat for 2 s"):
            while True:
                one.check()
                time.sleep(0.1)
        zero.set(phase="done")
        assert one.coordinator_finished()
