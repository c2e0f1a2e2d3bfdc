"""Runs across nodes, as two simulated nodes on this machine (the same shared run directory, one
``skyrl`` command per node):

- SFT: two nodes with one trainer rank each end at exactly the loss of one node with two ranks;
- RL on the quickstart, each node in its own network namespace (so nothing works by accident
  through one loopback): each node runs an engine and a trainer rank, node 0 also the
  orchestrator and the router, which reach node 1's engine only at node 1's address. Killing
  every process of node 1 mid-run stops node 0 within 60 s with one line naming node 1 and its log
  (node 0's trainer rank fails first, at once: the run still names the node that died);
  ``--resume`` on both nodes completes the run, and held-out accuracy rises as in the single-node
  quickstart test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.cli_runs import ENV, REPO, SKYRL, events, run_skyrl
from tests.integration.conftest import QUICKSTART_RECIPE as QUICKSTART
from tests.integration.conftest import SHORTENED_QUICKSTART as SHORTER
from tests.recipes import SFT, SMALL, tiny_recipe, write_recipe

pytestmark = pytest.mark.integration

SFT_RECIPE = tiny_recipe(
    SMALL, SFT, name="mnsft", data={"eval_size": 16}, sft={"steps": 20}, trainer={"zero_stage": None}
)
TWO_NODES = ["--set", "trainer.ranks=1", "--set", "cluster.nodes=2", "--set", 'cluster.address="127.0.0.1"']


def start(args, log: Path, netns: str | None = None, cwd: Path = REPO) -> subprocess.Popen:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.Popen(
        [*prefix, str(SKYRL), *map(str, args)],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=ENV,
    )


def finished(proc: subprocess.Popen, log: Path, timeout: float = 600) -> str:
    proc.wait(timeout=timeout)
    return log.read_text()


def test_two_node_sft_ends_at_the_single_node_loss(tmp_path):
    write_recipe(tmp_path / "sft.toml", SFT_RECIPE)
    one, two = tmp_path / "one", tmp_path / "two"
    run_skyrl("sft", "sft.toml", "--run-dir", one, "--quiet", cwd=tmp_path, timeout=600)
    common = ["sft", "sft.toml", "--run-dir", two, "--quiet", *TWO_NODES, "--set", "cluster.port=29631"]
    node0 = start([*common, "--node-rank", "0"], tmp_path / "node0.out", cwd=tmp_path)
    node1 = run_skyrl(*common, "--node-rank", "1", cwd=tmp_path, timeout=600)
    out0 = finished(node0, tmp_path / "node0.out")
    assert node0.returncode == 0, out0
    assert "sft done on node 1" in node1.stderr
    last = events(two, "train/loss")[-1]
    assert last == events(one, "train/loss")[-1] and last[0] == 20  # (step, loss): the same loss at step 20
    # node 1's rank ran under node 1's driver, logging into its own folder of the shared run directory
    assert "--node-rank 1" in (two / "logs/node-1/trainer.log").read_text().splitlines()[1]
    assert "--node-rank 0" in (two / "logs/trainer.log").read_text().splitlines()[1]


# ------------------------------------------------------------------------------------------ RL


@pytest.fixture(scope="module")
def namespaces():
    """Two network namespaces joined by a veth pair: node 0 at 10.231.N.1, node 1 at 10.231.N.2."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = os.getpid() % 100000
    subnet = 10 + os.getpid() % 240
    ns = [f"skyrl-mn{tag}-{i}" for i in (0, 1)]
    veth = [f"skm{tag}{c}" for c in "ab"]
    addresses = [f"10.231.{subnet}.{i}" for i in (1, 2)]
    steps = [
        ["ip", "netns", "add", ns[0]],
        ["ip", "netns", "add", ns[1]],
        ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]],
    ]
    for i in (0, 1):
        steps += [
            ["ip", "link", "set", veth[i], "netns", ns[i]],
            ["ip", "-n", ns[i], "addr", "add", f"{addresses[i]}/24", "dev", veth[i]],
            ["ip", "-n", ns[i], "link", "set", veth[i], "up"],
            ["ip", "-n", ns[i], "link", "set", "lo", "up"],
        ]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as err:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {getattr(err, 'stderr', err)}")
    yield ns, addresses
    for name in ns:
        kill_namespace(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def namespace_pids(name: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()


def namespace_commands(name: str) -> list[str]:
    found = []
    for pid in namespace_pids(name):
        try:
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return found


def kill_namespace(name: str) -> int:
    """SIGKILL every process of a simulated node (a machine that dies)."""
    pids = namespace_pids(name)
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def wait_for(path: Path, procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        for proc in procs:
            assert proc.poll() is None, f"a node exited before {path} appeared"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.5)


def test_rl_on_two_nodes_learns_survives_the_loss_of_node_1_and_resumes(tmp_path, namespaces, shortened_quickstart_sft):
    """Both nodes train and serve (the default layout): one trainer rank and one engine each, the
    quickstart's world of 2 ranks; node 0 also runs the router and the orchestrator."""
    (ns0, ns1), (address0, address1) = namespaces
    sft = shortened_quickstart_sft
    run = tmp_path / "rl"
    layout = ["--set", "cluster.nodes=2", "--set", "trainer.ranks=1", "--set", f'cluster.address="{address0}"']
    rl = ["--set", "rl.steps=10", "--set", "rl.eval_every=0", "--set", "rl.save_every=5"]
    common = [
        "rl",
        QUICKSTART,
        "--run-dir",
        run,
        "--quiet",
        *SHORTER,
        *rl,
        *layout,
        "--set",
        f"rl.init_from={sft / 'final'}",
    ]
    node0 = start([*common, "--node-rank", "0"], tmp_path / "node0.out", ns0)
    node1 = start([*common, "--node-rank", "1"], tmp_path / "node1.out", ns1)
    wait_for(run / "orchestrator_state" / "step-5.json", [node0, node1], 400)

    # which process ran where: each node (its own network) runs an engine and a trainer rank, only
    # node 0 the router and the orchestrator
    on0, on1 = namespace_commands(ns0), namespace_commands(ns1)
    for commands, address in ((on0, address0), (on1, address1)):
        assert any("backends.inference.serve" in c and f"--host {address}" in c for c in commands), commands
        assert any("torch.distributed.run" in c and "--nnodes 2" in c for c in commands), commands
    for role in ("vllm::router", "backends.rollout.orchestrator"):
        assert any(role in c for c in on0) and not any(role in c for c in on1), (role, on0, on1)
    router = (run / "logs/router.log").read_text()
    assert f"--worker-urls http://{address0}:" in router and f" http://{address1}:" in router
    assert sorted(p.name for p in (run / "logs/node-1").iterdir()) == ["engine-0.log", "plan.json", "trainer.log"]
    assert "learner ready: world 2" in (run / "logs/trainer.log").read_text()

    killed_at = time.monotonic()
    assert kill_namespace(ns1) >= 3  # node 1's driver, its engine and its trainer rank (with their children)
    out0 = finished(node0, tmp_path / "node0.out", timeout=120)
    stopped_s = time.monotonic() - killed_at
    errors = [line for line in out0.splitlines() if line.startswith("error:")]
    assert node0.returncode == 1 and stopped_s < 60, (stopped_s, out0[-2000:])
    assert len(errors) == 1 and errors[0].startswith("error: node 1 "), out0[-2000:]
    assert errors[0].endswith(f"log: {run}/logs/node-1")
    print(f"node 0 stopped {stopped_s:.1f} s after node 1 was killed")

    node0 = start([*common, "--node-rank", "0", "--resume"], tmp_path / "node0-resume.out", ns0)
    node1 = start([*common, "--node-rank", "1", "--resume"], tmp_path / "node1-resume.out", ns1)
    out0 = finished(node0, tmp_path / "node0-resume.out")
    out1 = finished(node1, tmp_path / "node1-resume.out", timeout=60)
    assert node0.returncode == 0, out0[-3000:]
    assert node1.returncode == 0 and "rl done on node 1" in out1, out1[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] is True
    trainer_log = (run / "logs/trainer.log").read_text()
    assert "at step 5" in trainer_log.split("resumed from")[-1].splitlines()[0]
    assert [s for s, _ in events(run, "train/policy_loss")][-5:] == [6, 7, 8, 9, 10]
    # learns like the single-node quickstart test (tests/integration/test_quickstart.py)
    assert summary["eval_accuracy_final"] >= summary["eval_accuracy_initial"] + 0.10, summary
    print(f"held-out accuracy {summary['eval_accuracy_initial']:.3f} -> {summary['eval_accuracy_final']:.3f}")
