"""Tinker server under load and across a SIGKILL: N concurrent official-SDK clients, then a restart.

N ``tinker`` SDK clients (threads; keys shared four clients to a key) each train a LoRA of their
own on the tiny model for a fixed time, in a random mix with a fixed seed: forward_backward then
optim_step, forward_backward alone (gradients accumulate), save_state (after a forward whose loss
it records), a new model from one of their saves with its optimizer (create-via-load; its forward
must give the recorded loss; then it is unloaded), a sampler save and samples (twice with the same seed now and then: the same
tokens). Sampling goes to a stub engine (deterministic tokens from the request, no vLLM: the
server's path is the real one, the engine is not). Meanwhile the server's RSS and open files are
sampled.

Then the server is SIGKILLed mid-load and started again on the same storage. The clients carry
on: a request caught by the kill must end in a clear error (the server is unreachable, the
request "was not run before the server restarted", the model "was lost when the server
restarted"), after which the client resumes from its last saved state (create-via-load, whose
forward must give the recorded loss) and trains on.

Checked at the end (``Report.problems``): no client error but those; no future left pending; per
model the futures' seq_ids run 1..n without a gap and as many are done as the client got results;
every future finished before the kill is returned after the restart byte for byte; every saved
checkpoint loads (and gives its recorded loss); a single-client replay of some clients' request
sequences gives the same losses; RSS and open files stop growing after the warm-up (the first
third of the load), within the stated margins.

    python benchmarks/bench_tinker_load.py [--clients 16] [--seconds 120] [--recover 30] [--seed 0]

``tests/integration/test_tinker_load.py`` runs it short (``run_load``) and asserts its problems away.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RSS_MARGIN = 0.25  # growth after the warm-up: at most this fraction ...
RSS_MARGIN_BYTES = 64 * 2**20  # ... plus this much (allocator and SQLite caches settling)
FILES_MARGIN = 8  # open files other than sockets: SQLite's three, logs, the odd checkpoint being written
SOCKETS_PER_CLIENT = 8  # the SDK's connection pools (training, sampling, session, futures)
RTOL = 1e-3  # a replay's losses (a pass batched with other adapters is not bit-identical)
# A replay compares a client's first REPLAY_OPTIM_STEPS optimizer steps: a pass batched with other
# adapters differs from a lone one in the last bits, and once a client's loss diverges (one went
# 8.7 -> 9.1 -> 13.1 -> 14.6 after ~32 Adam steps on the same datum) the steps amplify that past
# any fixed tolerance (6.6e-3 relative at that jump, within 1e-3 before it, on a 2-core Intel Xeon
# with AMX); a request run out of order shows at once, not only after a divergence.
REPLAY_OPTIM_STEPS = 30
UNLOAD_SEQ = 2**62  # backends.tinker.routes_common.UNLOAD_SEQ, without importing the server here
# uvicorn closes a keep-alive connection idle for 5 s; a client that sends on it just then gets a
# connection reset it cannot retry (a POST), so the raw HTTP client lets idle connections go first.
IDLE_BEFORE_THE_SERVER = httpx.Limits(keepalive_expiry=2.0)
# What a request caught by the kill may end in: each says what happened.
CLEAR_ERRORS = (
    "restarted",  # "the server restarted before this request ran", "lost when the server restarted"
    "connection",  # the server is not there (APIConnectionError)
    # the raw HTTP client's request was on the wire when the server died (httpx.RemoteProtocolError:
    # "Server disconnected without sending a response"); the SDK wraps the same as APIConnectionError
    "server disconnected",
    "timed out",
    "timeout",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "max": ordered[-1]}


# ------------------------------------------------------------------------------- stub engine


class StubEngine:
    """``/v1/completions`` and ``/v1/load_lora_adapter`` of an OpenAI-style engine: tokens are a
    hash of (model, prompt, seed, sample index), so equal requests get equal samples."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.requests = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                engine.requests += 1
                if self.path == "/v1/load_lora_adapter":
                    engine.loaded.add(body["lora_name"])
                    self._send(b"ok", "text/plain")
                elif self.path == "/v1/completions":
                    self._send(json.dumps(engine.complete(body)).encode(), "application/json")
                else:
                    self.send_error(404)

            def _send(self, data: bytes, ctype: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> dict:
        choices = []
        for i in range(int(body.get("n", 1))):
            key = json.dumps([body["model"], body["prompt"], body.get("seed"), i]).encode()
            tokens = [7 + zlib.crc32(key + bytes([k])) % 36 for k in range(int(body["max_tokens"]))]
            choice = {
                "token_ids": tokens,
                "logprobs": {"token_logprobs": [-1.0] * len(tokens)},
                "finish_reason": "length",
            }
            if body.get("prompt_logprobs") is not None:
                choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": -2.0}} for t in body["prompt"][1:]]
            choices.append(choice)
        return {"choices": choices}

    def stop(self) -> None:
        self.http.shutdown()


# ------------------------------------------------------------------------------------ server


class Server:
    """``python -m backends.tinker.server`` on a config file, startable again on the same storage."""

    def __init__(self, workdir: Path, model_dir: Path, keys: list[str], sample_url: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.storage = workdir / "storage"
        self.config = workdir / "server.json"
        self.config.write_text(
            json.dumps(
                {
                    "base_model": "tiny",
                    "model_dir": str(model_dir),
                    "storage_dir": str(self.storage),
                    "api_keys": keys,
                    "host": "127.0.0.1",
                    "port": self.port,
                    "max_live_adapters": 64,
                    "max_lora_rank": 8,
                    "max_sequence_tokens": 64,
                    "long_poll_s": 5,
                    "sample_url": sample_url,
                    "engine_urls": [sample_url],
                }
            )
        )
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout_s: float = 180.0) -> float:
        """Seconds until ``/healthz`` answers."""
        started = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "backends.tinker.server", "--config", str(self.config)],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.starts += 1
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer within {timeout_s} s; see {self.log_path}")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def db(self) -> sqlite3.Connection:
        db = sqlite3.connect(f"file:{self.storage / 'tinker.sqlite'}?mode=ro", uri=True, timeout=30)
        db.row_factory = sqlite3.Row
        return db


