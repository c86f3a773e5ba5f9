"""Mean logged training loss of each run over the 100 steps up to STEP, to compare runs that ran
for different lengths (the kernel presets' learning rate is constant after warm-up).

    python benchmarks/loss_at.py STEP RUNS_DIR [RUNS_DIR ...]

A RUNS_DIR is a `stableflash repro` output (seed*/baseline/metrics.jsonl under it).
"""
import json
import sys
from pathlib import Path


def mean_loss(metrics: Path, step: int) -> tuple[float, int]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    vals = [r["loss"] for r in rows if "event" not in r and step - 100 < r["step"] <= step]
    return (sum(vals) / len(vals) if vals else float("nan")), len(vals)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    step = int(sys.argv[1])
    for root in map(Path, sys.argv[2:]):
        for metrics in sorted(root.glob("seed*/*/metrics.jsonl")):
            value, n = mean_loss(metrics, step)
            print(f"{root.name:24s} {metrics.parent.parent.name:6s} {metrics.parent.name:10s} "
                  f"mean loss over ({step - 100}, {step}]: {value:.4f} (n={n})")


if __name__ == "__main__":
    main()
