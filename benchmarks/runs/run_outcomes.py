"""Outcome of each training run, as the mitigation tables state it: steps run, explosion step (loss
above 2× its running minimum without coming back within 50 steps: report.runs.explosion_step),
final and lowest loss, the monitor's warnings (count, first step) and the layers its switch moved,
with their steps. Arguments: run folders (those holding metrics.jsonl) or folders above them, which
are searched. Prints a table; JSON rows to --json.

    python benchmarks/runs/run_outcomes.py /tmp/r/sess-c /tmp/r/sess-d --json /tmp/outcomes.json
"""
import argparse
import json
from pathlib import Path

from stableflash.report import events_of, explosion_step, first_event_step, load_run, loss_series
from stableflash.train.metrics import read_metrics


def switches(run_dir: Path) -> list[list]:
    """[step, layers] of each monitor switch (its "monitor_action" records)."""
    return [[r["step"], r.get("layers")] for r in read_metrics(run_dir / "metrics.jsonl")
            if r.get("event") == "monitor_action" and r.get("action") == "switch"]


def outcome(run_dir: Path, root: Path) -> dict:
    run = load_run(run_dir)
    steps, losses = loss_series(run)
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    return {"run": str(run_dir.relative_to(root)), "attention": config.get("attention"),
            "steps": int(steps[-1]) + 1 if len(steps) else 0,
            "explosion_step": explosion_step(run),
            "final_loss": round(float(losses[-1]), 4) if len(losses) else None,
            "min_loss": round(float(losses.min()), 4) if len(losses) else None,
            "warnings": len(events_of(run, "monitor_warning")),
            "first_warning": first_event_step(run, "monitor_warning"),
            "switches": switches(run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    for path in args.paths:
        for metrics in sorted(path.rglob("metrics.jsonl")):
            rows.append(outcome(metrics.parent, path.parent))
    print(f"{'run':44s} {'steps':>6s} {'exploded':>9s} {'final':>7s} {'min':>6s} {'warn':>5s} {'first':>6s}  switches")
    for r in rows:
        print(f"{r['run']:44s} {r['steps']:6d} {str(r['explosion_step'] or '-'):>9s} {r['final_loss']:7.3f} "
              f"{r['min_loss']:6.3f} {r['warnings']:5d} {str(r['first_warning'] or '-'):>6s}  "
              + " ".join(f"{s}:{layers}" for s, layers in r["switches"]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
