"""The documentation site builds strictly, and every command, recipe and Python example on its
pages (and in the README) runs or validates as written (conventions: ``tests/docs_blocks.py``)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import tomli_w

from tests.docs_blocks import REPO, Block, all_blocks, command_lines

from .conftest import Result

BLOCKS = all_blocks()
SHELL = ("bash", "console", "sh", "shell")
# skyrl commands run as written: cheap, no servers, no long jobs.
RUN_AS_WRITTEN = {("recipes", "ls"), ("recipes", "show"), ("recipes", "validate"), ("recipes", "schema")}
DRY_RUN = {"sft", "rl", "quantize"}
SHELL_WORDS = {"cd", "export", "pip", "git", "uv", "mkdocs", "curl", "source", "cat", "ls", "tail", "watch", "kill"}


def ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


def _of(langs: tuple[str, ...]) -> list[Block]:
    return [b for b in BLOCKS if b.lang in langs and (b.marker is None or b.marker[0] != "run")]


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--quiet", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").is_file()


def test_the_key_reference_names_every_schema_key():
    from skyrl_cli.recipe.keys import toml_key
    from skyrl_cli.recipe.reference import markdown_reference, tables

    text = markdown_reference()
    for table, model in tables():
        for name in model.model_fields:
            key = f"{table}.{toml_key(model, name)}" if table else toml_key(model, name)
            assert f"| `{key}` |" in text, key


# ------------------------------------------------------------------------------------------ recipes


def _deep_merge(base: dict, fragment: dict) -> dict:
    merged = dict(base)
    for key, value in fragment.items():
        merged[key] = (
            _deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


@pytest.mark.parametrize("block", _of(("toml",)), ids=ids(_of(("toml",))))
def test_recipe_blocks_validate(block):
    from skyrl_cli.commands.common import load_for_run
    from skyrl_cli.recipe.registry import builtin_path

    data = tomllib.loads(block.code)
    base = block.option("based-on")
    if base:
        data = _deep_merge(tomllib.loads(builtin_path(base).read_text()), data)
        folder = builtin_path(base).parent
    else:
        folder = REPO / (block.option("in") or "recipes")
    probe = folder / f".docs-check-{os.getpid()}.toml"
    probe.write_text(tomli_w.dumps(data))
    try:
        load_for_run(str(probe), None, stage=None, gpu_count=int(block.option("gpus") or 0))
    finally:
        probe.unlink()


# ----------------------------------------------------------------------------------------- commands


def _parse_only(args: list[str]) -> None:
    """The real CLI's parser on ``args`` (unknown options, missing arguments, bad choices fail)."""
    from typer.main import get_command

    from skyrl_cli.app import app

    command, name, ctx = get_command(app), "skyrl", None
    while True:
        ctx = command.make_context(name, list(args), parent=ctx)
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not hasattr(command, "resolve_command") or not rest:
            return
        name, command, args = command.resolve_command(ctx, rest)


def _recipe_exists(arg: str) -> bool:
    from skyrl_cli.recipe.registry import builtin_recipes

    return (REPO / arg).is_file() or arg in {r.name for r in builtin_recipes()}


def _check_skyrl(args: list[str], skyrl, where: str) -> None:
    words = [a for a in args if not a.startswith("-")]
    if "--help" in args or "--version" in args or tuple(words[:2]) in RUN_AS_WRITTEN:
        result: Result = skyrl(*args)
        assert result.code == 0, f"{where}: skyrl {shlex.join(args)}: {result.err[-1500:]}"
    elif args[0] in DRY_RUN and len(words) > 1 and _recipe_exists(words[1]):
        extra = [] if "--dry-run" in args else ["--dry-run"]
        result = skyrl(*args, *extra)
        assert result.code == 0, f"{where}: skyrl {shlex.join(args)} --dry-run: {result.err[-1500:]}"
    else:
        try:
            _parse_only(args)
        except Exception as err:  # click's usage errors, from click or typer's vendored copy
            pytest.fail(f"{where}: skyrl {shlex.join(args)}: {type(err).__name__}: {err}")


def _check_other(words: list[str], where: str) -> None:
    """Scripts and files a command names must exist."""
    if words[0] in SHELL_WORDS:
        return
    if words[0] in ("python", "python3", ".venv/bin/python", "bash"):
        words = words[1:]
        if not words or words[0].startswith("-"):
            return
    target = words[0]
    if "/" in target or target.endswith((".py", ".sh")):
        assert (REPO / target).exists(), f"{where}: {target} does not exist"


def _without_redirections(words: list[str]) -> list[str]:
    """``skyrl recipes schema > out.json`` -> ``skyrl recipes schema`` (``>f``, ``> f``, ``2>&1``)."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in (">", ">>", "2>", "&>", "<"):
            skip = True
        elif not word.startswith((">", "2>", "&>", "<")):
            out.append(word)
    return out


def _commands(line: str) -> list[list[str]]:
    """``a && b | c > f`` -> the commands ``a`` and ``b`` (after a pipe: filters; redirections dropped)."""
    out = []
    for part in line.replace("&&", ";").split(";"):
        part = part.split("|")[0]
        words = _without_redirections(shlex.split(part, comments=True))
        while words and "=" in words[0] and not words[0].startswith(("-", "/")):
            words = words[1:]  # FOO=bar before the command
        if words:
            out.append(words)
    return out


@pytest.mark.parametrize("block", _of(SHELL), ids=ids(_of(SHELL)))
def test_command_blocks_run_or_parse(block, skyrl):
    for line in command_lines(block.code):
        for words in _commands(line):
            if words[0] in ("skyrl", ".venv/bin/skyrl"):
                _check_skyrl(words[1:], skyrl, block.where)
            else:
                _check_other(words, block.where)


# ------------------------------------------------------------------------------------------- python


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", _of(("python",)), ids=ids(_of(("python",))))
def test_python_blocks_run(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = types.ModuleType(f"docs_example_{block.line}")
    exec(compile(block.code, block.where, "exec"), module.__dict__)


@pytest.mark.parametrize(
    "block",
    [b for b in BLOCKS if b.marker and b.marker[0] == "run"],
    ids=ids([b for b in BLOCKS if b.marker and b.marker[0] == "run"]),
)
def test_blocks_run_by_a_named_test_have_one(block):
    test = REPO / block.marker[1]
    assert test.is_file(), f"{block.where}: {block.marker[1]} does not exist"
    assert block.page.name in test.read_text(), f"{block.where}: {block.marker[1]} does not read {block.page.name}"
