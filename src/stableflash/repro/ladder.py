"""The paper's isolation experiments (Section 3.2) as one command: the same training run with one
change to the failing attention at a time, each on the baseline's batch order.

Rungs: tiling off (block = sequence length); the failing attention in the failing layer only
(SDPA elsewhere), and SDPA in that layer only; δ from dP·P; O recomputed in fp32 for δ; O in fp32
in the forward pass (Ō, ℓ, O); O in fp32 for the heads with the largest W_Q spectral norm only;
only Ō = P̄V in fp32 (P̄ and the accumulator). The failing layer and heads are read off the
baseline's probes (the layer whose W_Q norm grew most; its heads with the largest norms).

A rung whose folder already holds a finished run of the same configuration is read, not trained
again: a ladder that was stopped continues where it was, and a baseline trained by ``stableflash
repro`` can be copied in as the ladder's baseline.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from stableflash.model.spec import parse_attention_spec, with_settings
from stableflash.repro.presets import REPRO_PRESETS, ReproPreset
from stableflash.repro.run import check_parallel, stored_summary, train_job, train_jobs
from stableflash.report.runs import explosion_step, load_run
from stableflash.train.config import TrainConfig, make_config


def finished_run(run_dir: Path, cfg: TrainConfig) -> dict | None:
    """run_dir's summary if it holds a finished run of ``cfg`` (``stored_summary``); None otherwise."""
    result = stored_summary(run_dir, cfg)
    return result if result is not None and result.get("status") in ("finished", "nonfinite", "exploded") else None


def failing_layer_and_heads(run_dir: Path, n_heads: int = 3) -> tuple[int, list[int]]:
    """The layer whose whole-matrix W_Q norm grew most between the first and last probe, and its
    ``n_heads`` heads with the largest W_Q norm at the last probe. (0, [0..]) without probes."""
    probes = load_run(run_dir).probes
    spectra = [p["spectral"] for p in probes if p.get("spectral")]
    if len(spectra) < 1:
        return 0, list(range(n_heads))
    first, last = spectra[0]["q_full"], spectra[-1]["q_full"]
    layer = max(range(len(last)), key=lambda i: (last[i] or 0) / max(first[i] or 1e-12, 1e-12))
    heads = spectra[-1]["q"][layer]
    order = sorted(range(len(heads)), key=lambda h: -(heads[h] or 0))
    return layer, sorted(order[:n_heads])


def _kernel_can_run(choice_text: str) -> bool:
    """Whether the fused kernels implement this single attention choice (policy and tile)."""
    from stableflash.attention.policy import resolve_policy
    try:
        from stableflash.attention.triton.launch import check_policy
        choice = parse_attention_spec(choice_text).default
        check_policy(resolve_policy(choice.policy, torch.bfloat16), torch.bfloat16)
    except (ImportError, ValueError):
        return False
    return True


def rungs(baseline: str, layer: int, heads: list[int], seq_len: int) -> dict[str, str]:
    """The attention spec of every rung, from a single-choice baseline spec.

    A rung the fused kernels cannot express (a key block they cannot hold, or one under a policy
    other than "paper"; fp32 heads above 30) runs on the emulated backend under the same policy,
    and its name says so: the kernels' "paper" switch computes what the emulated "paper" policy does with
    the kernels' key block of 64 (tests/attention/test_triton.py), so the rung changes only what it
    names."""
    spec = parse_attention_spec(baseline)
    if spec.overrides:
        raise ValueError(f"baseline={baseline!r}: the ladder needs one attention for every layer; "
                         "accepted: a single-choice spec such as 'emulated policy=paper'")
    base = str(spec.default)
    kernel = spec.default.backend == "triton"
    emulated = " ".join(["emulated", *base.split()[1:]]) if kernel else base

    def choice(settings: str) -> tuple[str, str]:
        """(suffix for the rung's name, the choice) of the baseline with ``settings`` set."""
        text = with_settings(base, settings)
        if kernel and not _kernel_can_run(text):
            return " [emulated backend]", with_settings(emulated, settings)
        return "", text

    heads_text = ",".join(map(str, heads))
    suffix, tiling_off = choice(f"block={seq_len}")       # the kernels take key blocks of 16-512
    table = {
        "baseline": base,
        "tiling off (block = sequence)" + suffix: tiling_off,
        f"failing attention in layer {layer} only": f"sdpa; {layer}: {base}",
        f"SDPA in layer {layer} only": f"{base}; {layer}: sdpa",
    }
    for name, settings in (("δ from dP·P", "delta=dP*P"), ("O recomputed in fp32 for δ", "delta=recompute_fp32"),
                           ("O in fp32 (forward)", "acc=fp32 row_sum=fp32 out=fp32")):
        suffix, text = choice(settings)
        table[name + suffix] = text
    suffix, text = choice(f"hp_heads={heads_text}")
    table[f"O in fp32 for heads {heads_text} of layer {layer}" + suffix] = f"{base}; {layer}: {text}"
    suffix, text = choice("p_bar=fp32 acc=fp32")
    table["only Ō = P̄V in fp32" + suffix] = text
    return table


