"""Imports point down the layers (README, "Development"): read from the source, no import needed.

- backends import from ``skyrl_cli`` only its contract modules (the recipe schema, metric events
  and run-health checks, errors, atomic files, the run directory, free ports), never its commands, plan or launch;
- the contract modules import nothing of skyrl beyond each other;
- the recipe layer does not import the plan, launch or command layers; the plan layer does not
  import launch or commands; the metrics layer does not import plan, launch or commands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = {
    "skyrl_cli.recipe.schema", "skyrl_cli.metrics.events", "skyrl_cli.errors", "skyrl_cli.atomic",
    "skyrl_cli.rundir", "skyrl_cli.ports", "skyrl_cli.metrics.health",
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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


def sources(package: str) -> list[Path]:
    return sorted((REPO / package.replace(".", "/")).rglob("*.py"))


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offending(package: str, allowed) -> list[str]:
    found = []
    for path in sources(package):
        for name in sorted(imported(path)):
            if within(name, "skyrl_cli") and not allowed(name):
                found.append(f"{module_name(path)} imports {name}")
    return found


def is_contract(name: str) -> bool:
    # ``from skyrl_cli.recipe.schema import Recipe`` shows up as both the module and module.Recipe.
    return any(within(name, c) for c in CONTRACTS) or name in ("skyrl_cli", "skyrl_cli.recipe", "skyrl_cli.metrics")


def test_backends_import_only_the_contract_modules():
    assert offending("backends", is_contract) == []


def test_contract_modules_import_only_each_other():
    found = []
    for contract in CONTRACTS:
        path = REPO / (contract.replace(".", "/") + ".py")
        found += [f"{contract} imports {n}" for n in sorted(imported(path)) if within(n, "skyrl_cli") and not is_contract(n)]
        found += [f"{contract} imports {n}" for n in sorted(imported(path)) if within(n, "backends")]
    assert found == []


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("skyrl_cli.recipe", ("skyrl_cli.plan", "skyrl_cli.launch", "skyrl_cli.commands", "skyrl_cli.app")),
        ("skyrl_cli.plan", ("skyrl_cli.launch", "skyrl_cli.commands", "skyrl_cli.app")),
        ("skyrl_cli.metrics", ("skyrl_cli.plan", "skyrl_cli.launch", "skyrl_cli.commands", "skyrl_cli.app")),
        ("skyrl_cli.launch", ("skyrl_cli.commands", "skyrl_cli.app")),
    ],
)
def test_cli_layers_point_down(package, forbidden):
    assert offending(package, lambda name: not any(within(name, f) for f in forbidden)) == []


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    # The checks above pass on an empty set too: prove the walk finds a function-local import.
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from skyrl_cli.launch.supervisor import Supervisor\n")
    assert "skyrl_cli.launch.supervisor" in imported(source)


def test_every_stage_a_plan_names_has_a_planner():
    import typing

    from skyrl_cli.plan.build import STAGE_PLANNERS
    from skyrl_cli.plan.model import LaunchPlan

    assert set(typing.get_args(LaunchPlan.model_fields["stage"].annotation)) == set(STAGE_PLANNERS)


MAX_FUNCTION_LINES = 60


def test_no_function_is_longer_than_60_lines():
    """Small functions with names that explain themselves (nested ones count on their own)."""
    long = []
    for package in ("skyrl_cli", "backends"):
        for path in sources(package):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{module_name(path)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
