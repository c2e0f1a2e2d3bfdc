"""What the benchmarks that drive a real ``skyrl`` run watch while it goes: files the run deletes
behind it (``Keeper``), every process's peak memory by its role in the run (``ProcessMemory``), and
the run's figures per step from ``events.jsonl`` (``per_step``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterator


def rl_argv(skyrl: str, recipe: Path, run_dir: Path, sets: list[str]) -> list[str]:
    """``skyrl rl RECIPE`` into a fresh ``run_dir``, quiet, with each ``KEY=VALUE`` of ``sets``."""
    argv = [skyrl, "rl", str(recipe), "--run-dir", str(run_dir), "--overwrite", "--quiet"]
    for item in sets:
        argv += ["--set", item]
    return argv


@contextlib.contextmanager
def work_dir(out: Path | None, prefix: str) -> Iterator[Path]:
    """``out`` kept as it is when the user named it; otherwise a temporary directory removed at the
    end, failed or not (a 0.5B run leaves 10-20 GB of checkpoints and weight versions behind)."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        yield out
        return
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class Watcher:
    """Calls ``look()`` every ``period_s`` on a thread of its own from ``with`` to its end, and once
    more at the end."""

    period_s = 0.05

    def __enter__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def watch(self) -> None:
        while not self.stop.is_set():
            self.look()
            self.stop.wait(self.period_s)
        self.look()

    def look(self) -> None:
        raise NotImplementedError


class Keeper(Watcher):
    """Hard-links each entry of ``source`` that ``wanted`` accepts into ``dest`` as it appears (the
    run prunes old weight versions and consumed batches; the benchmark reads them afterwards)."""

    def __init__(self, source: Path, dest: Path, wanted: Callable[[Path], bool]):
        self.source, self.dest, self.wanted = source, dest, wanted
        self.dest.mkdir(parents=True, exist_ok=True)

    def look(self) -> None:
        if not self.source.is_dir():
            return
        for path in self.source.iterdir():
            target = self.dest / path.name
            if not self.wanted(path) or target.exists():
                continue
            try:
                if path.is_dir():
                    shutil.copytree(path, target, copy_function=os.link)
                else:
                    os.link(path, target)
            except (OSError, shutil.Error):  # removed while copying: a later one is kept
                shutil.rmtree(target, ignore_errors=True)


def versions(path: Path) -> bool:
    """``weights/v<k>/`` directories."""
    return path.name.startswith("v") and path.name[1:].isdigit()


# A process's role in a run, from its command line; a process none matches takes its parent's role
# (vLLM's engine core and the trainer's rank processes are children of the matched ones).
ROLES = (
    ("torch.distributed.run", "torchrun"),  # first: its command line names the rank's module too
    ("backends.inference.serve", "engine (API server)"),
    ("VLLM::EngineCore", "engine (core)"),
    ("backends.train.rl_learner", "learner rank"),
    ("backends.train.sft", "trainer rank"),
    ("backends.rollout.orchestrator", "orchestrator"),
    ("vllm-router", "router"),
    ("backends.models.tied", "setup"),
)


def role_of(cmdline: str) -> str | None:
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    return None


def resident_peak(proc) -> int:
    """A process's peak resident bytes so far: the kernel's high-water mark (``VmHWM``), which no
    sampling interval misses, or its resident size now where /proc has no such line."""
    try:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return proc.memory_info().rss


class ProcessMemory(Watcher):
    """Samples the resident memory of ``root_pid`` and all its descendants every ``period_s``;
    ``peaks()`` gives each process's peak (its high-water mark up to the last sample), labelled
    with its role (the driver is ``skyrl``)."""

    period_s = 0.2

    def __init__(self, root_pid: int):
        import psutil  # lazy: only the benchmarks that watch a run need it

        self.root_pid = root_pid
        self.peak_rss: dict[int, int] = {}
        self.labels: dict[int, str] = {}
        self.cmdlines: dict[int, str] = {}
        try:
            self.root = psutil.Process(root_pid)
        except psutil.NoSuchProcess:
            self.root = None

    def look(self) -> None:
        import psutil  # lazy: as __init__

        if self.root is None:
            return
        try:
            tree = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in tree:
            try:
                rss = resident_peak(proc)
                cmdline = " ".join(proc.cmdline())
                # labelled again after an exec: a worker is first seen as its launcher's fork
                if self.cmdlines.get(proc.pid) != cmdline:
                    self.cmdlines[proc.pid] = cmdline
                    self.labels[proc.pid] = self.label(proc, cmdline)
            except psutil.Error:
                continue
            self.peak_rss[proc.pid] = max(rss, self.peak_rss.get(proc.pid, 0))

    def label(self, proc, cmdline: str) -> str:
        if proc.pid == self.root_pid:
            return "skyrl (driver)"
        role = role_of(cmdline)
        parent = proc.parent()
        inherited = self.labels.get(parent.pid) if parent else None
        # a forked child keeps its parent's command line: it is the parent's child, not another rank
        if role is None or role == inherited:
            role = (inherited if inherited.endswith(" child") else f"{inherited} child") if inherited else proc.name()
        return role

    def peaks(self) -> list[tuple[str, int, int]]:
        """(role, pid, peak RSS bytes), largest first."""
        rows = [(self.labels.get(pid, "?"), pid, rss) for pid, rss in self.peak_rss.items()]
        return sorted(rows, key=lambda row: -row[2])


def per_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """Each step's figures from ``events.jsonl`` (the latest value of each name at that step)."""
    rows: dict[int, dict[str, float]] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        rows.setdefault(int(event["step"]), {})[event["name"]] = event["value"]
    return rows


def event_times(run_dir: Path, name: str) -> dict[int, float]:
    """step -> wall-clock time of the event ``name`` at that step."""
    times: dict[int, float] = {}
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["name"] == name:
            times[int(event["step"])] = float(event["time"])
    return times


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
