"""A self-contained HTML report of one or more run folders, with a JSON summary beside it.

The page holds a summary table and every figure of :mod:`stableflash.report.plots`, embedded as
base64 PNG data URIs (the same PNGs are also written to ``<out_stem>_files/``). Plain HTML with
inline CSS: no JavaScript, no external resources; every string read from a run is escaped.
"""
from __future__ import annotations

import base64
import html
import io
import json
import logging
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable
from urllib.parse import quote

import numpy as np

from . import plots
from .runs import (Run, delta_series, events_of, explosion_step, first_event_step, load_run, metric_series,
                   probe_series, to_float)

log = logging.getLogger(__name__)

EXPLOSION_FACTOR = 2.0
EXPLOSION_WINDOW = 50


# ---------------------------------------------------------------------------------------- summary

def _number(value) -> float | int | str | None:
    """A number for the JSON summary: finite numbers as they are, non-finite ones spelled "nan",
    "inf", "-inf" (as in metrics.jsonl, since JSON has no NaN), anything else as None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    number = to_float(value)
    if isinstance(value, str) and math.isnan(number) and value.strip().lower().lstrip("+-") != "nan":
        return None                                       # text that is not a number
    if not math.isfinite(number):
        return repr(number)
    return value if isinstance(value, int) else number


def run_summary(run: Run) -> dict:
    """The JSON summary of one run (see :func:`build_report`). Values come from summary.json when
    it has them, otherwise from metrics.jsonl; ``status`` is None without summary.json."""
    summary = run.summary or {}
    steps, loss = metric_series(run, "loss")
    _, val = metric_series(run, "val_loss")
    finite_val = val[np.isfinite(val)]
    boom = explosion_step(run, EXPLOSION_FACTOR, EXPLOSION_WINDOW)
    first_warning = first_event_step(run, "monitor_warning")
    status = summary.get("status")
    return {
        "name": run.name,
        "path": str(run.path),
        "attention": run.attention,
        "status": None if status is None else str(status),
        "steps": _number(summary["steps"]) if "steps" in summary
        else (int(steps[-1]) + 1 if steps.size else None),
        "final_loss": _number(summary["final_loss"]) if "final_loss" in summary
        else (_number(float(loss[-1])) if loss.size else None),
        "best_val_loss": _number(summary["best_val_loss"]) if "best_val_loss" in summary
        else (float(finite_val.min()) if finite_val.size else None),
        "explosion_step": boom,
        "first_warning_step": first_warning,
        "lead_time": boom - first_warning if boom is not None and first_warning is not None else None,
        "warnings": len(events_of(run, "monitor_warning")),
        "actions": len(events_of(run, "monitor_action")),
        "nonfinite_events": len(events_of(run, "nonfinite")),
        "probes": len(run.probes),
        "missing_files": list(run.missing),
        "skipped_lines": dict(run.skipped),
        "problems": list(run.problems),
    }


# ---------------------------------------------------------------------------------------- figures

@dataclass
class _FigureSpec:
    """One figure of the page; every text field is plain text, escaped when the page is written."""

    fig_id: str
    title: str
    caption: str
    alt: str
    draw: Callable[[], object]
    no_data: str | None = None        # a note shown under the caption when the data is missing


def _slug(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-").lower() or "run"
    slug, n = base, 2
    while slug in taken:
        slug, n = f"{base}-{n}", n + 1
    taken.add(slug)
    return slug


def distinct_names(runs: list[Run]) -> list[Run]:
    """The runs, renamed with as many parent folders as it takes for no two to share a name: the
    runs of a reproduction are all called baseline/stabilized/control, one of each per seed folder
    (seed0/baseline, seed1/baseline, ...)."""
    parts = [run.path.resolve().parts for run in runs]
    for depth in range(1, max(map(len, parts)) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            break
    if depth == 1:
        return runs
    return [replace(run, name=name) for run, name in zip(runs, names)]


def _figure_specs(runs: list[Run]) -> list[_FigureSpec]:
    rule = (f"The dashed line marks the explosion step: the first step whose loss is non-finite, or exceeds "
            f"{EXPLOSION_FACTOR:g}× its running minimum without coming back below that within "
            f"{EXPLOSION_WINDOW} steps.")
    specs = [
        _FigureSpec("fig-loss", "Training loss",
                    "Training loss against step, one colour per run (legend: run name and attention spec); dots are "
                    "validation losses and crosses at the top edge mark non-finite losses. " + rule +
                    " A log scale is used when the losses span more than 20×.",
                    "Training loss against step for every run, with explosion steps marked",
                    lambda: plots.loss_curves(runs),
                    None if any(metric_series(r, "loss")[0].size for r in runs) else "no losses in any run"),
        _FigureSpec("fig-grad-norm", "Gradient norm",
                    "Gradient norm (before clipping) against step for every run, with the explosion steps dashed. "
                    "Growing gradient norms usually precede the loss rising.",
                    "Gradient norm against step for every run",
                    lambda: plots.grad_norm_curves(runs),
                    None if any(metric_series(r, "grad_norm")[0].size for r in runs)
                    else "no run logged grad_norm"),
    ]
    taken: set[str] = set()
    for run in runs:
        slug = _slug(run.name, taken)
        name = run.name
        has_spectral = probe_series(run, "spectral", "q_full")[0].size > 0
        has_rows = probe_series(run, "row", "repeated_max_frac")[0].size > 0
        missing = "probes.jsonl is missing" if "probes.jsonl" in run.missing else None
        specs.append(_FigureSpec(
            f"fig-spectral-{slug}", f"Spectral norm of W_q — {name}",
            "Left: spectral norm (largest singular value) of each layer's whole query projection W_q (rows: "
            "layers, layer 0 on top; columns: probe steps; brighter is larger, log colour scale when the values "
            "span more than 20×). Right: the per-head norms at the last probe step. The colour scale is fitted to "
            "this run alone, so read the colour bar: a layer brightening far beyond the others is a layer whose "
            "attention logits are growing.",
            f"Heatmap of the W_q spectral norm per layer and probe step for run {run.name}",
            lambda run=run: plots.spectral_heatmap(run, "q"),
            None if has_spectral else (missing or "no spectral probes in probes.jsonl")))
        specs.append(_FigureSpec(
            f"fig-repeated-max-{slug}", f"Repeated row maxima vs loss — {name}",
            "Per layer, the fraction of attention rows whose maximum score occurs more than once (mean over heads), "
            "against step; the grey line is the training loss on the right axis. In the failure mode, this fraction "
            "rises in one layer well before the loss explodes (cf. the paper's Fig. 13).",
            f"Repeated-maximum fraction per layer with the training loss, for run {run.name}",
            lambda run=run: plots.repeated_max_vs_loss(run),
            None if has_rows else (missing or "no row probes in probes.jsonl")))
    specs.append(_FigureSpec(
        "fig-delta", "Accumulated δ bias",
        "Running sum over probe steps of Σ_T(δ_lp − δ_hp): the softmax-backward term δ computed in low precision "
        "minus the same in high precision, summed over tokens. Colours are layers, line styles are runs. An unbiased "
        "kernel wanders around zero; a biased one drifts steadily away from it.",
        "Running sum of the low- minus high-precision delta difference per probed layer and run",
        lambda: plots.delta_bias(runs),
        None if any(delta_series(r) for r in runs) else "no run has delta probes"))
    specs.append(_FigureSpec(
        "fig-monitor", "Monitor timeline",
        "One row per run over its logged steps (grey bar): monitor warnings (triangles, labelled layer/head/indicator), "
        "monitor actions (squares: switch, diamonds: rollback, labelled with the layers), non-finite losses "
        "(crosses) and explosion stops (stars: stop_after_explosion); the red dashed tick is the explosion step. The gap between the first warning and the explosion "
        "is the lead time in the table above.",
        "Timeline of monitor warnings, actions, non-finite losses and explosion stops per run",
        lambda: plots.monitor_timeline(runs),
        None if any(plots.timeline_events(r) for r in runs)
        else "no monitor, non-finite or explosion-stop events in any run"))
    return specs


def _png_bytes(draw: Callable[[], object], fig_id: str) -> tuple[bytes, str | None]:
    """Render a figure to PNG; a figure that fails to draw becomes a note (and the error text)."""
    error = None
    try:
        fig = draw()
    except Exception as exc:               # one bad figure must not lose the whole report
        log.warning("figure %s could not be drawn: %s: %s", fig_id, type(exc).__name__, exc)
        error = f"{type(exc).__name__}: {exc}"
        fig = plots._new_figure(8, 2)
        plots._no_data(fig.add_subplot(), "this figure could not be drawn:\n" + plots._plain(error, 90))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, facecolor="white")
    fig.clear()
    return buffer.getvalue(), error


# ------------------------------------------------------------------------------------------- page

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 2em auto;
       max-width: 1200px; padding: 0 1.5em; color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; font-size: 0.88em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #e4e4e4; }
figcaption { font-size: 0.92em; color: #444; max-width: 60em; }
.nodata { color: #a05a00; font-weight: 600; }
.err { color: #b00020; font-weight: 600; }
code { background: #f4f4f4; padding: 0 0.2em; }
"""


