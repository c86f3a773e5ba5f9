"""The paper's isolation experiments (Section 3.2) as one command: the same training run with one
change to the failing attention at a time, each on the baseline's batch order.

Rungs: tiling off (block = sequence length); the failing attention in the failing layer only
(SDPA elsewhere), and SDPA in that layer only; δ from dP·P; O recomputed in fp32 for δ; O in fp32
in the forward pass (Ō, ℓ, O); O in fp32 for the heads with the largest W_Q spectral norm only;
only Ō = P̄V in fp32 (P̄ and the accumulator). The failing layer and heads are read off the
baseline's probes (the layer whose W_Q norm grew most; its heads with the largest norms).
"""
from __future__ import annotations

import json
from pathlib import Path

from stableflash.model import parse_attention_spec
from stableflash.repro.presets import REPRO_PRESETS, ReproPreset
from stableflash.report.runs import explosion_step, load_run
from stableflash.train.config import make_config
from stableflash.train.loop import train


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


def rungs(baseline: str, layer: int, heads: list[int], seq_len: int) -> dict[str, str]:
    """The attention spec of every rung, from a single-choice baseline spec."""
    spec = parse_attention_spec(baseline)
    if spec.overrides:
        raise ValueError(f"baseline={baseline!r}: the ladder needs one attention for every layer; "
                         "accepted: a single-choice spec such as 'emulated policy=paper'")
    base = str(spec.default)
    tiled = " ".join(p for p in base.split() if not p.startswith("block="))
    return {
        "baseline": base,
        "tiling off (block = sequence)": f"{tiled} block={seq_len}",
        f"failing attention in layer {layer} only": f"sdpa; {layer}: {base}",
        f"SDPA in layer {layer} only": f"{base}; {layer}: sdpa",
        "δ from dP·P": f"{base} delta=dP*P",
        "O recomputed in fp32 for δ": f"{base} delta=recompute_fp32",
        "O in fp32 (forward)": f"{base} acc=fp32 row_sum=fp32 out=fp32",
        f"O in fp32 for heads {','.join(map(str, heads))} of layer {layer}":
            f"{base}; {layer}: {base} hp_heads={','.join(map(str, heads))}",
        "only Ō = P̄V in fp32": f"{base} p_bar=fp32 acc=fp32",
    }


def run_ladder(preset: str | ReproPreset, out_dir: Path, seed: int = 0, steps: int | None = None,
               extra: tuple[str, ...] = (), progress: bool = True) -> dict:
    """Train the baseline, then every other rung on the same seed (hence the same batch order)."""
    p = preset if isinstance(preset, ReproPreset) else REPRO_PRESETS.get(preset)
    if p is None:
        raise ValueError(f"preset={preset!r} is unknown; accepted: {', '.join(REPRO_PRESETS)}")
    out_dir = Path(out_dir)

    def run(name: str, attention: str) -> dict:
        overrides = [*p.overrides, f"seed={seed}", f"attention={attention}", *extra]
        if steps is not None:
            overrides.append(f"max_iters={steps}")
        cfg = make_config(p.train_preset, overrides=overrides)
        run_dir = out_dir / name.replace(" ", "_").replace("/", "-").replace("·", "")
        summary = train(cfg, run_dir, progress=progress)
        return {"rung": name, "attention": attention, "status": summary["status"], "steps": summary["steps"],
                "exploded_at": explosion_step(load_run(run_dir)), "final_loss": summary["final_loss"],
                "run_dir": str(run_dir)}

    rows = [run("baseline", p.baseline)]
    layer, heads = failing_layer_and_heads(Path(rows[0]["run_dir"]))
    seq_len = make_config(p.train_preset, overrides=list(p.overrides)).block_size
    if seq_len is None:
        from stableflash.model import model_config
        seq_len = model_config(make_config(p.train_preset).model).block_size
    for name, attention in list(rungs(p.baseline, layer, heads, seq_len).items())[1:]:
        rows.append(run(name, attention))
    result = {"preset": p.name, "accelerated": p.accelerated, "seed": seed, "failing_layer": layer,
              "heads": heads, "rows": rows}
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
