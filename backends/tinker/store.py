"""SQLite persistence of the Tinker server: sessions, models, samplers, futures and checkpoints.

Everything a client may ask for again after a restart lives here: a finished future's result (JSON
or protobuf bytes), every saved checkpoint (the files are PEFT directories under the storage
directory; rows only record them), and who owns what (``owner``: a digest of the API key).

One connection shared by the API's event loop and the trainer thread, behind a lock; WAL mode
and ``synchronous=NORMAL``, so a SIGKILL loses at most what was not committed (each write is its
own transaction). A future is written ``done`` only together with its result, and a finished
future never changes again.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL,
    last_heartbeat REAL NOT NULL, finished INTEGER NOT NULL DEFAULT 0, info TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY, run_id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL, session_id TEXT NOT NULL,
    base_model TEXT NOT NULL, lora_rank INTEGER NOT NULL, config TEXT NOT NULL,
    user_metadata TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL, last_request REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'live'
);
CREATE TABLE IF NOT EXISTS samplers (
    sampler_id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL, base_model TEXT NOT NULL,
    model_path TEXT, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS futures (
    request_id INTEGER PRIMARY KEY AUTOINCREMENT, owner TEXT NOT NULL, kind TEXT NOT NULL,
    model_id TEXT, seq_id INTEGER, dedup TEXT UNIQUE, payload BLOB, status TEXT NOT NULL,
    result BLOB, result_type TEXT, created REAL NOT NULL, finished REAL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, owner TEXT NOT NULL, dir TEXT NOT NULL,
    created REAL NOT NULL, size_bytes INTEGER NOT NULL, has_optimizer INTEGER NOT NULL,
    PRIMARY KEY (run_id, kind, name)
);
"""

PENDING, DONE, FAILED = "pending", "done", "failed"


