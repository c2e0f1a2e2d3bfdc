"""Imports follow where code runs (README, "Development"); read from the source, no import needed.

- ``skyrl_contracts`` (what both sides import: the recipe schema, the run directory, atomic files,
  events, health checks, the exchange, errors, ports, the engines' names) imports only the standard
  library, pydantic and itself;
- ``backends`` (the launched processes) imports nothing of ``skyrl_cli``;
- ``skyrl_cli`` (the command and its driver) reaches the workers by starting them: it imports from
  ``backends`` only the named light modules of ``DRIVER_MAY_IMPORT``;
- inside the driver, imports point down: the recipe layer does not import the plan, launch or
  command layers, and so on (``DRIVER_LAYERS``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# httpx only: the engines' admin client, which the orchestrator syncs weights with and the driver's
# engine recovery brings a restarted engine up to date with.
DRIVER_MAY_IMPORT = {"backends.inference.weight_sync"}
CONTRACT_THIRD_PARTY = {"pydantic"}
# Each package and the packages it may not import. ``skyrl_cli.stages`` (how a stage runs: on this
# machine, on an engine pool, across nodes, under Slurm) sits above the engines and below the
# commands, which parse options and call it.
DRIVER_LAYERS = [
    (
        "skyrl_cli.recipe",
        (
            "skyrl_cli.plan",
            "skyrl_cli.launch",
            "skyrl_cli.engines",
            "skyrl_cli.stages",
            "skyrl_cli.commands",
            "skyrl_cli.app",
        ),
    ),
    (
        "skyrl_cli.plan",
        ("skyrl_cli.launch", "skyrl_cli.engines", "skyrl_cli.stages", "skyrl_cli.commands", "skyrl_cli.app"),
    ),
    (
        "skyrl_cli.metrics",
        ("skyrl_cli.plan", "skyrl_cli.launch", "skyrl_cli.stages", "skyrl_cli.commands", "skyrl_cli.app"),
    ),
    ("skyrl_cli.launch", ("skyrl_cli.engines", "skyrl_cli.stages", "skyrl_cli.commands", "skyrl_cli.app")),
    ("skyrl_cli.engines", ("skyrl_cli.stages", "skyrl_cli.commands", "skyrl_cli.app")),
    ("skyrl_cli.routing", ("skyrl_cli.stages", "skyrl_cli.commands", "skyrl_cli.app")),
    ("skyrl_cli.stages", ("skyrl_cli.commands", "skyrl_cli.app")),
]


def imported(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports, at any depth (function-local imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def imports_of(root: Path, package: str) -> list[tuple[str, str]]:
    """(importing file, imported name) for every module of ``package`` under ``root``."""
    found = []
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        found += [(str(path.relative_to(root)), name) for name in sorted(imported(path))]
    return found


def layering_violations(root: Path) -> list[str]:
    bad = []
    for where, name in imports_of(root, "skyrl_contracts"):
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top not in CONTRACT_THIRD_PARTY | {"skyrl_contracts", "__future__"}:
            bad.append(f"{where} imports {name} (contracts: the standard library and pydantic only)")
    bad += [
        f"{where} imports {name} (workers import only the contracts)"
        for where, name in imports_of(root, "backends")
        if within(name, "skyrl_cli")
    ]
    for where, name in imports_of(root, "skyrl_cli"):
        if within(name, "backends") and not any(within(name, m) or within(m, name) for m in DRIVER_MAY_IMPORT):
            bad.append(
                f"{where} imports {name} (the driver starts workers; it imports only {sorted(DRIVER_MAY_IMPORT)})"
            )
    for package, forbidden in DRIVER_LAYERS:
        bad += [
            f"{where} imports {name} ({package} is below it)"
            for where, name in imports_of(root, package)
            if any(within(name, f) for f in forbidden)
        ]
    return bad


def test_the_tree_keeps_the_layers():
    assert layering_violations(REPO) == []


def test_the_light_module_the_driver_may_import_is_light():
    for module in DRIVER_MAY_IMPORT:
        names = imported(REPO / (module.replace(".", "/") + ".py"))
        heavy = [n for n in names if n.split(".")[0] in ("torch", "transformers", "vllm", "deepspeed", "backends")]
        assert heavy == [], f"{module} must stay light: {heavy}"


@pytest.mark.parametrize(
    "path, source, complaint",
    [
        (
            "backends/train/x.py",
            "def f():\n    from skyrl_cli.launch.supervisor import Supervisor\n",
            "workers import only",
        ),
        ("skyrl_contracts/x.py", "import torch\n", "contracts: the standard library"),
        ("skyrl_cli/commands/x.py", "from backends.train.sft import main\n", "the driver starts workers"),
        ("skyrl_cli/plan/x.py", "from skyrl_cli.launch import supervisor\n", "skyrl_cli.plan is below it"),
    ],
)
def test_a_wrong_import_is_caught(tmp_path, path, source, complaint):
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(source)
    for package in ("skyrl_contracts", "backends", "skyrl_cli"):
        (tmp_path / package).mkdir(exist_ok=True)
    found = layering_violations(tmp_path)
    assert found and all(complaint in line and path in line for line in found), found


def test_an_allowed_import_is_not_flagged(tmp_path):
    for path, source in (
        ("skyrl_cli/engines/x.py", "from backends.inference.weight_sync import sync_weights\n"),
        ("backends/x.py", "from skyrl_contracts.rundir import RunDir\n"),
        ("skyrl_contracts/x.py", "import json\nfrom pydantic import BaseModel\n"),
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    assert layering_violations(tmp_path) == []


def test_every_stage_a_plan_names_has_a_planner():
    import typing

    from skyrl_cli.plan.build import STAGE_PLANNERS
    from skyrl_cli.plan.model import LaunchPlan

    assert set(typing.get_args(LaunchPlan.model_fields["stage"].annotation)) == set(STAGE_PLANNERS)
