"""``stableflash repro``: for each seed, train the baseline, the stabilized and the fp32-control
attention on the same batch order, then report.

The batch order is a pure function of the seed (train/data.py), so the three runs of a seed see
identical batches by construction; the recorded batch files are compared afterwards to prove it.
With ``parallel`` > 1 the runs go as that many worker processes at once (one GPU shares well
between small models whose steps are short: a reproduction must fit in minutes).
"""
from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from stableflash.model.spec import parse_attention_spec
from stableflash.repro.presets import REPRO_PRESETS, ReproPreset
from stableflash.report import build_report
from stableflash.report.runs import explosion_step, load_run
from stableflash.train.config import TrainConfig, make_config
from stableflash.train.loop import train

ROLES = ("baseline", "stabilized", "control")


def _same_batches(dirs: list[Path]) -> bool:
    """True when the recorded batch files agree over the steps all of them ran."""
    blobs = [(d / "batches" / "rank0.bin").read_bytes() for d in dirs]
    n = min(len(b) for b in blobs)
    return all(b[:n] == blobs[0][:n] for b in blobs)


def stored_summary(run_dir: Path, cfg: TrainConfig) -> dict | None:
    """run_dir's summary if it holds a run of ``cfg`` that wrote one (a key its config.json lacks,
    written before that key existed, must hold the default value); None otherwise."""
    summary, saved = Path(run_dir) / "summary.json", Path(run_dir) / "config.json"
    if not (summary.exists() and saved.exists()):
        return None
    stored, wanted, default = json.loads(saved.read_text()), cfg.to_dict(), TrainConfig().to_dict()
    if any(stored.get(key, default.get(key)) != value for key, value in wanted.items()):
        return None
    return json.loads(summary.read_text())


def train_job(job: tuple) -> dict:
    """One run (top level, so that worker processes can be handed it). A run of the same config
    that was interrupted (Ctrl-C, SIGTERM) in that folder is resumed from its checkpoint."""
    train_preset, overrides, run_dir, progress = job
    cfg = make_config(train_preset, overrides=overrides)
    earlier = stored_summary(Path(run_dir), cfg)
    resume = earlier is not None and earlier.get("status") == "interrupted"
    if resume and progress:
        print(f"resuming the interrupted run in {run_dir}")
    return train(cfg, Path(run_dir), resume=resume, progress=progress)


def check_parallel(parallel) -> None:
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel={parallel!r} is invalid; accepted: an int >= 1")


def train_jobs(jobs: list[tuple], parallel: int, progress: bool, desc: str) -> list[dict]:
    """Train (train preset, overrides, run dir) jobs one after another in this process, or
    ``parallel`` at once as worker processes; their summaries, in the jobs' order."""
    if parallel == 1:
        return [train_job((*job, progress)) for job in jobs]
    from tqdm.auto import tqdm
    # spawn: CUDA cannot be used in a forked child
    # workers keep torch's default thread count: on a CPU their runs then sum in the same order as
    # the sequential runs, so the losses agree bit for bit (OMP_NUM_THREADS splits the cores instead)
    with ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(train_job, (*job, False)) for job in jobs]
        for f in tqdm(futures, desc=desc, disable=not progress):
            f.result()
        return [f.result() for f in futures]


def plan_repro(preset: str | ReproPreset, out_dir: Path, seeds: tuple[int, ...] = (0,), steps: int | None = None,
               extra: tuple[str, ...] = (), parallel: int = 1, roles: tuple[str, ...] = ROLES
               ) -> tuple[ReproPreset, list[tuple]]:
    """The preset and the runs ``run_repro`` would train, ``(seed, role, attention, (train preset, overrides,
    run folder))`` each, with every argument and override checked (a ValueError naming what is wrong); nothing
    is written. ``stableflash repro`` calls it before the kernel-level probe, so bad input costs no work."""
    p = preset if isinstance(preset, ReproPreset) else REPRO_PRESETS.get(preset)
    if p is None:
        raise ValueError(f"preset={preset!r} is unknown; accepted: {', '.join(REPRO_PRESETS)}")
    check_parallel(parallel)
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
        raise ValueError(f"roles={list(roles)!r} is invalid; accepted: one or more of {', '.join(ROLES)}")
    out_dir = Path(out_dir)
    jobs = []
    for seed in seeds:
        for role, attention in p.attentions().items():
            if role not in roles:
                continue
            overrides = [*p.overrides, f"seed={seed}", f"attention={attention}", *extra]
            if steps is not None:
                overrides.append(f"max_iters={steps}")
            cfg = make_config(p.train_preset, overrides=overrides)    # a bad override fails before any run
            # the run's own attention: an --set attention=... in ``extra`` replaces the role's
            jobs.append((seed, role, cfg.attention, (p.train_preset, overrides, str(out_dir / f"seed{seed}" / role))))
    return p, jobs


