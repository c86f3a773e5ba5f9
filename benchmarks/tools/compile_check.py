"""Compile every kernel switch for Hopper (sm_90) without a GPU, before device time is spent.

    python benchmarks/tools/compile_check.py

Triton ships ptxas, so the forward, the δ pass and both backward kernels can be compiled for
compute capability 9.0 here. Each forward variant is a ``KernelConfig`` (plus the launcher's TMA
and persistent-grid switches) turned into the kernel's switches by ``op.forward_switches``, the
launcher's own conversion; each sets the compile-time switches one policy or option turns on
(formats, per-head fp32, fp32 P̄, soft-capping, the fp32 copy of O, stochastic rounding, the
"paper" emulation). Prints one line per variant with its cubin's size, its register spills (STL
instructions) and any global reductions in its SASS (REDG, UTMAREDG), or the error. The CPU
interpreter tests the arithmetic; this checks that the GPU compiler takes the code.
"""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from stableflash.attention.triton.backward import (attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, delta_dot_kernel,
                                                   delta_pass_kernel)
from stableflash.attention.triton.forward import attn_fwd_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_count import disassemble, opcode_counts  # noqa: E402  (this folder's SASS reader)

FP32_POINTERS = {"LSE", "DELTA", "O32"}
FLOATS = {"scale", "beta", "eps", "lo", "hi", "period", "cap_in", "cap_out", "softcap", "mask_mul", "drop_scale"}
# the masking switches, all off (a tree whose kernels lack them leaves them out: ``source``)
NO_MASKS = dict(BAND=False, VARLEN=False, MASK_KIND=0, MASK_ROWS=False, DROPOUT=False)
FWD = dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, PERSISTENT=False, TMA=False, INTERP=False, **NO_MASKS)
BWD = dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, EMU=False, SOFTCAP=False, INTERP=False, **NO_MASKS)
BWD_VARIANTS = {"default": {}, "paper emulation": dict(EMU=True), "soft-capped": dict(SOFTCAP=True),
                "paper, soft-capped": dict(EMU=True, SOFTCAP=True)}


def forward_variants() -> dict:
    """name → (KernelConfig, the launcher's switches beyond it): every switch a policy or option
    turns on, one at a time or in the combinations that share code."""
    from dataclasses import replace

    from stableflash.attention.triton.config import Arithmetic, DeltaSource, Format, KernelConfig, RuleKind
    fa2 = KernelConfig(rule=RuleKind.TIE_SHIFT, narrow=Format.BF16, narrow_out=True)
    e8m5 = replace(fa2, arithmetic=Arithmetic.PAPER, narrow=Format.E8M5, narrow_acc=True, narrow_row_sum=True)
    e4m3, e5m2 = Format.FP8_E4M3, Format.FP8_E5M2
    fp8pv = replace(fa2, p_bar=e4m3, fp8_product=True)
    return {
        "default (fa2, tie-shift)": (fa2, {}),
        "tensor descriptors": (fa2, dict(TMA=True)),
        "persistent grid": (fa2, dict(PERSISTENT=True)),
        "persistent grid, tensor descriptors": (fa2, dict(PERSISTENT=True, TMA=True)),
        "paper emulation, e8m5": (e8m5, {}),
        "paper, e8m5, stochastic": (replace(e8m5, stochastic=True), {}),
        "paper, e8m5, O fp32 kept for δ": (replace(e8m5, narrow_out=False, delta=DeltaSource.DO_O_FP32), {}),
        "fa2, P̄ and O in fp8 e4m3": (replace(fa2, narrow=e4m3, p_bar=e4m3), {}),
        "fa2, P̄ e4m3, O stored in e4m3 stochastically": (replace(fa2, narrow=e4m3, p_bar=e4m3, stochastic=True), {}),
        "fa2, P̄ e5m2, O stored in e5m2 stochastically": (replace(fa2, narrow=e5m2, p_bar=e5m2, stochastic=True), {}),
        "fa2, O e8m4, O as computed kept for δ": (replace(fa2, narrow=Format.E8M4, delta=DeltaSource.DO_O32), {}),
        "fa2, P̄ in e4m3, 16-bit P̄V beside it for δ": (replace(fa2, p_bar=e4m3, delta=DeltaSource.DO_O16), {}),
        "fa2, the O store's residual kept in bf16 for δ": (replace(fa2, delta=DeltaSource.DO_O_R), {}),
        "fa2, P̄ in e4m3, the 16-bit O's residual in bf16 for δ": (
            replace(fa2, narrow=e4m3, p_bar=e4m3, delta=DeltaSource.DO_O16_R), {}),
        "fa2, P̄V on the fp8 tensor cores (e4m3)": (fp8pv, {}),
        "fa2, P̄V on the fp8 tensor cores (e5m2)": (replace(fp8pv, p_bar=e5m2), {}),
        "fa2, fp8 tensor cores, the 16-bit O's residual for δ (consistent δ)": (
            replace(fp8pv, delta=DeltaSource.DO_O16_R), {}),
        "fa2, fp8 tensor cores, heads in fp32": (replace(fp8pv, hp_heads=(0,)), {}),
        "fa2, fp8 tensor cores, tensor descriptors for K (V8 by pointers)": (fp8pv, dict(TMA=True)),
        "fa2, fp8 tensor cores and the consistent δ, tensor descriptors": (
            replace(fp8pv, delta=DeltaSource.DO_O16_R), dict(TMA=True)),
        "fa2, P̄ and O in fp16": (replace(fa2, narrow=Format.FP16, p_bar=Format.FP16), {}),
        "fa2, fp32 P̄": (replace(fa2, p_bar=Format.FP32), {}),
        "paper, e8m5, heads in fp32": (replace(e8m5, hp_heads=(0,), delta=DeltaSource.DO_O_FP32), {}),
        "fa2, heads in fp32, P̄ in e4m3": (replace(fa2, p_bar=e4m3, hp_heads=(0,), delta=DeltaSource.DO_O_FP32), {}),
        "fa2, soft-capped": (replace(fa2, softcap=30.0), {}),
        "paper, soft-capped": (replace(fa2, arithmetic=Arithmetic.PAPER, narrow_acc=True, narrow_row_sum=True,
                                       softcap=30.0), {}),
    }


