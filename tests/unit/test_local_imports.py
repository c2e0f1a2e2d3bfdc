"""A function-local import says why it is not at the top of its module (issue #42).

An import inside a function hides what its module depends on, so one stays there only where import
time needs it: a heavy package the light ``skyrl`` commands (or a worker's start-up laps) must not
pay for, an optional package only some runs use, a command's implementation that ``skyrl --help``
must not import. Each such import carries a ``# lazy: <reason>`` comment on its line or the line
above, or on the first line of its group of consecutive imports (or the line above that). Read
from the source: no product module is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("skyrl_cli", "backends", "skyrl_contracts")
MARK = "# lazy:"
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
IMPORTS = (ast.Import, ast.ImportFrom)


def local_imports(tree: ast.AST) -> list[tuple[ast.stmt, ast.stmt]]:
    """(import, first import of its group) for every import statement inside a function.

    A group: import statements that follow each other in one block, line after line."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            first = None
            for i, stmt in enumerate(block):
                if isinstance(stmt, IMPORTS):
                    prev = block[i - 1] if i else None
                    if first is None or not (isinstance(prev, IMPORTS) and prev.end_lineno + 1 == stmt.lineno):
                        first = stmt
                    if in_function:
                        found.append((stmt, first))
                else:
                    first = None
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(child, FUNCTIONS))

    visit(tree, False)
    return found


def unexplained(path: Path) -> list[int]:
    """Lines of ``path``'s function-local imports without a ``# lazy:`` reason."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()

    def marked(lineno: int) -> bool:  # the line itself or the one above
        return any(MARK in lines[n - 1] for n in (lineno, lineno - 1) if n >= 1)

    return [
        stmt.lineno
        for stmt, first in local_imports(ast.parse(text))
        if not (any(marked(n) for n in range(stmt.lineno, stmt.end_lineno + 1)) or marked(first.lineno))
    ]


def test_every_function_local_import_says_why():
    missing = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            missing += [f"{name}:{line}" for line in unexplained(path)]
    assert not missing, "function-local imports without a `# lazy: <reason>` comment:\n" + "\n".join(missing)


def test_the_check_sees_groups_and_reasons(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n"
        "def f():\n"
        "    # lazy: torch; skyrl --help stays light\n"
        "    import torch\n"
        "    import numpy\n"
        "\n"
        "    import json\n"
        "    if os.environ:\n"
        "        from vllm import LLM  # lazy: optional package\n"
        "    try:\n"
        "        import re\n"
        "    except ImportError:\n"
        "        pass\n"
        "    return lambda: __import__('x')\n",
        encoding="utf-8",
    )
    assert unexplained(source) == [7, 11]