def open_files(pid: int) -> tuple[int, int]:
    """(sockets, other open files) of process ``pid``."""
    sockets = files = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:"):
            sockets += 1
        else:
            files += 1
    return sockets, files


class Monitor(threading.Thread):
    """The server process's RSS and open files every ``period_s``: (seconds, start number, rss,
    sockets, other files)."""

    def __init__(self, server: Server, period_s: float = 0.5):
        super().__init__(daemon=True)
        self.server, self.period_s = server, period_s
        self.samples: list[tuple[float, int, int, int]] = []
        self.stopping = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        import psutil

        while not self.stopping.wait(self.period_s):
            proc = self.server.proc
            if proc is None or proc.poll() is not None:
                continue
            try:
                rss = psutil.Process(proc.pid).memory_info().rss
                self.samples.append((time.monotonic() - self.t0, self.server.starts, rss, *open_files(proc.pid)))
            except (psutil.Error, OSError):
                pass


# ------------------------------------------------------------------------------------ clients


@dataclass
class Clock:
    """When the server went away and came back (monotonic seconds; None: not yet)."""

    killed_at: float | None = None
    back_at: float | None = None
    grace_s: float = 30.0

    def in_restart(self, started: float) -> bool:
        """Whether a request started at ``started`` may have been caught by the kill."""
        if self.killed_at is None:
            return False
        return started <= (self.back_at or time.monotonic()) + self.grace_s


@dataclass
class ClientRecord:
    index: int
    key: str
    seq: list[int]  # the client's training sequence
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    log: list[tuple[str, object, object]] = field(default_factory=list)  # the first model's ops
    seed_model: str | None = None
    saved: dict[str, float] = field(default_factory=dict)  # save_state path -> forward loss before it
    ok: Counter = field(default_factory=Counter)  # model id -> requests with a result
    samples_ok: int = 0
    clear_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    sessions: int = 0


