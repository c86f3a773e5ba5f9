"""Where the Gluon Hopper forward's time goes within a query tile, read by proton's intra-kernel profiler.

    python benchmarks/tools/forward_timeline.py [--shape 32,12,1024,64] [--no-causal] [--tiles 128x128x2P]
        [--buffer global] [--clock32] [--out DIR]

The persistent forward's consumers mark five phases of every query tile with proton scopes
(``hopper_forward``: ``q_wait`` — waiting for Q's tile; ``first_block`` — key block 0's S and softmax;
``full_blocks`` — the unmasked key blocks; ``masked_blocks`` — the diagonal or ragged blocks and the last
P̄V; ``epilogue`` — O, R and L out). With proton's instrumentation off (every other run) the scopes
compile to nothing. This tool turns it on for one forward call in a fresh compile cache, writes proton's
Chrome trace (``DIR/forward.chrome_trace``, viewable in Perfetto) and prints, per phase, its events and
their summed and mean duration as the trace states them (its ``dur`` field), with the shares of the
phases' sum (over the events proton's buffer held); the same as JSON in ``DIR/forward_timeline.json``. The instrumented kernel keeps more
registers live than the plain one (the clock reads), so its phases are read as shares, not as the plain
kernel's times. Needs a Hopper GPU and a triton with proton.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

PHASES = ("q_wait", "first_block", "full_blocks", "masked_blocks", "epilogue")


def summarise(trace: dict) -> dict:
    """phase → {"events", "total", "mean", "share"} from a Chrome trace's complete ("X") events named
    after the phases; ValueError naming what the trace holds when none of them is there."""
    durations = collections.defaultdict(list)
    names = collections.Counter()
    for event in trace.get("traceEvents", []):
        name = event.get("name")
        names[name] += 1
        if event.get("ph") == "X" and name in PHASES:
            durations[name].append(float(event["dur"]))
    if not durations:
        raise ValueError(f"the trace has no events named {', '.join(PHASES)}; it has {dict(names.most_common(10))}")
    whole = sum(sum(d) for d in durations.values())
    return {p: {"events": len(durations[p]), "total": sum(durations[p]),
                "mean": sum(durations[p]) / len(durations[p]) if durations[p] else 0.0,
                "share": sum(durations[p]) / whole} for p in PHASES}


def table(summary: dict) -> str:
    rows = ["| phase | events | total dur | mean dur | share |", "|---|---|---|---|---|"]
    for phase, s in summary.items():
        rows.append(f"| {phase} | {s['events']} | {s['total']:.1f} | {s['mean']:.3f} | {s['share']:.3f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    from stableflash.cli import _shape

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=_shape, default=(32, 12, 1024, 64), help="B,H,N,d (default 32,12,1024,64)")
    ap.add_argument("--no-causal", action="store_true", help="without the causal mask (default: causal)")
    ap.add_argument("--tiles", help="other persistent tiles, as gluon_forward_check.py's --tiles (e.g. 128x128x2P)")
    ap.add_argument("--buffer", choices=("global", "shared"), default="global",
                    help="where proton keeps the records while the kernel runs (default global: the forward "
                         "leaves too little shared memory at head_dim 128)")
    ap.add_argument("--clock32", action="store_true", help="32-bit clock reads (fewer registers a record)")
    ap.add_argument("--out", type=Path, default=Path("forward-timeline"), help="output folder")
    args = ap.parse_args(argv)
    if args.shape[3] not in (64, 128):
        ap.error(f"--shape {','.join(map(str, args.shape))} is invalid; accepted: head_dim (the last) 64 or 128")
    tiles = None
    if args.tiles:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gluon_forward_check
        try:
            tiles = gluon_forward_check.parse_tiles(args.tiles)
        except ValueError as err:
            ap.error(f"--tiles {args.tiles} is invalid: {err}")
        if not tiles.persistent:
            ap.error(f"--tiles {args.tiles} is invalid; accepted: persistent tiles (P or Pd), whose consumers "
                     "hold the scopes")
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        ap.error("needs a Hopper GPU (compute capability 9.0); none is visible")
    # a fresh compile cache: a kernel compiled before without the scopes would be taken as it is
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="forward-timeline-")
    try:
        import triton.profiler as proton
    except ImportError as err:
        ap.error(f"needs triton's proton profiler (triton.profiler), which this triton lacks: {err}")

    from stableflash.attention.gluon.launch import flash_forward_hopper
    B, H, N, d = args.shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    causal = not args.no_causal
    args.out.mkdir(parents=True, exist_ok=True)
    mode = proton.mode.Default(buffer_type=args.buffer, optimizations="clock32" if args.clock32 else "")
    proton.start(str(args.out / "forward"), data="trace", backend="instrumentation", mode=mode)
    flash_forward_hopper(q, k, v, causal, tiles=tiles)
    torch.cuda.synchronize()
    proton.finalize()
    trace_path = args.out / "forward.chrome_trace"
    summary = summarise(json.loads(trace_path.read_text()))
    print(f"{torch.cuda.get_device_name()}: the Gluon forward at {'×'.join(map(str, args.shape))}, "
          f"causal={causal}, instrumented ({trace_path})")
    print(table(summary))
    (args.out / "forward_timeline.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "shape": list(args.shape), "causal": causal, "tiles": args.tiles,
         "buffer": args.buffer, "clock32": args.clock32, "phases": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