def run_ladder(preset: str | ReproPreset, out_dir: Path, seed: int = 0, steps: int | None = None,
               extra: tuple[str, ...] = (), progress: bool = True, parallel: int = 1) -> dict:
    """Train the baseline, then every other rung on the same seed (hence the same batch order);
    ``parallel`` > 1 trains that many rungs at once as worker processes (as ``run_repro`` does)."""
    p = preset if isinstance(preset, ReproPreset) else REPRO_PRESETS.get(preset)
    if p is None:
        raise ValueError(f"preset={preset!r} is unknown; accepted: {', '.join(REPRO_PRESETS)}")
    check_parallel(parallel)
    out_dir = Path(out_dir)

    def job(name: str, attention: str) -> tuple:
        overrides = [*p.overrides, f"seed={seed}", f"attention={attention}", *extra]
        if steps is not None:
            overrides.append(f"max_iters={steps}")
        make_config(p.train_preset, overrides=overrides)          # a bad rung fails before any training
        return p.train_preset, overrides, str(out_dir / re.sub(r"[^A-Za-z0-9_.,=-]+", "_", name).strip("_"))

    def done(j: tuple) -> dict | None:
        summary = finished_run(Path(j[2]), make_config(j[0], overrides=j[1]))
        if summary is not None and progress:
            print(f"reusing the finished run in {j[2]}")
        return summary

    def row(name: str, attention: str, run_dir: str, summary: dict) -> dict:
        return {"rung": name, "attention": attention, "status": summary["status"], "steps": summary["steps"],
                "exploded_at": explosion_step(load_run(Path(run_dir))), "final_loss": summary["final_loss"],
                "run_dir": run_dir}

    base_job = job("baseline", p.baseline)
    rows = [row("baseline", p.baseline, base_job[2], done(base_job) or train_job((*base_job, progress)))]
    layer, heads = failing_layer_and_heads(Path(rows[0]["run_dir"]))
    seq_len = make_config(p.train_preset, overrides=list(p.overrides)).block_size
    if seq_len is None:
        from stableflash.model import model_config
        seq_len = model_config(make_config(p.train_preset).model).block_size
    todo = [(name, attention, job(name, attention))
            for name, attention in list(rungs(p.baseline, layer, heads, seq_len).items())[1:]]
    reused = [done(j) for _, _, j in todo]
    trained = iter(train_jobs([j for (_, _, j), r in zip(todo, reused) if r is None], parallel, progress,
                              "ladder rungs"))
    summaries = [r if r is not None else next(trained) for r in reused]
    rows += [row(name, attention, j[2], summary) for (name, attention, j), summary in zip(todo, summaries)]
    result = {"preset": p.name, "accelerated": p.accelerated, "seed": seed, "failing_layer": layer,
              "heads": heads, "parallel": parallel, "rows": rows}
    (out_dir / "ladder.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def format_ladder(result: dict) -> str:
    lines = [f"isolation ladder — preset {result['preset']}, seed {result['seed']}, failing layer "
             f"{result['failing_layer']} (heads {result['heads']})"]
    if result["accelerated"]:
        lines.append(f"ACCELERATED (not bf16): {result['accelerated']}")
    for r in result["rows"]:
        outcome = "stable" if r["exploded_at"] is None else f"exploded at step {r['exploded_at']}"
        loss = "-" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        lines.append(f"  {r['rung']:48s} {outcome:24s} final loss {loss:>8}   [{r['attention']}]")
    return "\n".join(lines)
