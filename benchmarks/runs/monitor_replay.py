"""The monitor's settings replayed on recorded runs, scored against the target: a warning in time
on the failures, none on the stabilized and control runs.

    python benchmarks/runs/monitor_replay.py FOLDER ... [--held-out ARCHIVE,...] [--new ARCHIVE,...] [--json OUT.json]

Every folder below the arguments that holds probes.jsonl and metrics.jsonl is a run (the same
metrics file twice is counted once). Its *archive* is the first folder below the argument it was
found under (one unpacked ``runs.tar.xz`` each when FOLDER holds the unpacked archives side by
side); it is named by its path below that argument (below the argument's own name when there are
several). Each setting of ``SETTINGS`` is replayed through ``diagnostics.monitor.Monitor`` on every
run's probe records in order, with the run's own warm-up (``warmup_iters``); only the probe
indicators are replayed (the metrics keep the loss every ``log_every`` steps, not every step).

A run's role comes from its config (``role``): *control* (every layer's attention rounds nowhere
below fp32), *stabilized* (every low-precision layer takes δ from the source
``attention.policy.consistent_delta_source`` names for its policy: what ``stabilize=True`` runs
there; the stored O plus its residual and O as computed in fp32 count as the same source, as do
the 16-bit P̄V's O and that O plus its residual), *baseline* (low-precision attention with δ from
its stored O, no row-maximum rule, nearest rounding, the architecture of its preset), *mitigation*
(anything else: a rule without the consistent δ, another δ source, stochastic rounding, fp32 heads,
a changed architecture, layers mixing those) and *switched* (``monitor=switch`` or ``rollback``:
the action changed the run after its first warning; left out of the scores).

A run folder copied from another and resumed with other settings (a fork) carries its parent's
records up to the fork: its metrics.jsonl begins with every line of the parent's (``find_forks``).
A fork with the parent's attention is the parent continued: the parent's folder, its first part,
is left out (*continued*) and the fork is scored in the parent's role. A fork with other
attention is *forked*: its steps before the fork ran the parent's arithmetic, so it is neither a
failure nor a held run of its own configuration; it is left out of the scores like a switched run,
and its first warning at or after the fork (the monitor's state carried over from the parent's
records, as a resumed run's monitor carries it from the checkpoint) is listed apart.

A failure is a run with an explosion step (``report.runs.explosion_step``: the loss non-finite, or
above 2× its running minimum for good). A warning is *in time* when it comes at least 500 steps,
or at least 20% of the steps to the explosion, before it (``in_time``). A *false alarm* is any
warning on a stabilized or control run that did not fail. A baseline or mitigation that did not
fail within its steps is counted apart: its configuration fails on other seeds or later, so a
warning there is not necessarily false.

Held out: whole archives, chosen before any setting was tuned by ``held_out_archives`` (the
archives' names sorted, shuffled by ``random.Random(26)``, taken in that order until they hold at
least a quarter of the scored runs); ``--held-out`` names others. Archives recorded after that
choice are named with ``--new``: they are scored apart and left out of the seeded choice, which
then picks from the archives it picked from before. Scores are printed for the tuning archives,
the held-out ones, the new ones (when named) and all together.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import statistics
import sys
from pathlib import Path

from stableflash.diagnostics.monitor import Monitor, MonitorConfig
from stableflash.report.runs import explosion_step, load_run

LEAD_STEPS = 500              # a warning this many steps before the explosion is in time ...
LEAD_SHARE = 0.2              # ... and so is one this share of the steps to the explosion before it
HELD_OUT_SEED = 26
HELD_OUT_SHARE = 0.25
ROLES = ("baseline", "mitigation", "stabilized", "control", "switched", "forked", "continued")
LEFT_OUT = ("switched", "forked", "continued")               # roles the scores leave out
OFF = {"spectral_ratio": 1e9, "repeated_max": 1e9}          # the default probe indicators off

# (name, MonitorConfig settings): the defaults, and the largest-logit indicators alone
SETTINGS = [("defaults (W_Q ratio 4, growth 3, repeated maxima 0.25, patience 2)", {}),
            ("W_Q ratio 3, patience 1", {"spectral_ratio": 3.0, "patience": 1})]
SETTINGS += [(f"largest logit above {t:g}, patience {p}", {**OFF, "max_logit": t, "patience": p})
             for t in (100.0, 150.0, 200.0, 300.0, 500.0) for p in (1, 2)]
SETTINGS += [(f"largest logit above {g:g}x its level after warm-up, patience {p}",
              {**OFF, "max_logit_growth": g, "patience": p})
             for g in (2.0, 3.0, 4.0, 5.0, 6.0, 8.0) for p in (1, 2)]
SETTINGS += [(f"largest logit above {g:g}x the median of its last probes, patience {p}",
              {**OFF, "max_logit_rise": g, "patience": p})
             for g in (2.0, 2.5, 3.0, 4.0, 5.0) for p in (1, 2)]


def in_time(warned: int | None, exploded: int) -> bool:
    """Whether a first warning at step ``warned`` came in time for an explosion at ``exploded``."""
    if warned is None or warned > exploded:
        return False
    return exploded - warned >= LEAD_STEPS or exploded - warned >= LEAD_SHARE * exploded


def role(config: dict, n_layer: int) -> str:
    """The run's role (module docstring) from its stored config and its number of layers."""
    import torch

    from stableflash.attention.policy import consistent_delta_source, resolve_policy
    from stableflash.model.spec import parse_attention_spec
    from stableflash.train.config import upgrade_stored

    config = upgrade_stored(config)
    if config.get("monitor") in ("switch", "rollback"):
        return "switched"
    same = {"dO·O32": "dO·(O+R)", "dO·O16": "dO·(O16+R)"}
    kinds = set()
    for choice in parse_attention_spec(config["attention"]).choices(n_layer):
        if choice.backend in ("sdpa", "reference"):
            kinds.add("exact")
            continue
        policy = resolve_policy(choice.policy, torch.bfloat16)
        points = [policy.point(p) for p in ("scores", "p_bar", "acc", "row_sum", "out")]
        if min(fmt.man_bits for fmt, _ in points) >= 23 and not policy.narrows_v:
            kinds.add("exact")
            continue
        source = choice.stabilization.policy_for(policy).delta
        wanted = consistent_delta_source(policy)
        if source != "dO·O" and same.get(source, source) == same.get(wanted, wanted):
            kinds.add("consistent")
        elif (choice.stabilization.rule.kind != "standard" or source != "dO·O" or policy.hp_heads
              or any(rounding != "rne" for _, rounding in points)):
            kinds.add("changed")
        else:
            kinds.add("plain")
    changed_model = bool(config.get("qk_norm") or config.get("attn_gate") or config.get("attn_softcap")
                         or "qknorm" in str(config.get("model")))
    if kinds == {"exact"}:
        return "control"
    if changed_model or len(kinds) > 1 or kinds == {"changed"}:
        return "mitigation"
    return "stabilized" if kinds == {"consistent"} else "baseline"


