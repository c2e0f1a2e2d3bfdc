"""Network faults: an engine that answers slowly or with 5xx (the fault proxy of tests/faults/proxy.py
between the router and a real engine, given as a remote engine in ``inference.urls``), the router's
retry and circuit-breaker settings from ``[inference.router]``, and a remote engine that is down at
start (a one-line error before anything starts).

    .venv/bin/python -m pytest -q -m faults tests/faults/test_network_faults.py
"""

from __future__ import annotations

import json

import pytest

from skyrl_contracts.ports import find_free_ports
from tests.faults.proxy import FaultProxy
from tests.faults.rl_runs import last_metric, run, tiny_rl_recipe
from tests.integration.cli_runs import REPO, run_skyrl

pytestmark = pytest.mark.faults


def _router_argv(*sets: str) -> list[str]:
    args = [a for s in sets for a in ("--set", s)]
    plan = json.loads(run_skyrl("rl", REPO / "recipes/quickstart.toml", "--dry-run", "--json", *args).stdout)
    (router,) = [p for p in plan["processes"] if p["role"] == "router"]
    return router["argv"]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_routers_retry_and_circuit_breaker_settings_reach_its_argv():
    argv = _router_argv()  # the defaults
    assert [
        _flag(argv, f)
        for f in (
            "--retry-max-retries",
            "--retry-initial-backoff-ms",
            "--retry-max-backoff-ms",
            "--cb-failure-threshold",
            "--cb-timeout-duration-secs",
        )
    ] == ["4", "100", "5000", "10", "10"]
    argv = _router_argv(
        "inference.router.retries=0",
        "inference.router.circuit_breaker_failures=0",
        "inference.router.retry_backoff_ms=20",
        "inference.router.retry_max_backoff_ms=40",
    )
    assert _flag(argv, "--retry-max-retries") == "1"  # vllm-router counts attempts: 1 is no retry
    assert "--disable-circuit-breaker" in argv and "--cb-failure-threshold" not in argv
    assert (_flag(argv, "--retry-initial-backoff-ms"), _flag(argv, "--retry-max-backoff-ms")) == ("20", "40")


def test_a_router_backoff_shorter_than_its_first_wait_is_a_recipe_error():
    proc = run_skyrl(
        "recipes", "validate", "quickstart", "--set", "inference.router.retry_max_backoff_ms=50", check=False
    )
    assert proc.returncode == 2
    assert proc.stderr.endswith(": inference.router: retry_max_backoff_ms (50) must be >= retry_backoff_ms (100)\n")
    assert proc.stderr.count("\n") == 1


def test_a_remote_engine_down_at_start_is_one_line_before_anything_starts(tmp_path):
    (port,) = find_free_ports(1)  # free now: nothing listens there
    url = f"http://127.0.0.1:{port}"
    recipe = tiny_rl_recipe(tmp_path, tmp_path / "no-model-needed", inference={"engines": 0, "urls": [url]})
    (tmp_path / "no-model-needed").mkdir()
    proc = run(recipe, check=False, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: inference.urls: the engine at {url} does not answer GET /health (ConnectError")
    assert not (tmp_path / "run").exists()  # no run directory: no engine, router or trainer was started


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One real engine serving the tiny model, started here (not by the run): the run reaches it
    through the proxy as a remote engine."""
    from tests.integration.conftest import build_tiny_model, inference_recipe, single_engine

    root = tmp_path_factory.mktemp("faults-engine")
    model = build_tiny_model(root / "model")
    with single_engine(inference_recipe(engines=1, max_num_seqs=16), model, root / "engine-run") as url:
        yield model, url


@pytest.mark.integration
def test_an_engine_answering_5xx_or_slowly_is_retried_and_the_run_finishes(tmp_path, engine):
    model, engine_url = engine
    # The router passes each failure on (retries = 0), so the rollout client's retries act and are counted.
    inference = {"engines": 0, "request_timeout_s": 5.0, "max_retries": 4, "router": {"retries": 0}}
    with FaultProxy(engine_url, fail_fraction=0.2, delay_fraction=0.1, delay_s=7.0, seed=1) as proxy:
        recipe = tiny_rl_recipe(tmp_path, model, inference={**inference, "urls": [proxy.url]})
        proc = run(recipe, timeout=600)
    run_dir = tmp_path / "run"
    assert "rl done:" in proc.stdout and "Traceback" not in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completed"] is True and summary["steps"] == 2
    assert proxy.failed >= 3 and proxy.delayed >= 1 and proxy.forwarded > 0, vars(proxy)
    retries = last_metric(run_dir, "rollout/retries")
    print(
        f"\nproxy: {proxy.failed} x 503, {proxy.delayed} delayed, {proxy.forwarded} forwarded; rollout/retries {retries}"
    )
    assert retries is not None and retries >= 3
    assert summary["metrics"]["rollout/retries"] == retries
    log = (run_dir / "logs/orchestrator.log").read_text()
    assert "HTTP 503: injected fault" in log and "ReadTimeout" in log


async def _failed_requests(router_url: str, n: int) -> int:
    """Of ``n`` one-token generations through the router, how many came back failed (the client
    does not retry here, so the router's retries are all there is)."""
    from backends.rollout.client import RolloutClient, RolloutError

    failed = 0
    async with RolloutClient(router_url, max_retries=0, timeout_s=30) as client:
        for i in range(n):
            try:
                await client.generate([5, 6, 7], f"s{i}", max_tokens=1, temperature=0.0)
            except RolloutError:
                failed += 1
    return failed


@pytest.mark.integration
@pytest.mark.parametrize("retries", [0, 3])
def test_the_router_retries_5xx_itself_as_inference_router_retries_says(tmp_path, engine, retries):
    """vllm-router, started with the plan's argv, in front of the proxy: with ``retries = 3`` it
    absorbs the injected 503s (a request fails only if 4 attempts in a row do); with 0 each one
    reaches the client."""
    import asyncio
    import subprocess
    import time

    import httpx

    from skyrl_cli.plan.inference import router_spec
    from tests.integration.conftest import cpu_machine, inference_recipe

    _, engine_url = engine
    recipe = inference_recipe(
        engines=0, urls=("http://unused:1",), router={"retries": retries, "circuit_breaker_failures": 0}
    )
    with FaultProxy(engine_url, fail_fraction=0.3, seed=retries) as proxy:
        port, prometheus = find_free_ports(2)
        spec = router_spec(recipe, cpu_machine(), [proxy.url], port, prometheus)
        with open(tmp_path / "router.log", "w") as log:
            router = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/liveness", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert router.poll() is None, (tmp_path / "router.log").read_text()
                time.sleep(0.1)
            failed = asyncio.run(_failed_requests(url, 30))
        finally:
            router.terminate()
            router.wait(timeout=10)
    print(f"\nrouter retries={retries}: {proxy.failed} x 503 injected, {failed} of 30 requests failed at the client")
    assert proxy.failed >= 3, vars(proxy)
    if retries == 0:
        assert failed == proxy.failed
    else:
        assert failed <= 1 and proxy.forwarded >= 30
