"""The report's figures. Each function returns a matplotlib ``Figure`` drawn on the Agg canvas.

Figures are created as ``Figure`` objects (never through pyplot), so nothing is shared between
them; drop the reference (or call ``fig.clear()``) when done. Missing data never raises: the
affected panel says "no data" and why.
"""
from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np

from .runs import Run, delta_series, explosion_step, loss_series, metric_series, probe_series

MATRICES = ("q", "k", "v", "o")
LOG_SPAN = 20.0                 # a y range wider than this factor is drawn on a log scale
_MAX_LABEL = 48                 # characters of a run-provided string shown in a legend
_MAX_ANNOTATIONS = 24           # event labels per run on the monitor timeline


def _new_figure(width: float, height: float):
    """A fresh Figure on its own Agg canvas (constrained layout keeps labels from overlapping)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:            # a dependency of the package, but an environment may lack it
        raise ImportError("the report needs matplotlib (a dependency of stableflash); install it with "
                          "`pip install matplotlib`") from exc
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _plain(text: object, limit: int = _MAX_LABEL) -> str:
    """Run-provided text made safe for matplotlib: no mathtext (``$``), not hidden from legends
    (a leading ``_``), shortened to ``limit`` characters."""
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def _compact(value: float) -> str:
    """A short number for a heatmap cell: 8.17, 26.9, 328, 5.1k, 12k, 2e5."""
    if abs(value) < 1000:
        return f"{value:.3g}"
    if abs(value) < 99_950:
        return f"{value / 1000:.2g}k" if abs(value) < 9_950 else f"{value / 1000:.0f}k"
    return f"{value:.0e}".replace("e+0", "e")


def _middle(text: str, limit: int) -> str:
    """``text`` shortened in the middle: attention specs differ most in their last words (rule=…)."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head):]


def _run_label(run: Run) -> str:
    attention = run.attention
    return _plain(run.name) + (f" ({_plain(_middle(attention, 40), 40)})" if attention
                               else " (attention: not recorded)")


def _no_data(ax, message: str, keep_x: bool = False) -> None:
    """Mark an Axes as empty with a readable note (``keep_x``: another Axes shares its x axis)."""
    ax.text(0.5, 0.5, "No data\n" + message, transform=ax.transAxes, ha="center", va="center",
            fontsize=11, color="0.35", wrap=True,
            bbox=dict(boxstyle="round,pad=0.6", facecolor="0.96", edgecolor="0.75"))
    if not keep_x:
        ax.set_xticks([])
    ax.set_yticks([])


def _colors(n: int) -> list:
    """``n`` distinct colours: tab10, tab20, then a sampled viridis for more."""
    from matplotlib import colormaps
    if n <= 20:
        cmap = colormaps["tab10" if n <= 10 else "tab20"]
        return [cmap(i) for i in range(n)]
    return [colormaps["viridis"](i / (n - 1)) for i in range(n)]


def _log_if_wide(ax, values: Sequence[np.ndarray], axis: str = "y") -> bool:
    """Use a log scale when the positive finite values span more than LOG_SPAN×."""
    finite = [v[np.isfinite(v)] for v in values]
    finite = np.concatenate(finite) if finite else np.zeros(0)
    if finite.size and finite.min() > 0 and finite.max() / finite.min() > LOG_SPAN:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
        return True
    return False


def _mark_nonfinite(ax, steps: np.ndarray, values: np.ndarray, color, label: str | None) -> None:
    """Crosses at the top edge of the Axes where ``values`` turns NaN or infinite (the first step
    of each non-finite stretch)."""
    nonfinite = ~np.isfinite(values)
    bad = steps[nonfinite & ~np.concatenate([[False], nonfinite[:-1]])]
    if bad.size:
        ax.set_ymargin(0.12)                   # headroom, so the crosses sit above the curves
        ax.plot(bad, np.full(bad.size, 0.97), linestyle="none", marker="X", markersize=9, color=color,
                markeredgecolor="black", transform=ax.get_xaxis_transform(), clip_on=False, label=label)


def _explosion_line(ax, step: int | None, color, label: str | None = None) -> None:
    if step is not None:
        ax.axvline(step, color=color, linestyle="--", linewidth=1.2, alpha=0.85, label=label)


