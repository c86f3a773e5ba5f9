"""The tables of a ``speed_tables.sh`` folder: what README.md, docs/kernels.md ("Speed") and
docs/training.md state, from the steps that have finished.

    python benchmarks/tools/speed_summary.py OUT_DIR

Reads ``attention-{causal,no-mask}-BxHxNxd.json`` (``stableflash bench attention``), ``train-*.json``
(``train_interleaved.py``) and ``bench-train.json`` (``stableflash bench train``); writes
``summary.md`` and ``summary.json`` there and prints the markdown. Ratios are times: SDPA's default
(cuDNN on Hopper) over ours, SDPA flash (FlashAttention-2) over ours, SDPA's default over the portable
Triton path; the stabilization's cost is ``stabilize=True``'s time over ``stabilize=False``'s, less
one. The accuracy line is the largest ratio of our error against float64 to a peer's over O, dQ, dK,
dV, on random and on tied-maximum inputs. A step that has not finished is listed as missing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stableflash.bench.attention import ROUTE_SHAPES

# the attention steps' shapes, as speed_tables.sh names them: the Hopper route's five
SHAPES = tuple("x".join(map(str, shape)) for shape in ROUTE_SHAPES)
MASKS = ("causal", "no-mask")
TRAIN_STEPS = {"train-b16-compiled": "compiled, batch 16", "train-b16-eager": "eager, batch 16",
               "train-b4-graphs": "CUDA graphs (reduce-overhead), batch 4", "train-b4-compiled": "compiled, batch 4",
               "train-b4-eager": "eager, batch 4"}
PROVIDERS = ("stableflash", "stableflash-none", "stableflash-portable", "sdpa-default", "sdpa-flash", "sdpa-cudnn",
             "sdpa-efficient", "flex")
PEERS = ("sdpa-default", "sdpa-flash")
OURS, REFERENCE = "triton", "sdpa"              # train_interleaved's cases: the first is SDPA's default


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def attention_case(data: dict) -> dict:
    """One ``bench attention`` file (one shape, one mask): per mode the providers' ms and TFLOP/s and the
    ratios; the float64 check's largest error ratio against each peer."""
    modes: dict = {}
    for row in data["rows"]:
        modes.setdefault(row["mode"], {})[row["provider"]] = (row["ms"], row["tflops"])
    out: dict = {}
    for mode, got in modes.items():
        ms = {p: got[p][0] for p in got}
        out[mode] = {
            "tflops": {p: got[p][1] for p in got},
            "vs_cudnn": _ratio(ms.get("sdpa-default"), ms.get("stableflash")),
            "vs_fa2": _ratio(ms.get("sdpa-flash"), ms.get("stableflash")),
            "cost": None if "stableflash" not in ms or "stableflash-none" not in ms
            else ms["stableflash"] / ms["stableflash-none"] - 1,
            "portable_vs_cudnn": _ratio(ms.get("sdpa-default"), ms.get("stableflash-portable")),
        }
    checks = data.get("checks", {})
    ours = checks.get("stableflash", {})
    out["error_ratio"] = {}
    for peer in PEERS:
        theirs = checks.get(peer, {})
        common = [m for m in ours if m in theirs and theirs[m] > 0]
        if common:
            worst = max(common, key=lambda m: ours[m] / theirs[m])
            out["error_ratio"][peer] = {"max": ours[worst] / theirs[worst], "at": worst}
    return out


def _span(values) -> str:
    values = [v for v in values if v is not None]
    return f"{min(values):.3f}–{max(values):.3f}" if values else "–"


