"""What the fault-injection suite (tests/faults) relies on, checked cheaply with files: messages for
killed processes and ranks, checkpoint writes that fail cleanly, run directories that cannot be
written, the RL resume point and a weight sync that waits for an engine (with real processes:
tests/integration/test_fault_handling_processes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skyrl_cli.launch.supervisor import exit_description, failure_message, killed_rank
from skyrl_contracts.errors import UsageError
from skyrl_contracts.rundir import RunDir

# torchrun's summary when rank 1 was SIGKILLed (torch 2.13), after rank 0's consequential error.
TORCHRUN_TAIL = """\
[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41000
W1201 16:40:01.123000 900 torch/distributed/elastic/multiprocessing/api.py:908] Sending process 901 closing signal SIGTERM
E1201 16:40:01.456000 900 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: -9) local_rank: 1 (pid: 902)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
backends.train.sft FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_16:40:01
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 902)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 902
============================================================
"""


def test_exit_description_names_the_signal():
    assert exit_description(-9) == "was killed by SIGKILL"
    assert exit_description(3) == "failed (exit code 3)"


def test_a_killed_rank_is_the_cause_not_the_peer_error(tmp_path):
    assert killed_rank(TORCHRUN_TAIL) == "rank 1 (pid 902) was killed by SIGKILL"
    log = tmp_path / "trainer.log"
    log.write_text("=== 2026-12-01 16:39:00 start: torchrun\n" + TORCHRUN_TAIL)
    assert failure_message("the trainer failed (exit code 1)", log) == (
        f"the trainer failed (exit code 1): rank 1 (pid 902) was killed by SIGKILL\nlog: {log}"
    )
    # a rank that failed on its own (exit code 1) leaves the exception line as the cause
    assert killed_rank(TORCHRUN_TAIL.replace("-9 (pid: 902)", "1 (pid: 902)")) is None


class _Engine:
    def save_checkpoint(self, path, tag, save_latest):
        Path(path).mkdir(parents=True)
        (Path(path) / "shard.pt").write_bytes(b"x" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


def test_a_failed_checkpoint_write_leaves_no_partial_directory(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import shutil
    from collections import namedtuple

    from backends.train import checkpoint

    previous = tmp_path / "checkpoints/step-4"
    (previous / "model").mkdir(parents=True)
    (previous / "trainer_state.json").write_text(json.dumps({"step": 4}))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 20, (10 << 20) - 4096, 4096))
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.save_checkpoint(_Engine(), tmp_path, 8, {}, lambda out: None, keep_last=2)
    assert str(info.value) == (
        f"checkpoint step-8 not written: No space left on device (0.0 MiB were free in {tmp_path}); "
        "step-4 is intact; resume with --resume"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-4"]


def test_a_run_directory_through_a_file_is_a_usage_error(tmp_path):
    from skyrl_contracts.schema import Recipe

    (tmp_path / "file").write_text("")
    recipe = Recipe.model_validate({"name": "x", "model": {"init": {}}, "data": {"task": "addition"}, "sft": {}})
    with pytest.raises(
        UsageError, match=r"^run directory .*/file/run is not writable: .*/file/run/logs: Not a directory$"
    ):
        RunDir(tmp_path / "file/run").prepare(recipe)


def test_rl_resumes_from_the_newest_checkpoint_with_orchestrator_state(tmp_path):
    paths = RunDir(tmp_path)
    for step in (2, 4):
        paths.checkpoint(step).mkdir(parents=True)
        (paths.checkpoint(step) / "trainer_state.json").write_text("{}")
    assert paths.latest_rl_checkpoint() is None
    paths.orchestrator_state.mkdir()
    paths.orchestrator_state_at(2).write_text("{}")
    assert paths.latest_rl_checkpoint() == paths.checkpoint(2)  # step-4's state was never written
    paths.orchestrator_state_at(4).write_text("{}")
    assert paths.latest_rl_checkpoint() == paths.checkpoint(4)


def test_a_weight_sync_waits_while_no_engine_is_reachable(tmp_path):
    """A single engine being restarted: the sync is tried again, not the end of the run."""
    import asyncio

    pytest.importorskip("torch")
    from backends.inference.weight_sync import NoEngineReachable
    from backends.rollout.engine_sync import EngineSync
    from tests.unit.test_rollout_orchestrator import _orchestrator

    orchestrator, _, engines, _, _ = _orchestrator(tmp_path, async_mode=False)
    sync = EngineSync(engines, orchestrator.exchange, orchestrator.events)
    load, calls = engines.load, []

    async def down_once(version, weights_dir):
        calls.append(version)
        if len(calls) == 1:
            raise NoEngineReachable(f"weight sync to version {version}: no engine reachable (http://x)")
        return await load(version, weights_dir)

    engines.load = down_once
    asyncio.run(sync.load_when_reachable(2))
    assert calls == [2, 2] and engines.version == "2"
    engines.load = lambda version, weights_dir: _raise(NoEngineReachable("no engine reachable"))
    with pytest.raises(NoEngineReachable):
        asyncio.run(sync.load_when_reachable(3, timeout_s=0))


async def _raise(err: Exception):
    raise err


def test_a_rank_failing_for_its_peer_does_not_hide_the_peer_error():
    from skyrl_cli.launch.supervisor import telling_line

    tail = (
        "[rank1]: backends.train.checkpoint.CheckpointError: checkpoint step-8 not written: No space left on device\n"
        "[rank0]: backends.train.checkpoint.CheckpointError: checkpoint step-8 not written: RuntimeError: [pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:47295. This is typically caused by a remote worker crashing. Check the "
        "logs of the remote worker before reporting an error.\n"
    )
    assert telling_line(tail) == "CheckpointError: checkpoint step-8 not written: No space left on device"
