"""Machine-instruction counts of the forward kernel for Hopper (sm_90), per row-maximum rule and
per configuration.

Compiles ``attn_fwd_kernel`` for compute capability 9.0 without a GPU (Triton ships ptxas and
nvdisasm) and counts the SASS instructions by opcode, so that the per-score cost of a rule can be
read before any device time is spent: the standard loop does a max, an FMA, an exp2, an add and
half a bf16 pack per score; what a stabilized rule adds shows up as the difference.

    python benchmarks/tools/sass_count.py [--head-dim 64] [--block-m 64] [--block-n 64] [--warps 4]
                                    [--stages 3] [--tma] [--warp-specialize] [--p-bar FORMAT]
                                    [--fp8-product] [--aligned] [--configs] [--out DIR]
    python benchmarks/tools/sass_count.py --compare A/sass-counts.json B/sass-counts.json

The kernel's switches come from a policy, as a call's do: ``launch.kernel_config`` builds the
KernelConfig and ``op.forward_switches`` turns it into the kernel's switches (the "fa2" preset
for bf16 by default). ``--p-bar`` rounds P̄ to a format of its own first (e.g. fp8_e4m3), and
``--fp8-product`` multiplies it with V in that fp8 format on the fp8 tensor cores (V read from
the launcher's fp8 copy); ``--aligned`` compiles as the JIT does for aligned tensors (pointers,
strides and lengths divisible by 16), which is what lets Triton pipeline the key loop's loads
into shared memory — without it the counts include the unpipelined loads' instructions.

``--configs`` compiles, instead of the rule table, a fixed list of configurations (``configs()``:
every rule under "fa2" and "paper", narrowed points, stochastic rounding, P̄ in fp32 and fp8, the
fp8 product, fp32 heads, each δ source's forward, soft-capping, a key block, fp16 inputs) and
writes, with --out, their counts and the SHA-256 of each listing; ``--compare`` prints where two
such outputs differ. Run against two source trees (``PYTHONPATH=<tree>/src``) it shows whether a
change to the kernel layer changed the machine code: a tree from before the typed configuration
(``launch.kernel_mode``, integer codes) is driven through its own launcher conversion
(``_legacy_job``), so both sides start from the same policies.

``--warp-specialize`` compiles the key loop as ``tl.range(..., warp_specialize=True)`` (a patched
copy of the kernel source, nothing in the package changes) to see whether this Triton splits the
loop into producer and consumer warps on sm_90: if it does, the SASS gains ``USETMAXREG``.
Prints one line per rule (or configuration) and, with --out, writes the listings and a JSON of the counts.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

from stableflash.attention import PrecisionPolicy

RULES = ("standard", "paper", "tie-shift", "all-shift")
SHOWN = ("FMNMX", "FSET", "FSETP", "FSEL", "FADD", "FFMA", "FMUL", "MUFU", "F2FP", "HGMMA", "USETMAXREG")
FORWARD = Path(__file__).resolve().parents[2] / "src/stableflash/attention/triton/forward.py"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def configs() -> dict[str, tuple]:
    """``--configs``: name → (rule kind, policy, input dtype name, softcap, block_k)."""
    fa2, paper = PrecisionPolicy.preset("fa2"), PrecisionPolicy.preset("paper")
    e8m5 = paper.replace(acc="e8m5", row_sum="e8m5", out="e8m5")
    fp8 = fa2.replace(p_bar="fp8_e4m3", out="fp8_e4m3")
    fp8pv = fa2.replace(p_bar="fp8_e4m3", v_bar="fp8_e4m3")
    out = {f"fa2 {k}": (k, fa2, "bf16", None, None) for k in RULES}
    out.update({f"paper {k}": (k, paper, "bf16", None, None) for k in RULES})
    tie = "tie-shift"
    out.update({
        "fa2 out e8m4": (tie, fa2.replace(out="e8m4"), "bf16", None, None),
        "fa2 out fp16": (tie, fa2.replace(out="fp16"), "bf16", None, None),
        "fa2 out bf16 stochastic": (tie, fa2.replace(out="bf16:stochastic"), "bf16", None, None),
        "fa2 p_bar, out fp8_e4m3": (tie, fp8, "bf16", None, None),
        "fa2 p_bar, out fp8_e5m2 stochastic": (tie, fa2.replace(p_bar="fp8_e5m2", out="fp8_e5m2:stochastic"),
                                                "bf16", None, None),
        "fa2 p_bar fp16": (tie, fa2.replace(p_bar="fp16"), "bf16", None, None),
        "fa2 p_bar fp32": (tie, fa2.replace(p_bar="fp32"), "bf16", None, None),
        "fa2 fp8 product e4m3": (tie, fp8pv, "bf16", None, None),
        "fa2 fp8 product e5m2": (tie, fa2.replace(p_bar="fp8_e5m2", v_bar="fp8_e5m2"), "bf16", None, None),
        "fa2 fp8 product e4m3, dO·(O16+R)": (tie, fp8pv.replace(delta="dO·(O16+R)"), "bf16", None, None),
        "fa2 fp8 product e4m3, hp_heads 0": (tie, fp8pv.replace(hp_heads=(0,)), "bf16", None, None),
        "fa2 hp_heads 0": (tie, fa2.replace(hp_heads=(0,)), "bf16", None, None),
        "fa2 out fp32 (O kept in fp32 for dO·O)": (tie, fa2.replace(out="fp32"), "bf16", None, None),
        "fa2 dO·O32": (tie, fa2.replace(delta="dO·O32"), "bf16", None, None),
        "fa2 dO·(O+R)": (tie, fa2.replace(delta="dO·(O+R)"), "bf16", None, None),
        "fa2 p_bar fp8_e4m3, dO·O16": (tie, fp8.replace(delta="dO·O16"), "bf16", None, None),
        "fa2 p_bar fp8_e4m3, dO·(O16+R)": (tie, fp8.replace(delta="dO·(O16+R)"), "bf16", None, None),
        "fa2 dP·P": (tie, fa2.replace(delta="dP·P"), "bf16", None, None),
        "fa2 recompute_fp32": (tie, fa2.replace(delta="recompute_fp32"), "bf16", None, None),
        "fa2 softcap": (tie, fa2, "bf16", 30.0, None),
        "paper e8m5": (tie, e8m5, "bf16", None, None),
        "paper e8m5 stochastic": (tie, paper.replace(acc="e8m5:stochastic", row_sum="e8m5:stochastic",
                                                     out="e8m5:stochastic"), "bf16", None, None),
        "paper e8m5 out fp32 (O kept in fp32 for dO·O)": (tie, e8m5.replace(out="fp32"), "bf16", None, None),
        "paper e8m5 hp_heads 0": (tie, e8m5.replace(hp_heads=(0,)), "bf16", None, None),
        "paper e8m5 dO·(O+R)": (tie, e8m5.replace(delta="dO·(O+R)"), "bf16", None, None),
        "paper p_bar fp32, acc fp32, row_sum, out e8m5": (
            tie, paper.replace(p_bar="fp32", acc="fp32", row_sum="e8m5", out="e8m5"), "bf16", None, None),
        "paper softcap": (tie, paper, "bf16", 30.0, None),
        "paper e8m5 key block 128": ("standard", e8m5, "bf16", None, 128),
        "fp16 fa2": ("standard", PrecisionPolicy.preset("fa2", "fp16"), "fp16", None, None),
        "fp16 fa2 tie-shift dO·(O+R)": (tie, PrecisionPolicy.preset("fa2", "fp16").replace(delta="dO·(O+R)"),
                                        "fp16", None, None),
    })
    return out


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


def forward_job(kind: str, policy: PrecisionPolicy, dtype: str, softcap: float | None,
                block_k: int | None) -> tuple[dict, dict, dict]:
    """(the kernel's switches, pointer types beside the inputs' dtype, a chosen key block's tile
    or {}) for one call's arguments, through the launcher's own conversion."""
    from stableflash.attention import ShiftRule
    from stableflash.attention.triton import launch
    if not hasattr(launch, "kernel_config"):
        return _legacy_job(kind, policy, dtype, softcap, block_k)
    config = launch.kernel_config(policy, ShiftRule(kind), DTYPES[dtype], softcap, block_k)
    const, pointers = _compile_check().forward_job(config, dtype=dtype)
    return const, pointers, _tile(config.block_k)


def _legacy_job(kind, policy, dtype, softcap, block_k) -> tuple[dict, dict, dict]:
    """``forward_job`` for a tree from before the typed configuration (``launch.kernel_mode``:
    integer codes and bit flags), restating that tree's ``op._forward`` and ``op.attn_fwd``."""
    from stableflash.attention import ShiftRule
    from stableflash.attention.triton import launch, op
    mode = launch.kernel_mode(policy, DTYPES[dtype])
    block = launch.check_key_block(block_k, policy, DTYPES[dtype], None)
    rule = ShiftRule(kind).capped_for(policy.point("p_bar")[0].min_normal)
    pfmt, keep = (mode.flags >> op.PFMT_SHIFT) - 1, op.KEEP_MODE.get(mode.delta, 0)
    const = dict(STAB=op.RULE_CODES[rule.kind], EMU=mode.emu, MBITS=mode.mbits, SR=mode.stochastic,
                 ACC_NARROW=bool(mode.flags & op.ACC_NARROW), ROW_NARROW=bool(mode.flags & op.ROW_NARROW),
                 O_NARROW=bool(mode.flags & op.O_NARROW), PBAR32=bool(mode.flags & op.PBAR32), HP=mode.hp_mask != 0,
                 PFMT=pfmt, SOFTCAP=bool(softcap), KEEP_O32=keep, PERSISTENT=False, TMA=False, INTERP=False)
    pointers = {"O32": f"*{dtype}"} if keep in op.RESIDUAL_KEEP else {}
    if pfmt >= 64:                                         # common.FP8_PV + the fp8 format's code
        pointers["V8"] = "*fp8e4nv" if pfmt == 96 else "*fp8e5"
    return const, pointers, _tile(block or None)


