"""`skyrl completions SHELL`: the shell completion script for bash, zsh or fish.

The scripts are small and dynamic (they ask ``skyrl`` itself for candidates through the
``_SKYRL_COMPLETE`` variable), so new commands complete without regenerating them. The committed
copies in ``completions/`` are written by ``python -m skyrl_cli.commands.completions --write completions/``
and a test fails when they are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer._completion_classes import completion_init
from typer._completion_shared import get_completion_script

from skyrl_contracts.errors import UsageError

PROG = "skyrl"
COMPLETE_VAR = "_SKYRL_COMPLETE"
# File name of each shell's script, as the shells' completion directories expect it.
FILES = {"bash": "skyrl.bash", "zsh": "_skyrl", "fish": "skyrl.fish"}


def completion_script(shell: str) -> str:
    return get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell) + "\n"


def write_scripts(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for shell, name in FILES.items():
        path = directory / name
        path.write_text(completion_script(shell), encoding="utf-8")
        written.append(path)
    return written


def register(app: typer.Typer) -> None:
    # Typer registers its shell classes only with add_completion=True; the root turns that off (no
    # --install-completion noise), so register them here for `_SKYRL_COMPLETE=complete_<shell>`.
    completion_init()

    @app.command("completions")
    def completions(
        shell: Annotated[str, typer.Argument(help="bash, zsh or fish.", metavar="SHELL")],
    ) -> None:
        """Print the completion script for SHELL, e.g. `skyrl completions bash > ~/.local/share/bash-completion/completions/skyrl`."""
        if shell not in FILES:
            raise UsageError(f"unknown shell {shell!r}; choose one of {', '.join(FILES)}")
        typer.echo(completion_script(shell), nl=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the shell completion scripts of skyrl.")
    parser.add_argument("--write", type=Path, required=True, metavar="DIR", help="Directory for the scripts.")
    args = parser.parse_args(argv)
    for path in write_scripts(args.write):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
