"""Largest attention logit each probe saw, per run: the probes' ``max_logit`` (per layer and head,
over the probed rows) reduced to one number per probed step. With the paper's row-maximum rule a
tied row whose largest logit passes about 87 underflows ℓ to zero on a GPU (fp32's range without
subnormals: docs/mitigations.md), so this says when a run came within reach of that edge.

    python benchmarks/runs/max_logit.py RUN_OR_ROOT [...] [--every 100] [--edge 87]

A RUN_OR_ROOT is a run folder (holding probes.jsonl) or any folder above run folders.
"""
import argparse
import math
from pathlib import Path

from stableflash.diagnostics.monitor import largest_logits
from stableflash.report import load_run


def max_logits(run_dir: Path) -> list[tuple[int, float]]:
    """(step, largest finite logit over every layer and head) of each probe record of the run (read
    by ``report.load_run``, which skips malformed lines with a warning): the largest of the
    monitor's per-layer values (``largest_logits``; NaN where a record has none finite)."""
    return [(rec["step"], max((v for _, v, _ in largest_logits(rec)), default=math.nan))
            for rec in load_run(run_dir).probes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--every", type=int, default=100, help="print steps that are multiples of this (and the last)")
    ap.add_argument("--edge", type=float, default=87.0, help="report the first probed step above this logit")
    args = ap.parse_args()
    for root in args.paths:
        files = [root / "probes.jsonl"] if (root / "probes.jsonl").exists() else sorted(root.rglob("probes.jsonl"))
        if not files:
            raise SystemExit(f"paths: {root} holds no probes.jsonl; accepted: a run folder or a folder above runs")
        for f in files:
            try:
                rows = max_logits(f.parent)
            except FileNotFoundError as exc:              # probes without the run's metrics.jsonl
                raise SystemExit(f"paths: {exc}") from None
            shown = [f"{s}:{v:.0f}" for i, (s, v) in enumerate(rows) if s % args.every == 0 or i == len(rows) - 1]
            above = next((s for s, v in rows if v > args.edge), None)
            name = f.parent.relative_to(root.parent) if f.parent != root else root.name
            print(f"{str(name):44s} first above {args.edge:g}: {above if above is not None else '-':>5}  "
                  + " ".join(shown))


if __name__ == "__main__":
    main()