def _num(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def summarise(folder: Path) -> tuple[dict, str]:
    """(the numbers, the markdown) of a ``speed_tables.sh`` folder."""
    env, missing, attention = None, [], {}
    for mask in MASKS:
        for shape in SHAPES:
            path = folder / f"attention-{mask}-{shape}.json"
            if not path.exists():
                missing.append(path.stem)
                continue
            data = json.loads(path.read_text())
            env = env or data.get("env")
            attention[f"{mask} {shape}"] = attention_case(data)
    training = {}
    for step in TRAIN_STEPS:
        path = folder / f"{step}.json"
        if not path.exists():
            missing.append(step)
            continue
        data = json.loads(path.read_text())
        if env is None:
            env = {k: data.get(k) for k in ("gpu", "torch", "triton")}
        cases = data["cases"]
        training[step] = {"reference": cases[REFERENCE], "ours": cases[OURS]}
    bench = None
    path = folder / "bench-train.json"
    if path.exists():
        bench = json.loads(path.read_text())["rows"]
    else:
        missing.append("bench-train")

    lines = [f"# Speed tables ({folder})", ""]
    if env:
        lines += [", ".join(f"{k} {v}" for k, v in env.items() if k in ("gpu", "torch", "triton", "cuda")), ""]
    if attention:
        lines += ["## Forward + backward (TFLOP/s, CUDA-graph timing, bf16, (B, N, 3, H, d) inputs)", "",
                  "| shape | mask | " + " | ".join(PROVIDERS) + " | cost | / cuDNN | / FA2 | portable / cuDNN |",
                  "|---|---|" + "---|" * (len(PROVIDERS) + 4)]
        for name, case in attention.items():
            mask, shape = name.split(" ")
            row = case.get("fwd+bwd")
            if row is None:
                continue
            tf = row["tflops"]
            lines.append(f"| {shape.replace('x', '×')} | {mask} | " + " | ".join(_num(tf.get(p), ".0f") for p in PROVIDERS)
                         + f" | {_num(None if row['cost'] is None else 100 * row['cost'], '+.1f')}% | "
                         f"{_num(row['vs_cudnn'], '.3f')} | {_num(row['vs_fa2'], '.2f')} | "
                         f"{_num(row['portable_vs_cudnn'], '.2f')} |")
        both = [c["fwd+bwd"] for c in attention.values() if "fwd+bwd" in c]
        fwd = {n: c["fwd"]["vs_cudnn"] for n, c in attention.items() if "fwd" in c}
        worst = {peer: max((c["error_ratio"][peer]["max"] for c in attention.values() if peer in c["error_ratio"]),
                           default=None) for peer in PEERS}
        lines += ["",
                  f"- forward + backward over SDPA's default: {_span(r['vs_cudnn'] for r in both)}; over SDPA flash: "
                  f"{_span(r['vs_fa2'] for r in both)}; the stabilization's largest cost: "
                  f"{_num(max((r['cost'] for r in both if r['cost'] is not None), default=None), '+.2%')}; "
                  f"the portable path over SDPA's default: {_span(r['portable_vs_cudnn'] for r in both)}",
                  "- forward alone over SDPA's default: " + ", ".join(f"{n} {_num(v, '.3f')}" for n, v in fwd.items()),
                  "- error against float64, the largest ratio of ours to: "
                  + ", ".join(f"{peer} {_num(v, '.3f')}" for peer, v in worst.items()), ""]
    if training:
        lines += ["## GPT-2 small training step against SDPA's default (interleaved, paired medians)", "",
                  "| step | SDPA's default, ms | ours, ms | ratio (quartiles) | host issue, ms: SDPA / ours |",
                  "|---|---|---|---|---|"]
        for step, got in training.items():
            ref, ours = got["reference"], got["ours"]
            q = ours["paired_ratio_quartiles"]
            lines.append(f"| {TRAIN_STEPS[step]} | {ref['median_ms']:.2f} | {ours['median_ms']:.2f} | "
                         f"{ours['paired_ratio_median']:.3f} ({q[0]:.3f}–{q[1]:.3f}) | "
                         f"{ref['issue_median_ms']:.2f} / {ours['issue_median_ms']:.2f} |")
        lines.append("")
    if bench:
        lines += ["## stableflash bench train", "", "| attention | ms/step | tokens/s | MFU | vs SDPA | peak MiB |",
                  "|---|---|---|---|---|---|"]
        for row in bench:
            lines.append(f"| {row['attention']} | {row['ms_per_step']:.1f} | {row['tokens_per_s']:,.0f} | "
                         f"{100 * row['mfu']:.1f}% | {row['ratio_to_first']:.2f}× | {row['peak_mib']:,.0f} |")
        lines.append("")
    if missing:
        lines += ["Not finished: " + ", ".join(missing), ""]
    summary = {"env": env, "attention": attention, "training": training, "bench_train": bench, "missing": missing}
    return summary, "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a speed_tables.sh output folder")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"folder {str(args.folder)!r} is not a directory; accepted: a speed_tables.sh output folder")
    summary, text = summarise(args.folder)
    (args.folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.folder / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
