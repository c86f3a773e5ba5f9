"""Machine-instruction counts of the forward kernel for Hopper (sm_90), per row-maximum rule.

Compiles ``attn_fwd_kernel`` for compute capability 9.0 without a GPU (Triton ships ptxas and
nvdisasm) and counts the SASS instructions by opcode, so that the per-score cost of a rule can be
read before any device time is spent: the standard loop does a max, an FMA, an exp2, an add and
half a bf16 pack per score; what a stabilized rule adds shows up as the difference.

    python benchmarks/tools/sass_count.py [--head-dim 64] [--block-m 64] [--block-n 64] [--warps 4]
                                    [--stages 3] [--tma] [--warp-specialize] [--pfmt -1] [--aligned]
                                    [--out DIR]

``--pfmt`` sets the P̄ format switch (e.g. 96: P̄ and V multiplied on the fp8 tensor cores in e4m3,
V read from the launcher's fp8 copy); ``--aligned`` compiles as the JIT does for aligned tensors
(pointers, strides and lengths divisible by 16), which is what lets Triton pipeline the key loop's
loads into shared memory — without it the counts include the unpipelined loads' instructions.

``--warp-specialize`` compiles the key loop as ``tl.range(..., warp_specialize=True)`` (a patched
copy of the kernel source, nothing in the package changes) to see whether this Triton splits the
loop into producer and consumer warps on sm_90: if it does, the SASS gains ``USETMAXREG``.
Prints one line per rule and, with --out, writes the listings and a JSON of the counts.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

RULES = ("standard", "paper", "ours", "bounded")
SHOWN = ("FMNMX", "FSET", "FSETP", "FSEL", "FADD", "FFMA", "FMUL", "MUFU", "F2FP", "HGMMA", "USETMAXREG")
FORWARD = Path(__file__).resolve().parents[2] / "src/stableflash/attention/triton/forward.py"


def load_kernel(warp_specialize: bool):
    """The forward kernel, from a copy whose key loop asks for warp specialization if requested."""
    if not warp_specialize:
        from stableflash.attention.triton.forward import attn_fwd_kernel
        return attn_fwd_kernel
    src = FORWARD.read_text()
    loop = "for start_n in range(start, stop, BLOCK_N):"
    if loop not in src:
        sys.exit(f"the key loop '{loop}' was not found in {FORWARD}")
    src = src.replace(loop, "for start_n in tl.range(start, stop, BLOCK_N, warp_specialize=True):")
    path = Path(tempfile.mkdtemp()) / "forward_ws.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("forward_ws", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.attn_fwd_kernel


def _compile_check():
    spec = importlib.util.spec_from_file_location("compile_check", Path(__file__).with_name("compile_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_forward(kernel, stab: int, args) -> bytes:
    const = dict(HEAD_DIM=args.head_dim, BLOCK_M=args.block_m, BLOCK_N=args.block_n, CAUSAL=not args.non_causal, STAB=stab,
                 EMU=False, MBITS=0, SR=False, ACC_NARROW=False, ROW_NARROW=False, O_NARROW=True, PBAR32=False,
                 HP=False, PFMT=args.pfmt, SOFTCAP=False, KEEP_O32=False, PERSISTENT=False, TMA=args.tma, INTERP=False)
    src = _compile_check().source(kernel, const, aligned=args.aligned)     # the launchers' argument types
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                              options=dict(num_warps=args.warps, num_stages=args.stages))
    return compiled.asm["cubin"]


def disassemble(cubin: bytes) -> str:
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def opcode_counts(sass: str) -> collections.Counter:
    counts = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            counts[m.group(1).split(".")[0]] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--tma", action="store_true")
    ap.add_argument("--warp-specialize", action="store_true")
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--pfmt", type=int, default=-1, help="P̄ format switch (96: fp8 e4m3 product)")
    ap.add_argument("--aligned", action="store_true", help="pointers, strides, lengths divisible by 16")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kernel = load_kernel(args.warp_specialize)
    scores = args.block_m * args.block_n // (32 * args.warps)      # per thread and key block
    print(f"triton {triton.__version__}, sm_90, head_dim {args.head_dim}, tile {args.block_m}×{args.block_n}, "
          f"{args.warps} warps, {args.stages} stages, tma={args.tma}, warp_specialize={args.warp_specialize}, "
          f"pfmt={args.pfmt}, aligned={args.aligned}; "
          f"{scores} scores per thread per key block, two key loops (unmasked, masked)")
    result = {}
    for stab, rule in enumerate(RULES):
        sass = disassemble(compile_forward(kernel, stab, args))
        counts = opcode_counts(sass)
        result[rule] = {"total": sum(counts.values()), **dict(counts)}
        print(f"{rule:9s} total {sum(counts.values()):5d}  " + "  ".join(f"{o} {counts[o]}" for o in SHOWN))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"fwd-{rule}.sass").write_text(sass)
    base = result["standard"]
    for rule in RULES[1:]:
        extra = {k: result[rule].get(k, 0) - base.get(k, 0) for k in set(result[rule]) | set(base) if k != "total"}
        top = sorted(((v, k) for k, v in extra.items() if v), reverse=True)[:6]
        print(f"{rule} − standard: {result[rule]['total'] - base['total']:+d} instructions "
              f"({(result[rule]['total'] - base['total']) / (2 * scores):+.2f} per score); largest: "
              + ", ".join(f"{k} {v:+d}" for v, k in top))
    if args.out:
        (args.out / "sass-counts.json").write_text(json.dumps({"triton": triton.__version__, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "counts": result}, indent=1))


if __name__ == "__main__":
    main()