class LoadClient(threading.Thread):
    """One SDK client's random mix of requests until ``stop`` is set."""

    WEIGHTS = (("step", 40), ("accumulate", 10), ("save", 15), ("load", 12), ("sample", 18), ("sampler", 5))

    def __init__(self, index: int, key: str, url: str, seed: int, clock: Clock, stop: threading.Event):
        super().__init__(daemon=True, name=f"load-client-{index}")
        self.url, self.clock, self.stopping = url, clock, stop
        self.rng = random.Random(seed * 1000 + index)
        self.rank_seed = seed * 1000 + index
        self.seq = [7 + self.rng.randrange(36) for _ in range(14)]
        self.rec = ClientRecord(index, key, self.seq)
        self.ops = [name for name, weight in self.WEIGHTS for _ in range(weight)]

    # ---------------------------------------------------------------------- helpers

    def timed(self, op: str, fn):
        started = time.monotonic()
        out = fn()
        self.rec.latencies[op].append(time.monotonic() - started)
        return out

    def datum(self):
        from tinker import types

        seq = self.seq
        return types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
        )

    def adam(self):
        from tinker import types

        return types.AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8)

    # ------------------------------------------------------------------------- run

    def run(self) -> None:
        first = True
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                self.session(first)
                return
            except Exception as err:  # noqa: BLE001 - classified here
                message = f"{type(err).__name__}: {err}"
                if self.clock.in_restart(started) and any(word in message.lower() for word in CLEAR_ERRORS):
                    self.rec.clear_errors.append(message[:300])
                else:
                    self.rec.problems.append(f"client {self.rec.index}: {message[:500]}")
                    return
            first = False
            while self.clock.back_at is None and not self.stopping.is_set():
                time.sleep(0.2)

    def session(self, first: bool) -> None:
        import tinker

        self.rec.sessions += 1
        with (
            tinker.ServiceClient(base_url=self.url, api_key=self.rec.key) as sc,
            httpx.Client(base_url=self.url, timeout=60, limits=IDLE_BEFORE_THE_SERVER) as self.http,
        ):
            self.sc = sc
            if first:
                tc = self.timed(
                    "create",
                    lambda: sc.create_lora_training_client(base_model="tiny", rank=4, seed=self.rank_seed).result(),
                )
                self.rec.seed_model = tc.model_id
            else:  # after the restart: from the last save, which must give its recorded loss
                tc = self.resume(sc)
            self.rec.ok[tc.model_id] += 1
            sampler = None
            while not self.stopping.is_set():
                op = self.rng.choice(self.ops)
                if op in ("load",) and not self.rec.saved:
                    op = "save"
                if op == "sample" and sampler is None:
                    op = "sampler"
                result = getattr(self, f"op_{op}")(tc, sampler)
                if op == "sampler":
                    sampler = result

    def resume(self, sc):
        if not self.rec.saved:
            return self.timed(
                "create",
                lambda: sc.create_lora_training_client(base_model="tiny", rank=4, seed=self.rank_seed).result(),
            )
        path = list(self.rec.saved)[-1]
        tc = self.timed("create_from_state", lambda: sc.create_training_client_from_state_with_optimizer(path).result())
        loss = self.forward(tc, log=False)
        if abs(loss - self.rec.saved[path]) > RTOL * max(1.0, abs(loss)):
            self.rec.problems.append(
                f"client {self.rec.index}: {path} resumed with loss {loss}, saved {self.rec.saved[path]}"
            )
        return tc

    def record(self, tc, op: str, arg, result) -> None:
        self.rec.ok[tc.model_id] += 1
        if tc.model_id == self.rec.seed_model:
            self.rec.log.append((op, arg, result))

    def forward(self, tc, log: bool = True) -> float:
        out = self.timed("forward", lambda: tc.forward([self.datum()], "cross_entropy").result())
        loss = out.metrics["loss:sum"]
        if log:
            self.record(tc, "forward", None, loss)
        else:
            self.rec.ok[tc.model_id] += 1
        return loss

    # ------------------------------------------------------------------------- ops

    def op_step(self, tc, sampler) -> None:
        self.op_accumulate(tc, sampler)
        self.timed("optim_step", lambda: tc.optim_step(self.adam()).result())
        self.record(tc, "optim", None, None)

    def op_accumulate(self, tc, sampler) -> None:
        out = self.timed("forward_backward", lambda: tc.forward_backward([self.datum()], "cross_entropy").result())
        self.record(tc, "fb", None, out.metrics["loss:sum"])

    def op_save(self, tc, sampler) -> None:
        loss = self.forward(tc)
        name = f"c{self.rec.index}-{len(self.rec.saved)}-{self.rec.sessions}"
        path = self.timed("save_state", lambda: tc.save_state(name).result().path)
        self.record(tc, "save", path, None)
        self.rec.saved[path] = loss

    def op_load(self, tc, sampler) -> None:
        """A new model from one of this client's saves (create-via-load), which must give the loss
        recorded at the save; then it is unloaded (its adapter slot given back)."""
        path = self.rng.choice(sorted(self.rec.saved))
        loaded = self.timed(
            "load_state", lambda: self.sc.create_training_client_from_state_with_optimizer(path).result()
        )
        self.rec.ok[loaded.model_id] += 1
        loss = self.forward(loaded, log=False)
        if abs(loss - self.rec.saved[path]) > RTOL * max(1.0, abs(loss)):
            self.rec.problems.append(
                f"client {self.rec.index}: {path} loaded with loss {loss}, saved {self.rec.saved[path]}"
            )
        r = self.http.post(
            "/api/v1/unload_model", json={"model_id": loaded.model_id}, headers={"X-API-Key": self.rec.key}
        )
        if r.status_code != 200:  # the server's message says why (a kill in between: "...restarted...")
            raise RuntimeError(f"unload_model {loaded.model_id}: {r.status_code} {r.text[:300]}")

    def op_sampler(self, tc, sampler):
        sampler = self.timed("save_for_sampler", lambda: tc.save_weights_and_get_sampling_client().result())
        self.record(tc, "sampler", None, None)
        return sampler

    def op_sample(self, tc, sampler) -> None:
        from tinker import types

        prompt = types.ModelInput.from_ints(self.seq[:4])
        params = types.SamplingParams(max_tokens=4, seed=self.rng.randrange(1000), temperature=1.0)
        out = self.timed("sample", lambda: sampler.sample(prompt, 2, params).result())
        tokens = [list(s.tokens) for s in out.sequences]
        if len(tokens) != 2 or any(len(t) != 4 for t in tokens):
            self.rec.problems.append(f"client {self.rec.index}: sample gave {tokens}")
        if self.rng.random() < 0.3:  # the same request again: the same tokens
            again = self.timed("sample", lambda: sampler.sample(prompt, 2, params).result())
            if [list(s.tokens) for s in again.sequences] != tokens:
                self.rec.problems.append(f"client {self.rec.index}: equal sample requests differ")
            self.rec.samples_ok += 1
        self.rec.samples_ok += 1


