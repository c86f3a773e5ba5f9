"""W_Q spectral norm (probes' "q_full", per layer) at chosen steps of each run folder given.

    python docs/notebook/results/laptop-repro/wq_norms.py 2000 4000 4600 -- RUN_DIR...
"""
import json
import sys
from pathlib import Path

cut = sys.argv.index("--")
steps, runs = [int(s) for s in sys.argv[1:cut]], sys.argv[cut + 1:]
for run in runs:
    probes = {r["step"]: r for r in map(json.loads, (Path(run) / "probes.jsonl").open())}
    cells = [f"{s}: " + ("/".join(f"{x:.1f}" for x in probes[s]["spectral"]["q_full"]) if s in probes else "-")
             for s in steps]
    print(f"{run:40s} W_Q norm by layer at step " + "  ".join(cells))
