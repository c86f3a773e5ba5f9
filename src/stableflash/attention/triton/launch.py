"""What the Triton backend accepts, and the call from ``flash_attention`` into the custom op."""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from stableflash.attention.policy import O16_SOURCES, PrecisionPolicy, memoize, parse_point, resolve_delta
from stableflash.attention.shift import ShiftRule
from stableflash.attention.triton import common
from stableflash.attention.triton.op import (ACC_NARROW, DELTA_SOURCES, DTYPES, HEAD_DIMS, HP_HEAD_LIMIT, KEEP_O32,
                                             KEY_BLOCKS, NARROW_ALL, O_NARROW, PBAR32, PFMT_SHIFT, ROW_NARROW,
                                             RULE_CODES, attention, interpreting, key_block_config)

FP8_PV = common.FP8_PV.value   # added to the fp8 code in PFMT: P̄ and V multiplied in fp8

SUPPORT = {
    "head_dims": HEAD_DIMS,
    "dtypes": DTYPES,
    "policies": "'fa2' (bf16 or fp16) or 'paper' (bf16), with delta 'dO·O', 'dO·O32', 'dO·(O+R)', 'dP·P', 'recompute_fp32' or 'auto' "
                "('dO·O16' and 'dO·(O16+R)' too under 'fa2'); v_bar equal to an fp8 p_bar (P̄V on the fp8 tensor cores); "
                "for bf16 also hp_heads 0-30, p_bar in fp32, e8m1-e8m6, fp16, fp8_e5m2 or fp8_e4m3, and 'fa2' "
                "with out or 'paper' with acc, row_sum and out each in fp32 or in one shared format bf16, "
                "e8m1-e8m6, fp16, fp8_e5m2 or fp8_e4m3 (each nearest-even, or ':stochastic')",
}


def check_inputs(q: torch.Tensor, k: torch.Tensor) -> None:
    """Raise a clear error for inputs the kernels cannot take (shapes already checked by the API)."""
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        raise ValueError(f"backend='triton' needs CUDA tensors; got device {q.device} (CPU tensors run only "
                         "under the Triton interpreter, TRITON_INTERPRET=1)")
    if q.dtype not in DTYPES:
        raise TypeError(f"backend='triton' takes float16 or bfloat16; got dtype {q.dtype} "
                        "(use backend='emulated' for other dtypes)")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"backend='triton' supports head_dim in {HEAD_DIMS}; got head_dim={q.shape[-1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]}) "
                         "for grouped-query attention")


# the narrow formats beyond bf16 and e8mY that the kernels round to, by code
SMALL_FORMATS = {"fp16": common.FP16.value, "fp8_e5m2": common.E5M2.value, "fp8_e4m3": common.E4M3.value}
FP8_CODES = (common.E5M2.value, common.E4M3.value)


def _narrow_bits(point: str) -> tuple[int, bool] | None:
    """(format code, stochastic) of a narrowing point the kernels implement: 0 for bf16, Y for an
    e8mY format with 1 ≤ Y ≤ 6; 30, 31, 32 for fp16, fp8 e5m2 and e4m3 (each nearest-even or
    stochastic); (23, False) for fp32; None otherwise."""
    fmt, mode = parse_point(point)
    if fmt.name == "fp32":
        return (23, False) if mode == "rne" else None
    if mode not in ("rne", "stochastic"):
        return None
    if fmt.name in SMALL_FORMATS:
        return SMALL_FORMATS[fmt.name], mode == "stochastic"
    if fmt.name == "bf16":
        return 0, mode == "stochastic"
    narrow = fmt.exp_bits == 8 and fmt.bias == 127 and fmt.has_inf and 1 <= fmt.man_bits <= 6
    return (fmt.man_bits, mode == "stochastic") if narrow else None


class KernelMode(NamedTuple):
    """How the kernels run a policy: the "paper" emulation or "fa2" arithmetic (emu); the narrowing
    format's mantissa bits (0 bf16, 1-6 e8mY, 23 fp32) and rounding (stochastic); the δ source code;
    which points the format narrows and whether P̄ is fp32 (flags, op.ACC_NARROW ...); the heads kept
    in fp32 (hp_mask, bit h for head h)."""
    emu: bool
    mbits: int
    stochastic: bool
    delta: int
    flags: int
    hp_mask: int


_FLAG = {"acc": ACC_NARROW, "row_sum": ROW_NARROW, "out": O_NARROW}