def _cell(value) -> str:
    if value is None or value == "":
        return '<td class="num">—</td>'
    if isinstance(value, float):
        return f'<td class="num">{value:.4g}</td>'
    if isinstance(value, int) and not isinstance(value, bool):
        return f'<td class="num">{value}</td>'
    return f"<td>{html.escape(str(value))}</td>"


def _summary_table(rows: list[dict]) -> str:
    columns = [("name", "run"), ("attention", "attention"), ("status", "status"), ("steps", "steps"),
               ("final_loss", "final loss"), ("best_val_loss", "best val loss"),
               ("explosion_step", "explosion step"), ("first_warning_step", "first warning"),
               ("lead_time", "lead time (steps)"), ("warnings", "warnings")]
    head = "".join(f"<th>{label}</th>" for _, label in columns)
    body = "".join("<tr>" + "".join(_cell(row[key]) for key, _ in columns) + "</tr>" for row in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{body}</tbody>\n</table>"


def _run_details(runs: list[Run]) -> str:
    """Per run: folder, a few config values, the notes, and what was missing or skipped."""
    keys = ("model", "optimizer", "lr", "seed", "dtype")
    head = "<th>run</th><th>folder</th>" + "".join(f"<th>{k}</th>" for k in keys) + "<th>notes</th><th>data issues</th>"
    body = []
    for run in runs:
        config = run.config or {}
        issues = [f"no {name}" for name in run.missing]
        issues += [f"{count} malformed line(s) skipped in {name}" for name, count in run.skipped.items()]
        issues += run.problems
        cells = [_cell(run.name), _cell(str(run.path))] + [_cell(config.get(k)) for k in keys]
        cells.append(_cell(config.get("notes")) if config else _cell("no config.json"))
        cells.append(_cell("; ".join(issues)))
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{''.join(body)}</tbody>\n</table>"


def build_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write an HTML report of ``run_dirs`` and return its path.

    Writes ``out`` (default: ``report.html`` in the first run folder), the figures as PNG files in
    ``<out_stem>_files/`` (also embedded in the page as data URIs, so the page stands alone), and
    ``<out_stem>.json``: per run its name, attention, status, steps, final and best validation
    loss, explosion step, first monitor-warning step, lead time (explosion − first warning) and
    number of warnings. Raises FileNotFoundError for a missing run folder or metrics.jsonl.
    """
    run_dirs = [Path(p) for p in run_dirs]
    if not run_dirs:
        raise ValueError("run_dirs is empty; accepted: one or more run folders holding metrics.jsonl")
    runs = distinct_names([load_run(p) for p in run_dirs])
    out = Path(out) if out is not None else run_dirs[0] / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    files_dir = out.parent / f"{out.stem}_files"
    files_dir.mkdir(exist_ok=True)

    rows = [run_summary(run) for run in runs]
    summary = {"explosion_rule": {"factor": EXPLOSION_FACTOR, "window": EXPLOSION_WINDOW}, "runs": rows}
    json_path = out.parent / f"{out.stem}.json"
    json_path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")

    sections = []
    for spec in _figure_specs(runs):
        png, error = _png_bytes(spec.draw, spec.fig_id)
        (files_dir / f"{spec.fig_id}.png").write_bytes(png)
        data = base64.b64encode(png).decode("ascii")
        link = quote(f"{files_dir.name}/{spec.fig_id}.png")
        notes = ""
        if spec.no_data:
            notes += f' <span class="nodata">No data: {html.escape(spec.no_data)}.</span>'
        if error:
            notes += f' <span class="err">This figure could not be drawn: {html.escape(error)}</span>'
        sections.append(
            f'<figure>\n<h2>{html.escape(spec.title)}</h2>\n'
            f'<img id="{spec.fig_id}" alt="{html.escape(spec.alt, quote=True)}" src="data:image/png;base64,{data}">\n'
            f'<figcaption>{html.escape(spec.caption)}{notes} '
            f'(<a href="{html.escape(link, quote=True)}">PNG file</a>)</figcaption>\n</figure>')

    names = ", ".join(html.escape(run.name) for run in runs)
    page = (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>stableflash report: {names}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>stableflash training report</h1>\n<p class=\"sub\">{len(runs)} run(s): {names}</p>\n"
        "<h2>Summary</h2>\n"
        "<p>One row per run (also in <code>" + html.escape(json_path.name) + "</code>). The explosion step is the "
        f"first step whose loss is non-finite or exceeds {EXPLOSION_FACTOR:g}× its running minimum for "
        f"{EXPLOSION_WINDOW} steps; the lead time is the explosion step minus the first monitor warning's step "
        "(positive: the monitor warned that many steps ahead).</p>\n"
        + _summary_table(rows) +
        "\n<h2>Runs</h2>\n" + _run_details(runs) + "\n"
        + "\n".join(sections) + "\n</body>\n</html>\n")
    out.write_text(page, encoding="utf-8")
    return out