def forward_job(config, launch: dict | None = None, dtype: str = "bf16") -> tuple[dict, dict]:
    """(constexprs, pointer types) of the forward for a KernelConfig: ``op.forward_switches`` over
    FWD and ``launch``; O32 in O's dtype for the residual δ sources, V8 in P̄'s fp8 format for the
    fp8 product (as ``op._forward`` allocates them)."""
    from stableflash.attention.triton.config import Format
    from stableflash.attention.triton.op import forward_switches
    pointers = {"O32": f"*{dtype}"} if config.delta.residual else {}
    if config.fp8_product:
        pointers["V8"] = "*fp8e4nv" if config.p_bar is Format.FP8_E4M3 else "*fp8e5"
    return {**FWD, **forward_switches(config), **(launch or {})}, pointers


def delta_variants() -> dict:
    from stableflash.attention.triton.config import DeltaSource
    dp_p, fp32 = DeltaSource.DP_P.value, DeltaSource.RECOMPUTE_FP32.value
    return {"dP·P": dict(DELTA_SRC=dp_p), "recompute in fp32": dict(DELTA_SRC=fp32),
            "dP·P, soft-capped": dict(DELTA_SRC=dp_p, SOFTCAP=True)}


def source(kernel, const: dict, aligned: bool = True, pointers: dict | None = None, dtype: str = "bf16") -> ASTSource:
    """``kernel`` with the constants ``const``, typed as the launchers call it: tensors in ``dtype``
    (bf16 or fp16), fp32 LSE/δ/O32, V8 as V, and the pointer types in ``pointers`` instead (e.g.
    O32 in O's dtype, an fp8 V8: ``forward_job``). With ``aligned``, what the launcher's JIT would
    specialize at the benchmarks' shapes: pointers, strides and lengths divisible by 16 (aligned,
    vectorizable loads: what lets the key loop be pipelined)."""
    names = kernel.arg_names
    const = {k: v for k, v in const.items() if k in names}
    pointers = pointers or {}
    sig = {n: "constexpr" if n in const else pointers[n] if n in pointers else
           ("*fp32" if n in FP32_POINTERS else f"*{dtype}") if n.isupper() else
           "fp32" if n in FLOATS else "i32" for n in names}
    divisible = [n for n in names if aligned and n not in const
                 and (n.isupper() or n.startswith("stride") or n in ("n_q", "n_k"))]
    return ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()},
                     attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})


def compile_kernel(kernel, const: dict, warps: int = 4, stages: int = 3,
                   pointers: dict | None = None) -> tuple[int, collections.Counter]:
    """Compile for sm_90; (the cubin's size in bytes, its SASS opcode counts)."""
    compiled = triton.compile(source(kernel, const, pointers=pointers), target=GPUTarget("cuda", 90, 128),
                              options=dict(num_warps=warps, num_stages=stages))
    cubin = compiled.asm["cubin"]
    return len(cubin), opcode_counts(disassemble(cubin))


