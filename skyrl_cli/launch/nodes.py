"""The nodes of a run across machines find, check and watch each other through the shared run
directory (``nodes/node-<k>.json``, one file per node, rewritten atomically every second).

Nothing here is a cluster manager: the run directory must be on a file system every node mounts
at the same path (as every peer assumes on clusters), and this module only uses it.

A node's marker (``Marker``) holds the launch id, the recipe hash, the stage and flags, its phase,
its engines' URLs and a beat counter. How the nodes meet:

1. Node 0 prepares the run directory, then writes its marker with a fresh launch id.
2. Every other node waits for a *live* node-0 marker (its beat advances: a marker left by an
   earlier launch does not), joins that launch (its own marker names the launch id) and compares
   the recipe hash and flags: another recipe, stage or ``--resume``/``--async`` is refused there, in
   one line, and node 0 refuses the run the same way when it reads that node's marker.
3. Node 0 waits until every node has joined. A node that does not see the others within
   ``cluster.arrival_timeout_s`` stops with one line saying that the run directory must be on a
   shared file system (the usual cause: each node sees its own local directory).

Then each node watches the others (``Rendezvous.check``, called from the supervisor's wait loops):
node 0 watches every node, the others watch node 0. A node whose marker has not changed for
``cluster.heartbeat_timeout_s`` (measured with this node's own monotonic clock, so clocks need not
agree), or that reports "failed", ends the run on the watcher with one line naming it and its log
directory. Node 0 writes "done" at the end; the other nodes then stop their engines and exit 0.

Why files and not a TCP service: the run directory is already the contract between the processes
(batches, weights, checkpoints), it is what must be shared anyway, and checking the marker exchange
is exactly the check that it is shared.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from skyrl_contracts.atomic import write_json
from skyrl_contracts.errors import LaunchError, UsageError
from skyrl_contracts.rundir import RunDir

BEAT_PERIOD_S = 1.0
POLL_S = 0.25
# Phases, in order: node 0's tell the other nodes when they may start their processes.
PHASES = ("joined", "setup-done", "ready", "running", "done", "failed")


@dataclass
class Marker:
    node: int
    launch: str
    hash: str
    stage: str
    flags: dict
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    beat: int = 0
    phase: str = "joined"
    engines: list[str] = field(default_factory=list)
    log_dir: str = ""
    message: str = ""


def read_marker(path: Path) -> Marker | None:
    try:
        data = json.loads(path.read_text())
        return Marker(**data)
    except (OSError, ValueError, TypeError):
        return None


class Rendezvous:
    """One node's side of the exchange; a context manager that beats while it is open."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        node: int,
        nodes: int,
        recipe_hash: str,
        stage: str,
        flags: dict,
        *,
        arrival_timeout_s: float,
        heartbeat_timeout_s: float,
        peers: list[int] | None = None,
    ):
        self.paths = RunDir(run_dir)
        self.node, self.nodes = node, nodes
        self.peers = peers if peers is not None else (list(range(1, nodes)) if node == 0 else [0])
        self.arrival_timeout_s = arrival_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.marker = Marker(
            node=node,
            launch=uuid.uuid4().hex if node == 0 else "",
            hash=recipe_hash,
            stage=stage,
            flags=dict(flags),
            log_dir=str(self.paths.node_logs(node)),
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # peer -> (last beat seen, monotonic time it changed)
        self._seen: dict[int, tuple[int, float]] = {}

    # ------------------------------------------------------------------ own marker
    def _write(self) -> None:
        with self._lock:
            self.marker.beat += 1
            data = asdict(self.marker)
        try:
            write_json(self.paths.node_marker(self.node), data, indent=None)
        except OSError:
            pass  # a full or flaky file system: the others see a silent node and say so

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_PERIOD_S):
            self._write()

    def set(self, **fields) -> None:
        """Change the marker (``phase``, ``engines``, ``message``) and write it now."""
        with self._lock:
            for key, value in fields.items():
                setattr(self.marker, key, value)
        self._write()

    def __enter__(self) -> "Rendezvous":
        self.paths.nodes.mkdir(parents=True, exist_ok=True)
        self.paths.node_logs(self.node).mkdir(parents=True, exist_ok=True)
        if self.node == 0:
            self._write()
        return self

    def start_beating(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name=f"node-{self.node}-heartbeat", daemon=True)
            self._thread.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.marker.launch:  # a node that never joined leaves no marker behind
            if exc_type is None:
                self.set(phase="done")
            else:
                self.set(phase="failed", message=str(exc).splitlines()[0] if str(exc) else exc_type.__name__)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ meeting
    def log_of(self, node: int) -> Path:
        return self.paths.node_logs(node)

    def _not_shared(self, node: int) -> UsageError:
        return UsageError(
            f"node {node} did not appear within {self.arrival_timeout_s:.0f} s (cluster.arrival_timeout_s): no live "
            f"marker at {self.paths.node_marker(node)}; the run directory must be on a shared file system that every "
            f"node mounts at the same path, and every node must run the same command; node {node}'s log: "
            f"{self.log_of(node)}"
        )

    def _compare(self, other: Marker) -> None:
        """Refuse a peer started with another recipe, stage or flags (one line, both nodes named)."""
        first, second = sorted((self.marker, other), key=lambda m: m.node)
        what = None
        if other.hash != self.marker.hash:
            what = f"different recipes (hash {first.hash} on node {first.node}, {second.hash} on node {second.node})"
        elif other.stage != self.marker.stage:
            what = f"different stages (skyrl {first.stage} on node {first.node}, skyrl {second.stage} on node {second.node})"
        elif other.flags != self.marker.flags:
            diff = sorted(
                k for k in {**other.flags, **self.marker.flags} if other.flags.get(k) != self.marker.flags.get(k)
            )
            shown = lambda m: ", ".join(f"{k}={m.flags.get(k)}" for k in diff)  # noqa: E731
            what = f"different flags ({shown(first)} on node {first.node}, {shown(second)} on node {second.node})"
        if what:
            raise UsageError(
                f"nodes {first.node} and {second.node} were started with {what}: every node must run the same "
                f"recipe, --set values and flags; refused at the rendezvous (run directory {self.paths.root})"
            )

    def join(self) -> None:
        """Meet the other nodes (see the module docstring); raises ``UsageError`` in one line."""
        if self.node == 0:
            self.start_beating()
            self._wait_joined()
            return
        deadline = time.monotonic() + self.arrival_timeout_s
        first: Marker | None = None
        while True:
            current = read_marker(self.paths.node_marker(0))
            if current is not None and current.phase not in ("done", "failed"):
                if first is None or first.launch != current.launch:
                    first = current
                elif current.beat != first.beat:  # alive: its beat advanced while we looked
                    break
            if time.monotonic() > deadline:
                raise self._not_shared(0)
            time.sleep(POLL_S)
        try:
            self._compare(current)
        except UsageError as err:  # node 0 reads this marker and refuses the run the same way
            self.set(launch=current.launch, phase="failed", message=str(err))
            raise
        self.set(launch=current.launch)
        self.start_beating()
        self._seen[0] = (current.beat, time.monotonic())

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + self.arrival_timeout_s
        pending = set(self.peers)
        while pending:
            for peer in sorted(pending):
                other = read_marker(self.paths.node_marker(peer))
                if other is None or other.launch != self.marker.launch:
                    continue
                self._compare(other)
                self._seen[peer] = (other.beat, time.monotonic())
                pending.discard(peer)
            if pending and time.monotonic() > deadline:
                raise self._not_shared(min(pending))
            if pending:
                time.sleep(POLL_S)

    # ------------------------------------------------------------------ watching
    def peer(self, node: int) -> Marker | None:
        marker = read_marker(self.paths.node_marker(node))
        return marker if marker is not None and marker.launch == self.marker.launch else None

    def check(self) -> dict[int, Marker]:
        """Every watched peer's marker now; a peer that failed or fell silent raises ``LaunchError``
        (one line: the node, what happened, its log)."""
        now = time.monotonic()
        found = {}
        for peer in self.peers:
            other = self.peer(peer)
            # a peer's silence counts from the first look at it, also when no marker was ever seen
            beat, since = self._seen.setdefault(peer, (-1, now))
            if other is not None:
                found[peer] = other
                if other.phase == "failed":
                    raise LaunchError(
                        f"node {peer} ({other.host}) failed: {other.message or 'see its log'}; log: {self.log_of(peer)}"
                    )
                if other.beat != beat:
                    self._seen[peer] = (other.beat, now)
                    continue
                if other.phase == "done":
                    continue
            if now - since > self.heartbeat_timeout_s:
                host = f" ({other.host})" if other is not None else ""
                raise LaunchError(
                    f"node {peer}{host} stopped: no heartbeat for {now - since:.0f} s (cluster.heartbeat_timeout_s = "
                    f"{self.heartbeat_timeout_s:.0f}); log: {self.log_of(peer)}"
                )
        return found

    @contextlib.contextmanager
    def blaming_nodes(self, settle_s: float = 4 * BEAT_PERIOD_S):
        """A process that fails here because another node died (a trainer rank whose peer's
        connection closed, say) is reported as that node's death: on a ``LaunchError``, peers whose
        beat does not advance within ``settle_s`` are watched until they beat again (then the
        original error stands) or their heartbeat times out (then that is the error)."""
        try:
            yield
        except LaunchError as err:
            if str(err).startswith("node "):
                raise
            start = time.monotonic()
            beats = {peer: self._seen.get(peer, (-1, start))[0] for peer in self.peers}
            silent = set(beats)
            while silent and time.monotonic() - start < self.heartbeat_timeout_s + settle_s:
                found = self.check()  # raises for a peer that failed or fell silent for too long
                for peer in list(silent):
                    current = self._seen.get(peer, (-1, start))[0]
                    other = found.get(peer)
                    if current != beats[peer] or (other is not None and other.phase == "done"):
                        silent.discard(peer)
                if silent:
                    time.sleep(POLL_S)
            raise

    def wait_for(self, node: int, phases: tuple[str, ...], what: str, timeout_s: float) -> Marker:
        """Until ``node``'s marker reaches one of ``phases`` (watching every peer meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            other = self.check().get(node)
            if other is not None and other.phase in phases:
                return other
            if time.monotonic() > deadline:
                raise LaunchError(f"node {node} did not get {what} within {timeout_s:.0f} s; log: {self.log_of(node)}")
            time.sleep(POLL_S)

    def coordinator_finished(self) -> bool:
        """On a node other than 0: whether node 0 ended the run (raises when it failed or vanished)."""
        marker = self.check().get(0)
        return marker is not None and marker.phase == "done"
