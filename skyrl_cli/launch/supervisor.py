"""Starts and supervises the processes of a launch plan, and guarantees their teardown.

Every process gets its own session (process group) so that one ``killpg`` reaches the children it
spawns (vLLM's EngineCore, torchrun's workers), its output goes to ``logs/<name>.log``, and it is
torn down when the supervisor exits for any reason:

- normal exit, an exception, or Ctrl-C: ``__exit__`` sends SIGTERM to every group, waits a grace
  period, then SIGKILLs what is left;
- SIGINT / SIGTERM / SIGHUP to the driver: the first raises ``Interrupted`` so the same path runs,
  later ones cannot cut the teardown short (``skyrl_cli.launch.interrupts``, the one home of the
  signal logic); a process is started and registered for teardown as one step, and no process
  starts once the teardown has begun (the engine-recovery thread may try to restart one);
- SIGKILL of the driver (nothing in the driver runs): a small reaper process
  (``skyrl_cli.launch.reaper``) holds a pipe from the driver and kills every group it was told about
  when the pipe closes; as a second line, each child is started with ``PR_SET_PDEATHSIG=SIGTERM``.
  PDEATHSIG fires when the *thread* that forked the child exits, so only start processes from the
  main thread or threads that live as long as the run.

Detached processes (``start(spec, detached=True)``, and ``adopt`` of one an earlier command
started) are the exception: an engine pool's (``skyrl_cli.engines.pool``) outlive the command, so
they get no PDEATHSIG, the reaper is not told about them and the teardown leaves them running.
They are still polled, waited for and restarted (``restart`` keeps them detached; ``on_detached``
hears of the new process, so the pool's state file can follow it).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

import httpx

from skyrl_cli.launch.interrupts import deferred, signal_name, stop_signals_raise
from skyrl_cli.launch.op_builds import clear_abandoned_locks
from skyrl_cli.launch.pids import pid_alive
from skyrl_cli.plan.model import ProcessSpec
from skyrl_contracts.errors import LaunchError
from skyrl_contracts.rundir import RunDir

TERM_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the driver dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: teardown then relies on the driver's own exit path


def log_tail(path: Path, lines: int = 20, max_bytes: int = 16384) -> str:
    """The last lines of a log file (within its last ``max_bytes``), for error messages."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - max_bytes))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# What processes put before their lines: vLLM's "(APIServer pid=7) " / "(EngineCore_DP0 pid=9) ",
# torchrun's "[rank0]: ", and a logger's "ERROR 12-01 11:38:36 [core.py:708] ".
_LINE_PREFIX = re.compile(
    r"^(?:\([\w ]+ pid=\d+\) ?|\[rank\d+\]: ?)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\] ?)?"
)
_EXCEPTION_LINE = re.compile(r"^((?:\w+\.)*\w*(?:Error|Exception|Exit|Failure)\w*): (\S.*)$")
# Lines that only point at the real cause: vLLM's front end ends an engine's failed start with
# "RuntimeError: Engine core initialization failed. See root cause above. ...", and a trainer rank
# whose peer failed first with gloo's "Connection closed by peer ... This is typically caused by a
# remote worker crashing" (the peer's own error is the cause, wherever it is in the log).
_POINTER = re.compile(r"\b(?:see|check)\b.*\babove\b|caused by a remote worker crashing", re.IGNORECASE)
_PYDANTIC_HEAD = re.compile(r"^\d+ validation errors? for (\w+)$")
TELLING_LINE_CHARS = 300
_START_MARK = re.compile(r"^=== [\d-]+ [\d:]+ start: .*$", re.MULTILINE)


def telling_line(tail: str) -> str | None:
    """The line of a log tail that says why the process failed: the last exception of a Python
    traceback that carries a message of its own, as ``Name: message`` (a pydantic ValidationError,
    which vLLM's configs raise, with its first detail line); ``None`` when there is none."""
    lines = [_LINE_PREFIX.sub("", line).rstrip() for line in tail.splitlines()]
    for index in range(len(lines) - 1, -1, -1):
        match = _EXCEPTION_LINE.match(lines[index])
        if match is None or _POINTER.search(match.group(2)):
            continue
        name, message = match.group(1).rsplit(".", 1)[-1], match.group(2)
        model = _PYDANTIC_HEAD.match(message)
        if model and index + 1 < len(lines):
            detail = re.sub(r"\s*\[type=.*$", "", lines[index + 1].strip()).removeprefix("Value error, ")
            message = f"{model.group(1)}: {detail}"
        return _shortened(f"{name}: {message}")
    return None