@memoize
def kernel_mode(policy: PrecisionPolicy, dtype: torch.dtype) -> KernelMode:
    """The kernels' switches for ``policy``; ValueError if they cannot run it. Under "fa2" O may be
    narrowed (or fp32), under "paper" ℓ, Ō and O: those not in fp32 share one format and rounding
    mode. P̄ may be fp32 (no tensor-core rounding of P̄), and ``hp_heads`` (heads 0-30) keep P̄, Ō, ℓ
    and O in fp32. The kernels hand O back in the input dtype (as the emulated backend does); where
    the policy's O is fp32 (``out=fp32`` or fp32 heads) and δ comes from dO·O, the forward keeps
    that O in fp32 for δ (delta code KEEP_O32). fp16 inputs: the "fa2" preset and δ sources only."""
    policy = resolve_delta(policy)                   # δ source "consistent": the one consistent_delta_source names
    low = "fp16" if dtype == torch.float16 else "bf16"
    for name, emu, narrowable in (("fa2", False, ("out",)), ("paper", True, ("acc", "row_sum", "out"))):
        preset = replace(PrecisionPolicy.preset(name, low), name="custom")
        free = {f: getattr(preset, f) for f in (*narrowable, "p_bar", "v_bar")}
        base = replace(policy, delta="dO·O", name="custom", hp_heads=(), **free)
        p_bar = _narrow_bits(policy.p_bar) if policy.p_bar not in (preset.p_bar, "fp32") else None
        if base != preset or (emu and low != "bf16") or (policy.p_bar not in (preset.p_bar, "fp32") and (
                low != "bf16" or p_bar is None or p_bar[1])):
            continue
        if low != "bf16":
            if all(getattr(policy, f) == v for f, v in free.items()) and not policy.hp_heads:
                return KernelMode(emu, 0, False, DELTA_SOURCES[policy.delta], NARROW_ALL, 0)
            continue
        points = {f: _narrow_bits(getattr(policy, f)) for f in narrowable}
        narrow = {m for m in points.values() if m != (23, False)}
        if None in points.values() or len(narrow) > 1:
            continue
        if policy.hp_heads and max(policy.hp_heads) > HP_HEAD_LIMIT:
            raise ValueError(f"hp_heads={policy.hp_heads} has a head above {HP_HEAD_LIMIT}; backend='triton' keeps "
                             f"heads 0-{HP_HEAD_LIMIT} in fp32 — use backend='emulated' for higher heads")
        bits, stochastic = narrow.pop() if narrow else (23, False)
        flags = sum(_FLAG[f] for f, m in points.items() if m != (23, False)) | (PBAR32 if policy.p_bar == "fp32" else 0)
        if p_bar is not None:                   # P̄ rounded to its own format before P̄V
            flags |= (p_bar[0] + 1) << PFMT_SHIFT
        if policy.narrows_v:                    # V too: only as an fp8 product, V in P̄'s fp8 format
            if p_bar is None or p_bar[0] not in FP8_CODES or policy.v_bar != policy.p_bar:
                continue
            flags += FP8_PV << PFMT_SHIFT
        hp_mask = sum(1 << h for h in policy.hp_heads)
        if emu and policy.delta in O16_SOURCES:
            raise ValueError(f"delta={policy.delta!r} with policy={policy.describe()}: backend='triton' computes the 16-bit "
                             "product for δ only under 'fa2' arithmetic; accepted under 'paper': delta 'dO·O', "
                             "'dO·O32', 'dP·P' or 'recompute_fp32' — or use backend='emulated'")
        keep = (points["out"] == (23, False) or hp_mask) and policy.delta == "dO·O"
        return KernelMode(emu, bits, stochastic, KEEP_O32 if keep else DELTA_SOURCES[policy.delta], flags, hp_mask)
    raise ValueError(f"policy={policy.describe()} is not implemented by backend='triton'; accepted: "
                     f"{SUPPORT['policies']} — use backend='emulated' for any other policy")


def check_key_block(block_k: int | None, policy: PrecisionPolicy, dtype: torch.dtype, head_dim: int | None) -> int:
    """The forward's key block for ``block_k`` (0: the kernel's own, for None). A chosen key block
    is part of the "paper" emulation's arithmetic (ℓ and Ō are rounded after every key block), so
    the kernels take one only for a policy they run in that mode, and only a tile they can hold
    (``op.key_block_config``; with head_dim None, the block's size alone); ValueError otherwise."""
    if block_k is None:
        return 0
    if not kernel_mode(policy, dtype).emu:
        raise ValueError(f"block_k={block_k} with policy={policy.describe()}: backend='triton' takes a key block "
                         "only under the 'paper' emulation, where it sets where ℓ and Ō are rounded; accepted: "
                         "block_k=None (the kernel's own tiles), or backend='emulated' for this policy")
    if block_k not in KEY_BLOCKS:
        raise ValueError(f"block_k={block_k} is not a key block the kernels take; accepted: one of {KEY_BLOCKS}")
    if head_dim is not None:
        key_block_config(block_k, head_dim)
    return block_k


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                     rule: ShiftRule, policy: PrecisionPolicy, softcap: float | None = None,
                     block_k: int | None = None) -> torch.Tensor:
    """The fused kernels, differentiable. Inputs validated by ``flash_attention`` and ``check_inputs``;
    ``block_k``: the forward's key block under the "paper" emulation (``check_key_block``)."""
    mode = kernel_mode(policy, q.dtype)
    block = check_key_block(block_k, policy, q.dtype, q.shape[-1])
    rule = rule.capped_for(policy.point("p_bar")[0].min_normal)   # tied entries' P̄ stays normal in P̄'s format
    return attention(q, k, v, causal, scale, RULE_CODES[rule.kind], float(rule.beta), float(rule.eps),
                     float(rule.min_shift), float(rule.max_shift), mode.emu, mode.mbits, mode.delta, mode.stochastic,
                     mode.flags, mode.hp_mask, softcap or 0.0, block)
