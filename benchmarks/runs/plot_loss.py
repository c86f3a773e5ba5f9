"""Training-loss curves of runs on one log-scale plot, each run's monitor switches as dotted lines
in its colour and an x where a run did not finish (non-finite, stopped into an explosion, or
stopped by hand: its summary does not say "finished").

    python benchmarks/runs/plot_loss.py OUT.png --run "LABEL=RUN_DIR" [--run ...] [--title T]
                                   [--ylim 0.25 12] [--xlim 0 5000] [--dashed LABEL ...]

A RUN_DIR holds metrics.jsonl (a `stableflash train` or `repro` run folder). Colours follow the
order of --run; --dashed draws the named runs dashed (e.g. a baseline the others are read against).
"""
import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from stableflash.report import events_of, load_run, loss_series  # noqa: E402


def parse_run(text: str) -> tuple[str, Path]:
    label, sep, path = text.rpartition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"--run {text!r} is invalid; accepted: LABEL=RUN_DIR")
    if not (Path(path) / "metrics.jsonl").exists():
        raise argparse.ArgumentTypeError(f"--run {text!r}: {path} holds no metrics.jsonl; accepted: a run folder")
    return label, Path(path)


def plot(out: Path, runs: list[tuple[str, Path]], title: str, ylim, xlim, dashed=()) -> None:
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, (label, path) in enumerate(runs):
        run = load_run(path)
        steps, losses = loss_series(run)
        color = f"C{i}"
        ax.plot(steps, losses, "--" if label in dashed else "-", color=color, label=label, lw=1)
        if (run.summary or {}).get("status") != "finished":
            ax.plot(steps[-1], losses[-1], "x", color=color, ms=9, mew=2)
        for e in events_of(run, "monitor_action"):
            ax.axvline(e["step"], color=color, lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if ylim:
        ax.set_ylim(*ylim)
    if xlim:
        ax.set_xlim(*xlim)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--run", type=parse_run, action="append", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--ylim", type=float, nargs=2)
    ap.add_argument("--xlim", type=float, nargs=2)
    ap.add_argument("--dashed", nargs="*", default=())
    args = ap.parse_args()
    plot(args.out, args.run, args.title, args.ylim, args.xlim, set(args.dashed))


if __name__ == "__main__":
    main()
