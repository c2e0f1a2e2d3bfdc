"""`skyrl runs ls|show|compare|report` on small run directories written the way runs write them
(RunDir.prepare, the metrics EventWriter, write_summary)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import time
from pathlib import Path

import pytest

from skyrl_cli.metrics.summary import write_summary
from skyrl_contracts.events import EventWriter
from skyrl_contracts.rundir import RunDir

from .conftest import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(
    path: Path,
    *,
    steps: int = 6,
    start: float = 1_000_000.0,
    ended: dict | None = None,
    reward_gain: float = 0.1,
    stage: str = "rl",
) -> Path:
    """A run of ``steps`` steps: trainer and orchestrator events, and summary.json when ``ended``."""
    from skyrl_cli.recipe.loader import load_recipe

    run = RunDir(path).prepare(
        load_recipe(REPO / "recipes" / "quickstart.toml"),
        {
            "stage": stage,
            "device": "cpu",
            "processes": [
                {"name": "engine-0", "role": "engine", "argv": ["serve"], "devices": ["cpu:0"], "ports": [12345]}
            ],
        },
    )
    with EventWriter(run.events, "trainer") as trainer, EventWriter(run.events, "orchestrator") as orchestrator:
        for step in range(1, steps + 1):
            now = start + 2.0 * step
            orchestrator.log(
                step, {"rollout/reward_mean": 0.2 + reward_gain * step, "async/staleness_mean": 0.5}, now=now
            )
            trainer.log(
                step,
                {"train/policy_loss": 1.0 / step, "train/tokens_per_s": 100.0 * step, "async/staleness_mean": 1.0},
                now=now + 1,
            )
            if step % 2 == 0:
                trainer.log(step, {"eval/accuracy": 0.1 * step}, now=now + 1.5)
    if ended is not None:
        write_summary(path, {"stage": stage, "wall_s": 30.0, **ended})
    return path


@pytest.fixture
def runs_root(tmp_path) -> Path:
    root = tmp_path / "runs"
    make_run(root / "quickstart" / "rl", ended={"completed": True})
    make_run(root / "other" / "rl", steps=3, ended={"completed": False, "interrupted": "SIGINT"})
    live = make_run(root / "live" / "rl", steps=2, start=time.time() - 10)  # no summary yet, events just now
    assert not RunDir(live).summary.exists()
    return root


def test_ls_lists_every_run_with_status_steps_and_final_figures(skyrl, runs_root, monkeypatch):
    old = make_run(runs_root / "crashed" / "sft", steps=2, stage="sft")  # no summary, events long ago
    os.utime(RunDir(old).events, (time.time() - 3600, time.time() - 3600))
    resumed = make_run(runs_root / "resumed" / "rl", ended={"completed": True})  # then continued with --resume:
    summary = json.loads(RunDir(resumed).summary.read_text())
    RunDir(resumed).summary.write_text(json.dumps({**summary, "time": 1_000_100.0}))  # the first launch's
    with EventWriter(RunDir(resumed).events, "trainer") as trainer:
        trainer.log(7, {"train/policy_loss": 0.1}, now=time.time())
    monkeypatch.setenv("COLUMNS", "200")
    result = skyrl("runs", "ls", "--root", runs_root)
    assert result.code == 0, result.err
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in result.out.splitlines()
        if "/rl " in line or "/sft " in line
    }
    assert rows["quickstart/rl"] == ["quickstart", "rl", "done", "6", "30", "0.6", "0.8", "0.1667"]
    assert rows["other/rl"][2:4] == ["interrupted (SIGINT)", "3"]
    assert rows["live/rl"][2:4] == ["running", "2"]
    assert rows["crashed/sft"][1:4] == ["sft", "unfinished", "2"]  # stage from plan.json
    assert rows["resumed/rl"][2:4] == ["running", "7"]


def test_ls_keeps_run_names_whole_in_80_columns(skyrl, runs_root, monkeypatch):
    make_run(runs_root / "a-much-longer-experiment-name" / "rl", ended={"completed": True})
    monkeypatch.setenv("COLUMNS", "80")
    result = skyrl("runs", "ls", "--root", runs_root)
    assert result.code == 0, result.err
    assert max(len(line) for line in result.out.splitlines()) <= 80
    first_cells = [line.split("│")[1].strip() for line in result.out.splitlines() if line.count("│") > 2]
    for run in ("quickstart/rl", "other/rl", "live/rl", "a-much-longer-experiment-name/rl"):
        assert run in first_cells, (run, result.out)


def test_ls_json_and_an_empty_folder(skyrl, runs_root, tmp_path):
    records = [json.loads(line) for line in skyrl("runs", "ls", "--root", runs_root, "--json").out.splitlines()]
    by_run = {Path(r["run"]).parent.name: r for r in records}
    assert set(by_run) == {"quickstart", "other", "live"}
    assert by_run["quickstart"]["metrics"] == {
        "accuracy": pytest.approx(0.6),
        "reward": pytest.approx(0.8),
        "loss": pytest.approx(1 / 6),
    }
    assert by_run["live"]["status"] == "running" and by_run["live"]["wall_s"] == pytest.approx(3.5)
    empty = skyrl("runs", "ls", "--root", tmp_path / "nothing")
    assert empty.code == 0 and "no runs under" in empty.out


def test_show_prints_the_recipe_plan_and_figures(skyrl, runs_root, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    result = skyrl("runs", "show", "quickstart", "--root", runs_root)  # one run under runs/quickstart/
    assert result.code == 0, result.err
    assert "quickstart rl, done, 6 steps, 30 s" in result.out
    assert 'name = "quickstart"' in result.out and "[rl]" in result.out  # the resolved recipe, as TOML
    assert re.search(r"engine-0\s*│\s*engine\s*│\s*cpu:0\s*│\s*12345", result.out)
    assert re.search(r"rollout/reward_mean\s*│\s*0\.8\b", result.out)


def test_a_run_argument_that_names_nothing_or_several(skyrl, runs_root):
    missing = skyrl("runs", "show", "nowhere", "--root", runs_root)
    assert missing.code == 2
    assert (
        missing.err
        == f"error: no run directory at nowhere (nor under {runs_root}/); `skyrl runs ls` lists the runs under {runs_root}/\n"
    )
    several = skyrl("runs", "show", str(runs_root))
    assert several.code == 2 and "holds 3 runs" in several.err and "name one of them" in several.err


def png_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.size


def test_compare_prints_final_figures_and_writes_overlaid_curves(skyrl, runs_root, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    b = make_run(tmp_path / "b" / "rl", ended={"completed": True}, reward_gain=0.05)
    out = tmp_path / "cmp.png"
    result = skyrl(
        "runs",
        "compare",
        "quickstart/rl",
        b,
        "-m",
        "rollout/reward_mean",
        "-m",
        "train/policy_loss",
        "-o",
        out,
        "--root",
        runs_root,
    )
    assert result.code == 0, result.err
    assert re.search(r"rollout/reward_mean\s*│\s*0\.8\s*│\s*0\.5\b", result.out)  # the two runs' last values
    assert re.search(r"train/policy_loss\s*│\s*0\.1667\s*│\s*0\.1667", result.out)
    assert "eval/accuracy" not in result.out  # only the chosen metrics
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and png_size(data) == (1200, 600)  # two panels, step and wall time each


def test_compare_refuses_an_unknown_metric_and_a_single_run(skyrl, runs_root):
    typo = skyrl("runs", "compare", "quickstart/rl", "other/rl", "-m", "rollout/reward_men", "--root", runs_root)
    assert (
        typo.code == 2
        and typo.err == "error: --metric 'rollout/reward_men': no run logged it; did you mean 'rollout/reward_mean'?\n"
    )
    one = skyrl("runs", "compare", "quickstart/rl", "--root", runs_root)
    assert one.code == 2 and "needs two runs or more" in one.err


def test_report_writes_a_png_and_a_self_contained_html_page(skyrl, runs_root):
    result = skyrl("runs", "report", "quickstart/rl", "live/rl", "--root", runs_root)  # a run in progress too
    assert result.code == 0, result.err
    folder = RunDir(runs_root / "quickstart" / "rl").report
    assert result.out == f"wrote {folder / 'report.png'}\nwrote {folder / 'report.html'}\n"
    png = (folder / "report.png").read_bytes()
    # reward, accuracy, loss, throughput, staleness: 5 panels of 300 px, no KL / logprob / KV data here
    assert png.startswith(PNG_MAGIC) and png_size(png) == (1200, 1500)
    page = (folder / "report.html").read_text()
    assert "<script" not in page and not re.search(r"""(src|href)=["']?(https?:|//|file:)""", page)
    images = re.findall(r'<img class="plot" alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert [alt for alt, _ in images] == [
        "reward",
        "held-out accuracy",
        "loss",
        "throughput (tokens/s)",
        "staleness (policy versions)",
    ]
    assert all(png_size(base64.b64decode(data)) == (1200, 300) for _, data in images)
    assert "<td>quickstart/rl</td>" in page and "<td>live/rl</td>" in page and "<td>running</td>" in page


