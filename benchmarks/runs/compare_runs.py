"""Compare training runs step by step: loss differences against the first run and median tokens/s
(first WARM records skipped). Used for the DDP check (one GPU vs two, same global batch and data
order). Prints a table; JSON to $OUT/compare.json (or --json PATH)."""
import argparse
import json
import os
import statistics
from pathlib import Path

from stableflash.train.metrics import read_metrics


def records(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "event" not in r and "loss" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "compare.json")
    args = ap.parse_args()
    base = {r["step"]: r for r in records(args.runs[0])}
    out = []
    for run in args.runs:
        rows = records(run)
        common = [r for r in rows if r["step"] in base]
        diffs = [abs(r["loss"] - base[r["step"]]["loss"]) for r in common]
        speed = [r["tokens_per_s"] for r in rows[args.warm:] if "tokens_per_s" in r]
        out.append({"run": str(run), "steps": len(rows), "final_loss": rows[-1]["loss"] if rows else None,
                    "max_abs_loss_diff": max(diffs) if diffs else None,
                    "mean_abs_loss_diff": statistics.fmean(diffs) if diffs else None,
                    "median_tokens_per_s": statistics.median(speed) if speed else None})
    b = out[0]["median_tokens_per_s"]
    for o in out:
        o["speed_ratio"] = o["median_tokens_per_s"] / b if b and o["median_tokens_per_s"] else None
    args.json.write_text(json.dumps(out, indent=1))
    print(f"{'run':40s} {'steps':>6s} {'final loss':>11s} {'max |Δloss|':>12s} {'mean |Δloss|':>13s} "
          f"{'tokens/s':>10s} {'ratio':>6s}")
    for o in out:
        print(f"{o['run'][-40:]:40s} {o['steps']:6d} {o['final_loss']:11.5f} {o['max_abs_loss_diff']:12.3e} "
              f"{o['mean_abs_loss_diff']:13.3e} {o['median_tokens_per_s'] or 0:10.0f} {o['speed_ratio'] or 0:6.2f}")


if __name__ == "__main__":
    main()
