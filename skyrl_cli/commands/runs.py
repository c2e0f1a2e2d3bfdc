"""`skyrl runs ls|show|compare|report`: look at runs from their run directories alone.

RUN is a run directory (``--run-dir`` of the run), or a path under the runs folder (``--root``,
default ``runs/``): ``quickstart/rl``, or ``quickstart`` when it holds one run. A run in progress
is read as far as its events go.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from skyrl_contracts.errors import UsageError

RootOpt = Annotated[Path, typer.Option("--root", help="The runs folder that RUN names are looked up in and ls lists.")]
RunsArg = Annotated[list[str], typer.Argument(help="Run directories, or paths under --root.", metavar="RUN...")]
DEFAULT_ROOT = Path("runs")


def _resolve(runs: list[str], root: Path) -> list[Path]:
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.runview.catalog import resolve_run

    return [resolve_run(run, root) for run in runs]


def _value(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def ls(
    root: RootOpt = DEFAULT_ROOT,
    json_: Annotated[bool, typer.Option("--json", help="One JSON object per run.")] = False,
) -> None:
    """List the runs under --root: stage, status, steps, wall time and final figures."""
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.console import Console
    from rich.table import Table

    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.runview.catalog import HEADLINE, find_runs, run_info

    infos = [run_info(path) for path in find_runs(root)] if root.is_dir() else []
    if json_:
        for info in infos:
            record = {
                "run": str(info.path),
                "name": info.name,
                "stage": info.stage,
                "status": info.status,
                "steps": info.steps,
                "wall_s": info.wall_s,
                "metrics": info.headline(),
            }
            typer.echo(json.dumps(record))
        return
    if not infos:
        typer.echo(f"no runs under {root}/ (skyrl sft / skyrl rl write them there; --root names another folder)")
        return
    table = Table(title=f"runs under {root}/ (skyrl runs show RUN)")
    # The run's name is what a user copies into `skyrl runs show`: never wrapped (80 columns used
    # to cut "quickstart/rl" into three lines); the other text columns fold instead.
    table.add_column("run", no_wrap=True)
    for column in ("recipe", "stage", "status", "steps", "wall s", *(label for label, _ in HEADLINE)):
        left = column in ("recipe", "stage", "status")
        table.add_column(column, justify="left" if left else "right", overflow="fold" if left else "ellipsis")
    for info in infos:
        run = str(info.path.relative_to(root)) if info.path != root else "."
        figures = [_value(v) for v in info.headline().values()]
        table.add_row(run, info.name, info.stage, info.status, str(info.steps), f"{info.wall_s:.0f}", *figures)
    Console().print(table)


def _recipe_toml(path: Path) -> str:
    """recipe.resolved.json as TOML (unset keys, JSON nulls, left out)."""
    # lazy: tomli_w; the CLI's light commands import this module without it
    import tomli_w

    def drop_nulls(value):
        if isinstance(value, dict):
            return {k: drop_nulls(v) for k, v in value.items() if v is not None}
        return [drop_nulls(v) for v in value] if isinstance(value, list) else value

    return tomli_w.dumps(drop_nulls(json.loads(path.read_text(encoding="utf-8"))))


def _plan_table(path: Path):
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.table import Table

    plan = json.loads(path.read_text(encoding="utf-8"))
    table = Table(title=f"plan: {plan.get('stage')} on {plan.get('device')}, async {plan.get('async_mode', False)}")
    for column in ("process", "role", "devices", "ports"):
        table.add_column(column)
    for proc in plan.get("processes", []):
        table.add_row(
            proc["name"], proc["role"], " ".join(proc.get("devices", [])), " ".join(map(str, proc.get("ports", [])))
        )
    return table


def show(
    run: Annotated[str, typer.Argument(help="Run directory, or a path under --root.", metavar="RUN")],
    root: RootOpt = DEFAULT_ROOT,
) -> None:
    """Print a run's status, resolved recipe, launch plan and final figures."""
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.console import Console

    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.metrics.summary import summary_table
    from skyrl_cli.runview.catalog import run_info
    from skyrl_contracts.rundir import RunDir

    (path,) = _resolve([run], root)
    info, files, console = run_info(path), RunDir(path), Console()
    console.print(
        f"[bold]{path}[/bold]: {info.name} {info.stage}, {info.status}, {info.steps} steps, {info.wall_s:.0f} s"
    )
    if files.resolved_recipe.is_file():
        console.rule("resolved recipe (recipe.resolved.json)")
        console.print(_recipe_toml(files.resolved_recipe), markup=False, highlight=False)
    if files.plan.is_file():
        console.print(_plan_table(files.plan))
    console.print(summary_table(info.summary))


def _check_metrics(metrics: list[str], paths: list[Path]) -> None:
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.runview.curves import load_curves

    known = sorted({name for path in paths for name in load_curves(path)})
    for name in metrics:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = (
                f"; did you mean {close[0]!r}?"
                if close
                else f"; metrics of these runs: {', '.join(known) or 'none yet'}"
            )
            raise UsageError(f"--metric {name!r}: no run logged it{hint}")


def compare(
    runs: RunsArg,
    metric: Annotated[
        Optional[list[str]],
        typer.Option("--metric", "-m", help="Metric to plot (repeatable; default: the report's panels)."),
    ] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG of the overlaid curves.")] = Path("compare.png"),
    root: RootOpt = DEFAULT_ROOT,
) -> None:
    """Compare runs: a table of their final figures and a PNG of their curves overlaid."""
    # lazy: rich; skyrl recipes validate and completions stay light
    from rich.console import Console
    from rich.table import Table

    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.runview.catalog import final_rows
    from skyrl_cli.runview.curves import REPORT_PANELS, metric_panels
    from skyrl_cli.runview.report import figure_png, load_runs, panels_with_data
    from skyrl_contracts.atomic import write_bytes

    if len(runs) < 2:
        raise UsageError("skyrl runs compare needs two runs or more (skyrl runs show RUN looks at one)")
    paths = _resolve(runs, root)
    _check_metrics(metric or [], paths)
    loaded = load_runs(paths)
    table = Table(title="final figures")
    for column in ("metric", *(r.label for r in loaded)):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, values in final_rows([r.info for r in loaded], metric or None):
        table.add_row(name, *map(_value, values))
    Console().print(table)
    panels = panels_with_data(metric_panels(metric) if metric else REPORT_PANELS, loaded)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(output, figure_png(panels, loaded))
    typer.echo(f"wrote {output}")


def report(
    runs: RunsArg,
    out: Annotated[
        Optional[Path],
        typer.Option("--out", help="Folder for report.png and report.html (default: RUN/report/ of the first run)."),
    ] = None,
    root: RootOpt = DEFAULT_ROOT,
) -> None:
    """Write report.png and a self-contained report.html of one run, or of several compared."""
    # lazy: command implementation; skyrl --help stays fast
    from skyrl_cli.runview.report import write_report
    from skyrl_contracts.rundir import RunDir

    paths = _resolve(runs, root)
    png, page = write_report(paths, out if out is not None else RunDir(paths[0]).report)
    typer.echo(f"wrote {png}\nwrote {page}")


def register(app: typer.Typer) -> None:
    sub = typer.Typer(
        help="Runs you can look at: list, show, compare and report (PNG + HTML) from run directories.",
        no_args_is_help=True,
    )
    for name, command in (("ls", ls), ("show", show), ("compare", compare), ("report", report)):
        sub.command(name)(command)
    app.add_typer(sub, name="runs")
