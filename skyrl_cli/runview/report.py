"""The report of one or more runs: a PNG of every panel against step and wall time, and a
self-contained HTML page (the same plots as PNG data URIs, the runs and their final figures; no
script, no external file), from the run directories alone.

matplotlib is imported inside the functions (``Figure`` with the Agg canvas, no pyplot state), so
``skyrl --help`` and ``skyrl runs ls`` never load it.
"""

from __future__ import annotations

import base64
import html
import io
import time
from dataclasses import dataclass
from pathlib import Path

from skyrl_cli.runview.catalog import HEADLINE, RunInfo, final_rows, run_info, short_labels
from skyrl_cli.runview.curves import REPORT_PANELS, Curve, Panel, load_curves, panel_curves
from skyrl_contracts.atomic import write_bytes, write_text

PANEL_HEIGHT_IN = 3.0
FIGURE_WIDTH_IN = 12.0
DPI = 100
LINESTYLES = ("-", "--", ":", "-.")


@dataclass(frozen=True)
class ReportedRun:
    label: str
    info: RunInfo
    curves: dict[str, list[Curve]]


def load_runs(paths: list[Path]) -> list[ReportedRun]:
    return [ReportedRun(label, run_info(p), load_curves(p)) for label, p in zip(short_labels(paths), paths)]


def panels_with_data(panels: tuple[Panel, ...], runs: list[ReportedRun]) -> list[Panel]:
    return [panel for panel in panels if any(panel_curves(panel, run.curves) for run in runs)]


def _draw_panel(ax_step, ax_time, panel: Panel, runs: list[ReportedRun]) -> None:
    """Every run in its own colour, each metric of the panel in its own line style."""
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        for (label, curve), style in zip(panel_curves(panel, run.curves), LINESTYLES * 4):
            legend = label if len(runs) == 1 else f"{run.label}: {label}"
            steps, values = curve.by_step()
            ax_step.plot(steps, values, style, color=color, marker="." if len(steps) < 30 else None, label=legend)
            ax_time.plot(curve.times, curve.values, style, color=color, label=legend)
    for ax, xlabel in ((ax_step, "step"), (ax_time, "wall time (s)")):
        ax.set_title(f"{panel.title} vs {xlabel.split(' (')[0]}", fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
    ax_step.legend(fontsize=7, loc="best")


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _figure(rows: int):
    # lazy: matplotlib; skyrl --help and the light commands stay light
    from matplotlib.figure import Figure  # Agg canvas for savefig: no display, no pyplot

    figure = Figure(figsize=(FIGURE_WIDTH_IN, PANEL_HEIGHT_IN * max(rows, 1)), layout="constrained")
    return figure, figure.subplots(max(rows, 1), 2, squeeze=False)


def figure_png(panels: list[Panel], runs: list[ReportedRun], title: bool = True) -> bytes:
    """All ``panels`` in one image: one row each, against step (left) and wall time (right);
    ``title``: the runs and their status above them."""
    figure, axes = _figure(len(panels))
    for row, panel in zip(axes, panels):
        _draw_panel(row[0], row[1], panel, runs)
    if not panels:
        axes[0][0].text(0.5, 0.5, "no metric events yet", ha="center", va="center", transform=axes[0][0].transAxes)
    if title:
        figure.suptitle(", ".join(f"{run.label} ({run.info.status})" for run in runs))
    return _png(figure)


def panel_pngs(panels: list[Panel], runs: list[ReportedRun]) -> list[tuple[Panel, bytes]]:
    """One image per panel, for the HTML page (which names the runs itself)."""
    return [(panel, figure_png([panel], runs, title=False)) for panel in panels]


def _format(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


STYLE = """body{font-family:sans-serif;margin:2em;max-width:1250px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee}"""


def report_html(runs: list[ReportedRun], images: list[tuple[Panel, bytes]]) -> str:
    """The page: the runs with their headline figures, each panel's plot as a PNG data URI, then
    every final figure."""
    run_rows = [
        [
            r.label,
            r.info.name,
            r.info.stage,
            r.info.status,
            str(r.info.steps),
            f"{r.info.wall_s:.0f}",
            *map(_format, r.info.headline().values()),
            str(r.info.path),
        ]
        for r in runs
    ]
    headline = [f"final {label}" for label, _ in HEADLINE]
    figures = [[name, *map(_format, values)] for name, values in final_rows([r.info for r in runs])]
    plots = (
        "".join(
            f'<h3>{html.escape(panel.title)}</h3><img class="plot" alt="{html.escape(panel.title)}" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
            for panel, png in images
        )
        or "<p>no metric events yet</p>"
    )
    title = "skyrl report: " + ", ".join(r.label for r in runs)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p>written {time.strftime('%Y-%m-%d %H:%M:%S')} from the run directories</p>"
        + _table(["run", "recipe", "stage", "status", "steps", "wall s", *headline, "directory"], run_rows)
        + f"<h2>curves</h2>{plots}"
        + "<h2>final figures</h2>"
        + _table(["metric", *(r.label for r in runs)], figures)
        + "</body></html>\n"
    )


def write_report(paths: list[Path], out_dir: Path, panels: tuple[Panel, ...] = REPORT_PANELS) -> tuple[Path, Path]:
    """``out_dir/report.png`` and ``out_dir/report.html`` of the runs at ``paths``."""
    runs = load_runs(paths)
    shown = panels_with_data(panels, runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    png_path, html_path = out_dir / "report.png", out_dir / "report.html"
    write_bytes(png_path, figure_png(shown, runs))
    write_text(html_path, report_html(runs, panel_pngs(shown, runs)))
    return png_path, html_path
