"""The faithful GPT-2 runs (benchmarks/runs/faithful_gpt2.sh) side by side: a compact record of each,
a table and a figure of the loss and of the indicators of the layer whose W_Q grows most.

    python benchmarks/runs/faithful_report.py --run LABEL=RUN_DIR [--run ...] [--machine LABEL=GPU ...]
                                              [--fork LABEL=PARENT@STEP ...] --out FOLDER
    python benchmarks/runs/faithful_report.py --from FOLDER/runs.json[.xz] [--run LABEL=RUN_DIR ...] --out FOLDER

The first form reads run folders (metrics.jsonl, probes.jsonl, config.json, summary.json) and writes
FOLDER/runs.json: per run its attention, seed, machine, status, the loss of every logged step, its
events (monitor warnings, non-finite and explosion stops) and, per probe, each layer's W_Q spectral
norm, its largest attention logit and its fraction of rows with repeated maxima (the largest over
the heads), and the monitor's state where the probe records hold it. A fork (``faithful_gpt2.sh
fork``: a copy of PARENT resumed at STEP with other arithmetic) keeps only its own records from
STEP on; its explosion step is judged on PARENT's losses before STEP followed by its own. Both forms then write
FOLDER/table.txt, FOLDER/table.json and FOLDER/indicators.png from runs.json, so the table and the
figure can be made again from the committed record alone. Given both, the runs of --run (and their
--fork and --machine) are added after the records of --from, and the whole is written to FOLDER/runs.json:
a later lease's runs join a committed record whose full run folders are no longer at hand. --from also
reads the record xz-compressed (runs.json.xz, as committed: 22% of the bytes).

The table gives the watched layer's largest logit and W_Q norm at steps 2000, 2300 and 4000 and at the
last probe, the largest fraction of its rows with repeated maxima over all the probes (the largest
over heads), the other layers' largest W_Q norm at the last probe, and the largest 50-step mean loss
(windows wholly within the run's own steps, ending after step 2000, the warm-up). The explosion step is ``report.runs.explosion_step``'s (the loss non-finite, or above 2× its running
minimum with no return below within 50 steps). The watched layer is the one with the largest W_Q
spectral norm at the first run's last probe.
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from stableflash.files import write_text_atomic  # noqa: E402
from stableflash.report.runs import Run, explosion_step, load_run  # noqa: E402


def _pair(text: str, what: str) -> tuple[str, str]:
    label, sep, value = text.rpartition("=")     # a label may hold "=", a path or GPU name does not
    if not sep or not label or not value:
        raise argparse.ArgumentTypeError(f"{what} {text!r} is invalid; accepted: LABEL=VALUE")
    return label, value


def _worst(heads) -> float | None:
    values = [h for h in heads or [] if isinstance(h, (int, float)) and math.isfinite(h)]
    return max(values) if values else None


def _round(value, digits):
    return None if value is None or not math.isfinite(value) else round(value, digits)


def compact(label: str, path: Path, machine: str | None, fork: tuple[str, int] | None = None) -> dict:
    """One run folder as the record runs.json keeps (a fork's from its step on)."""
    run = load_run(path)
    start = fork[1] if fork else 0
    run.metrics = [m for m in run.metrics if m["step"] >= start]
    run.events = [e for e in run.events if e.get("step", start) >= start]
    run.probes = [p for p in run.probes if p["step"] >= start]
    cfg, summary = run.config or {}, run.summary or {}
    probes = []
    for p in run.probes:
        row, spectral = p.get("row") or {}, p.get("spectral") or {}
        probes.append({
            "step": p["step"],
            "q_norm": [_round(v, 3) if isinstance(v, (int, float)) else None for v in spectral.get("q_full") or []],
            "max_logit": [_round(_worst(h), 2) for h in row.get("max_logit") or []],
            "repeated_max": [_round(_worst(h), 5) for h in row.get("repeated_max_frac") or []],
            **({"monitor": p["monitor"]} if "monitor" in p else {})})
    return {
        "label": label, "folder": path.name, "machine": machine, "attention": run.attention,
        "forked_from": fork[0] if fork else None, "forked_at": start if fork else None,
        "seed": cfg.get("seed"), "tokens_per_step": (cfg.get("batch_size") or 0) * (cfg.get("grad_accum") or 0) * 1024,
        "status": summary.get("status"), "steps": summary.get("steps"),
        "best_val_loss": summary.get("best_val_loss"),
        "loss": [[m["step"], _round(float(m["loss"]), 5)] for m in run.metrics
                 if isinstance(m.get("loss"), (int, float))],
        "events": [{k: e[k] for k in ("step", "event", "indicator", "layer", "value", "since", "message") if k in e}
                   for e in run.events],
        "probes": probes}


def history(record: dict, by_label: dict) -> list:
    """The run's [step, loss] rows, a fork's preceded by its parent's before the fork."""
    if not record.get("forked_from"):
        return record["loss"]
    parent = history(by_label[record["forked_from"]], by_label)
    return [r for r in parent if r[0] < record["forked_at"]] + record["loss"]


def as_run(record: dict, by_label: dict) -> Run:
    return Run(name=record["label"], path=Path(record["folder"]),
               metrics=[{"step": s, "loss": v if v is not None else math.nan} for s, v in history(record, by_label)],
               events=record["events"])


def watched_layer(records: list[dict]) -> int:
    last = records[0]["probes"][-1]["q_norm"]
    return max(range(len(last)), key=lambda i: -1 if last[i] is None else last[i])


def at(record: dict, step: int, key: str, layer: int):
    for p in record["probes"]:
        if p["step"] == step:
            return p[key][layer]
    return None


WARMUP = 2000        # the preset's warm-up steps: the loss before it falls from ln(50257)


def peak_mean(record: dict, by_label: dict, window: int = 50) -> str | None:
    """The largest mean loss over ``window`` consecutive logged steps wholly within the run's own
    steps and ending after the warm-up, as "VALUE@STEP" (the window's last step)."""
    rows = [(s, v) for s, v in history(record, by_label) if v is not None]
    own = record["loss"][0][0] if record["loss"] else None
    if own is None or len(rows) < window:
        return None
    means = np.convolve([v for _, v in rows], np.ones(window) / window, mode="valid")
    ends = [s for s, _ in rows][window - 1:]
    first = max(own + window - 1, WARMUP)
    best = max((i for i in range(len(ends)) if ends[i] >= first), key=lambda i: means[i], default=None)
    return None if best is None else f"{means[best]:.3f}@{ends[best]}"


def table(records: list[dict]) -> tuple[list[dict], str]:
    layer = watched_layer(records)
    by_label = {r["label"]: r for r in records}
    rows = []
    for r in records:
        loss = [v for _, v in r["loss"] if v is not None]
        first_step = r["loss"][0][0] if r["loss"] else r.get("forked_at")
        warn = next((e for e in r["events"] if e.get("event") == "monitor_warning"
                     and (first_step is None or e["step"] >= first_step)), None)
        last = r["probes"][-1] if r["probes"] else None
        rows.append({
            "run": r["label"], "machine": r["machine"], "steps": f"{first_step}-{r['loss'][-1][0]}" if loss else f"{first_step}: none",
            "status": r["status"] or "no summary (stopped with its machine)",
            "explosion_step": explosion_step(as_run(r, by_label)),
            "min_loss": min(loss) if loss else None, "last_100_mean": float(np.mean(loss[-100:])) if loss else None,
            "first_warning": (f"{warn['step']} {warn.get('indicator')}" + (f" L{warn['layer']}" if warn.get("layer") is not None else "")) if warn else None,
            "layer": layer,
            **{f"max_logit@{s}": at(r, s, "max_logit", layer) for s in (2000, 2300, 4000)},
            **{f"q_norm@{s}": at(r, s, "q_norm", layer) for s in (2000, 2300, 4000)},
            "repeated_max_peak": max((p["repeated_max"][layer] for p in r["probes"]
                                      if p["repeated_max"][layer] is not None), default=None),
            "peak_50_step_mean": peak_mean(r, by_label),
            "max_logit_last": last["max_logit"][layer] if last else None,
            "q_norm_last": last["q_norm"][layer] if last else None,
            "q_norm_others_last": max((v for i, v in enumerate(last["q_norm"]) if i != layer and v is not None),
                                      default=None) if last else None,
            "last_probe": last["step"] if last else None})
    cols = list(rows[0])
    fmt = [f"{c}" for c in cols]
    lines = [" | ".join(fmt)]
    for row in rows:
        lines.append(" | ".join("-" if row[c] is None else f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c])
                                for c in cols))
    return rows, "\n".join(lines) + "\n"