def _legend(ax, inside_max: int = 6) -> None:
    """The Axes' legend: inside ("best") for up to ``inside_max`` entries, below the plot for more."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    if len(handles) <= inside_max:
        ax.legend(handles, labels, fontsize=8, framealpha=0.9, loc="best")
    else:
        # as many columns as the longest label allows across the figure (~16 characters of 8-point
        # text per inch), so that no label runs off the page; the figure grows by each legend row,
        # so that the plot keeps its height
        per_row = int(ax.figure.get_figwidth() * 16 // max(len(label) for label in labels))
        ncol = max(1, min(per_row, 3 if len(handles) > 8 else 2, len(handles)))
        ax.figure.set_figheight(ax.figure.get_figheight() + 0.17 * math.ceil(len(handles) / ncol))
        ax.figure.legend(handles, labels, fontsize=8, loc="outside lower center", frameon=False, ncol=ncol)


def _style_key(ax, **shown: bool) -> None:
    """Grey proxy legend entries explaining the marker styles (only those that were drawn)."""
    from matplotlib.lines import Line2D
    styles = {"validation": dict(linestyle="none", marker="o", markeredgecolor="black", label="dots: validation loss"),
              "explosion": dict(linestyle="--", label="dashed: explosion step"),
              "nonfinite": dict(linestyle="none", marker="X", markersize=9, markeredgecolor="black",
                                label="crosses: non-finite values")}
    for key, style in styles.items():
        if shown.get(key):
            ax.add_line(Line2D([], [], color="0.55", **style))


# ------------------------------------------------------------------------------------- the figures

def _curves(runs: Sequence[Run], key: str, title: str, ylabel: str, with_val: bool):
    """One line of ``key`` against step per run, the explosion steps, non-finite values, and
    (``with_val``) the validation losses."""
    fig = _new_figure(10, 4.8)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    series = [(run, *metric_series(run, key)) for run in runs]
    if not any(np.isfinite(values).any() for _, _, values in series):
        _no_data(ax, f"no run logged a finite {key} in metrics.jsonl" if runs else "no runs given")
        return fig
    shown = dict(validation=False, explosion=False, nonfinite=False)
    plotted = []
    for (run, steps, values), color in zip(series, _colors(len(series))):
        if steps.size == 0:
            continue
        boom = explosion_step(run)
        label = _run_label(run) + (f", explodes at step {boom}" if boom is not None else "")
        ax.plot(steps, np.where(np.isfinite(values), values, np.nan), color=color, linewidth=1.3, label=label)
        plotted.append(values)
        if with_val:
            val_steps, val = metric_series(run, "val_loss")
            if np.isfinite(val).any():
                ax.plot(val_steps, val, linestyle="none", marker="o", markersize=5, color=color,
                        markeredgecolor="black", markeredgewidth=0.6)
                shown["validation"] = True
                plotted.append(val)
        _explosion_line(ax, boom, color)
        shown["explosion"] |= boom is not None
        _mark_nonfinite(ax, steps, values, color, label=None)
        shown["nonfinite"] |= not bool(np.isfinite(values).all())
    _log_if_wide(ax, plotted)
    ax.grid(True, alpha=0.3)
    _style_key(ax, **shown)
    _legend(ax, inside_max=0)                 # below the plot: noisy curves leave no free corner
    return fig


def loss_curves(runs: Sequence[Run]):
    """Training loss against step for every run, validation losses as dots, the explosion step
    (see :func:`explosion_step`) as a dashed line and non-finite losses as crosses at the top.
    The legend names each run with its attention spec; a log scale is used past a 20× span."""
    return _curves(runs, "loss", "Training loss", "loss", with_val=True)


def grad_norm_curves(runs: Sequence[Run]):
    """Gradient norm (before clipping) against step for every run, with the explosion steps."""
    return _curves(runs, "grad_norm", "Gradient norm", "grad norm", with_val=False)


def _edges(centers: np.ndarray) -> np.ndarray:
    """Cell edges around sorted centres (for pcolormesh with uneven probe spacing)."""
    c = np.asarray(centers, dtype=np.float64)
    if c.size == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[c[0] - (mid[0] - c[0])], mid, [c[-1] + (c[-1] - mid[-1])]])


def _norm_for(values: np.ndarray):
    from matplotlib.colors import LogNorm, Normalize
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return Normalize(0, 1)
    lo, hi = float(finite.min()), float(finite.max())
    if lo > 0 and hi / lo > LOG_SPAN:
        return LogNorm(lo, hi)
    return Normalize(lo, hi if hi > lo else lo + 1e-12)


def spectral_heatmap(run: Run, matrix: str = "q"):
    """Spectral norm of one attention projection: layers × probe steps for the whole matrix
    (``<matrix>_full``), and layers × heads at the last probe step (``<matrix>``)."""
    if matrix not in MATRICES:
        raise ValueError(f"matrix={matrix!r} is invalid; accepted: {', '.join(MATRICES)}")
    fig = _new_figure(11, 4.4)
    grid = fig.add_gridspec(1, 2, width_ratios=[3.2, 1])
    ax, ax_head = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    fig.suptitle(f"{_plain(run.name)}: spectral norm of W_{matrix}")
    steps, full = probe_series(run, "spectral", f"{matrix}_full")
    if steps.size and full.ndim == 2 and np.isfinite(full).any():
        values = full.T                               # layers × steps
        mesh = ax.pcolormesh(_edges(steps), np.arange(values.shape[0] + 1) - 0.5, values,
                             norm=_norm_for(values), cmap="magma", shading="flat")
        fig.colorbar(mesh, ax=ax, label=f"‖W_{matrix}‖₂ (whole matrix)", pad=0.01)
        ax.set_yticks(range(values.shape[0]))
        ax.set_ylim(values.shape[0] - 0.5, -0.5)     # layer 0 at the top
        ax.set_xlabel("probe step")
        ax.set_ylabel("layer")
        ax.set_title("whole matrix, per layer over training", fontsize=10)
        boom = explosion_step(run)
        if boom is not None:
            ax.axvline(boom, color="cyan", linestyle="--", linewidth=1.4, label=f"explosion (step {boom})")
            ax.legend(fontsize=8, loc="lower left", framealpha=0.9)
    else:
        ax.set_title("whole matrix, per layer over training", fontsize=10)
        _no_data(ax, f"no spectral['{matrix}_full'] values in probes.jsonl"
                 + (" (file missing)" if "probes.jsonl" in run.missing else ""))
    head_steps, heads = probe_series(run, "spectral", matrix)
    if head_steps.size and heads.ndim == 3 and np.isfinite(heads[-1]).any():
        last = heads[-1]                               # layers × heads
        image = ax_head.imshow(last, aspect="auto", cmap="magma", norm=_norm_for(last), interpolation="nearest")
        fig.colorbar(image, ax=ax_head, pad=0.02)
        ax_head.set_xticks(range(last.shape[1]))
        ax_head.set_yticks(range(last.shape[0]))
        ax_head.set_xlabel("head")
        ax_head.set_ylabel("layer")
        ax_head.set_title(f"per head, step {int(head_steps[-1])}", fontsize=10)
        if last.size <= 48:
            norm = _norm_for(last)
            for (layer, head), value in np.ndenumerate(last):
                if math.isfinite(value):
                    shade = float(norm(value))
                    ax_head.text(head, layer, _compact(value), ha="center", va="center", fontsize=8,
                                 color="black" if shade > 0.6 else "white")
    else:
        ax_head.set_title("per head, last probe", fontsize=10)
        _no_data(ax_head, f"no per-head\nspectral['{matrix}']")
    return fig


def repeated_max_vs_loss(run: Run):
    """Per layer, the fraction of attention rows whose maximum score is repeated (mean over heads)
    against step, with the training loss on a twin axis (cf. the paper's Fig. 13)."""
    fig = _new_figure(10, 4.6)
    ax = fig.add_subplot()
    ax.set_title(f"{_plain(run.name)}: repeated row maxima vs loss")
    ax.set_xlabel("step")
    steps, frac = probe_series(run, "row", "repeated_max_frac")
    loss_steps, loss = loss_series(run)
    has_probes = steps.size > 0 and frac.ndim >= 2 and np.isfinite(frac).any()
    has_loss = np.isfinite(loss).any()
    if not has_probes and not has_loss:
        _no_data(ax, "no row['repeated_max_frac'] probes and no finite loss")
        return fig
    if has_probes:
        with warnings.catch_warnings():          # a layer with only NaN heads stays NaN, quietly
            warnings.simplefilter("ignore", RuntimeWarning)
            per_layer = np.nanmean(frac.reshape(frac.shape[0], frac.shape[1], -1), axis=2)   # steps × layers
        for layer, color in zip(range(per_layer.shape[1]), _colors(per_layer.shape[1])):
            ax.plot(steps, per_layer[:, layer], color=color, linewidth=1.5, marker=".", markersize=4,
                    label=f"layer {layer}")
        ax.set_ylabel("repeated-max fraction (mean over heads)")
        top = np.nanmax(per_layer)
        ax.set_ylim(0.0, max(0.05, 1.15 * float(top)) if math.isfinite(top) else 1.0)   # a fraction: from 0
        ax.grid(True, alpha=0.3)
    else:
        _no_data(ax, "no row['repeated_max_frac'] values in probes.jsonl"
                 + (" (file missing)" if "probes.jsonl" in run.missing else ""), keep_x=True)
    twin = ax.twinx()
    if has_loss:
        twin.plot(loss_steps, np.where(np.isfinite(loss), loss, np.nan), color="0.35", linewidth=1.0,
                  alpha=0.8, label="training loss (right axis)")
        _log_if_wide(twin, [loss])
        twin.set_ylabel("training loss", color="0.3")
        _mark_nonfinite(twin, loss_steps, loss, "0.35", label="non-finite loss")
    else:
        twin.set_yticks([])
    boom = explosion_step(run)
    _explosion_line(ax, boom, "crimson", label=f"explosion (step {boom})" if boom is not None else None)
    handles, labels = [], []
    for axes in (ax, twin):
        h, lab = axes.get_legend_handles_labels()
        handles += h
        labels += lab
    if handles:                               # below the plot: the curves fill the whole axes
        fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=min(len(handles), 6),
                   frameon=False)
    return fig


