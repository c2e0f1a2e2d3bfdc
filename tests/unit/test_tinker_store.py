"""The SQLite store: futures dedup, results across a reopen, ownership rows, restart marking."""

from __future__ import annotations

import json

from backends.tinker.store import DONE, FAILED, PENDING, Store


def test_futures_dedup_complete_and_survive_reopen(tmp_path):
    db = tmp_path / "s.sqlite"
    store = Store(db)
    rid, new = store.submit("alice", "optim_step", None, model_id="m", seq_id=3, dedup="m#3")
    assert new
    assert store.submit("alice", "optim_step", None, model_id="m", seq_id=3, dedup="m#3") == (rid, False)
    other, new = store.submit("alice", "optim_step", None, model_id="m", seq_id=4, dedup="m#4")
    assert new and other != rid
    store.complete(rid, b'{"metrics": {}}', "json")
    store.close()

    again = Store(db)
    fut = again.future(rid)
    assert fut.status == DONE and fut.result == b'{"metrics": {}}' and fut.owner == "alice"
    assert [f.request_id for f in again.pending()] == [other]
    assert again.fail_all_pending("restarted") == 1
    failed = again.future(other)
    assert failed.status == FAILED and json.loads(failed.result) == {"error": "restarted", "category": "Server"}
    assert again.pending() == []


def test_models_sessions_checkpoints(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    store.create_session("s1", "alice", {"tags": []})
    assert store.session("s1")["owner"] == "alice"
    store.add_model("s1:train:0", "s1_train_0", "alice", "s1", "tiny", 8, {"lora_config": {}}, {"k": "v"})
    assert store.model("s1:train:0")["state"] == "live"
    assert store.model_by_run("s1_train_0")["lora_rank"] == 8
    assert store.mark_live_models_lost() == 1
    assert store.model("s1:train:0")["state"] == "lost"
    store.add_checkpoint("s1_train_0", "weights", "c1", "alice", str(tmp_path / "c1"), 10, True)
    assert [r["name"] for r in store.checkpoints("alice")] == ["c1"]
    assert store.checkpoints("bob") == []
    store.delete_checkpoint("s1_train_0", "weights", "c1")
    assert store.checkpoint("s1_train_0", "weights", "c1") is None
    store.finish_session("s1", {"reason": {"type": "success"}})
    assert store.session("s1")["finished"] == 1
    assert store.future(12345) is None
    assert PENDING == "pending"


def test_a_finished_future_never_changes(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    rid, _ = store.submit("alice", "sample", None)
    store.complete(rid, b"first", "proto")
    store.fail(rid, "late error")
    store.complete(rid, b"second", "proto")
    fut = store.future(rid)
    assert (fut.status, fut.result) == (DONE, b"first")