# ------------------------------------------------------------------------------------ checks


def finished_futures(server: Server) -> list[sqlite3.Row]:
    with server.db() as db:
        return db.execute(
            "SELECT request_id, owner, kind, status, result, result_type FROM futures WHERE status != 'pending'"
        ).fetchall()


def check_finished_futures(server: Server, rows, keys: list[str], limit: int) -> tuple[int, list[str]]:
    """(checked, problems): each future finished before the kill, asked for again after it."""
    from backends.tinker.protocol import owner_of

    key_of = {owner_of(k): k for k in keys}
    problems = []
    picked = rows if len(rows) <= limit else random.Random(0).sample(list(rows), limit)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for row in picked:
            headers = {"X-API-Key": key_of[row["owner"]], "Accept": "application/x-protobuf"}
            r = http.post("/api/v1/retrieve_future", json={"request_id": str(row["request_id"])}, headers=headers)
            if r.status_code != 200 or r.content != row["result"]:
                problems.append(
                    f"future {row['request_id']} ({row['kind']}) after the restart: {r.status_code} {r.text[:200]}"
                )
    return len(picked), problems


def check_store(server: Server, records: list[ClientRecord]) -> list[str]:
    """No future pending; per model, seq_ids 1..n without a gap; as many done as results seen."""
    problems = []
    with server.db() as db:
        pending = db.execute("SELECT COUNT(*) FROM futures WHERE status = 'pending'").fetchone()[0]
        if pending:
            problems.append(f"{pending} futures still pending")
        per_model: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for row in db.execute("SELECT model_id, seq_id, status FROM futures WHERE model_id IS NOT NULL"):
            if row["seq_id"] != UNLOAD_SEQ:
                per_model[row["model_id"]].append((row["seq_id"], row["status"]))
        samples_done = db.execute("SELECT COUNT(*) FROM futures WHERE kind = 'sample' AND status = 'done'").fetchone()[
            0
        ]
    for model_id, rows in per_model.items():
        seqs = sorted(s for s, _ in rows)
        if seqs != list(range(seqs[0], seqs[0] + len(seqs))) or seqs[0] != 0:
            problems.append(f"model {model_id}: seq_ids {seqs[:5]}...{seqs[-5:]} are not 0..n without a gap")
    for rec in records:
        for model_id, seen in rec.ok.items():
            done = sum(1 for _, status in per_model.get(model_id, []) if status == "done")
            if done != seen:
                problems.append(f"model {model_id}: {done} futures done, the client got {seen} results")
    seen_samples = sum(r.samples_ok for r in records)
    if samples_done < seen_samples:
        problems.append(f"{samples_done} sample futures done, the clients got {seen_samples}")
    return problems