def _tile(block_k: int | None) -> dict:
    return {"block_k": block_k} if block_k else {}


def compile_forward(kernel, const: dict, pointers: dict, tile: dict, dtype: str, args) -> bytes:
    """The cubin of the forward with switches ``const``, at the tile of ``args`` or, for a chosen
    key block, that block's (``op.key_block_config``)."""
    from stableflash.attention.triton.op import key_block_config
    block_m, block_n, warps, stages = args.block_m, args.block_n, args.warps, args.stages
    if tile:
        cfg = key_block_config(tile["block_k"], args.head_dim)
        block_m, block_n, warps, stages = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages
    const = {**const, "HEAD_DIM": args.head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n,
             "CAUSAL": not args.non_causal, "PERSISTENT": False, "TMA": args.tma, "INTERP": False,
             **_compile_check().NO_MASKS}
    src = _compile_check().source(kernel, const, aligned=args.aligned, pointers=pointers, dtype=dtype)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=warps, num_stages=stages))
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


def compare(a: Path, b: Path) -> int:
    """Print the configurations whose opcode counts or listings differ between two outputs."""
    ca, cb = (json.loads(p.read_text()) for p in (a, b))
    names = sorted(set(ca["counts"]) | set(cb["counts"]))
    same = 0
    for n in names:
        x, y = ca["counts"].get(n), cb["counts"].get(n)
        if x == y and ca.get("listings", {}).get(n) == cb.get("listings", {}).get(n):
            same += 1
            continue
        diff = {k: (x or {}).get(k, 0) - (y or {}).get(k, 0) for k in set(x or {}) | set(y or {})}
        print(f"differs: {n}: " + (", ".join(f"{k} {v:+d}" for k, v in sorted(diff.items()) if v)
                                   or "same counts, different listing"))
    print(f"{same} of {len(names)} configurations with identical opcode counts and listings ({a} vs {b})")
    return 0 if same == len(names) else 1


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
    ap.add_argument("--p-bar", help="the format P̄ is rounded to before P̄V (e.g. fp8_e4m3)")
    ap.add_argument("--fp8-product", action="store_true", help="P̄V on the fp8 tensor cores, V in --p-bar's format")
    ap.add_argument("--aligned", action="store_true", help="pointers, strides, lengths divisible by 16")
    ap.add_argument("--configs", action="store_true", help="compile CONFIGS instead of the rule table")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two outputs and exit")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    kernel = load_kernel(args.warp_specialize)
    scores = args.block_m * args.block_n // (32 * args.warps)      # per thread and key block
    print(f"triton {triton.__version__}, sm_90, head_dim {args.head_dim}, tile {args.block_m}×{args.block_n}, "
          f"{args.warps} warps, {args.stages} stages, tma={args.tma}, warp_specialize={args.warp_specialize}, "
          f"p_bar={args.p_bar}, fp8_product={args.fp8_product}, aligned={args.aligned}; "
          f"{scores} scores per thread per key block, two key loops (unmasked, masked)")
    if args.configs:
        jobs = configs()
    else:
        policy = PrecisionPolicy.preset("fa2")
        if args.p_bar:
            policy = policy.replace(p_bar=args.p_bar, **({"v_bar": args.p_bar} if args.fp8_product else {}))
        jobs = {rule: (rule, policy, "bf16", None, None) for rule in RULES}
    result, listings = {}, {}
    width = max(map(len, jobs))
    for name, (kind, policy, dtype, softcap, block_k) in jobs.items():
        const, pointers, tile = forward_job(kind, policy, dtype, softcap, block_k)
        sass = disassemble(compile_forward(kernel, const, pointers, tile, dtype, args))
        counts = opcode_counts(sass)
        result[name] = {"total": sum(counts.values()), **dict(counts)}
        listings[name] = hashlib.sha256(sass.encode()).hexdigest()
        print(f"{name:{width}s} total {sum(counts.values()):5d}  " + "  ".join(f"{o} {counts[o]}" for o in SHOWN),
              flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"fwd-{re.sub(r'[^A-Za-z0-9_.+-]+', '_', name)}.sass").write_text(sass)
    if not args.configs:
        base = result["standard"]
        for rule in RULES[1:]:
            extra = {k: result[rule].get(k, 0) - base.get(k, 0) for k in set(result[rule]) | set(base) if k != "total"}
            top = sorted(((v, k) for k, v in extra.items() if v), reverse=True)[:6]
            print(f"{rule} − standard: {result[rule]['total'] - base['total']:+d} instructions "
                  f"({(result[rule]['total'] - base['total']) / (2 * scores):+.2f} per score); largest: "
                  + ", ".join(f"{k} {v:+d}" for v, k in top))
    if args.out:
        (args.out / "sass-counts.json").write_text(json.dumps({"triton": triton.__version__, "args": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "counts": result,
            "listings": listings}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
