"""The environment the supervisor gives the processes it starts (starting, watching and tearing
down real processes: tests/integration/test_supervisor_processes.py)."""

from __future__ import annotations


def test_gpu_positions_map_through_the_inherited_visible_devices():
    from skyrl_cli.launch.supervisor import child_env

    under = {"CUDA_VISIBLE_DEVICES": "2,3,4", "PATH": "/bin"}
    assert child_env(under, {"CUDA_VISIBLE_DEVICES": "0,1"})["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert child_env(under, {"CUDA_VISIBLE_DEVICES": "2"})["CUDA_VISIBLE_DEVICES"] == "4"
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}
    assert child_env(uuids, {"CUDA_VISIBLE_DEVICES": "1"})["CUDA_VISIBLE_DEVICES"] == "GPU-bb"
    assert child_env({}, {"CUDA_VISIBLE_DEVICES": "0,1"})["CUDA_VISIBLE_DEVICES"] == "0,1"  # all GPUs visible
    assert child_env(under, {})["CUDA_VISIBLE_DEVICES"] == "2,3,4"  # a CPU process inherits