def figure(records: list[dict], out: Path) -> None:
    layer = watched_layer(records)
    by_label = {r["label"]: r for r in records}
    fig, axes = plt.subplots(3, 1, figsize=(14, 10), sharex=True)
    for i, r in enumerate(records):
        colour, ls, mark = f"C{i % 10}", ("-", "--", ":")[i // 10 % 3], ".x+"[i // 10 % 3]   # ten colours, then styles
        rows = [(s, v) for s, v in history(r, by_label) if v is not None]
        own = r["loss"][0][0] if r["loss"] else None
        steps, loss = np.array([s for s, _ in rows]), np.array([v for _, v in rows])
        stop = explosion_step(as_run(r, by_label))
        if own is not None:                              # a fork's mean starts from its parent's last steps
            w = min(50, len(loss))
            smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
            keep = steps[w - 1:] >= own
            axes[0].plot(steps[w - 1:][keep], smooth[keep], color=colour, ls=ls, label=r["label"], lw=1.2)
        elif own is None and stop is not None:           # stopped at its first step: marked where it stopped
            axes[0].plot([stop], [loss[-50:].mean()], "x", color=colour, ms=10, mew=2,
                         label=f"{r['label']} (non-finite at {stop})")
        ps = [p["step"] for p in r["probes"]]
        axes[1].plot(ps, [p["max_logit"][layer] for p in r["probes"]], color=colour, ls=ls, marker=mark, lw=1, ms=4)
        axes[2].plot(ps, [p["q_norm"][layer] for p in r["probes"]], color=colour, ls=ls, marker=mark, lw=1, ms=4)
        if stop is not None and own is not None:
            for ax in axes:
                ax.axvline(stop, color=colour, ls=":", lw=1)
    axes[0].set_ylabel("training loss (mean of 50 steps)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside: the curves keep the panel
    axes[1].set_ylabel(f"layer {layer}: largest attention logit")
    axes[1].set_yscale("log")
    axes[2].set_ylabel(f"layer {layer}: W_Q spectral norm")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("step (dotted: explosion step)")
    fig.suptitle("GPT-2 small, faithful bf16 attention arithmetic, installed-packages corpus")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _records(path: Path, ap: argparse.ArgumentParser) -> list:
    """The records of a runs.json this script wrote (``.xz``: read through xz), or an error naming --from."""
    try:
        if path.suffix == ".xz":
            with lzma.open(path, "rt") as f:
                text = f.read()
        else:
            text = path.read_text()
        records = json.loads(text)
    except (OSError, lzma.LZMAError, UnicodeDecodeError, json.JSONDecodeError) as e:
        ap.error(f"--from {str(path)!r} could not be read as a runs.json this script wrote "
                 f"(or its .xz): {type(e).__name__}: {e}")
    if not isinstance(records, list) or not all(isinstance(r, dict) and "label" in r for r in records):
        ap.error(f"--from {str(path)!r} is not a runs.json this script wrote: expected a list of run records")
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="append", default=[], type=lambda t: _pair(t, "--run"), metavar="LABEL=RUN_DIR")
    ap.add_argument("--machine", action="append", default=[], type=lambda t: _pair(t, "--machine"),
                    metavar="LABEL=GPU")
    ap.add_argument("--fork", action="append", default=[],
                    metavar="LABEL=PARENT@STEP", help="LABEL is a fork of run PARENT from step STEP")
    ap.add_argument("--from", dest="source", type=Path,
                    help="a runs.json this script wrote, or that file xz-compressed (runs.json.xz)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not args.run and not args.source:
        ap.error("give --run LABEL=RUN_DIR (one or more), --from runs.json, or both")
    records = _records(args.source, ap) if args.source else []
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        machines = dict(args.machine)
        forks = {}
        known = [r["label"] for r in records]
        again = sorted({label for label, _ in args.run} & set(known))
        if again:
            ap.error(f"--run labels already in {args.source}: {', '.join(again)}; accepted: new labels")
        labels = known + [label for label, _ in args.run]
        for text in args.fork:                 # labels may hold "=": the split that names a --run's label
            head, sep, step = text.rpartition("@")
            cuts = [i for i, c in enumerate(head) if c == "=" and head[:i] in labels and head[i + 1:] in labels]
            if not sep or not step.isdigit() or not cuts:
                names = [head[:i] for i, c in enumerate(head) if c == "="]
                missing = [n for n in names if n not in labels] if names else []
                if missing and len(missing) == len(names):
                    ap.error(f"--fork {text!r} names runs that no --run{' or --from record' if records else ''} gives: "
                             f"{', '.join(missing)}")
                ap.error(f"--fork {text!r} is invalid; accepted: LABEL=PARENT@STEP, LABEL and PARENT labels of --run")
            forks[head[:cuts[0]]] = (head[cuts[0] + 1:], int(step))
        unknown = sorted(set(machines) - {label for label, _ in args.run})
        if unknown:
            ap.error(f"--machine names runs that no --run gives: {', '.join(unknown)}")
        absent = [f"{label}={path}" for label, path in args.run if not (Path(path) / "metrics.jsonl").is_file()]
        if absent:
            ap.error(f"--run {', '.join(absent)}: no metrics.jsonl there; accepted: training run folders")
        records += [compact(label, Path(path), machines.get(label), forks.get(label)) for label, path in args.run]
        write_text_atomic(args.out / "runs.json", json.dumps(records, separators=(",", ":")) + "\n")
    rows, text = table(records)
    write_text_atomic(args.out / "table.json", json.dumps(rows, indent=1) + "\n")
    write_text_atomic(args.out / "table.txt", text)
    figure(records, args.out / "indicators.png")
    print(text, end="")
    print(f"written: {args.out / 'table.txt'}, table.json, indicators.png" + (", runs.json" if args.run else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
