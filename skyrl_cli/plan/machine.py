"""Facts about this host that a launch plan depends on, detected without importing torch.

``MachineFacts`` is passed into the planner (``skyrl_cli.plan.build.build_plan``) so that plans are
pure functions and tests can describe any machine (``MachineFacts(cpu_cores=(0, 1), gpus=(0, 1, 2, 3))``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from skyrl_contracts.ports import find_free_ports


def default_torch_extensions_dir() -> str:
    """Where DeepSpeed caches the CPU ops it compiles (fixed, so they are built once per machine)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(cache) / "skyrl" / "torch_extensions")


def _cpu_cores() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def visible_gpu_count() -> int:
    """GPUs this process may use, without importing torch: ``CUDA_VISIBLE_DEVICES`` if set, else
    the lines of ``nvidia-smi -L`` (0 when there is no nvidia-smi or it fails)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def gpu_memory() -> list[tuple[int, str, float, float]]:
    """``(index, name, total GiB, free GiB)`` of each GPU nvidia-smi lists (none without it)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = [exe, "--query-gpu=index,name,memory.total,memory.free", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        index, name, total, free = (part.strip() for part in line.split(","))
        gpus.append((int(index), name, float(total) / 1024, float(free) / 1024))
    return gpus


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU computes bf16 natively (AVX-512-BF16 or AMX). Without them bf16 is emulated:
    vLLM on the quickstart model measured 2.7x slower in bf16 than in fp32 on an AVX2-only EPYC."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return bool(NATIVE_BF16_FLAGS & set(line.split(":", 1)[-1].split()))
    except OSError:
        pass
    return False


@dataclass(frozen=True)
class MachineFacts:
    cpu_cores: tuple[int, ...]
    gpus: tuple[int, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)
    host: str = "127.0.0.1"
    cpu_bf16: bool = False  # native bf16 on the CPU (cpu_has_native_bf16)
    torch_extensions_dir: str = field(default_factory=default_torch_extensions_dir)
    port_finder: Callable[[int], list[int]] = field(default=find_free_ports, compare=False, repr=False)

    @property
    def cores(self) -> int:
        return len(self.cpu_cores)

    def free_ports(self, n: int) -> list[int]:
        return list(self.port_finder(n))


def detect_machine(gpu_count: int | None = None) -> MachineFacts:
    """This host: usable CPU cores (affinity), visible GPUs (CUDA_VISIBLE_DEVICES / nvidia-smi).
    ``gpu_count``: GPUs 0..N-1 instead of the visible ones (``skyrl recipes validate --gpus N``
    checks a recipe for another machine)."""
    gpus = tuple(range(visible_gpu_count() if gpu_count is None else gpu_count))
    return MachineFacts(cpu_cores=_cpu_cores(), gpus=gpus, cpu_bf16=cpu_has_native_bf16())