def delta_bias(runs: Sequence[Run]):
    """Running sum over steps of Σ_T(δ_lp − δ_hp), the accumulated low- vs high-precision
    difference of the softmax backward term δ, per probed layer: one line per run and layer."""
    fig = _new_figure(10, 4.6)
    ax = fig.add_subplot()
    ax.set_title(r"Accumulated δ bias: running sum of $\Sigma_T(\delta_{lp} - \delta_{hp})$")
    ax.set_xlabel("step")
    ax.set_ylabel("running sum")
    per_run = [(run, delta_series(run, "running_sum")) for run in runs]
    if not any(layers for _, layers in per_run):
        _no_data(ax, "no run has 'delta' probes in probes.jsonl")
        return fig
    all_layers = sorted({layer for _, layers in per_run for layer in layers},
                        key=lambda name: (0, int(name)) if name.lstrip("-").isdigit() else (1, name))
    color_of = dict(zip(all_layers, _colors(len(all_layers))))
    styles = ["-", "--", ":", "-."]
    for index, (run, layers) in enumerate(per_run):
        for layer, (steps, values) in layers.items():
            ax.plot(steps, values, color=color_of[layer], linestyle=styles[index % len(styles)], linewidth=1.4,
                    label=f"{_plain(run.name)} · layer {_plain(layer, 12)}")
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.grid(True, alpha=0.3)
    _legend(ax, inside_max=8)
    return fig