def check_checkpoints(
    server: Server, records: list[ClientRecord], keys: list[str], limit: int
) -> tuple[int, list[str]]:
    """Every saved training checkpoint (up to ``limit``) loads; those with a recorded loss give it."""
    import tinker
    from tinker import types

    from backends.tinker.protocol import owner_of, tinker_path

    key_of = {owner_of(k): k for k in keys}
    recorded = {path: (loss, rec) for rec in records for path, loss in rec.saved.items()}
    with server.db() as db:
        rows = db.execute("SELECT run_id, kind, name, owner FROM checkpoints ORDER BY created").fetchall()
    rows = [r for r in rows if r["kind"] == "weights"]
    picked = rows if len(rows) <= limit else random.Random(1).sample(rows, limit)
    problems, by_key = [], defaultdict(list)
    for row in picked:
        by_key[key_of[row["owner"]]].append(tinker_path(row["run_id"], row["kind"], row["name"]))
    loaded = 0
    for key, paths in by_key.items():
        with (
            tinker.ServiceClient(base_url=server.url, api_key=key) as sc,
            httpx.Client(base_url=server.url, limits=IDLE_BEFORE_THE_SERVER) as http,
        ):
            for path in paths:
                try:
                    tc = sc.create_training_client_from_state_with_optimizer(path).result()
                    if path in recorded:
                        loss_then, rec = recorded[path]
                        seq = rec.seq
                        datum = types.Datum(
                            model_input=types.ModelInput.from_ints(seq[:-1]),
                            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
                        )
                        loss = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
                        if abs(loss - loss_then) > RTOL * max(1.0, abs(loss)):
                            problems.append(f"{path}: loss {loss} after loading, {loss_then} when saved")
                    http.post("/api/v1/unload_model", json={"model_id": tc.model_id}, headers={"X-API-Key": key})
                    loaded += 1
                except Exception as err:  # noqa: BLE001 - reported
                    problems.append(f"{path} does not load: {type(err).__name__}: {err}")
    return loaded, problems


