"""skyrl_contracts.atomic: files and directories appear whole or not at all, and a failure leaves nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from skyrl_contracts import atomic
from skyrl_contracts.rundir import RunDir


def _tree(path):
    return {p.relative_to(path).as_posix(): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def _built(parent, name, files):
    path = parent / name
    path.mkdir()
    for rel, text in files.items():
        (path / rel).write_text(text)
    return path


def test_write_then_read(tmp_path):
    atomic.write_text(tmp_path / "a" / "b.txt", "héllo")
    atomic.write_bytes(tmp_path / "a" / "c.bin", b"\x00\x01")
    atomic.write_json(tmp_path / "a" / "d.json", {"x": [1, 2]})
    atomic.write_json(tmp_path / "a" / "d.json", {"y": 3}, indent=None)
    assert (tmp_path / "a" / "b.txt").read_text(encoding="utf-8") == "héllo"
    assert (tmp_path / "a" / "c.bin").read_bytes() == b"\x00\x01"
    assert json.loads((tmp_path / "a" / "d.json").read_text()) == {"y": 3}
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b.txt", "c.bin", "d.json"]


def test_files_get_the_umask_permissions_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        atomic.write_text(tmp_path / "f", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch, failing):
    path = tmp_path / "summary.json"
    atomic.write_json(path, {"old": True})

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, failing, disk_full)
    with pytest.raises(OSError, match="No space"):
        atomic.write_json(path, {"new": True})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def _record_states(monkeypatch, final_dir, calls):
    """Wrap every call that moves or deletes a directory; note whether ``final_dir`` exists after it."""

    def wrap(owner, name):
        real = getattr(owner, name)

        def recorded(*args, **kwargs):
            result = real(*args, **kwargs)
            calls.append((name, final_dir.is_dir() and _tree(final_dir)))
            return result

        monkeypatch.setattr(owner, name, recorded)

    wrap(atomic, "exchange")
    wrap(atomic.os, "replace")
    wrap(atomic.os, "rename")
    wrap(atomic.shutil, "rmtree")


def _needs_exchange(tmp_path):
    probe_a, probe_b = _built(tmp_path, "a", {}), _built(tmp_path, "b", {})
    supported = atomic.exchange(probe_a, probe_b)
    probe_a.rmdir()
    probe_b.rmdir()
    if not supported:
        pytest.skip("this file system has no RENAME_EXCHANGE; the fallback is tested below")


def test_publish_over_an_existing_dir_never_leaves_it_missing(tmp_path, monkeypatch):
    _needs_exchange(tmp_path)
    final = tmp_path / "final"
    atomic.publish_dir(_built(tmp_path, ".tmp-1", {"w": "v1", "old-only": "x"}), final)
    calls = []
    _record_states(monkeypatch, final, calls)
    atomic.publish_dir(_built(tmp_path, ".tmp-2", {"w": "v2"}), final)
    assert [name for name, _ in calls] == ["exchange", "rmtree"]
    assert all(state for _, state in calls), calls  # final/ was there, whole, after every step
    assert calls[0][1] == {"w": "v2"}
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # the old content is gone


def test_publish_fallback_is_missing_only_between_its_two_renames(tmp_path, monkeypatch):
    final = tmp_path / "final"
    atomic.publish_dir(_built(tmp_path, ".tmp-1", {"w": "v1"}), final)
    calls = []
    _record_states(monkeypatch, final, calls)
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)  # e.g. NFS
    atomic.publish_dir(_built(tmp_path, ".tmp-2", {"w": "v2"}), final)
    assert calls == [("replace", False), ("replace", {"w": "v2"}), ("rmtree", {"w": "v2"})]
    assert [p.name for p in tmp_path.iterdir()] == ["final"]


def test_publish_fallback_puts_the_old_dir_back_when_the_rename_in_fails(tmp_path, monkeypatch):
    final = tmp_path / "final"
    atomic.publish_dir(_built(tmp_path, ".tmp-1", {"w": "v1"}), final)
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    real = os.replace

    def fail_rename_in(src, dst):
        if str(src).endswith(".tmp-2"):
            raise OSError(errno.EIO, "I/O error")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", fail_rename_in)
    with pytest.raises(OSError, match="I/O"):
        atomic.publish_dir(_built(tmp_path, ".tmp-2", {"w": "v2"}), final)
    assert _tree(final) == {"w": "v1"}


def test_a_publish_killed_between_the_renames_is_undone(tmp_path):
    # What the fallback leaves when killed after renaming final/ aside: no final/, the old one whole.
    _built(tmp_path, ".old-final-4242", {"w": "v1"})
    _built(tmp_path, ".old-finalist-7", {"w": "another name"})
    atomic.recover_dir(tmp_path / "final")
    assert _tree(tmp_path / "final") == {"w": "v1"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old-finalist-7", "final"]
    # Left again, with final/ present: the next publish deletes it.
    _built(tmp_path, ".old-final-4243", {"w": "stale"})
    atomic.publish_dir(_built(tmp_path, ".tmp-3", {"w": "v3"}), tmp_path / "final")
    assert _tree(tmp_path / "final") == {"w": "v3"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old-finalist-7", "final"]


def test_remove_leftovers(tmp_path):
    _built(tmp_path, ".tmp-step-8", {"half": "x"})
    (tmp_path / ".tmp-LATEST-1-ab").write_text("3")
    _built(tmp_path, ".trash-step-2", {"w": "x"})
    _built(tmp_path, ".old-step-4-99", {"w": "v4"})
    _built(tmp_path, "step-12", {"w": "v12"})
    _built(tmp_path, ".old-step-12-99", {"w": "stale"})
    atomic.remove_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-12", "step-4"]
    assert _tree(tmp_path / "step-4") == {"w": "v4"}
    atomic.remove_leftovers(tmp_path / "missing")  # nothing to do, no error


def test_publish_fsyncs_before_the_dir_is_visible(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(atomic, "fsync_tree", lambda root: order.append(("fsync", sorted(os.listdir(root)))))
    real = os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: (order.append(("visible", None)), real(a, b)))
    atomic.publish_dir(_built(tmp_path, ".tmp-1", {"model.safetensors": "w"}), tmp_path / "final")
    assert order == [("fsync", ["model.safetensors"]), ("visible", None)]


def test_fsync_tree_visits_every_file(tmp_path, monkeypatch):
    _built(tmp_path, "d", {"a": "1"})
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "sub" / "b").write_text("2")
    synced = []
    real = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    atomic.fsync_tree(tmp_path / "d")
    assert {os.path.relpath(p, tmp_path) for p in synced} >= {"d/a", "d/sub/b", "d/sub", "d"}


def test_atomic_dir_failure_leaves_target_untouched(tmp_path):
    target = tmp_path / "ckpt"
    with atomic.atomic_dir(target) as tmp:
        (tmp / "model.safetensors").write_text("v1")
    with pytest.raises(RuntimeError):
        with atomic.atomic_dir(target) as tmp:
            (tmp / "model.safetensors").write_text("half")
            raise RuntimeError("crash mid-write")
    assert (target / "model.safetensors").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_atomic_dir_replaces_existing(tmp_path):
    target = tmp_path / "ckpt"
    for version in ("v1", "v2"):
        with atomic.atomic_dir(target) as tmp:
            (tmp / "f").write_text(version)
    assert _tree(target) == {"f": "v2"}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_discard_dir_goes_through_trash(tmp_path, monkeypatch):
    _built(tmp_path, "step-2", {"w": "x"})
    _built(tmp_path, ".trash-step-2", {"w": "left by a crash"})
    moved = []
    real = shutil.rmtree
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda p, **kw: (moved.append(os.path.basename(p)), real(p, **kw)))
    atomic.discard_dir(tmp_path / "step-2")
    assert "step-2" not in moved and moved[-1] == ".trash-step-2"  # never deleted under its own name
    assert list(tmp_path.iterdir()) == []


def test_rl_final_model_is_replaced_whole(tmp_path, monkeypatch):
    from skyrl_cli.stages.results import publish_final_model

    _needs_exchange(tmp_path)
    run = tmp_path / "rl"
    run.mkdir()
    _built(run, "final", {"config.json": "old"})
    (run / "checkpoints" / "step-2" / "model").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "model" / "config.json").write_text("new")
    (run / "checkpoints" / "step-2" / "trainer_state.json").write_text("{}")
    calls = []
    _record_states(monkeypatch, run / "final", calls)
    publish_final_model(RunDir(run))
    assert calls and all(state for _, state in calls)  # the old final/ stayed until the new one was in
    assert _tree(run / "final") == {"config.json": "new"}
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "final"]


def test_an_rl_launch_deletes_half_written_weight_versions(tmp_path):
    from skyrl_cli.stages.local import clear_exchange

    (tmp_path / "weights").mkdir()
    _built(tmp_path / "weights", ".tmp-v3-123-abcd", {"model.safetensors": "half"})
    _built(tmp_path / "weights", "v2", {"model.safetensors": "w"})
    clear_exchange(RunDir(tmp_path))
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v2"]
