"""Mean logged training loss of each run over the 100 steps up to STEP, to compare runs that ran
for different lengths (the kernel presets' learning rate is constant after warm-up).

    python benchmarks/runs/loss_at.py STEP RUNS_DIR [RUNS_DIR ...]

A RUNS_DIR is a `stableflash repro` output (seed*/<role>/metrics.jsonl under it).
"""
import sys
from pathlib import Path

from stableflash.report import load_run, loss_series


def mean_loss(run_dir: Path, step: int) -> tuple[float, int]:
    steps, losses = loss_series(load_run(run_dir))
    window = losses[(steps > step - 100) & (steps <= step)]
    return (float(window.mean()) if window.size else float("nan")), int(window.size)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    step = int(sys.argv[1])
    for root in map(Path, sys.argv[2:]):
        for metrics in sorted(root.glob("seed*/*/metrics.jsonl")):
            value, n = mean_loss(metrics.parent, step)
            print(f"{root.name:24s} {metrics.parent.parent.name:6s} {metrics.parent.name:10s} "
                  f"mean loss over ({step - 100}, {step}]: {value:.4f} (n={n})")


if __name__ == "__main__":
    main()
