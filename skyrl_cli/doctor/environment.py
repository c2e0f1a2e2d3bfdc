"""This machine without a recipe: Python, packages against the tested set, GPUs, and that DeepSpeed,
vLLM and vllm-router import and start."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from skyrl_cli.doctor.checks import Check, failed, passed, python_child, skipped
from skyrl_cli.plan.inference import Machine, router_binary
from skyrl_cli.plan.machine import gpu_memory
from skyrl_contracts.ports import find_free_ports

DISTRIBUTION = "skyrl-cli"
# The Python minor versions the stack was verified on (README, "Install").
TESTED_PYTHON = ((3, 11),)
# Extra requirements to check, whitespace-separated (e.g. a custom reward's packages):
#   SKYRL_DOCTOR_REQUIRE="sympy>=1.12 my-env-lib" skyrl doctor my.toml
REQUIRE_ENV = "SKYRL_DOCTOR_REQUIRE"
SETUP_HINT = "scripts/setup.sh installs the tested set"
IMPORT_TIMEOUT_S = 180.0


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    required = SpecifierSet(importlib.metadata.metadata(DISTRIBUTION).get("Requires-Python") or "")
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_PYTHON)
    if not required.contains(version):
        return failed(
            "python",
            f"{version} does not satisfy {required}",
            f"use Python {tested} (SKYRL_PYTHON=python{tested} scripts/setup.sh)",
        )
    note = "tested" if sys.version_info[:2] in TESTED_PYTHON else f"untested: the stack was verified on {tested}"
    return passed("python", f"{version} at {sys.executable} ({note})")


def stack_extra(gpu_count: int) -> str:
    """The extra of pyproject.toml whose pins apply here: ``cpu`` (versions verified together) on a
    machine without GPUs, ``gpu`` otherwise."""
    return "gpu" if gpu_count else "cpu"


def tested_requirements(extra: str) -> list:
    """skyrl's own requirements and those of ``extra`` (from the installed package's metadata, i.e.
    pyproject.toml)."""
    found = []
    for text in importlib.metadata.requires(DISTRIBUTION) or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
            requirement.marker = None
            found.append(requirement)
    return found


def user_requirements() -> list:
    """The requirements named in ``$SKYRL_DOCTOR_REQUIRE``."""
    return [Requirement(text) for text in os.environ.get(REQUIRE_ENV, "").split()]


def _package_problem(requirement, hint: str) -> Check | None:
    try:
        installed = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return failed(f"package {requirement.name}", "not installed", f"pip install '{requirement}'{hint}")
    if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
        return failed(
            f"package {requirement.name}",
            f"{installed} installed, wanted: {requirement.specifier}",
            f"pip install '{requirement}'{hint}",
        )
    return None


def check_packages(extra: str) -> list[Check]:
    tested, wanted = tested_requirements(extra), user_requirements()
    problems = [_package_problem(r, f" ({SETUP_HINT})") for r in tested] + [_package_problem(r, "") for r in wanted]
    problems = [p for p in problems if p is not None]
    if problems:
        return problems
    also = f", and the {len(wanted)} of ${REQUIRE_ENV}" if wanted else ""
    return [passed("packages", f"{len(tested)} of the tested {extra} set installed at tested versions{also}")]


def check_gpus(gpu_count: int) -> Check:
    if gpu_count == 0:
        return passed("gpus", 'none visible: CPU runs only (trainer.device = "auto" picks the CPU)')
    listed = ", ".join(
        f"{i}: {name} {total:.0f} GiB ({free:.0f} free)" for i, name, total, free in gpu_memory()[:gpu_count]
    )
    return passed("gpus", f"{gpu_count} visible{': ' + listed if listed else ''}")


# Each imports the package and does the first thing a run does with it, in a child process.
STARTS = {
    "deepspeed": "import deepspeed; from deepspeed.accelerator import get_accelerator; "
    "print(deepspeed.__version__, 'on', get_accelerator().device_name())",
    "vllm": "import vllm; from vllm import EngineArgs; print(vllm.__version__)",
}


def check_starts() -> list[Check]:
    """DeepSpeed and vLLM import (in parallel, each in its own process), vllm-router starts."""
    with ThreadPoolExecutor(len(STARTS) + 1) as pool:
        futures = {name: pool.submit(python_child, code, IMPORT_TIMEOUT_S) for name, code in STARTS.items()}
        router = pool.submit(check_router_starts)
        checks = []
        for name, future in futures.items():
            result = future.result()
            if result.ok:
                checks.append(passed(f"{name} imports", result.output))
            else:
                checks.append(
                    failed(
                        f"{name} imports",
                        result.output,
                        f"reinstall it: {SETUP_HINT} (it installs the tested versions from requirements/lock-cpu.txt)",
                    )
                )
        return checks + [router.result()]


def check_router_starts(timeout_s: float = 20.0) -> Check:
    """Start vllm-router without workers on free ports and wait for ``/liveness``."""
    binary = router_binary(Machine("cpu"))
    if shutil.which(binary) is None:
        return failed("vllm-router starts", f"no {binary} executable", f"pip install vllm-router ({SETUP_HINT})")
    port, metrics_port = find_free_ports(2)
    argv = [
        binary,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "error",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    started, deadline = time.monotonic(), time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/liveness", timeout=1.0).status_code == 200:
                    return passed(
                        "vllm-router starts", f"{binary} answered /liveness in {time.monotonic() - started:.1f} s"
                    )
            except httpx.HTTPError:
                time.sleep(0.2)
        why = f"exited with {proc.returncode}" if proc.poll() is not None else f"no /liveness within {timeout_s:.0f} s"
        return failed("vllm-router starts", why, f"run `{binary} --port {port}` to see why; {SETUP_HINT}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def environment_checks(gpu_count: int, with_starts: bool = True) -> list[Check]:
    checks = [check_python(), *check_packages(stack_extra(gpu_count)), check_gpus(gpu_count)]
    if with_starts:
        checks += check_starts()
    else:
        checks.append(skipped("imports", "not checked (--quick)"))
    return checks
