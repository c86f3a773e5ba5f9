"""Compile every kernel switch for Hopper (sm_90) without a GPU, before device time is spent.

    python benchmarks/tools/compile_check.py

Triton ships ptxas, so the forward, the δ pass and both backward kernels can be compiled for
compute capability 9.0 here. Each variant below sets the compile-time switches one policy or
option turns on (formats, per-head fp32, fp32 P̄, soft-capping, the fp32 copy of O, stochastic
rounding, the "paper" emulation). Prints one line per variant with its SASS size, or the error.
The CPU interpreter tests the arithmetic; this checks that the GPU compiler takes the code.
"""
from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from stableflash.attention.triton.backward import (attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, delta_dot_kernel,
                                                   delta_pass_kernel)
from stableflash.attention.triton.forward import attn_fwd_kernel
from stableflash.attention.triton.op import RESIDUAL_KEEP

FP32_POINTERS = {"LSE", "DELTA", "O32"}
FLOATS = {"scale", "beta", "eps", "lo", "hi", "period", "cap_in", "cap_out", "softcap"}
FWD = dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, STAB=2, EMU=False, MBITS=0, SR=False, ACC_NARROW=False,
           ROW_NARROW=False, O_NARROW=True, PBAR32=False, HP=False, PFMT=-1, SOFTCAP=False, KEEP_O32=False, PERSISTENT=False, TMA=False,
           INTERP=False)
FWD_VARIANTS = {
    "default (fa2, our rule)": {},
    "tensor descriptors": dict(TMA=True),
    "persistent grid": dict(PERSISTENT=True),
    "persistent grid, tensor descriptors": dict(PERSISTENT=True, TMA=True),
    "paper emulation, e8m5": dict(EMU=True, MBITS=5, ACC_NARROW=True, ROW_NARROW=True),
    "paper, e8m5, stochastic": dict(EMU=True, MBITS=5, ACC_NARROW=True, ROW_NARROW=True, SR=True),
    "paper, e8m5, O fp32 kept for δ": dict(EMU=True, MBITS=5, ACC_NARROW=True, ROW_NARROW=True, O_NARROW=False,
                                          KEEP_O32=True),
    "fa2, P̄ and O in fp8 e4m3": dict(MBITS=32, PFMT=32),
    "fa2, P̄ e4m3, O stored in e4m3 stochastically": dict(MBITS=32, PFMT=32, SR=True),
    "fa2, P̄ e5m2, O stored in e5m2 stochastically": dict(MBITS=31, PFMT=31, SR=True),
    "fa2, O e8m4, O as computed kept for δ": dict(MBITS=4, KEEP_O32=2),
    "fa2, P̄ in e4m3, 16-bit P̄V beside it for δ": dict(PFMT=32, KEEP_O32=3),
    "fa2, the O store's residual kept in bf16 for δ": dict(KEEP_O32=4),
    "fa2, P̄ in e4m3, the 16-bit O's residual in bf16 for δ": dict(PFMT=32, MBITS=32, KEEP_O32=5),
    "fa2, P̄V on the fp8 tensor cores (e4m3)": dict(PFMT=96),
    "fa2, P̄V on the fp8 tensor cores (e5m2)": dict(PFMT=95),
    "fa2, fp8 tensor cores, the 16-bit O's residual for δ (the guard)": dict(PFMT=96, KEEP_O32=5),
    "fa2, fp8 tensor cores, heads in fp32": dict(PFMT=96, HP=True),
    "fa2, fp8 tensor cores, tensor descriptors for K (V8 by pointers)": dict(PFMT=96, TMA=True),
    "fa2, fp8 tensor cores and the guard, tensor descriptors": dict(PFMT=96, KEEP_O32=5, TMA=True),
    "fa2, P̄ and O in fp16": dict(MBITS=30, PFMT=30),
    "fa2, fp32 P̄": dict(PBAR32=True),
    "paper, e8m5, heads in fp32": dict(EMU=True, MBITS=5, ACC_NARROW=True, ROW_NARROW=True, HP=True, KEEP_O32=True),
    "fa2, heads in fp32, P̄ in e4m3": dict(PFMT=32, HP=True, KEEP_O32=True),
    "fa2, soft-capped": dict(SOFTCAP=True),
    "paper, soft-capped": dict(EMU=True, SOFTCAP=True, ACC_NARROW=True, ROW_NARROW=True),
}
BWD = dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, EMU=False, SOFTCAP=False, INTERP=False)
BWD_VARIANTS = {"default": {}, "paper emulation": dict(EMU=True), "soft-capped": dict(SOFTCAP=True),
                "paper, soft-capped": dict(EMU=True, SOFTCAP=True)}