def _shortened(text: str) -> str:
    """At most ``TELLING_LINE_CHARS``, cut after a sentence where one ends late enough."""
    if len(text) <= TELLING_LINE_CHARS:
        return text
    end = text.rfind(". ", 0, TELLING_LINE_CHARS)
    return text[: end + 1] if end > TELLING_LINE_CHARS // 2 else text[: TELLING_LINE_CHARS - 3] + "..."


def start_mark(spec: ProcessSpec) -> bytes:
    """The line each start of a process writes into its log (``failure_message`` reads after the last)."""
    return f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(spec.argv)}\n".encode()


def exit_description(code: int) -> str:
    """How a process ended, for messages: ``was killed by SIGKILL`` or ``failed (exit code 1)``."""
    return f"was killed by {signal_name(-code)}" if code < 0 else f"failed (exit code {code})"


# torchrun's summary of a failed worker group (torch.distributed.elastic ChildFailedError).
_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-\d+) \(pid: (\d+)\)", re.DOTALL
)


def killed_rank(tail: str) -> str | None:
    """``rank 1 (pid 42) was killed by SIGKILL`` when torchrun reports that a signal ended its first
    failed worker: the other ranks' errors (a peer's closed connection) are only the consequence."""
    matches = list(_ROOT_CAUSE.finditer(tail))
    if not matches:
        return None
    rank, code, pid = matches[-1].groups()
    return f"rank {rank} (pid {pid}) {exit_description(int(code))}"


def job_failure(name: str, code: int, log_path: Path) -> str:
    """The message for a job that ended with ``code``: killed by a signal from outside, one line
    (nothing in its log says why); else ``failure_message``."""
    if code < 0:
        return f"the {name} {exit_description(code)}; log: {log_path}"
    return failure_message(f"the {name} {exit_description(code)}", log_path, 25)


def failure_message(what: str, log_path: Path, lines: int = 20) -> str:
    """``what`` failed: with the log line that says why and the log's path, or when no line says
    it, the log's path and its last ``lines`` lines."""
    # The log is appended to by every start of the process: only this start's lines count.
    this_start = _START_MARK.split(log_tail(log_path, 400, max_bytes=65536))[-1].strip("\n")
    why = killed_rank(this_start) or telling_line(this_start)
    if why is not None:
        return f"{what}: {why}\nlog: {log_path}"
    tail = "\n".join(this_start.splitlines()[-lines:])
    return f"{what}; log: {log_path}" + (f"\n{tail}" if tail else "")


@dataclass
class ManagedProcess:
    spec: ProcessSpec
    popen: "subprocess.Popen | PopenLike"
    log_path: Path
    started_at: float
    detached: bool = False  # outlives the supervisor (an engine pool's)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()