def find_runs(roots: list[Path]) -> list[dict]:
    seen, runs, lines = set(), [], {}
    for root in roots:
        for probes in sorted(root.rglob("probes.jsonl")):
            folder = probes.parent
            if not (folder / "metrics.jsonl").is_file():
                continue
            text = (folder / "metrics.jsonl").read_bytes()
            digest = hashlib.sha1(text).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            run = load_run(folder)
            widths = [len(r["spectral"]["q_full"]) for r in run.probes if (r.get("spectral") or {}).get("q_full")]
            if not widths or not run.config:
                continue                                  # no probe with the layers, or no config: cannot score
            rel = folder.relative_to(root)
            name = (rel if len(roots) == 1 else Path(root.name) / rel).as_posix()   # below the argument(s)
            runs.append({"path": name, "archive": rel.parts[0] if len(rel.parts) > 1 else root.name,
                         "role": role(run.config, widths[0]), "probes": run.probes,
                         "warmup": int(run.config.get("warmup_iters") or 0),
                         "probe_every": run.config.get("probe_every"),
                         "exploded_at": explosion_step(run),
                         "steps": run.metrics[-1]["step"] + 1 if run.metrics else 0,
                         "attention": run.config.get("attention")})
            lines[name] = text.splitlines()
    find_forks(runs, lines)
    return runs


