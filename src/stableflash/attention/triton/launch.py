"""What the Triton backend accepts, and the call from ``flash_attention`` into the custom op."""
from __future__ import annotations

from dataclasses import replace

import torch

from stableflash.attention.policy import PrecisionPolicy, memoize
from stableflash.attention.shift import ShiftRule
from stableflash.attention.triton.op import DELTA_SOURCES, DTYPES, HEAD_DIMS, RULE_CODES, attention, interpreting

SUPPORT = {
    "head_dims": HEAD_DIMS,
    "dtypes": DTYPES,
    "policies": "'fa2' (bf16 or fp16) or 'paper' (bf16), with delta 'dO·O', 'dP·P' or 'recompute_fp32'",
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


@memoize
def kernel_mode(policy: PrecisionPolicy, dtype: torch.dtype) -> tuple[bool, int]:
    """(emu, delta source code) of the kernels that implement ``policy``; ValueError otherwise."""
    low = "fp16" if dtype == torch.float16 else "bf16"
    base = replace(policy, delta="dO·O", name="custom")
    for name, emu in (("fa2", False), ("paper", True)):
        preset = replace(PrecisionPolicy.preset(name, low), name="custom")
        if base == preset and not (emu and low != "bf16"):
            return emu, DELTA_SOURCES[policy.delta]
    raise ValueError(f"policy={policy.describe()} is not implemented by backend='triton'; accepted: "
                     f"{SUPPORT['policies']} — use backend='emulated' for any other policy")


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                     rule: ShiftRule, policy: PrecisionPolicy) -> torch.Tensor:
    """The fused kernels, differentiable. Inputs validated by ``flash_attention`` and ``check_inputs``."""
    emu, delta_src = kernel_mode(policy, q.dtype)
    return attention(q, k, v, causal, scale, RULE_CODES[rule.kind], float(rule.beta), float(rule.eps),
                     float(rule.min_shift), float(rule.max_shift), emu, delta_src)
