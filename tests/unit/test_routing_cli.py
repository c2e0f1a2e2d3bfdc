"""`skyrl bench routing` end to end on a tiny simulated workload (tables, --json, --plot, bad input)."""

import json

import pytest

from skyrl_cli.app import main

TINY = [
    "bench",
    "routing",
    "--replicas",
    "2",
    "--trajectories",
    "16",
    "--groups-per-step",
    "2",
    "--turns",
    "4",
    "--steps",
    "2",
    "--trainer-step-s",
    "5",
    "--repeats",
    "1",
]


def run(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as exit_:
        code = exit_.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_per_pressure_level(capsys):
    code, out, _ = run(TINY + ["--pressure", "low,0.6", "--policies", "consistent_hash,sticky_least_loaded"], capsys)
    assert code == 0
    assert "KV pressure low" in out and "KV pressure 0.6" in out
    assert "sticky_least_loaded" in out and "vs CH" in out


def test_json_and_plot(capsys, tmp_path):
    png = tmp_path / "routing.png"
    code, out, _ = run(TINY + ["--json", "--plot", str(png)], capsys)
    assert code == 0
    report = json.loads(out)
    results = report["results"]
    assert {r["pressure"] for r in results} == {"low", "moderate", "high"}
    assert {r["policy"] for r in results} == set(report["config"]["policies"])
    for r in results:
        assert r["metrics"]["gen_tokens_per_s"] > 0 and 0 <= r["metrics"]["prefix_hit_rate"] <= 1
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "flag, value, message",
    [("--pressure", "extreme", "unknown pressure level"), ("--policies", "fastest", "unknown routing policy")],
)
def test_bad_input_is_a_usage_error(capsys, flag, value, message):
    code, _, err = run(TINY + [flag, value], capsys)
    assert code == 2 and message in err
