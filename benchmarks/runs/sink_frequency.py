"""How often rows put their maximum on the first key (an attention sink), and how often that maximum
is tied, per probe step of recorded runs (the probes' row["sink_frac"], row["sink_repeated_frac"]:
``diagnostics.probes.row_max_stats``). The paper's Appendix D finds such sinks, with repeated maxima,
in Llama-3.1-8B. Beside each step: the chance level, the fraction of rows whose maximum would fall
on key 0 if each row's maximum were equally likely to be any key it sees (causal rows 1..T−1 of a
sequence of T).

    python benchmarks/runs/sink_frequency.py RUN_DIR ... [--json OUT.json]
"""
import argparse
import json
from pathlib import Path

import numpy as np

from stableflash.report.runs import load_run


def chance(block_size: int) -> float:
    """Mean over causal rows i = 1..T−1 (row i sees i + 1 keys) of 1/(i + 1)."""
    return float(np.mean(1.0 / np.arange(2, block_size + 1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = []
    for run in args.runs:
        loaded = load_run(run)
        config = loaded.config or {}
        block = config.get("block_size")
        rows = [r for r in loaded.probes if "sink_frac" in r.get("row", {})]
        if not rows:
            print(f"{run}: no sink statistics in probes.jsonl (recorded before they existed)")
            continue
        t = int(rows[0].get("seq_len") or block or 0)
        level = chance(t) if t > 1 else float("nan")
        print(f"{run}  (model {config.get('model')}, chance level {level:.3f} at T = {t})")
        print(f"{'step':>6} {'sink mean':>10} {'sink max':>9} {'tied sink mean':>15} {'tied sink max':>14}")
        for r in rows:
            sink, tied = np.array(r["row"]["sink_frac"]), np.array(r["row"]["sink_repeated_frac"])
            print(f"{r['step']:6d} {sink.mean():10.3f} {sink.max():9.3f} {tied.mean():15.3f} {tied.max():14.3f}")
            out.append({"run": str(run), "step": r["step"], "sink_frac": r["row"]["sink_frac"],
                        "sink_repeated_frac": r["row"]["sink_repeated_frac"], "chance": level})
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
