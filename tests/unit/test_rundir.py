"""The run-directory object: its layout, its checkpoint lister and its readers (no torch)."""

from __future__ import annotations

import json

from skyrl_contracts.rundir import CHECKPOINT_STATE_FILE, RunDir


def _checkpoint(run: RunDir, name: str, complete: bool = True) -> None:
    path = run.checkpoints / name
    path.mkdir(parents=True)
    if complete:
        (path / CHECKPOINT_STATE_FILE).write_text("{}")


def test_only_complete_checkpoints_count_in_numeric_order(tmp_path):
    run = RunDir(tmp_path)
    assert run.latest_checkpoint() is None
    for name in ("step-4", "step-12", ".tmp-step-20", "notes"):
        _checkpoint(run, name)
    _checkpoint(run, "step-16", complete=False)  # no trainer_state.json: never published
    assert [s for s, _ in run.complete_checkpoints()] == [4, 12]  # numeric order, not text order
    assert run.latest_checkpoint() == run.checkpoint(12)


def test_latest_weights_version_reads_the_pointer_and_tolerates_its_absence(tmp_path):
    run = RunDir(tmp_path)
    assert run.latest_weights_version() is None
    run.weights.mkdir()
    run.latest_weights.write_text("garbage")
    assert run.latest_weights_version() is None
    run.latest_weights.write_text("7\n")
    assert run.latest_weights_version() == 7
    assert run.weights_version(7) == tmp_path / "weights" / "v7"


def test_initial_accuracy_round_trips_and_a_broken_file_reads_as_absent(tmp_path):
    run = RunDir(tmp_path)
    assert run.initial_accuracy() is None
    run.write_initial_accuracy(0, 0.25)
    assert json.loads(run.eval_initial.read_text()) == {"version": 0, "accuracy": 0.25}
    assert run.initial_accuracy() == 0.25
    run.eval_initial.write_text("{")
    assert run.initial_accuracy() is None


def test_every_path_stays_inside_the_run_directory(tmp_path):
    run = RunDir(tmp_path / "r")
    paths = [
        run.resolved_recipe,
        run.plan,
        run.log("engine-0"),
        run.events,
        run.summary,
        run.eval_initial,
        run.checkpoint(3),
        run.final,
        run.final_tmp,
        run.batch(2),
        run.weights_version(1),
        run.latest_weights,
        run.current_weights,
        run.stop_request,
        run.orchestrator_state_at(4),
    ]
    assert all(p.is_relative_to(run.root) for p in paths)
    assert len(set(paths)) == len(paths)


def test_buffer_states_are_pruned_to_the_newest_few(tmp_path):
    run = RunDir(tmp_path)
    run.orchestrator_state.mkdir(parents=True)
    for step in (20, 40, 60, 80, 100, 120):  # what a long run wrote before: one per checkpoint
        run.orchestrator_state_at(step).write_text("{}")
    (run.orchestrator_state / "notes.txt").write_text("not a state")
    gone = run.prune_orchestrator_states(3)
    assert [p.name for p in gone] == ["step-20.json", "step-40.json", "step-60.json"]
    assert sorted(p.name for p in run.orchestrator_state.iterdir()) == [
        "notes.txt",
        "step-100.json",
        "step-120.json",
        "step-80.json",
    ]
