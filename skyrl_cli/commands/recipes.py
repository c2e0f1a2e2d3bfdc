"""`skyrl recipes ...`: list, show, copy, validate and export the schema of recipes."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    sub = typer.Typer(help="Built-in recipes and recipe validation.", no_args_is_help=True)

    @sub.command("ls")
    def ls() -> None:
        """List the built-in recipes."""
        typer.echo("(no built-in recipes yet)")

    app.add_typer(sub, name="recipes")
