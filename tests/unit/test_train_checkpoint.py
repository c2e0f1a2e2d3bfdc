"""Checkpoint directories: only complete ones count, leftovers of a killed run are removed."""

from __future__ import annotations

from backends.train.checkpoint import STATE_FILE, remove_leftovers
from skyrl_contracts.rundir import RunDir


def _checkpoint(root, name, complete=True):
    path = root / "checkpoints" / name
    path.mkdir(parents=True)
    if complete:
        (path / STATE_FILE).write_text("{}")
    return path


def test_leftovers_are_removed(tmp_path):
    _checkpoint(tmp_path, ".tmp-step-8")
    _checkpoint(tmp_path, ".trash-step-2")
    _checkpoint(tmp_path, ".old-step-4-77")  # left by an older step-4 that a killed publish replaced
    keep = _checkpoint(tmp_path, "step-4")
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [keep.name]


def test_a_killed_publish_is_undone_at_start_up(tmp_path):
    # Killed between moving the old step-4 (or final/) aside and renaming the new one in.
    _checkpoint(tmp_path, ".old-step-4-77")
    (tmp_path / ".old-final-77").mkdir()
    (tmp_path / ".old-final-77" / "config.json").write_text("{}")
    (tmp_path / ".tmp-final").mkdir()
    remove_leftovers(tmp_path)
    assert [s for s, _ in RunDir(tmp_path).complete_checkpoints()] == [4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "final"]
    assert (tmp_path / "final" / "config.json").is_file()
