"""The recipe against this machine: GPU layout and memory, ports, disk space, gloo / NCCL and hosts."""

from __future__ import annotations

import errno
import json
import shutil
import socket
import tempfile
from pathlib import Path

from skyrl_cli.doctor.checks import Check, failed, passed, skipped
from skyrl_cli.plan.build import build_plan
from skyrl_cli.plan.feasibility import feasibility_problems
from skyrl_cli.plan.fit import estimate, memory_problems
from skyrl_cli.plan.fit_text import engine_lines, hardware_here, trainer_lines
from skyrl_cli.plan.machine import MachineFacts
from skyrl_cli.plan.rl import inference_machine
from skyrl_cli.plan.shape import ModelShape, trained_shape
from skyrl_cli.plan.trainer import trainer_device
from skyrl_cli.recipe.locator import dotted
from skyrl_cli.recipe.validate import resolve_path
from skyrl_contracts.auxiliary import auxiliary_models
from skyrl_contracts.ports import find_free_ports
from skyrl_contracts.schema import Recipe

# Measured on the quickstart model (1.07 M parameters, fp32): a checkpoint is 21.4 MB, 20 bytes a
# parameter (the HF model, 4, plus DeepSpeed's fp32 weights and two Adam moments, 16); final/ and
# each RL weight version are the HF model alone.
CHECKPOINT_BYTES_PER_PARAM = 20
MODEL_BYTES_PER_PARAM = 4
RL_WEIGHT_VERSIONS_ON_DISK = 2
GIB = 1024**3


def _fix_for(key: str, message: str, gpu_count: int) -> str:
    if key == "trainer.device":
        return 'set trainer.device = "auto" (or "cpu") to run on CPU, or run where a GPU is visible'
    if "GPU" in message:
        return f"lower trainer.ranks / inference.engines / inference.tensor_parallel to fit {gpu_count} GPU(s), or run on a machine with more"
    return f"change {key} in the recipe (skyrl recipes validate RECIPE reports the same)"


def check_layout(recipe: Recipe, machine: MachineFacts, base_dir: Path) -> list[Check]:
    """The checks ``skyrl sft`` / ``skyrl rl`` would refuse the recipe with, as fail lines."""
    problems = feasibility_problems(recipe, machine, base_dir)
    if problems:
        return [
            failed("layout", f"{dotted(p.path)}: {p.message}", _fix_for(dotted(p.path), p.message, len(machine.gpus)))
            for p in problems
        ]
    device = trainer_device(recipe, machine)
    engines = recipe.inference.engines if recipe.rl is not None else 0
    where = f"{len(machine.gpus)} GPU(s)" if device == "cuda" else f"{machine.cores} CPU core(s)"
    beside = "".join(f" + {m.engines.engines} {m.name} engine(s)" for m in auxiliary_models(recipe))
    return [
        passed(
            "layout",
            f"{recipe.trainer.ranks} trainer rank(s) on {device}, {engines} local engine(s){beside}: fits {where}",
        )
    ]


def check_gpu_memory(recipe: Recipe, machine: MachineFacts, gpus: list[tuple[int, str, float, float]]) -> list[Check]:
    """vLLM takes ``gpu_memory_utilization`` of a GPU's total memory at start and fails when less is free."""
    if recipe.rl is None or not recipe.inference.engines or trainer_device(recipe, machine) != "cuda":
        return []
    share, memory = recipe.inference.gpu_memory_utilization, {g[0]: g for g in gpus}
    checks = []
    for gpu in inference_machine(recipe, machine, "cuda").engine_gpus:
        if gpu not in memory:
            continue
        _, name, total, free = memory[gpu]
        if free < share * total:
            fix = f"free GPU {gpu} (nvidia-smi lists its processes) or set inference.gpu_memory_utilization <= {max(free / total - 0.02, 0.01):.2f}"
            took = f"the engine takes {share} x {total:.1f} GiB = {share * total:.1f} GiB"
            checks.append(failed("gpu memory", f"GPU {gpu} ({name}): {free:.1f} GiB free, {took}", fix))
        else:
            checks.append(
                passed(
                    "gpu memory",
                    f"GPU {gpu} ({name}): {free:.1f} of {total:.1f} GiB free, the engine takes {share:.0%}",
                )
            )
    return checks


