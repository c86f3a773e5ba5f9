"""What ``gluon_forward_check.py`` and ``gluon_backward_check.py`` share: the command line (compile
and count the SASS without a GPU, or ``--time`` on one), the timing rows' printout and the wait
counts' format. Each tool passes its own rows functions; this module is not run by itself."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import triton

from stableflash.cli import _shape   # `stableflash bench attention`'s --shape


def fmt_waits(w: dict) -> str:
    """The warpgroup waits by how many products they leave in flight: "≤N:count" each."""
    return " ".join(f"≤{n}:{c}" for n, c in sorted(w.items()))


def print_time(rows: list[dict], label: str, width: int) -> None:
    """The GPU, then each accuracy row (its ``rel_err_*`` fields) and each timing row (``label``
    before the shape, the provider's name padded to ``width``)."""
    import torch
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for r in rows:
        if r["kind"] == "accuracy":
            errs = " ".join(f"{key[len('rel_err_'):]} {value:.3e}" for key, value in r.items()
                            if key.startswith("rel_err_"))
            print(f"accuracy d={r['head_dim']} causal={r['causal']} {r['provider']:{width}s} {errs}")
    for r in rows:
        if r["kind"] == "time":
            shape = "×".join(map(str, r["shape"]))
            print(f"{label} {shape:16s} causal={r['causal']} {r['provider']:{width}s} {r['ms']:.3f} ms "
                  f"{r['tflops']:.0f} TFLOP/s")


def main(argv, *, doc: str, kernel: str, variants_help: str, compile_rows: Callable, print_compile: Callable,
         time_rows: Callable, time_label: str, width: int, tiles_type: Callable | None = None,
         tiles_help: str = "") -> int:
    """The tool's command line: without --time ``print_compile(compile_rows(variants))``; with it
    ``time_rows(shapes, causal, variants)`` printed by ``print_time``; --json writes the rows.
    ``kernel``: what the tool checks ("forward", "backward"), for help and errors. ``tiles_type``
    (one --tiles value to the tool's tiles, raising ValueError with what is accepted): a --tiles
    option, whose values both rows functions then take as ``tiles=``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--variants", action="store_true", help=variants_help)
    if tiles_type is not None:
        def parse(text: str):
            try:
                return tiles_type(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"--tiles {text!r}: {exc}") from None
        ap.add_argument("--tiles", nargs="+", type=parse, default=[], metavar="SPEC", help=tiles_help)
    ap.add_argument("--time", action="store_true", help=f"on a GPU: accuracy against float64, then {kernel} timings")
    ap.add_argument("--non-causal", action="store_true", help="with --time: time non-causal attention")
    ap.add_argument("--shapes", nargs="+", type=_shape,
                    default=[(32, 12, 1024, 64), (8, 16, 4096, 64), (4, 16, 8192, 128)], help="with --time: B,H,N,d shapes")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    from stableflash.attention.gluon import unavailable_reason
    reason = unavailable_reason()
    if reason is not None:
        print(f"the Gluon Hopper {kernel} is not available here: {reason}", file=sys.stderr)
        return 1
    extra = {"tiles": args.tiles} if tiles_type is not None else {}
    if args.time:
        import torch
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            ap.error("--time needs a Hopper GPU (compute capability 9.0); none is visible")
        rows = time_rows(list(args.shapes), not args.non_causal, args.variants, **extra)
        print_time(rows, time_label, width)
    else:
        rows = compile_rows(args.variants, **extra)
        print_compile(rows)
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "rows": rows}, separators=(",", ":")) + "\n")
    return 0