def find_forks(runs: list[dict], lines: dict[str, list[bytes]]) -> None:
    """Mark the forks among ``runs`` (module docstring) from their metrics lines (``lines``, by
    path): a run's parent is the run with the most lines that are all the first lines of its own,
    fewer than its own. A fork with its parent's attention and role continues it (the parent
    becomes *continued*, with ``continued_by``); one with other attention is *forked*, with
    ``forked_from`` and ``forked_at`` (the step of its first record after the parent's)."""
    by_first: dict[bytes, list[dict]] = {}
    for run in runs:
        if lines[run["path"]]:
            by_first.setdefault(lines[run["path"]][0], []).append(run)
    decided = []
    for group in by_first.values():
        for run in group:
            own = lines[run["path"]]
            parents = [r for r in group
                       if len(lines[r["path"]]) < len(own) and own[:len(lines[r["path"]])] == lines[r["path"]]]
            if parents:
                parent = max(parents, key=lambda r: len(lines[r["path"]]))
                decided.append((run, parent, json.loads(own[len(lines[parent["path"]])]).get("step", 0)))
    for run, parent, at in decided:              # every parent found first: roles as the configs give them
        if run["attention"] == parent["attention"] and run["role"] == parent["role"]:
            parent["continued_by"] = run["path"]
        else:
            run["forked_from"], run["forked_at"] = parent["path"], at
    for run, parent, _ in sorted(decided, key=lambda d: len(lines[d[0]["path"]])):   # parents before their forks
        if "continued_by" in parent and "forked_from" in parent and "forked_from" not in run:
            run["forked_from"], run["forked_at"] = parent["forked_from"], parent["forked_at"]   # a fork continued
    for run in runs:
        if "continued_by" in run:
            run["role"] = "continued"
        elif "forked_from" in run:
            run["role"] = "forked"


def held_out_archives(runs: list[dict], seed: int = HELD_OUT_SEED, share: float = HELD_OUT_SHARE) -> list[str]:
    """Whole archives held out: sorted, shuffled by ``random.Random(seed)``, taken until they hold
    ``share`` of the scored runs (the switched, forked and continued ones left out)."""
    counts: dict[str, int] = {}
    for r in runs:
        if r["role"] not in LEFT_OUT:
            counts[r["archive"]] = counts.get(r["archive"], 0) + 1
    order = sorted(counts)
    random.Random(seed).shuffle(order)
    held, n = [], 0
    for archive in order:
        if n >= share * sum(counts.values()):
            break
        held.append(archive)
        n += counts[archive]
    return sorted(held)


def stored_settings(config: dict) -> dict:
    """The MonitorConfig settings a run was trained with (its config.json's ``monitor_<field>``, as
    ``train.config.monitor_config`` reads them), the action, its scope and the warm-up left out: what
    replaying it as it ran takes."""
    return {f.name: config[f"monitor_{f.name}"] for f in dataclasses.fields(MonitorConfig)
            if f.name != "scope" and f"monitor_{f.name}" in config}


def first_warning(run: dict, settings: dict, since: int = 0) -> int | None:
    """The step of the first probe warning at or after step ``since`` that the monitor with
    ``settings`` gives on ``run``'s records (replayed from the first)."""
    monitor = Monitor(MonitorConfig(action="warn", warmup_steps=run["warmup"], **settings))
    for record in run["probes"]:
        if monitor.observe_probe(record["step"], record) and record["step"] >= since:
            return record["step"]
    return None


def score(runs: list[dict], warned: dict[str, int | None]) -> dict:
    fails = [r for r in runs if r["exploded_at"] is not None and r["role"] not in LEFT_OUT]
    leads = [r["exploded_at"] - warned[r["path"]] for r in fails
             if warned[r["path"]] is not None and warned[r["path"]] <= r["exploded_at"]]
    held = {role: [r for r in runs if r["exploded_at"] is None and r["role"] == role] for role in ROLES[:4]}
    return {"failures": len(fails), "in_time": sum(in_time(warned[r["path"]], r["exploded_at"]) for r in fails),
            "before": len(leads), "median_lead": statistics.median(leads) if leads else None,
            "false_alarms": sum(warned[r["path"]] is not None for r in held["stabilized"] + held["control"]),
            "stabilized_or_control": len(held["stabilized"] + held["control"]),
            "false_alarm_runs": [r["path"] for r in held["stabilized"] + held["control"] if warned[r["path"]] is not None],
            "not_in_time": [[r["path"], warned[r["path"]], r["exploded_at"]] for r in fails
                            if not in_time(warned[r["path"]], r["exploded_at"])],
            **{f"warned_{role}_held": sum(warned[r["path"]] is not None for r in held[role])
               for role in ("baseline", "mitigation")},
            **{f"{role}_held": len(held[role]) for role in ("baseline", "mitigation")}}


