"""How the monitor's thresholds trade lead time against false alarms, replayed on recorded runs.

    python benchmarks/runs/monitor_sweep.py RUN_OR_FOLDER ... [--json OUT.json]

Every folder below the arguments that holds probes.jsonl and metrics.jsonl is a run (duplicates,
same metrics file content, are counted once). The monitor (``diagnostics.monitor.Monitor``) is a
function of the probe records, so replaying them with other thresholds shows what it would have
said. Only the probe indicators are replayed (W_Q's spectral norm, repeated maxima); the loss
indicator needs every step's loss, which the metrics keep every 10 steps only. For each setting:
how many explosions (``report.runs.explosion_step``) got a warning before them, the median lead
time in steps, and how many runs that never exploded got a warning anyway (false alarms). The
default setting is checked against the warnings the runs logged while training.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import statistics
from pathlib import Path

from stableflash.diagnostics.monitor import Monitor, MonitorConfig
from stableflash.report.runs import explosion_step, load_run

GRID = {"spectral_ratio": (2.0, 3.0, 4.0, 6.0, 8.0), "growth": (2.0, 3.0, 5.0), "patience": (1, 2, 3),
        "repeated_max": (0.25, 1e9)}          # 1e9: the repeated-maxima indicator off
# the largest-logit indicator (off by default) alone, the other probe indicators off, and beside
# the default setting
LOGIT_GRID = {"max_logit": (100.0, 150.0, 200.0, 300.0, 500.0, 1000.0), "patience": (1, 2)}
ALONE = {"spectral_ratio": 1e9, "repeated_max": 1e9}


def runs_below(paths: list[Path]) -> list[Path]:
    seen, found = set(), []
    for root in paths:
        for probes in sorted(root.rglob("probes.jsonl")):
            run = probes.parent
            if not (run / "metrics.jsonl").exists():
                continue
            digest = hashlib.sha1((run / "metrics.jsonl").read_bytes()).hexdigest()
            if digest not in seen:
                seen.add(digest)
                found.append(run)
    return found


def first_warning(probes: list[dict], **settings) -> int | None:
    monitor = Monitor(MonitorConfig(action="warn", **settings))
    for record in probes:
        if monitor.observe_probe(record["step"], record):
            return record["step"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = []
    for path in runs_below(args.paths):
        run = load_run(path)
        logged = [e["step"] for e in run.events if e.get("event") == "monitor_warning" and e.get("indicator") != "loss"]
        runs.append({"path": str(path), "probes": run.probes, "exploded_at": explosion_step(run),
                     "logged_first": min(logged) if logged else None,
                     "status": (run.summary or {}).get("status"),
                     "steps": run.metrics[-1]["step"] + 1 if run.metrics else 0})
    # a run stopped by a non-finite gradient failed, but not by explosion: neither group
    stopped = [r for r in runs if r["exploded_at"] is None and r["status"] == "nonfinite"]
    boom = [r for r in runs if r["exploded_at"] is not None]
    calm = [r for r in runs if r["exploded_at"] is None and r["status"] != "nonfinite"]
    replay = [first_warning(r["probes"]) for r in runs]
    agree = sum(a == r["logged_first"] for a, r in zip(replay, runs))
    print(f"{len(runs)} runs: {len(boom)} exploded, {len(calm)} did not, {len(stopped)} stopped on a non-finite "
          f"gradient (left out); the default setting's replay gives the logged first probe warning in {agree} of "
          f"{len(runs)}")
    rows = [evaluate(dict(zip(GRID, values)), boom, calm) for values in itertools.product(*GRID.values())]
    print(f"{'spectral':>8} {'growth':>6} {'patience':>8} {'rep.max':>7} | {'before':>6} {'late':>4} {'missed':>6} "
          f"{'median lead':>11} {'min lead':>8} | false alarms")
    for r in rows:
        rep = "off" if r["repeated_max"] > 1 else f"{r['repeated_max']:g}"
        print(f"{r['spectral_ratio']:>8g} {r['growth']:>6g} {r['patience']:>8} {rep:>7} | {outcome(r)}")
    logit_rows = []
    for alone in (True, False):
        for values in itertools.product(*LOGIT_GRID.values()):
            settings = {**(ALONE if alone else {}), **dict(zip(LOGIT_GRID, values))}
            logit_rows.append({**evaluate(settings, boom, calm), "alone": alone})
    print(f"\nthe largest-logit indicator, alone and beside the default probe indicators\n"
          f"{'max logit':>9} {'patience':>8} {'with':>14} | {'before':>6} {'late':>4} {'missed':>6} "
          f"{'median lead':>11} {'min lead':>8} | false alarms")
    for r in logit_rows:
        with_ = "alone" if r["alone"] else "the defaults"
        print(f"{r['max_logit']:>9g} {r['patience']:>8} {with_:>14} | {outcome(r)}")
    if args.json:
        args.json.write_text(json.dumps({"runs": [{k: v for k, v in r.items() if k != "probes"} for r in runs],
                                         "default_replay_agrees": agree, "rows": rows, "logit_rows": logit_rows},
                                        indent=1))


def evaluate(settings: dict, boom: list[dict], calm: list[dict]) -> dict:
    """One setting replayed on the exploded runs (warned before, late, missed; lead times) and on
    the runs that never exploded (false alarms)."""
    leads, missed, late = [], 0, 0
    for r in boom:
        w = first_warning(r["probes"], **settings)
        if w is None:
            missed += 1
        elif w > r["exploded_at"]:
            late += 1
        else:
            leads.append(r["exploded_at"] - w)
    false = sum(first_warning(r["probes"], **settings) is not None for r in calm)
    return {**settings, "warned_before": len(leads), "late": late, "missed": missed,
            "median_lead": statistics.median(leads) if leads else None,
            "min_lead": min(leads) if leads else None, "false_alarms": false, "quiet_runs": len(calm)}


def outcome(r: dict) -> str:
    return (f"{r['warned_before']:>6} {r['late']:>4} {r['missed']:>6} {str(r['median_lead']):>11} "
            f"{str(r['min_lead']):>8} | {r['false_alarms']} of {r['quiet_runs']}")


if __name__ == "__main__":
    main()