DELTA_VARIANTS = {"dP·P": dict(DELTA_SRC=1), "recompute in fp32": dict(DELTA_SRC=2),
                  "dP·P, soft-capped": dict(DELTA_SRC=1, SOFTCAP=True)}


def source(kernel, const: dict, aligned: bool = True) -> ASTSource:
    """``kernel`` with the constants ``const``, typed as the launchers call it: bf16 tensors, fp32
    LSE/δ/O32 (O32 in O's dtype for the residual δ sources), an fp8 V8 for the fp8 product. With
    ``aligned``, what the launcher's JIT would specialize at the benchmarks' shapes: pointers,
    strides and lengths divisible by 16 (aligned, vectorizable loads: what lets the key loop be
    pipelined)."""
    names = kernel.arg_names
    fp32 = FP32_POINTERS - {"O32"} if const.get("KEEP_O32") in RESIDUAL_KEEP else FP32_POINTERS   # O32 in O's dtype
    pfmt = const.get("PFMT", -1)            # an fp8 product reads V8, V converted by the launcher
    v8 = {96: "*fp8e4nv", 95: "*fp8e5"}.get(pfmt, "*bf16")
    sig = {n: "constexpr" if n in const else v8 if n == "V8" else
           ("*fp32" if n in fp32 else "*bf16") if n.isupper() else
           "fp32" if n in FLOATS else "i32" for n in names}
    divisible = [n for n in names if aligned and n not in const
                 and (n.isupper() or n.startswith("stride") or n in ("n_q", "n_k"))]
    return ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()},
                     attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})


def compile_kernel(kernel, const: dict, warps: int = 4, stages: int = 3) -> int:
    """Compile for sm_90; the cubin's size in bytes."""
    compiled = triton.compile(source(kernel, const), target=GPUTarget("cuda", 90, 128),
                              options=dict(num_warps=warps, num_stages=stages))
    return len(compiled.asm["cubin"])


def key_block_jobs() -> list[tuple]:
    """The "paper" forward at the key blocks a caller may choose (``op.key_block_config``: the
    ladder's "tiling off" takes 512 keys at once), at the largest head_dim each allows."""
    from stableflash.attention.triton.op import KEY_BLOCK_AREA, key_block_config
    jobs = []
    for block in (16, 128, 256, 512):
        d = min(256, KEY_BLOCK_AREA // block)
        cfg = key_block_config(block, d)
        const = {**FWD, **FWD_VARIANTS["paper emulation, e8m5"], **cfg.kwargs, "HEAD_DIM": d}
        jobs.append((f"forward: paper, e8m5, key block {block}, d {d}", attn_fwd_kernel, const,
                     cfg.num_warps, cfg.num_stages))
    return jobs


def main() -> None:
    jobs = [(f"forward: {n}", attn_fwd_kernel, {**FWD, **v}) for n, v in FWD_VARIANTS.items()]
    jobs = [(*j, 4, 3) for j in jobs] + key_block_jobs()
    jobs += [(f"dK/dV: {n}", attn_bwd_dkdv_kernel, {**BWD, "BLOCK_M": 32, **v}, 4, 3) for n, v in BWD_VARIANTS.items()]
    jobs += [(f"dQ: {n}", attn_bwd_dq_kernel, {**BWD, **v}, 4, 3) for n, v in BWD_VARIANTS.items()]
    jobs += [(f"δ pass: {n}", delta_pass_kernel, {**BWD, **v}, 4, 3) for n, v in DELTA_VARIANTS.items()]
    jobs += [(f"δ = rowsum(dO ∘ {n})", delta_dot_kernel, dict(HEAD_DIM=64, BLOCK_M=64, HAS_R=r), 4, 3)
             for n, r in (("O", False), ("(O + R)", True))]
    failed = 0
    for name, kernel, const, warps, stages in jobs:
        try:
            print(f"{name:50s} ok   cubin {compile_kernel(kernel, const, warps, stages):>7} bytes", flush=True)
        except Exception as exc:                      # report every variant, then fail
            failed += 1
            print(f"{name:50s} FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
    print(f"{len(jobs) - failed} of {len(jobs)} compiled for sm_90 (triton {triton.__version__})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
