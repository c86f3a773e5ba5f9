"""Kernel cost of each of stableflash's variants in a benchmark JSON (``stableflash bench attention``):
forward+backward time relative to a reference provider, cost = reference TFLOP/s ÷ variant's − 1,
and the variant's ratio to SDPA's flash backend, per shape.

    python benchmarks/tools/mitigation_costs.py benchmarks/results/attention-H200-2026-11-22-mitigations.json \
        [--against stableflash-none] [--mode fwd+bwd]

Given several JSONs (repeated runs of the same benchmark), the cost is taken within each file and
it prints, per variant and shape, the median over the files, the [min, max] range and how many
files had both the variant and the reference at that shape (a run cut short lacks some cells).
"""
import argparse
import json
import statistics
from pathlib import Path

from stableflash.bench.attention import LEGACY_PROVIDERS, VARIANTS


def load(path: str) -> dict:
    """A benchmark JSON as written. Its providers keep the names the file gives them: files written
    before the providers were named stableflash-* use earlier names (``ours-stable``, ...), and what
    some of those ran changed between files (docs/notebook/kernel-optimisation-log.md), so they are
    not renamed here."""
    return json.loads(Path(path).read_text())


def ours(name: str) -> bool:
    """Whether a provider is one of stableflash's variants, under its current or an earlier name."""
    return name in VARIANTS or name in LEGACY_PROVIDERS


def tflops(data: dict, mode: str) -> dict:
    """{(shape, provider): TFLOP/s} of one benchmark JSON's rows in ``mode``."""
    return {(tuple(r["shape"]), r["provider"]): r["tflops"] for r in data["rows"]
            if r["mode"] == mode and r.get("tflops")}


def variants(datas: list, against: str) -> list:
    """stableflash's providers other than ``against``, in the order the files first list them."""
    names = [p for d in datas for p in d["config"]["providers"] if ours(p) and p != against]
    return list(dict.fromkeys(names))


def costs(datas: list, against: str, mode: str = "fwd+bwd") -> dict:
    """{(variant, shape): [cost in each file that has the cell]}, cost = ref TFLOP/s / variant's - 1."""
    out = {}
    for data in datas:
        tf = tflops(data, mode)
        for (shape, name), mine in tf.items():
            ref = tf.get((shape, against))
            if name != against and ref is not None:
                out.setdefault((name, shape), []).append(ref / mine - 1)
    return out


def name_width(names: list) -> int:
    """The variant column's width: the longest provider name keeps its cells apart."""
    return max([len("variant"), *map(len, names)]) + 2


def print_one(data: dict, against: str, mode: str) -> None:
    tf = tflops(data, mode)
    shapes = sorted({s for s, _ in tf}, key=lambda s: s[2])
    names = variants([data], against)
    w = name_width(names)
    print(f"{mode}: cost vs {against} (time), and ratio to sdpa-flash (TFLOP/s)")
    print("variant".ljust(w) + "".join(f"{'x'.join(map(str, s)):>33}" for s in shapes))
    for name in names:
        cells = []
        for s in shapes:
            ref, mine, flash = tf.get((s, against)), tf.get((s, name)), tf.get((s, "sdpa-flash"))
            if ref is None or mine is None:
                cells.append("-")
                continue
            cell = f"{ref / mine - 1:+.1%} ({mine:.0f} TF/s"
            cells.append(cell + (f", {mine / flash:.2f}x flash)" if flash else ")"))
        print(name.ljust(w) + "".join(f" {c:>32}" for c in cells))


def print_many(datas: list, against: str, mode: str) -> None:
    table = costs(datas, against, mode)
    shapes = sorted({s for _, s in table}, key=lambda s: s[2])
    print(f"{mode}: cost vs {against} (time) over {len(datas)} files: median [min, max] n=files with the cell")
    names = variants(datas, against)
    w = name_width(names)
    print("variant".ljust(w) + "".join(f"{'x'.join(map(str, s)):>32}" for s in shapes))
    for name in names:
        cells = []
        for s in shapes:
            c = table.get((name, s))
            cells.append(f"{statistics.median(c):+.1%} [{min(c):+.1%}, {max(c):+.1%}] n={len(c)}" if c else "-")
        print(name.ljust(w) + "".join(f"{c:>32}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--against", help="the reference provider (default: stableflash-none, or ours-standard "
                                       "in a file of the earlier names)")
    ap.add_argument("--mode", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
    args = ap.parse_args()
    datas = [load(path) for path in args.json]
    if args.against is None:
        named = {p for d in datas for p in d["config"]["providers"]}
        args.against = "ours-standard" if "ours-standard" in named and "stableflash-none" not in named else \
            "stableflash-none"
    if len(datas) == 1:
        print_one(datas[0], args.against, args.mode)
    else:
        print_many(datas, args.against, args.mode)


if __name__ == "__main__":
    main()