def replay(server: Server, rec: ClientRecord, seed: int) -> list[str]:
    """The client's first model's requests again (up to ``REPLAY_OPTIM_STEPS`` optimizer steps),
    alone on a fresh model of the same seed: the same losses (the requests ran in seq_id order,
    whatever else the server was doing)."""
    import tinker

    client = LoadClient(rec.index, rec.key, server.url, seed, Clock(), threading.Event())
    problems = []
    with tinker.ServiceClient(base_url=server.url, api_key=rec.key) as sc:
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=client.rank_seed).result()
        optim_steps = 0
        for step, (op, arg, expected) in enumerate(rec.log):
            if optim_steps >= REPLAY_OPTIM_STEPS:
                break
            if op == "fb":
                got = tc.forward_backward([client.datum()], "cross_entropy").result().metrics["loss:sum"]
            elif op == "forward":
                got = tc.forward([client.datum()], "cross_entropy").result().metrics["loss:sum"]
            elif op == "optim":
                tc.optim_step(client.adam()).result()
                optim_steps += 1
                continue
            else:  # saves: no change to the model
                continue
            if abs(got - expected) > RTOL * max(1.0, abs(expected)):
                problems.append(f"client {rec.index} step {step} ({op}): replay loss {got}, under load {expected}")
                break
    return problems


GAUGES = {"rss": 2, "sockets": 3, "files": 4}  # columns of Monitor.samples


def memory_problems(samples, start_no: int, warmup_until: float, clients: int) -> tuple[dict, list[str]]:
    """Figures (start, after the warm-up, peak after it, end) per gauge, and what grew too much."""
    series = [s for s in samples if s[1] == start_no]
    if not series:
        return {}, [f"no RSS samples of server start {start_no}"]
    warm = [s for s in series if s[0] >= warmup_until] or series[-1:]
    figures = {
        name: {"start": series[0][col], "warm": warm[0][col], "peak": max(s[col] for s in warm), "end": series[-1][col]}
        for name, col in GAUGES.items()
    }
    margins = {
        "rss": lambda base: base * (1 + RSS_MARGIN) + RSS_MARGIN_BYTES,
        "files": lambda base: base + FILES_MARGIN,
        "sockets": lambda base: max(base, clients * SOCKETS_PER_CLIENT),  # a pool per client, not a leak
    }
    problems = [
        f"server {name} grew after the warm-up: {f['warm']} -> {f['peak']} (margin {margins[name](f['warm']):.0f})"
        for name, f in figures.items()
        if f["peak"] > margins[name](f["warm"])
    ]
    return figures, problems


# --------------------------------------------------------------------------------------- run


@dataclass
class Report:
    clients: int
    load_s: float
    recover_s: float
    records: list[ClientRecord]
    start_s: list[float]
    memory: dict[str, dict]
    futures_checked: int = 0
    checkpoints_loaded: int = 0
    replayed: int = 0
    problems: list[str] = field(default_factory=list)

    def latencies(self) -> dict[str, dict[str, float]]:
        merged: dict[str, list[float]] = defaultdict(list)
        for rec in self.records:
            for op, values in rec.latencies.items():
                merged[op].extend(values)
        return {op: percentiles(v) for op, v in sorted(merged.items())}

    def summary(self) -> str:
        lat = self.latencies()
        served = sum(v["n"] for v in lat.values())
        lines = [
            f"{self.clients} SDK clients, {self.load_s:.0f} s of load, SIGKILL, restart, {self.recover_s:.0f} s more",
            f"requests served (with a result): {served}; server starts took {', '.join(f'{s:.1f} s' for s in self.start_s)}",
            "latency per op (s):            n      p50      p95      p99      max",
        ]
        for op, p in lat.items():
            lines.append(f"  {op:<22} {p['n']:>7} {p['p50']:8.3f} {p['p95']:8.3f} {p['p99']:8.3f} {p['max']:8.3f}")
        for when, gauges in self.memory.items():
            for name, f in gauges.items():
                scale, unit = (2**20, " MiB") if name == "rss" else (1, "")
                lines.append(
                    f"server {name} {when}: {f['start'] // scale}{unit} at start, {f['warm'] // scale} after the "
                    f"warm-up, {f['peak'] // scale} peak after it, {f['end'] // scale} at the end"
                )
        clear = sum(len(r.clear_errors) for r in self.records)
        kinds = Counter(e.split(":")[0] for r in self.records for e in r.clear_errors)
        lines.append(
            f"restart: {clear} requests caught by the kill ended in a clear error ({dict(kinds)}); "
            f"{self.futures_checked} finished futures returned again byte for byte; "
            f"{self.checkpoints_loaded} checkpoints loaded; {self.replayed} clients replayed alone"
        )
        lines.append(f"problems: {len(self.problems)}")
        lines.extend(f"  - {p}" for p in self.problems[:40])
        return "\n".join(lines)