def key_block_jobs() -> list[tuple]:
    """The "paper" forward at the key blocks a caller may choose (``op.key_block_config``: the
    ladder's "tiling off" takes 512 keys at once), at the largest head_dim each allows."""
    from dataclasses import replace

    from stableflash.attention.triton.op import KEY_BLOCK_AREA, key_block_config
    config, _ = forward_variants()["paper emulation, e8m5"]
    jobs = []
    for block in (16, 128, 256, 512):
        d = min(256, KEY_BLOCK_AREA // block)
        cfg = key_block_config(block, d)
        const, pointers = forward_job(replace(config, block_k=block), {**cfg.kwargs, "HEAD_DIM": d})
        jobs.append((f"forward: paper, e8m5, key block {block}, d {d}", attn_fwd_kernel, const,
                     cfg.num_warps, cfg.num_stages, pointers))
    return jobs


def mask_jobs() -> list[tuple]:
    """The masking switches (positional band, packed sequences, a bool or additive attn_mask,
    dropout, and combinations) in each kernel, argument types as the launcher passes them (the
    dropout seed a 64-bit int)."""
    from dataclasses import replace
    fa2, _ = forward_variants()["default (fa2, tie-shift)"]
    e8m5, _ = forward_variants()["paper emulation, e8m5"]
    types = {"CU_Q": "*i32", "CU_K": "*i32", "drop_seed": "i64"}
    variants = {
        "band": dict(BAND=True),
        "packed sequences": dict(BAND=True, VARLEN=True),
        "bool attn_mask": dict(MASK_KIND=1, MASK_ROWS=True),
        "additive key padding": dict(MASK_KIND=2),
        "dropout": dict(DROPOUT=True),
        "band, bool mask, dropout": dict(BAND=True, MASK_KIND=1, MASK_ROWS=True, DROPOUT=True),
        "packed sequences, dropout": dict(BAND=True, VARLEN=True, DROPOUT=True),
    }
    jobs = []
    for name, v in variants.items():
        ptr = {**types, "MASK": "*u8" if v.get("MASK_KIND") == 1 else "*fp32"}
        for label, config in (("fa2", fa2), ("paper", replace(e8m5, softcap=30.0))):
            const, pointers = forward_job(config, {**NO_MASKS, **v, "CAUSAL": False})
            jobs.append((f"forward {label}: {name}", attn_fwd_kernel, const, 4, 3, {**pointers, **ptr}))
        for bwd_name, kernel, extra in (("dK/dV", attn_bwd_dkdv_kernel, {"BLOCK_M": 32}), ("dQ", attn_bwd_dq_kernel, {}),
                                        ("δ pass", delta_pass_kernel, delta_variants()["dP·P"])):
            jobs.append((f"{bwd_name}: {name}", kernel, {**BWD, **extra, **v, "CAUSAL": False}, 4, 3, ptr))
    return jobs


def main() -> None:
    jobs = [(f"forward: {n}", attn_fwd_kernel, *forward_job(c, launch))
            for n, (c, launch) in forward_variants().items()]
    jobs = [(name, kernel, const, 4, 3, pointers) for name, kernel, const, pointers in jobs] + key_block_jobs()
    jobs += [(f"dK/dV: {n}", attn_bwd_dkdv_kernel, {**BWD, "BLOCK_M": 32, **v}, 4, 3, None)
             for n, v in BWD_VARIANTS.items()]
    jobs += [(f"dQ: {n}", attn_bwd_dq_kernel, {**BWD, **v}, 4, 3, None) for n, v in BWD_VARIANTS.items()]
    jobs += [(f"dQ with δ = rowsum(dO ∘ {n}) fused", attn_bwd_dq_kernel, {**BWD, "FUSE_DELTA": True, "HAS_R": r},
              4, 3, None) for n, r in (("O", False), ("(O + R)", True))]
    jobs += [(f"δ pass: {n}", delta_pass_kernel, {**BWD, **v}, 4, 3, None) for n, v in delta_variants().items()]
    jobs += [(f"δ = rowsum(dO ∘ {n})", delta_dot_kernel, dict(HEAD_DIM=64, BLOCK_M=64, HAS_R=r), 4, 3, None)
             for n, r in (("O", False), ("(O + R)", True))]
    jobs += mask_jobs()
    failed = 0
    for name, kernel, const, warps, stages, pointers in jobs:
        try:
            size, ops = compile_kernel(kernel, const, warps, stages, pointers)
            reductions = "".join(f", {op} {ops[op]}" for op in ("REDG", "UTMAREDG") if ops[op])
            print(f"{name:50s} ok   cubin {size:>7} bytes, STL {ops['STL']}{reductions}", flush=True)
        except Exception as exc:                      # report every variant, then fail
            failed += 1
            print(f"{name:50s} FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
    print(f"{len(jobs) - failed} of {len(jobs)} compiled for sm_90 (triton {triton.__version__})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
