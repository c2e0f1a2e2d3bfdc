"""docs/tinker.md as a reader runs it: `skyrl tinker serve` on the built-in tinker recipe, over the
quickstart's model where the recipe looks for it (runs/quickstart/sft/final), then the page's SDK
script, unmodified, in a process of its own; and the page's recipe for a model of one's own."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.docs_blocks import DOCS, REPO, blocks
from tests.integration.cli_runs import ENV, SKYRL, children
from tests.integration.conftest import free_ports, wait_groups_gone

pytestmark = pytest.mark.integration
pytest.importorskip("tinker")

PAGE = DOCS / "tinker.md"
MARKER = ("run", "tests/integration/test_tinker_docs.py")
KEY = "tml-docs"


def page_blocks(lang: str) -> list[str]:
    found = [b.code for b in blocks(PAGE) if b.marker == MARKER and b.lang == lang]
    assert found, f"no {lang} block of {PAGE.name} is marked {MARKER}"
    return found


def quickstart_model(out: Path) -> Path:
    """The model `skyrl sft quickstart` writes to final/ before training changes its weights: the
    quickstart's model.init at its seed, with the character tokenizer of its task."""
    from backends.data.sft import load_source
    from backends.models.loading import load_model, load_tokenizer_for, save_hf
    from skyrl_cli.recipe.loader import load_recipe

    recipe = load_recipe(REPO / "recipes" / "quickstart.toml", ["data.train_size=1", "data.eval_size=1"])
    tokenizer = load_tokenizer_for(recipe.model, load_source(recipe.data, recipe.seed).alphabet())
    return save_hf(load_model(recipe.model, tokenizer, recipe.seed), tokenizer, out)


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A folder laid out as the checkout: recipes/tinker.toml (the built-in, as shipped) and the
    quickstart's SFT output in runs/, where the recipe's model.path points."""
    (tmp_path / "recipes").mkdir()
    shutil.copy(REPO / "recipes" / "tinker.toml", tmp_path / "recipes")
    quickstart_model(tmp_path / "runs" / "quickstart" / "sft" / "final")
    return tmp_path


def wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    """Until the server answers and the command has said where it serves (it says so once its own
    readiness poll has seen the server up: a moment after the first answer)."""
    deadline = time.monotonic() + timeout_s
    said = f"tinker: serving quickstart on {url}"
    while time.monotonic() < deadline:
        assert server.poll() is None, f"skyrl tinker serve ended ({server.returncode}):\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200 and said in log.read_text():
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"the server did not come up in {timeout_s} s:\n{log.read_text()[-3000:]}")


def test_the_sdk_script_trains_and_samples_on_the_builtin_recipe(checkout):
    (script,) = page_blocks("python")
    (checkout / "script.py").write_text(script)
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    log = checkout / "serve.log"
    with open(log, "w") as sink:
        server = subprocess.Popen(
            [str(SKYRL), "tinker", "serve", "recipes/tinker.toml", "--set", f"tinker.port={port}"],
            cwd=checkout,
            env={**ENV, "SKYRL_TINKER_API_KEYS": KEY},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(url, server, log)
        started = time.monotonic()
        run = subprocess.run(
            [sys.executable, "script.py"],
            cwd=checkout,
            env={**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": KEY},
            capture_output=True,
            text=True,
            timeout=600,
        )
        print(f"the script took {time.monotonic() - started:.1f} s:\n{run.stdout}")
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        # What the page shows it printing (the answers are the model's: here an untrained one's)
        lines = run.stdout.splitlines()
        assert re.fullmatch(r"before: \['.*', '.*'\]", lines[0]), lines
        assert [re.fullmatch(r"step (\d+): loss (\d+\.\d{3})", line).group(1) for line in lines[1:-1]] == [
            str(i) for i in range(8)
        ], lines
        assert re.fullmatch(r"after: \['.*', '.*'\]", lines[-1]), lines
        groups = children(server.pid)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)  # Ctrl-C, as the page says
            try:
                server.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    assert server.returncode == 130 and log.read_text().rstrip().endswith("interrupted (SIGINT)"), log.read_text()[
        -3000:
    ]
    assert len(groups) >= 3, groups  # engine, router, API server
    assert not wait_groups_gone([server.pid, *groups]), "processes left behind"
    assert (checkout / "runs" / "tinker" / "tinker" / "storage" / "tinker.sqlite").is_file()


def test_the_recipe_for_a_model_of_ones_own_validates(checkout):
    """The page's recipe, with a model in models/my-model next to it."""
    (recipe,) = page_blocks("toml")
    shutil.copytree(checkout / "runs" / "quickstart" / "sft" / "final", checkout / "models" / "my-model")
    (checkout / "tinker.toml").write_text(recipe)
    result = subprocess.run(
        [str(SKYRL), "tinker", "serve", "tinker.toml", "--dry-run", "--json"],
        cwd=checkout,
        env={**ENV, "SKYRL_TINKER_API_KEYS": KEY},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