def run_load(
    model_dir: Path,
    workdir: Path,
    clients: int = 16,
    load_s: float = 40.0,
    recover_s: float = 15.0,
    seed: int = 0,
    replays: int = 4,
    futures_limit: int = 400,
    checkpoints_limit: int = 40,
    log=print,
) -> Report:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    keys = [f"tml-load{i}" for i in range(max(1, (clients + 3) // 4))]
    engine = StubEngine()
    server = Server(workdir, model_dir, keys, engine.url)
    monitor = Monitor(server)
    clock, stop = Clock(), threading.Event()
    start_s = [server.start()]
    log(f"server up in {start_s[0]:.1f} s; {clients} clients for {load_s:.0f} s")
    monitor.start()
    t_load = time.monotonic() - monitor.t0
    threads = [LoadClient(i, keys[i // 4], server.url, seed, clock, stop) for i in range(clients)]
    try:
        for t in threads:
            t.start()
        time.sleep(load_s)
        clock.killed_at = time.monotonic()
        server.kill()
        log("server SIGKILLed")
        finished = finished_futures(server)
        start_s.append(server.start())
        clock.back_at = time.monotonic()
        t_back = clock.back_at - monitor.t0
        log(f"server back in {start_s[-1]:.1f} s on the same storage; {len(finished)} futures had finished")
        time.sleep(recover_s)
        stop.set()
        for t in threads:
            t.join(timeout=180)
        hung = [t.name for t in threads if t.is_alive()]
        records = [t.rec for t in threads]
        problems = [p for r in records for p in r.problems] + [f"{name} did not stop" for name in hung]
        checked, found = check_finished_futures(server, finished, keys, futures_limit)
        problems += found + check_store(server, records)
        loaded, found = check_checkpoints(server, records, keys, checkpoints_limit)
        problems += found
        picked = [r for r in records if r.log][:replays]
        for rec in picked:
            problems += replay(server, rec, seed)
        monitor.stopping.set()
        warmup = t_load + load_s * 0.3
        before, found_before = memory_problems(monitor.samples, 1, warmup, clients)
        after, _ = memory_problems(monitor.samples, 2, t_back, clients)
        problems += found_before
        return Report(
            clients,
            load_s,
            recover_s,
            records,
            start_s,
            {"before the kill": before, "after the restart": after},
            checked,
            loaded,
            len(picked),
            problems,
        )
    finally:
        stop.set()
        monitor.stopping.set()
        server.stop()
        engine.stop()


def build_model(out: Path) -> Path:
    import string

    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tok = build_char_tokenizer(string.digits + string.ascii_lowercase + " +-*=?.,")
    model = build_tiny_model(TinyModelInit(hidden_size=128, layers=2, heads=4), tok, 0)
    return save_hf(model, tok, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=120.0, help="load before the SIGKILL")
    parser.add_argument("--recover", type=float, default=30.0, help="load after the restart")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replays", type=int, default=16)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-tinker-load-"))
    model_dir = build_model(workdir / "model")
    report = run_load(
        model_dir,
        workdir,
        args.clients,
        args.seconds,
        args.recover,
        args.seed,
        args.replays,
        futures_limit=2000,
        checkpoints_limit=200,
    )
    print(report.summary())
    sys.exit(1 if report.problems else 0)


if __name__ == "__main__":
    main()