def line(s: dict) -> str:
    share = 100 * s["in_time"] / s["failures"] if s["failures"] else math.nan
    return (f"{s['in_time']:>3}/{s['failures']:<3} {share:3.0f}% {s['before']:>4} {str(s['median_lead']):>7} | "
            f"{s['false_alarms']:>2}/{s['stabilized_or_control']:<3}| {s['warned_baseline_held']:>2}/{s['baseline_held']:<3}"
            f"{s['warned_mitigation_held']:>3}/{s['mitigation_held']:<3}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--held-out", help="comma-separated archives to hold out instead of the seeded choice")
    ap.add_argument("--new", help="comma-separated archives recorded after the held-out choice: scored apart")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.is_dir()]
    if missing:
        print(f"monitor_replay: {', '.join(missing)}: not a folder; expected folders holding run folders", file=sys.stderr)
        return 2
    runs = find_runs(args.paths)
    if not runs:
        print(f"monitor_replay: no run with probes.jsonl, metrics.jsonl and config.json below {', '.join(map(str, args.paths))}",
              file=sys.stderr)
        return 2
    new = sorted(args.new.split(",")) if args.new else []
    unknown = sorted(set(new) - {r["archive"] for r in runs})
    if unknown:
        print(f"monitor_replay: --new {', '.join(unknown)}: no such archive below {', '.join(map(str, args.paths))}",
              file=sys.stderr)
        return 2
    held = sorted(args.held_out.split(",")) if args.held_out else held_out_archives(
        [r for r in runs if r["archive"] not in new])
    parts = {"tuning": [r for r in runs if r["archive"] not in held + new],
             "held out": [r for r in runs if r["archive"] in held],
             **({"new": [r for r in runs if r["archive"] in new]} if new else {}), "all": runs}
    forks = [r for r in runs if r["role"] == "forked"]
    counts = {role: [sum(r["role"] == role and (r["exploded_at"] is not None) == f for r in runs) for f in (True, False)]
              for role in ROLES}
    print(f"{len(runs)} runs; held out: {', '.join(held)}" + (f"; new: {', '.join(new)}" if new else ""))
    print("roles (failed / did not): " + ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in counts.items()))
    print(f"in time: a first warning >= {LEAD_STEPS} steps or >= {LEAD_SHARE:.0%} of the steps to the explosion before it")
    print("columns: failures warned in time (share), warned before at all, median lead | false alarms on stabilized "
          "and control runs that held | warnings on baselines, on mitigations that held")
    rows = []
    for name, settings in SETTINGS:
        warned = {r["path"]: first_warning(r, settings) for r in runs}
        row = {"setting": name, "settings": settings, **{part: score(rs, warned) for part, rs in parts.items()},
               "forks_warned_after_fork": {r["path"]: first_warning(r, settings, since=r["forked_at"]) for r in forks}}
        del row["all"]["not_in_time"]                 # the parts' lists together
        rows.append(row)
        print(f"\n{name}")
        for part in parts:
            print(f"  {part:>8}: {line(row[part])}")
        if forks:
            after = row["forks_warned_after_fork"]
            print(f"     forks: warned at or after the fork on {sum(v is not None for v in after.values())} of {len(forks)}")
    if args.json:
        args.json.write_text(json.dumps({"held_out": held, "new": new, "lead_steps": LEAD_STEPS, "lead_share": LEAD_SHARE,
                                         "runs": [{k: v for k, v in r.items() if k != "probes"} for r in runs],
                                         "rows": rows}, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
