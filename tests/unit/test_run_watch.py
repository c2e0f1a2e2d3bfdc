"""benchmarks/run_watch.py's pure parts: the work directory a benchmark writes its runs into is
removed at the end unless the user named it, and the command line it drives ``skyrl rl`` with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from run_watch import rl_argv, work_dir  # noqa: E402


def test_a_temporary_work_dir_is_removed_even_when_the_benchmark_fails():
    with pytest.raises(RuntimeError):
        with work_dir(None, "skyrl-test-") as out:
            (out / "weights").mkdir()
            (out / "weights" / "v1.bin").write_bytes(b"x" * 1024)
            raise RuntimeError("the run died")
    assert not out.exists()


def test_a_named_work_dir_is_created_and_kept(tmp_path):
    named = tmp_path / "runs" / "here"
    with work_dir(named, "skyrl-test-") as out:
        (out / "kept.json").write_text("{}")
    assert out == named and (named / "kept.json").is_file()


def test_rl_argv_sets_each_override():
    argv = rl_argv("skyrl", Path("r.toml"), Path("/tmp/run"), ["a.b=1", "c=2"])
    assert argv[:3] == ["skyrl", "rl", "r.toml"]
    assert argv[argv.index("--run-dir") + 1] == "/tmp/run"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--set"] == ["a.b=1", "c=2"]
