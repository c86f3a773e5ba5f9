"""What the Triton backend accepts, and the call from ``flash_attention`` into the custom op."""
from __future__ import annotations

from dataclasses import replace

import torch

from stableflash.attention.policy import PrecisionPolicy, memoize, parse_point
from stableflash.attention.shift import ShiftRule
from stableflash.attention.triton.op import (DELTA_SOURCES, DTYPES, HEAD_DIMS, KEEP_O32, RULE_CODES, attention,
                                             interpreting)

SUPPORT = {
    "head_dims": HEAD_DIMS,
    "dtypes": DTYPES,
    "policies": "'fa2' (bf16 or fp16) or 'paper' (bf16), with delta 'dO·O', 'dP·P' or 'recompute_fp32'; "
                "for bf16, 'fa2' with out, or 'paper' with acc and row_sum (and out, or out=fp32), in one "
                "format bf16, e8m1-e8m6 (nearest-even, or ':stochastic') or fp32",
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


def _narrow_bits(point: str) -> tuple[int, bool] | None:
    """(mantissa bits, stochastic) of a narrowing point the kernels implement: 0 for bf16, Y for an
    e8mY format with 1 ≤ Y ≤ 6, each rounded to nearest-even or stochastically; (23, False) for
    fp32; None otherwise."""
    fmt, mode = parse_point(point)
    if fmt.name == "fp32":
        return (23, False) if mode == "rne" else None
    if mode not in ("rne", "stochastic"):
        return None
    if fmt.name == "bf16":
        return 0, mode == "stochastic"
    narrow = fmt.exp_bits == 8 and fmt.bias == 127 and fmt.has_inf and 1 <= fmt.man_bits <= 6
    return (fmt.man_bits, mode == "stochastic") if narrow else None


@memoize
def kernel_mode(policy: PrecisionPolicy, dtype: torch.dtype) -> tuple[bool, int, bool, int, bool]:
    """(emu, mantissa bits, stochastic, delta source code, O narrowed) of the kernels that implement
    ``policy``; ValueError otherwise. Mantissa bits > 0: the e8mY format of O ("fa2") or of ℓ, Ō and
    O ("paper"); 23 keeps them in fp32. Stochastic: those points (or a bf16 O) rounded
    stochastically. The kernels hand O back in the input dtype (as the emulated backend does); an
    fp32 ``out`` with δ from dO·O makes the forward keep an fp32 O for δ (delta code KEEP_O32), and
    under "paper" ``out=fp32`` may follow narrowed ℓ and Ō (O narrowed: False)."""
    low = "fp16" if dtype == torch.float16 else "bf16"
    for name, emu, narrowed in (("fa2", False, ("out",)), ("paper", True, ("acc", "row_sum", "out"))):
        preset = replace(PrecisionPolicy.preset(name, low), name="custom")
        base = replace(policy, delta="dO·O", name="custom", **{f: getattr(preset, f) for f in narrowed})
        if base != preset or (emu and low != "bf16"):
            continue
        if low != "bf16":
            if all(getattr(policy, f) == getattr(preset, f) for f in narrowed):
                return emu, 0, False, DELTA_SOURCES[policy.delta], True
            continue
        inner = {_narrow_bits(getattr(policy, f)) for f in narrowed[:-1]} or {_narrow_bits(policy.out)}
        out = _narrow_bits(policy.out)
        if len(inner) == 1 and None not in inner and out in (*inner, (23, False)):
            bits, stochastic = inner.pop()
            delta = KEEP_O32 if out == (23, False) and policy.delta == "dO·O" else DELTA_SOURCES[policy.delta]
            return emu, bits, stochastic, delta, out != (23, False) or bits == 23
    raise ValueError(f"policy={policy.describe()} is not implemented by backend='triton'; accepted: "
                     f"{SUPPORT['policies']} — use backend='emulated' for any other policy")


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                     rule: ShiftRule, policy: PrecisionPolicy) -> torch.Tensor:
    """The fused kernels, differentiable. Inputs validated by ``flash_attention`` and ``check_inputs``."""
    emu, mbits, stochastic, delta_src, o_narrow = kernel_mode(policy, q.dtype)
    return attention(q, k, v, causal, scale, RULE_CODES[rule.kind], float(rule.beta), float(rule.eps),
                     float(rule.min_shift), float(rule.max_shift), emu, mbits, delta_src, stochastic, o_narrow)