_EVENT_STYLE = {
    "monitor_warning": dict(marker="^", color="darkorange", label="monitor warning"),
    "switch": dict(marker="s", color="royalblue", label="monitor action: switch"),
    "rollback": dict(marker="D", color="purple", label="monitor action: rollback"),
    "nonfinite": dict(marker="X", color="red", label="non-finite"),
    "exploded": dict(marker="*", color="black", label="stopped: exploded"),
}


def _event_key(event: dict) -> str | None:
    kind = event.get("event")
    if kind == "monitor_action":
        return "rollback" if event.get("action") == "rollback" else "switch"
    return kind if kind in _EVENT_STYLE else None


def timeline_events(run: Run) -> list[dict]:
    """The run's events the monitor timeline marks (those ``_EVENT_STYLE`` has a marker for)."""
    return [e for e in run.events if _event_key(e) is not None]


def _event_text(event: dict) -> str:
    kind = event.get("event")
    if kind == "monitor_warning":
        parts = [f"L{event['layer']}" if event.get("layer") is not None else "",
                 f"H{event['head']}" if event.get("head") is not None else "",
                 str(event.get("indicator", ""))]
        return _plain(" ".join(p for p in parts if p), 28)
    if kind == "monitor_action":
        layers = event.get("layers")
        layers = ",".join(map(str, layers)) if isinstance(layers, list) else (layers or "")
        return _plain(f"{event.get('action', 'action')} L{layers}" if layers != "" else str(event.get("action", "")), 28)
    if kind == "exploded":
        return f"exploded since {event['since']}" if "since" in event else "exploded"
    return "non-finite"


