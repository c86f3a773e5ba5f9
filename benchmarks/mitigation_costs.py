"""Kernel cost of each of our variants in a benchmark JSON (``stableflash bench attention``):
forward+backward time relative to a reference provider, cost = reference TFLOP/s ÷ variant's − 1,
and the variant's ratio to SDPA's flash backend, per shape.

    python benchmarks/mitigation_costs.py benchmarks/results/attention-H200-2026-11-22-mitigations.json \
        [--against ours-standard] [--mode fwd+bwd]
"""
import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--against", default="ours-standard")
    ap.add_argument("--mode", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
    args = ap.parse_args()
    data = json.load(open(args.json))
    tf = {(tuple(r["shape"]), r["provider"]): r["tflops"] for r in data["rows"]
          if r["mode"] == args.mode and r.get("tflops")}
    shapes = sorted({s for s, _ in tf}, key=lambda s: s[2])
    names = [p for p in data["config"]["providers"] if p.startswith("ours") and p != args.against]
    print(f"{args.mode}: cost vs {args.against} (time), and ratio to sdpa-flash (TFLOP/s)")
    print("variant".ljust(16) + "".join(f"{'x'.join(map(str, s)):>28}" for s in shapes))
    for name in names:
        cells = []
        for s in shapes:
            ref, mine, flash = tf.get((s, args.against)), tf.get((s, name)), tf.get((s, "sdpa-flash"))
            if ref is None or mine is None:
                cells.append("-")
                continue
            cell = f"{ref / mine - 1:+.1%} ({mine:.0f} TF/s"
            cells.append(cell + (f", {mine / flash:.2f}x flash)" if flash else ")"))
        print(name.ljust(16) + "".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
