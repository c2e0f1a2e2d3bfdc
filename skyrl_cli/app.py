"""The Typer root: wiring only, and the one place errors become exit codes and messages.

Each command lives in ``skyrl_cli/commands/<name>.py`` and exposes ``register(app)``. Command modules
import nothing heavy at module level, so ``skyrl --help`` stays fast.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from skyrl_cli import __version__
from skyrl_cli.launch.interrupts import Interrupted, stop_signals_raise
from skyrl_contracts.errors import SkyrlError

COMMAND_MODULES = ("recipes", "completions", "sft", "rl", "quantize", "engines", "bench", "tinker", "runs", "doctor")


def _flags_without_a_type(display_type_rich):
    """typer 0.29's help labels every flag ``<bool>``, a value a flag never takes (``--help <bool>``
    was the first line a user read)."""

    def display(self, ctx):
        return None if self.is_flag else display_type_rich(self, ctx)

    return display


if hasattr(typer.core.TyperOption, "display_type_rich"):  # typer before 0.29 shows no type for flags
    typer.core.TyperOption.display_type_rich = _flags_without_a_type(typer.core.TyperOption.display_type_rich)

app = typer.Typer(
    name="skyrl",
    help="Post-train LLMs from one TOML recipe: SFT, fully-async RL on vLLM + vllm-router, DeepSpeed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"skyrl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """skyrl: declarative post-training from one TOML recipe."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"skyrl_cli.commands.{_name}").register(app)


def _debug() -> bool:
    return os.environ.get("SKYRL_DEBUG", "") not in ("", "0", "false")


def _is_click_exception(err: BaseException) -> bool:
    """A click usage error, from click itself or from the copy of click that typer 0.29+ vendors
    (``typer._click``): a second class of the same name that ``click.ClickException`` does not
    catch. With only the first, every usage error of a fresh install became an "internal error"."""
    return any(cls.__name__ == "ClickException" for cls in type(err).__mro__) and hasattr(err, "show")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app and map failures to messages and exit codes."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with stop_signals_raise():  # Ctrl-C / SIGTERM / SIGHUP: one behaviour for every command
            code = app(args=args, standalone_mode=False)
    except SkyrlError as err:
        if _debug():
            raise
        for line in str(err).splitlines() or [type(err).__name__]:
            print(f"{err.prefix}{line}", file=sys.stderr)
        sys.exit(err.exit_code)
    except Interrupted as stop:  # outside a run (a run reports RunInterrupted)
        print(f"interrupted ({stop})", file=sys.stderr)
        sys.exit(stop.exit_code)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:
        if _is_click_exception(err):  # a usage error: click's own message and exit code (2)
            err.show()
            sys.exit(err.exit_code)
        if _debug():
            raise
        print(
            f"error: internal error: {type(err).__name__}: {err} (set SKYRL_DEBUG=1 for a traceback)", file=sys.stderr
        )
        sys.exit(1)
    # Without standalone mode Typer *returns* the code of a typer.Exit (and of a KeyboardInterrupt,
    # as 130) instead of exiting: ignoring it made an interrupted run exit 0.
    if isinstance(code, int) and code:
        sys.exit(code)
    if not args:  # the help of a bare `skyrl` is a usage error: click 8.2+ raises it, click 8.1 returned 0
        sys.exit(2)


if __name__ == "__main__":
    main()