@dataclass
class Future:
    request_id: int
    owner: str
    kind: str
    model_id: str | None
    seq_id: int | None
    payload: bytes | None
    status: str
    result: bytes | None
    result_type: str | None
    created: float


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def _one(self, sql: str, args: tuple = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ------------------------------------------------------------------------------ sessions

    def create_session(self, session_id: str, owner: str, info: dict) -> None:
        now = time.time()
        self._exec("INSERT INTO sessions VALUES (?, ?, ?, ?, 0, ?)", (session_id, owner, now, now, json.dumps(info)))

    def session(self, session_id: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM sessions WHERE session_id = ?", (session_id,))

    def sessions(self, owner: str) -> list[sqlite3.Row]:
        return self._all("SELECT * FROM sessions WHERE owner = ? ORDER BY created", (owner,))

    def heartbeat(self, session_id: str) -> None:
        self._exec("UPDATE sessions SET last_heartbeat = ? WHERE session_id = ?", (time.time(), session_id))

    def stale_sessions(self, before: float) -> list[sqlite3.Row]:
        """Sessions not finished whose last heartbeat is older than ``before``."""
        return self._all("SELECT * FROM sessions WHERE finished = 0 AND last_heartbeat < ?", (before,))

    def session_models(self, session_id: str, live_only: bool = False) -> list[str]:
        states = " AND state IN ('pending', 'live')" if live_only else ""
        return [r[0] for r in self._all(f"SELECT model_id FROM models WHERE session_id = ?{states}", (session_id,))]

    def session_samplers(self, session_id: str) -> list[str]:
        return [r[0] for r in self._all("SELECT sampler_id FROM samplers WHERE session_id = ?", (session_id,))]

    def finish_session(self, session_id: str, reason: dict) -> None:
        row = self.session(session_id)
        info = json.loads(row["info"]) if row else {}
        info["finish"] = reason
        self._exec("UPDATE sessions SET finished = 1, info = ? WHERE session_id = ?", (json.dumps(info), session_id))

    # -------------------------------------------------------------------------------- models

    def add_model(
        self,
        model_id: str,
        run_id: str,
        owner: str,
        session_id: str,
        base_model: str,
        rank: int,
        config: dict,
        user_metadata: dict | None,
    ) -> None:
        now = time.time()
        self._exec(
            "INSERT OR REPLACE INTO models VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'live')",
            (
                model_id,
                run_id,
                owner,
                session_id,
                base_model,
                rank,
                json.dumps(config),
                json.dumps(user_metadata or {}),
                now,
                now,
            ),
        )

    def model(self, model_id: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM models WHERE model_id = ?", (model_id,))

    def model_by_run(self, run_id: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM models WHERE run_id = ?", (run_id,))

    def models(self, owner: str, limit: int = 100, offset: int = 0) -> list[sqlite3.Row]:
        return self._all(
            "SELECT * FROM models WHERE owner = ? ORDER BY created LIMIT ? OFFSET ?", (owner, limit, offset)
        )

    def count_models(self, owner: str) -> int:
        return int(self._one("SELECT COUNT(*) FROM models WHERE owner = ?", (owner,))[0])

    def live_model_count(self) -> int:
        """Models holding (or about to hold) an adapter slot, over all owners."""
        return int(self._one("SELECT COUNT(*) FROM models WHERE state IN ('pending', 'live')")[0])

    def touch_model(self, model_id: str) -> None:
        self._exec("UPDATE models SET last_request = ? WHERE model_id = ?", (time.time(), model_id))

    def set_model_state(self, model_id: str, state: str) -> None:
        self._exec("UPDATE models SET state = ? WHERE model_id = ?", (state, model_id))

    def mark_live_models_lost(self) -> int:
        """At start-up: adapters held in memory by a previous server process are gone."""
        return self._exec("UPDATE models SET state = 'lost' WHERE state = 'live'").rowcount

    # ------------------------------------------------------------------------------ samplers

    def add_sampler(
        self, sampler_id: str, owner: str, session_id: str, base_model: str, model_path: str | None
    ) -> None:
        self._exec(
            "INSERT OR IGNORE INTO samplers VALUES (?, ?, ?, ?, ?, ?)",
            (sampler_id, owner, session_id, base_model, model_path, time.time()),
        )

    def sampler(self, sampler_id: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM samplers WHERE sampler_id = ?", (sampler_id,))

    # ------------------------------------------------------------------------------- futures

    def submit(
        self,
        owner: str,
        kind: str,
        payload: bytes | None,
        *,
        model_id: str | None = None,
        seq_id: int | None = None,
        dedup: str | None = None,
    ) -> tuple[int, bool]:
        """A new pending future, or (for a repeated ``dedup`` key) the existing one: (id, is_new)."""
        with self._lock:
            if dedup is not None:
                row = self._db.execute("SELECT request_id FROM futures WHERE dedup = ?", (dedup,)).fetchone()
                if row is not None:
                    return int(row[0]), False
            cur = self._db.execute(
                "INSERT INTO futures (owner, kind, model_id, seq_id, dedup, payload, status, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (owner, kind, model_id, seq_id, dedup, payload, PENDING, time.time()),
            )
            return int(cur.lastrowid), True

    def future(self, request_id: int) -> Future | None:
        row = self._one("SELECT * FROM futures WHERE request_id = ?", (request_id,))
        if row is None:
            return None
        return Future(
            row["request_id"],
            row["owner"],
            row["kind"],
            row["model_id"],
            row["seq_id"],
            row["payload"],
            row["status"],
            row["result"],
            row["result_type"],
            row["created"],
        )

    def pending(self) -> list[Future]:
        rows = self._all("SELECT request_id FROM futures WHERE status = ? ORDER BY request_id", (PENDING,))
        return [f for f in (self.future(r[0]) for r in rows) if f is not None]

    def complete(self, request_id: int, result: bytes, result_type: str) -> None:
        self._exec(
            "UPDATE futures SET status = ?, result = ?, result_type = ?, finished = ?, payload = NULL "
            "WHERE request_id = ? AND status = ?",
            (DONE, result, result_type, time.time(), request_id, PENDING),
        )

    def fail(self, request_id: int, message: str, category: str = "User") -> None:
        body = json.dumps({"error": message, "category": category}).encode()
        self._exec(
            "UPDATE futures SET status = ?, result = ?, result_type = 'json', finished = ?, payload = NULL "
            "WHERE request_id = ? AND status = ?",
            (FAILED, body, time.time(), request_id, PENDING),
        )

    def fail_all_pending(self, message: str) -> int:
        ids = [f.request_id for f in self.pending()]
        for rid in ids:
            self.fail(rid, message, "Server")
        return len(ids)

    # --------------------------------------------------------------------------- checkpoints

    def add_checkpoint(
        self, run_id: str, kind: str, name: str, owner: str, directory: str, size: int, has_optimizer: bool
    ) -> None:
        self._exec(
            "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (run_id, kind, name, owner, directory, time.time(), size, int(has_optimizer)),
        )

    def checkpoint(self, run_id: str, kind: str, name: str) -> sqlite3.Row | None:
        return self._one("SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?", (run_id, kind, name))

    def checkpoints(self, owner: str, run_id: str | None = None) -> list[sqlite3.Row]:
        if run_id is None:
            return self._all("SELECT * FROM checkpoints WHERE owner = ? ORDER BY created", (owner,))
        return self._all("SELECT * FROM checkpoints WHERE owner = ? AND run_id = ? ORDER BY created", (owner, run_id))

    def delete_checkpoint(self, run_id: str, kind: str, name: str) -> None:
        self._exec("DELETE FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?", (run_id, kind, name))


def as_json(row: sqlite3.Row | None, *json_fields: str) -> dict[str, Any] | None:
    if row is None:
        return None
    out = dict(row)
    for name in json_fields:
        out[name] = json.loads(out[name]) if out.get(name) else {}
    return out
