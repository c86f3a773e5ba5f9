"""Forward + backward time of several providers interleaved in one process: a ratio between them that
the spread between processes does not blur.

    python benchmarks/tools/interleaved_bench.py [--shape 32,12,1024,64 ...] [--no-causal | --both]
        [--providers sdpa-default stableflash] [--rounds 3] [--rep-ms 200] [--json OUT.json]

``stableflash bench attention`` times each provider once, one after the other, and the same command
run twice gives ratios a percent or two apart. Here every round times each provider once
(``stableflash.bench.attention.time_one``: CUDA-graph timing, (B, N, H, d) buffers seen as (B, H, N, d),
bf16, fresh random inputs) in an order turned by one each round (``stableflash.bench.rounds.round_order``:
each provider takes each place equally often), and the rounds repeat: per shape and causal switch, each
provider's median over the rounds, each one's ratio to the first provider (its median time over the
provider's: above 1, faster than the first) and the ratio of every round, so that drift shows. With
``stableflash`` and ``stableflash-none`` among the providers, also the stabilization's cost: the
stabilized median over the unstabilized one, less 1. Prints a line per shape and a table; ``--json``
writes them with the GPU and versions. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from stableflash.bench.attention import ROUTE_SHAPES
from stableflash.bench.rounds import round_order
from stableflash.cli import _provider, _shape   # `stableflash bench attention`'s --shape and --providers


def time_rounds(shape, causal: bool, providers: list[str], rounds: int, rep_ms: int, gen) -> dict[str, list[float]]:
    """provider → ms of each round at this shape and causal switch."""
    import torch

    from stableflash.bench.attention import BenchConfig, time_one
    cfg = BenchConfig(shapes=(tuple(shape),), causal=causal, timing="graph", layout="bnhd", rep_ms=rep_ms)
    times = {p: [] for p in providers}
    for index in range(rounds):
        for p in round_order(providers, index):
            times[p].append(time_one(p, shape, "fwd+bwd", cfg, torch.bfloat16, "cuda", gen))
    return times


STABILIZED, UNSTABILIZED = "stableflash", "stableflash-none"    # stabilize=True and stabilize=False


def summary(shape, causal: bool, times: dict[str, list[float]]) -> dict:
    """The row of one shape: median ms per provider, ratio to the first provider (its time over each
    one's), each round's ratio, and where both were timed the stabilization's cost (``STABILIZED``'s
    median over ``UNSTABILIZED``'s, less 1; else None)."""
    first, *_ = times
    median = {p: statistics.median(t) for p, t in times.items()}
    cost = median[STABILIZED] / median[UNSTABILIZED] - 1 if STABILIZED in median and UNSTABILIZED in median else None
    return {"shape": list(shape), "causal": causal, "ms": times, "median_ms": median,
            "ratio_to_first": {p: median[first] / m for p, m in median.items()},
            "per_round": {p: [a / b for a, b in zip(times[first], t)] for p, t in times.items()},
            "stabilization_cost": cost}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", type=_shape, default=list(ROUTE_SHAPES),
                    help="B,H,N,d shapes (default: the Hopper route's five, bench.attention.ROUTE_SHAPES)")
    ap.add_argument("--providers", nargs="+", type=_provider, default=["sdpa-default", "stableflash"],
                    help="the first is the one the others are compared with (default: sdpa-default stableflash)")
    ap.add_argument("--no-causal", action="store_true", help="non-causal only (default: causal only)")
    ap.add_argument("--both", action="store_true", help="causal, then non-causal")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every provider (default 3)")
    ap.add_argument("--rep-ms", type=int, default=200, help="milliseconds of replays per timing (default 200)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} is invalid; accepted: a positive integer")
    if args.rep_ms < 1:
        ap.error(f"--rep-ms {args.rep_ms} is invalid; accepted: a positive integer")
    if args.both and args.no_causal:
        ap.error("--both and --no-causal together are invalid; accepted: one of them, or neither (causal only)")
    if len(set(args.providers)) < 2 or len(set(args.providers)) != len(args.providers):
        ap.error(f"--providers {' '.join(args.providers)} is invalid; accepted: two or more different providers")
    import torch
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (it times the kernels there); none is visible")
    import triton
    switches = [True, False] if args.both else [False] if args.no_causal else [True]
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "rounds": args.rounds, "rep_ms": args.rep_ms, "providers": args.providers, "rows": []}
    for causal in switches:
        for shape in args.shape:
            row = summary(shape, causal, time_rounds(shape, causal, args.providers, args.rounds, args.rep_ms, gen))
            out["rows"].append(row)
            others = "  ".join(f"{p} {row['median_ms'][p]:.4f} ms ({row['ratio_to_first'][p]:.3f}×, rounds "
                               f"{', '.join(f'{r:.3f}' for r in row['per_round'][p])})" for p in args.providers[1:])
            cost = "" if row["stabilization_cost"] is None else f"  stabilization {row['stabilization_cost']:+.1%}"
            print(f"{'x'.join(map(str, shape))} causal={causal}: {args.providers[0]} "
                  f"{row['median_ms'][args.providers[0]]:.4f} ms  {others}{cost}", flush=True)
    print(f"\n{out['gpu']}, torch {out['torch']}, triton {out['triton']}: {args.providers[0]}'s median time over each "
          f"provider's ({args.rounds} rounds)")
    with_cost = out["rows"][0]["stabilization_cost"] is not None     # (the same providers in every row)
    print("| shape | causal | " + " | ".join(args.providers[1:]) + (" | stabilization's cost" if with_cost else "")
          + " |")
    print("|---|---|" + "---|" * (len(args.providers) - 1 + with_cost))
    for row in out["rows"]:
        cost = f" | {row['stabilization_cost']:+.1%}" if with_cost else ""
        print(f"| {'×'.join(map(str, row['shape']))} | {row['causal']} | "
              + " | ".join(f"{row['ratio_to_first'][p]:.3f}" for p in args.providers[1:]) + cost + " |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