def run_repro(preset: str | ReproPreset, out_dir: Path, seeds: tuple[int, ...] = (0,), steps: int | None = None,
              extra: tuple[str, ...] = (), progress: bool = True, parallel: int = 1,
              roles: tuple[str, ...] = ROLES) -> dict:
    """Run the paired runs of ``preset`` for each seed into out_dir/seed<k>/<role>, then the report.
    ``parallel``: how many runs at once (worker processes; 1 runs them in this process, in order).
    ``roles``: which of baseline, stabilized, control to run (a search may run the baseline alone)."""
    p, jobs = plan_repro(preset, out_dir, seeds, steps, extra, parallel, roles)
    out_dir = Path(out_dir)
    summaries = train_jobs([job for *_, job in jobs], parallel, progress, "repro runs")
    rows, run_dirs = [], []
    for (seed, role, attention, job), summary in zip(jobs, summaries):
        run_dir = Path(job[2])
        run = load_run(run_dir)
        rows.append({"seed": seed, "role": role, "attention": attention,
                     "consistent_delta": parse_attention_spec(attention).consistent_delta_sources(), "status": summary["status"],
                     "steps": summary["steps"], "final_loss": summary["final_loss"],
                     "best_val_loss": summary["best_val_loss"], "explosion_step": explosion_step(run),
                     "first_warning": next((e["step"] for e in run.events if e.get("event") == "monitor_warning"),
                                           None), "run_dir": str(run_dir)})
        run_dirs.append(run_dir)
    for seed in seeds:
        same = _same_batches([Path(r["run_dir"]) for r in rows if r["seed"] == seed])
        for r in rows:
            if r["seed"] == seed:
                r["same_batches_as_baseline"] = same
    report = build_report(run_dirs, out_dir / "report.html")
    result = {"preset": p.name, "description": p.description, "accelerated": p.accelerated, "seeds": list(seeds),
              "parallel": parallel, "rows": rows, "report": str(report),
              # what makes the preset fail sooner holds only for its own attentions, not for a --set attention
              "verdict": verdict(rows, p if all(r["attention"] == p.attentions()[r["role"]] for r in rows) else None)}
    (out_dir / "repro.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def verdict(rows: list[dict], preset: ReproPreset | None = None) -> str:
    """One honest line on what happened; for an accelerated ``preset``, what makes it fail sooner
    than bf16 and what the same run did in bf16."""
    return _outcome(rows) + (_accelerated_note(preset) if preset is not None and preset.accelerated else "")


def _accelerated_note(p: ReproPreset) -> str:
    faithful = f", which {p.faithful}" if p.faithful else ""
    return f" Accelerated: {p.accelerated}, a stand-in for bf16{faithful} (docs/reproduction.md)."


def _outcome(rows: list[dict]) -> str:
    base = [r for r in rows if r["role"] == "baseline"]
    exploded = [r for r in base if r["explosion_step"] is not None]
    others = [r for r in rows if r["role"] != "baseline" and r["explosion_step"] is not None]
    if not base:
        diverged = "; ".join(f"{r['role']} (seed {r['seed']}) diverged at step {r['explosion_step']}" for r in others)
        return "No baseline was run (roles without it): " + (diverged + "." if diverged else
                                                              f"none of the {len(rows)} run(s) diverged.")
    if not exploded:
        return (f"The baseline did not diverge in any of {len(base)} seed(s): no explosion reproduced with this "
                "configuration.")
    text = (f"The baseline diverged in {len(exploded)} of {len(base)} seed(s) (steps "
            f"{', '.join(str(r['explosion_step']) for r in exploded)})")
    if others:
        return text + "; but " + ", ".join(f"{r['role']} (seed {r['seed']}) also diverged at step "
                                            f"{r['explosion_step']}" for r in others) + "."
    ran = {r["role"] for r in rows}
    names = {"stabilized": "the stabilized run", "control": "the fp32 control"}
    held = [names[x] for x in names if x in ran]
    if not held:
        return text + " (the stabilized run and the fp32 control were not run)."
    missing = "" if len(held) == 2 else f" ({[names[x] for x in names if x not in ran][0]} not run)"
    return text + f"; {' and '.join(held)} did not{missing}."


def format_table(result: dict) -> str:
    lines = [f"stableflash repro — preset {result['preset']}: {result['description']}"]
    if result["accelerated"]:
        lines.append(f"ACCELERATED (not bf16): {result['accelerated']}")
    lines.append(f"{'seed':>4} {'run':11s} {'status':10s} {'steps':>6} {'exploded at':>11} {'final loss':>10} "
                 f"{'first warning':>13}  attention")
    for r in result["rows"]:
        loss = "-" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        lines.append(f"{r['seed']:>4} {r['role']:11s} {r['status']:10s} {r['steps']:>6} "
                     f"{'-' if r['explosion_step'] is None else r['explosion_step']:>11} {loss:>10} "
                     f"{'-' if r['first_warning'] is None else r['first_warning']:>13}  {r['attention']}"
                     + (f" (δ: {', '.join(r['consistent_delta'])})" if r.get("consistent_delta") else ""))
    same = all(r["same_batches_as_baseline"] for r in result["rows"])
    lines.append(f"batch order identical across the runs of each seed: {'yes' if same else 'NO'}")
    lines.append(result["verdict"])
    lines.append(f"report: {result['report']}")
    return "\n".join(lines)
