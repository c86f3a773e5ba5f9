"""Wall time and seconds per step of each run folder under the given folders: wall from the run's
config.json (written when it starts) to its summary.json (written when it ends), s/step as the
median of the logged steps' "ms" (the step alone: no probe, eval or checkpoint).

    python docs/notebook/results/laptop-repro/walls.py /tmp/laptop-final /tmp/lp/e3/s12
"""
import json
import statistics
import sys
from pathlib import Path

for root in map(Path, sys.argv[1:]):
    for metrics in sorted(root.rglob("metrics.jsonl")):
        run = metrics.parent
        wall = (run / "summary.json").stat().st_mtime - (run / "config.json").stat().st_mtime
        rows = [json.loads(line) for line in metrics.open()]
        ms = [r["ms"] for r in rows if "ms" in r]
        steps = json.loads((run / "summary.json").read_text())["steps"]
        print(f"{str(run):45s} steps {steps:5d}  wall {wall:6.1f} s  median {statistics.median(ms) / 1e3:.4f} s/step"
              f"  ({wall / steps:.4f} s/step with probes, evals, checkpoints)")