def test_report_of_a_run_without_events_yet(skyrl, tmp_path):
    from skyrl_cli.recipe.loader import load_recipe

    run = RunDir(tmp_path / "fresh").prepare(load_recipe(REPO / "recipes" / "quickstart.toml"))
    result = skyrl("runs", "report", run.root, "--out", tmp_path / "out")
    assert result.code == 0, result.err
    assert "no metric events yet" in (tmp_path / "out" / "report.html").read_text()
    assert (tmp_path / "out" / "report.png").read_bytes().startswith(PNG_MAGIC)


def test_curves_average_a_step_and_name_the_process_of_a_shared_metric(runs_root):
    from skyrl_cli.runview.curves import REPORT_PANELS, curves_of, load_curves, panel_curves
    from skyrl_contracts.events import MetricEvent

    (curve,) = curves_of(
        [MetricEvent(10.0, 1, "inference", "engine/kv_cache_usage", v) for v in (0.2, 0.4)]
        + [MetricEvent(12.0, 2, "inference", "engine/kv_cache_usage", 0.9)]
    )["engine/kv_cache_usage"]
    assert curve.by_step() == ([1, 2], [pytest.approx(0.3), 0.9]) and curve.times == [0.0, 0.0, 2.0]
    staleness = next(p for p in REPORT_PANELS if p.names[0] == "async/staleness_mean")
    labels = [label for label, _ in panel_curves(staleness, load_curves(runs_root / "quickstart" / "rl"))]
    assert labels == ["async/staleness_mean [orchestrator]", "async/staleness_mean [trainer]"]