def _label_positions(events: list[dict], char_width: float) -> list[tuple[dict, int]]:
    """Which events get a text label, and on which side (+1 above, −1 below) of their marker:
    labels never overlap on a side; warnings and actions go first in step order, non-finite
    events (whose marker says it all) last; at most _MAX_ANNOTATIONS per row."""
    priority = {"monitor_warning": 0, "monitor_action": 0, "nonfinite": 1, "exploded": 1}
    placed: dict[int, list[tuple[float, float]]] = {1: [], -1: []}
    chosen = []
    for event in sorted(events, key=lambda e: (priority.get(e.get("event"), 3), e["step"])):
        if len(chosen) >= _MAX_ANNOTATIONS:
            break
        half = (len(_event_text(event)) / 2 + 1) * char_width
        left, right = event["step"] - half, event["step"] + half
        for side in (1, -1):
            if all(right < l or left > r for l, r in placed[side]):
                placed[side].append((left, right))
                chosen.append((event, side))
                break
    return chosen


def monitor_timeline(runs: Sequence[Run]):
    """Monitor warnings, monitor actions, non-finite losses and explosion stops as markers on a step axis, one row
    per run, labelled with layer/head (and indicator) where the labels fit without overlapping;
    grey bars span each run's logged steps, a red dashed tick marks its explosion step."""
    fig = _new_figure(10, max(2.8, 1.4 + 1.1 * len(runs)))
    ax = fig.add_subplot()
    ax.set_title("Monitor warnings and actions, non-finite losses, explosion stops")
    ax.set_xlabel("step")
    if not runs:
        _no_data(ax, "no runs given")
        return fig
    all_steps = [r["step"] for run in runs for r in run.metrics + run.events]
    span = max(all_steps) - min(all_steps) if all_steps else 1
    char_width = max(span, 1) * 0.0085          # ≈ one 7 pt character on the ~7 inch wide axes
    any_events = False
    seen_labels: set[str] = set()
    tick_labels = []
    for row, run in enumerate(runs):
        steps, _ = loss_series(run)
        if steps.size:
            ax.plot([steps.min(), steps.max()], [row, row], color="0.8", linewidth=6, solid_capstyle="butt",
                    zorder=1)
        boom = explosion_step(run)
        if boom is not None:
            ax.plot([boom, boom], [row - 0.3, row + 0.3], color="crimson", linestyle="--", linewidth=1.3,
                    zorder=2, label=None if "explosion" in seen_labels else "explosion step")
            seen_labels.add("explosion")
        events = timeline_events(run)
        for event in events:
            style = dict(_EVENT_STYLE[_event_key(event)])
            label = style.pop("label")
            ax.plot([event["step"]], [row], linestyle="none", markersize=9, markeredgecolor="black",
                    markeredgewidth=0.6, zorder=3, label=None if label in seen_labels else label, **style)
            seen_labels.add(label)
        any_events |= bool(events)
        chosen = _label_positions(events, char_width)
        for event, side in chosen:
            ax.annotate(_event_text(event), (event["step"], row), textcoords="offset points",
                        xytext=(0, 10 if side > 0 else -16), ha="center", fontsize=7, zorder=4,
                        color=_EVENT_STYLE[_event_key(event)]["color"])
        hidden = len(events) - len(chosen)
        tick_labels.append(_plain(run.name, 24) + (f"\n({hidden} label{'s' if hidden > 1 else ''} hidden)" if hidden else ""))
    ax.set_yticks(range(len(runs)))
    ax.set_yticklabels(tick_labels)
    ax.set_ylim(len(runs) - 0.4, -0.6)
    ax.grid(True, axis="x", alpha=0.3)
    if not any_events:
        ax.text(0.5, 0.02, "No data: no monitor, non-finite or explosion-stop events in any run's metrics.jsonl",
                transform=ax.transAxes, ha="center", va="bottom", fontsize=10, color="0.35")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return fig