def check_estimates(
    recipe: Recipe, machine: MachineFacts, base_dir: Path, gpus: list[tuple[int, str, float, float]]
) -> list[Check]:
    """The memory each process of the recipe needs (``skyrl_cli.plan.fit``) against this host's
    GPUs: one line a trainer stage and one for the engines."""
    hardware = hardware_here(recipe, machine, gpus)
    shape = trained_shape(recipe, base_dir)
    if shape is None:
        return [skipped("memory", "the model's shape is unknown (no config.json of a Llama-family model)")]
    est = estimate(recipe, shape, hardware)
    misfits = {p.path: p for p in memory_problems(recipe, est, hardware)}
    lines = [line for line in trainer_lines(est, hardware) if not line.startswith(" ")] + engine_lines(est, hardware)
    checks = [passed("memory", line) for line in lines if "DOES NOT FIT" not in line]
    propose = f"skyrl recipes validate RECIPE --gpus {hardware.gpus} --gpu-memory {hardware.gib or 80:g} proposes splits that fit"
    checks += [
        failed("memory", f"{dotted(p.path)}: {p.message}", f"change {dotted(p.path)}; {propose}")
        for p in misfits.values()
    ]
    return checks


def planned_ports(recipe: Recipe, machine: MachineFacts) -> list[tuple[str, int]]:
    """``(process, port)`` of every port the recipe's stages would bind (their launch plans)."""
    stages = [
        s for s, section in (("sft", recipe.sft), ("rl", recipe.rl), ("tinker", recipe.tinker)) if section is not None
    ]
    with tempfile.TemporaryDirectory(prefix="skyrl-doctor-") as scratch:
        plans = [build_plan(recipe, stage, Path(scratch) / stage, machine=machine) for stage in stages]
    return [(proc.name, port) for plan in plans for proc in plan.processes for port in proc.ports]


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not bind ``host:port`` now (SO_REUSEADDR, as servers bind: a port
    in TIME_WAIT is free; one that something listens on is not)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def _port_key(recipe: Recipe, process: str, port: int) -> str | None:
    """The recipe key that fixed this port (the planner chose the others free)."""
    if process == "router" and recipe.inference.router.port == port:
        return "inference.router.port"
    if recipe.tinker is not None and recipe.tinker.port == port:
        return "tinker.port"
    return None


def check_ports(recipe: Recipe, machine: MachineFacts, ports: list[tuple[str, int]] | None = None) -> list[Check]:
    """Every ``(process, port)`` of ``ports`` (default: the recipe's plans) is free on this host."""
    ports = planned_ports(recipe, machine) if ports is None else ports
    taken = [(process, port) for process, port in ports if port_in_use(machine.host, port)]
    checks = []
    for process, port in taken:
        key = _port_key(recipe, process, port)
        (spare,) = find_free_ports(1)
        how = (
            f"set {key} = {spare} (a free one now) or leave it unset" if key else "run again (it was free when planned)"
        )
        checks.append(
            failed(
                "ports",
                f"port {port} ({process}) is in use on {machine.host}",
                f"{how}; `ss -ltnp 'sport = :{port}'` shows who holds it",
            )
        )
    if not taken:
        listed = ", ".join(f"{process} {port}" for process, port in ports)
        checks.append(passed("ports", f"{len(ports)} free on {machine.host}" + (f": {listed}" if listed else "")))
    return checks


def model_parameters(recipe: Recipe, base_dir: Path) -> int | None:
    """Parameters of the recipe's model: from ``model.init``'s shape, or its weight files' size."""
    init = recipe.model.init
    if init is not None:
        return ModelShape.from_init(init, recipe.model.tokenizer).parameters()
    folder = resolve_path(recipe.model.path, base_dir)
    files = [p for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern)]
    if not files:
        return None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    width = 4 if (config.get("dtype") or config.get("torch_dtype")) == "float32" else 2
    return sum(p.stat().st_size for p in files) // width


def disk_needed(recipe: Recipe, params: int) -> int:
    """Bytes the recipe's stages leave on disk at their peak: ``keep_last`` checkpoints plus the one
    being written, final/, and the RL stage's weight versions."""
    per_stage = []
    for stage in (recipe.sft, recipe.rl):
        if stage is not None:
            per_stage.append(CHECKPOINT_BYTES_PER_PARAM * (stage.keep_last + 1) + MODEL_BYTES_PER_PARAM)
    if recipe.rl is not None:
        per_stage.append(MODEL_BYTES_PER_PARAM * RL_WEIGHT_VERSIONS_ON_DISK)
    return params * sum(per_stage)


def check_disk(recipe: Recipe, base_dir: Path, runs_root: Path) -> Check:
    params = model_parameters(recipe, base_dir)
    folder = (runs_root / recipe.name).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if params is None:
        return skipped(
            "disk", f"{free / GIB:.1f} GiB free at {existing}; the model's size is unknown (no weight files found)"
        )
    need = disk_needed(recipe, params)
    detail = f"{free / GIB:.1f} GiB free at {existing}, the run needs about {need / GIB:.2f} GiB ({params / 1e6:.1f} M parameters)"
    if free < need:
        return failed(
            "disk",
            detail,
            f"free {max(need - free, 0) / GIB:.1f} GiB there, lower sft/rl keep_last, or run from another folder",
        )
    return passed("disk", detail)
