"""`skyrl runs` on a real shortened quickstart: one SFT run, then RL from it sync and --async,
listed, compared and reported; the HTML page is opened in headless Chromium, which must decode
every plot.

The SFT run and the sync RL run are the session's shared shortened quickstart (copied: 500 SFT
steps learn the two-digit sums and copy the teacher's flaw, then 10 sync RL steps,
``tests/integration/test_quickstart.py``); the --async run here, 8 steps from the same SFT model, so
the curves show learning. The --async run samples its first batches from version 0 while its
learner starts (up to rl.async.max_staleness ahead), so the check is that some held-out
evaluation rose, not the last.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.cli_runs import REPO, events, run_skyrl
from tests.integration.conftest import SHORTENED_QUICKSTART

pytestmark = pytest.mark.integration

RECIPE = REPO / "recipes" / "quickstart.toml"
ASYNC_RL = ["--set", "rl.steps=8", "--set", "rl.eval_every=4", "--set", "rl.save_every=0", "--async"]
PANELS = [
    "reward",
    "held-out accuracy",
    "loss",
    "KL",
    "logprob diff, trainer vs engine",
    "throughput (tokens/s)",
    "staleness (policy versions)",
    "engine KV cache use",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shortened_quickstart_sft, shortened_quickstart_rl) -> Path:
    """runs/sft and runs/sync (copies of the session's shortened quickstart), then runs/async from
    the SFT's final model."""
    root = tmp_path_factory.mktemp("runs")
    shutil.copytree(shortened_quickstart_sft, root / "sft")
    shutil.copytree(shortened_quickstart_rl, root / "sync")
    init = f"rl.init_from={root / 'sft' / 'final'}"
    run_skyrl(
        "rl",
        RECIPE,
        "--quiet",
        *SHORTENED_QUICKSTART,
        *ASYNC_RL,
        "--set",
        init,
        "--run-dir",
        root / "async",
        timeout=600,
    )
    return root


def test_the_runs_learned(runs):
    loss = [v for _, v in events(runs / "sft", "train/loss")]
    assert loss[-1] < loss[0] / 3, loss
    for name in ("sync", "async"):
        summary = json.loads((runs / name / "summary.json").read_text())
        assert summary["completed"] and summary["async"] is (name == "async")
        best = max(v for _, v in events(runs / name, "eval/accuracy"))
        assert best >= summary["eval_accuracy_initial"] + 0.05, (name, summary)


def test_ls_and_compare(runs):
    listed = [json.loads(line) for line in run_skyrl("runs", "ls", "--root", runs, "--json").stdout.splitlines()]
    assert sorted((Path(r["run"]).name, r["stage"], r["status"], r["steps"]) for r in listed) == [
        ("async", "rl", "done", 8),
        ("sft", "sft", "done", 500),
        ("sync", "rl", "done", 10),
    ]
    out = runs / "compare.png"
    compared = run_skyrl(
        "runs",
        "compare",
        "sync",
        "async",
        "--root",
        runs,
        "-m",
        "eval/accuracy",
        "-m",
        "rollout/reward_mean",
        "-o",
        out,
    )
    assert re.search(r"eval/accuracy\s*│\s*[\d.]+\s*│\s*[\d.]+", compared.stdout), compared.stdout
    assert png_size(out.read_bytes()) == (1200, 600)


def png_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.size


def drawn_share(data: bytes) -> float:
    """The share of pixels that are not the white background."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        gray = image.convert("L")
        histogram = gray.histogram()
        return 1 - sum(histogram[250:]) / (gray.width * gray.height)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        why = "Chromium is not installed (scripts/setup.sh installs it: apt-get install -y chromium)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return found


# Appended to a copy of the page (the report itself has no script): after load, the state of each
# image goes into the DOM that --dump-dom prints.
PROBE = """<script>window.addEventListener("load", () => {
  for (const img of document.images) img.setAttribute("data-decoded", img.complete + " " + img.naturalWidth + "x" + img.naturalHeight);
});</script>"""


def headless(browser: str, *args: str) -> subprocess.CompletedProcess:
    argv = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--virtual-time-budget=10000",
        *args,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_report_png_and_html_render_in_chromium(runs, tmp_path):
    out = runs / "report"
    run_skyrl("runs", "report", "sync", "async", "--root", runs, "--out", out)
    png = (out / "report.png").read_bytes()
    assert png_size(png) == (1200, 300 * len(PANELS)) and drawn_share(png) > 0.05

    page = (out / "report.html").read_text()
    assert "<script" not in page and not re.search(r"""(src|href)=["']?(https?:|//|file:)""", page)  # nothing to fetch
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    browser = chromium()
    dom = headless(browser, "--dump-dom", probed.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    decoded = re.findall(r'<img class="plot" alt="([^"]+)"[^>]*data-decoded="([^"]+)"', dom.stdout)
    assert decoded == [(alt, "true 1200x300") for alt in PANELS], dom.stdout[:2000]

    shot = tmp_path / "page.png"
    taken = headless(browser, f"--screenshot={shot}", "--window-size=1300,2000", (out / "report.html").as_uri())
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    assert drawn_share(shot.read_bytes()) > 0.05  # tables and plots, not a blank page