class PopenLike(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class AdoptedProcess:
    """The ``Popen`` surface (pid, poll, wait) of a process another command started: it is not our
    child, so its exit code is unknown (1 stands for "exited") and init reaps it."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return None if pid_alive(self.pid) else 1

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return 1


def child_env(base: dict[str, str], overrides: dict[str, str]) -> dict[str, str]:
    """The environment a process starts with: ``base`` (this process's) with the spec's ``overrides``.

    A plan numbers GPUs as torch does, 0..N-1 among the visible ones (``cuda:1`` is the second
    visible GPU). When skyrl itself runs under ``CUDA_VISIBLE_DEVICES=2,3,4``, the spec's
    ``CUDA_VISIBLE_DEVICES=0,1`` means that list's entries ``2,3``: passed on as written it would
    name physical GPUs 0 and 1, which another job may own."""
    env = {**base, **overrides}
    inherited = base.get("CUDA_VISIBLE_DEVICES")
    wanted = overrides.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None and wanted:
        names = [d.strip() for d in inherited.split(",") if d.strip()]
        try:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(names[int(i)] for i in wanted.split(","))
        except (ValueError, IndexError):
            pass  # not positions among the inherited list: left as the plan wrote it
    return env


class Supervisor:
    """Context manager owning the processes of one run. See the module docstring."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        base_env: dict[str, str] | None = None,
        on_detached: Callable[[ManagedProcess], None] | None = None,
        logs_dir: str | os.PathLike | None = None,
    ):
        """``logs_dir``: where the processes log (default ``logs/`` of the run; across nodes a node
        other than node 0 logs into ``logs/node-<k>/`` of the shared run directory)."""
        self.run_dir = Path(run_dir)
        self.on_detached = on_detached
        self.paths = RunDir(self.run_dir)
        self.logs_dir = Path(logs_dir) if logs_dir is not None else self.paths.logs
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.processes: dict[str, ManagedProcess] = {}
        self._lock = threading.RLock()
        self._signals = contextlib.ExitStack()
        self._closed = False
        self._reaper: subprocess.Popen | None = None
        self._extension_dirs: set[str] = set()  # where started processes build DeepSpeed ops

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Supervisor":
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "skyrl_cli.launch.reaper"],
            stdin=subprocess.PIPE,
            start_new_session=True,
            text=True,
        )
        self._signals.enter_context(stop_signals_raise())
        atexit.register(self.shutdown)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.shutdown()
        finally:
            self._signals.close()
            atexit.unregister(self.shutdown)

    # ------------------------------------------------------------------ processes
    def start(self, spec: ProcessSpec, detached: bool = False, log_path: Path | None = None) -> ManagedProcess:
        """Start ``spec`` (its output to ``log_path``, default ``logs/<name>.log`` of the run)."""
        with self._lock, deferred():  # started => registered, so that the teardown reaches it
            if self._closed:
                raise LaunchError(f"not starting {spec.name}: the run is shutting down")
            if spec.name in self.processes and self.processes[spec.name].returncode is None:
                raise LaunchError(f"process {spec.name!r} is already running")
            log_path = Path(log_path) if log_path is not None else self.logs_dir / f"{spec.name}.log"
            log = open(log_path, "ab", buffering=0)
            log.write(start_mark(spec))
            env = child_env(self.base_env, spec.env)
            if env.get("TORCH_EXTENSIONS_DIR"):
                self._extension_dirs.add(env["TORCH_EXTENSIONS_DIR"])
                clear_abandoned_locks(env["TORCH_EXTENSIONS_DIR"])
            try:
                popen = subprocess.Popen(
                    list(spec.argv),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    preexec_fn=None if detached else _die_with_parent,
                )
            except OSError as err:
                raise LaunchError(f"cannot start {spec.name}: {spec.argv[0]}: {err.strerror}") from err
            finally:
                log.close()  # the child holds its own descriptor
            proc = ManagedProcess(spec, popen, log_path, time.monotonic(), detached=detached)
            if not detached:
                self._tell_reaper(f"+{popen.pid}")
            self.processes[spec.name] = proc
        if detached and self.on_detached is not None:
            self.on_detached(proc)
        return proc

    def adopt(self, spec: ProcessSpec, pid: int, log_path: Path) -> ManagedProcess:
        """Supervise a detached process an earlier command started (an engine pool's)."""
        with self._lock:
            proc = ManagedProcess(spec, AdoptedProcess(pid), Path(log_path), time.monotonic(), detached=True)
            self.processes[spec.name] = proc
            return proc

    def take_over(
        self, spec: ProcessSpec, popen: "PopenLike", log_path: Path, hand: Callable[[], None]
    ) -> ManagedProcess:
        """Make a process another command started run ``spec`` for this run (an engine pool's warm
        learner or orchestrator, ``skyrl_cli.engines.standby``): ``hand()`` gives it the work. From then on it is
        the run's own: torn down with it, and the reaper's if the driver is killed."""
        with self._lock, deferred():
            if self._closed:
                raise LaunchError(f"not starting {spec.name}: the run is shutting down")
            with open(log_path, "ab") as log:
                log.write(start_mark(spec))
                log.write(f"(run by a warm process of the engine pool, pid {popen.pid})\n".encode())
            proc = ManagedProcess(spec, popen, Path(log_path), time.monotonic())
            self._tell_reaper(f"+{popen.pid}")
            self.processes[spec.name] = proc
            hand()
        return proc

    def _tell_reaper(self, line: str) -> None:
        if self._reaper is None or self._reaper.stdin is None:
            return
        try:
            self._reaper.stdin.write(line + "\n")
            self._reaper.stdin.flush()
        except (BrokenPipeError, ValueError):
            self._reaper = None

    def poll(self) -> dict[str, int | None]:
        with self._lock:
            return {name: p.returncode for name, p in self.processes.items()}

    def _failure(self, proc: ManagedProcess, what: str) -> LaunchError:
        return LaunchError(failure_message(f"{proc.spec.name} {what} (exit code {proc.returncode})", proc.log_path))

    def wait_ready(
        self, names: Iterable[str] | None = None, timeout_s: float | None = None, watch_jobs: Iterable[str] = ()
    ) -> None:
        """Block until every named process answers its readiness URL with HTTP 200. A job in
        ``watch_jobs`` (started beside them) that exits non-zero meanwhile raises ``LaunchError``."""
        with self._lock:
            pending = [self.processes[n] for n in (list(self.processes) if names is None else names)]
            watched = [self.processes[n] for n in watch_jobs]
        deadline = time.monotonic() + (timeout_s or max((p.spec.ready.timeout_s for p in pending), default=0))
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for job in watched:
                    if job.returncode:
                        raise LaunchError(job_failure(job.spec.name, job.returncode, job.log_path))
                for proc in list(pending):
                    if proc.returncode is not None:
                        raise self._failure(proc, "exited before it was ready")
                    url = proc.spec.ready.url
                    if url is None or _answers_ok(client, url):
                        pending.remove(proc)
                if pending and time.monotonic() > deadline:
                    names_left = ", ".join(p.spec.name for p in pending)
                    raise LaunchError(f"timed out waiting for {names_left} to become ready; see {self.logs_dir}")
                if pending:
                    time.sleep(0.25)

    def wait_job(
        self,
        name: str,
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 0.5,
        fatal_services: Iterable[str] | None = None,
    ) -> int:
        """Wait for a job to exit; return its exit code. A service listed in ``fatal_services``
        (default: all services) that dies meanwhile raises ``LaunchError``."""
        job = self.processes[name]
        while True:
            code = job.popen.poll()
            if on_tick is not None:
                on_tick()
            if code is not None:
                return code
            self._check_services(fatal_services)
            time.sleep(tick_s)

    def wait_jobs(
        self,
        names: Iterable[str],
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 0.5,
        fatal_services: Iterable[str] | None = None,
    ) -> None:
        """Wait until every named job has exited 0. The first one to end otherwise raises
        ``LaunchError`` at once, naming it and its log: the others may wait for it forever (a
        learner for the batches of a killed orchestrator). Services as in ``wait_job``."""
        pending = list(names)
        while pending:
            if on_tick is not None:
                on_tick()
            for name in list(pending):
                proc = self.processes[name]
                code = proc.returncode
                if code == 0:
                    pending.remove(name)
                elif code is not None:
                    raise LaunchError(job_failure(name, code, proc.log_path))
            if pending:
                self._check_services(fatal_services)
                time.sleep(tick_s)

    def _check_services(self, fatal_services: Iterable[str] | None) -> None:
        watched = set(fatal_services) if fatal_services is not None else None
        with self._lock:
            for other in self.processes.values():
                if other.spec.kind != "service" or other.returncode is None:
                    continue
                if watched is None or other.spec.name in watched:
                    raise self._failure(other, "died")

    def stop(self, name: str, grace_s: float = TERM_GRACE_S) -> None:
        with self._lock:
            proc = self.processes.get(name)
        if proc is not None:
            _terminate_groups([proc], grace_s)
            if not proc.detached:
                self._tell_reaper(f"-{proc.popen.pid}")

    def restart(self, name: str, spec: ProcessSpec | None = None) -> ManagedProcess:
        """Stop ``name`` and start it again (a detached process comes back detached)."""
        with self._lock:
            old = self.processes[name]
        self.stop(name)
        # A detached process keeps its log (an engine pool's is in the pool's folder, not the run's).
        return self.start(spec or old.spec, detached=old.detached, log_path=old.log_path if old.detached else None)

    def shutdown(self, grace_s: float = TERM_GRACE_S) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = [p for p in self.processes.values() if not p.detached]
        # Reverse start order: jobs and the router go before the engines they talk to.
        with deferred():  # a Ctrl-C now is raised once every group is gone
            _terminate_groups(list(reversed(procs)), grace_s)
            self._tell_reaper("done")
            for directory in self._extension_dirs:  # a build our processes left half-done
                clear_abandoned_locks(directory)
        if self._reaper is not None:
            try:
                self._reaper.stdin.close()
                self._reaper.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._reaper.kill()
            self._reaper = None


def _answers_ok(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # pid == pgid: each child leads its own session
    except (ProcessLookupError, PermissionError):
        pass


def _terminate_groups(procs: list[ManagedProcess], grace_s: float) -> None:
    """SIGTERM every process group, wait up to ``grace_s``, SIGKILL the rest (children included)."""
    for proc in procs:
        _signal_group(proc.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        # Also the group: a leader that exited on SIGTERM may leave children behind.
        _signal_group(proc.popen.pid, signal.SIGKILL)
        try:
            proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            print(f"warning: {proc.spec.name} (pid {proc.popen.pid}) did not exit", file=sys.stderr)
