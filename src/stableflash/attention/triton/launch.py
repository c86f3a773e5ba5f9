"""What the Triton backend accepts, and the call from ``flash_attention`` into the custom op."""
from __future__ import annotations

from dataclasses import replace

import torch

from stableflash.attention.masking import Alignment, Masking
from stableflash.attention.policy import PrecisionPolicy, memoize, parse_point, resolve_delta, resolve_policy
from stableflash.attention.shift import ShiftRule
from stableflash.attention.triton.config import (HP_HEAD_LIMIT, Arithmetic, DeltaSource, Format, KernelConfig,
                                                 RuleKind)
from stableflash.attention.triton.op import (DTYPES, HEAD_DIMS, KEY_BLOCKS, UNBOUNDED, Masks, attention,
                                             interpreting, key_block_config)

SUPPORT = {
    "head_dims": HEAD_DIMS,
    "dtypes": DTYPES,
    "policies": "'fa2' (bf16 or fp16) or 'paper' (bf16), with delta 'dO·O', 'dO·O32', 'dO·(O+R)', 'dP·P', 'recompute_fp32' or 'auto' "
                "('dO·O16' and 'dO·(O16+R)' too under 'fa2'); v_bar equal to an fp8 p_bar (P̄V on the fp8 tensor cores); "
                "for bf16 also hp_heads 0-30, p_bar in fp32, e8m1-e8m6, fp16, fp8_e5m2 or fp8_e4m3, and 'fa2' "
                "with out or 'paper' with acc, row_sum and out each in fp32 or in one shared format bf16, "
                "e8m1-e8m6, fp16, fp8_e5m2 or fp8_e4m3 (each nearest-even, or ':stochastic')",
    "masks": "causal top-left or bottom-right, a window (left, right), packed sequences (cu_seqlens), "
             "an attn_mask (bool or float, broadcast to (B, H, Nq, Nk), no gradient; not with packed sequences), "
             "dropout 0 ≤ p < 1",
}
MASK_DTYPES = (torch.bool, torch.float32, torch.float16, torch.bfloat16)


def check_inputs(q: torch.Tensor, k: torch.Tensor, *, masking: Masking = Masking(),
                 attn_mask: torch.Tensor | None = None, varlen: bool = False, dropout_p: float = 0.0) -> None:
    """Raise a clear error for inputs the kernels cannot take (shapes already checked by the API):
    the device, dtype, head_dim and head grouping; an ``attn_mask`` that is not bool or float,
    not of shape (B, H, Nq, Nk) (expand a broadcastable one first), requires a gradient, or
    comes with packed sequences (``varlen``: then q is (1, H, total, d)); a dropout probability
    outside [0, 1)."""
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
    if not isinstance(masking, Masking):
        raise TypeError(f"masking={masking!r} is invalid; accepted: a stableflash.attention.masking.Masking")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} is invalid; backend='triton' takes a float with 0 ≤ dropout_p < 1")
    if varlen and q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) take q as (1, H, total, d); got q of shape {tuple(q.shape)}")
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask of type {type(attn_mask).__name__} is invalid; accepted: None or a tensor")
    if varlen:
        raise ValueError("attn_mask with packed sequences (cu_seqlens) is not supported by backend='triton'; "
                         "accepted: attn_mask=None with cu_seqlens (the sequences' boundaries are the mask)")
    if attn_mask.dtype not in MASK_DTYPES:
        raise TypeError(f"attn_mask of dtype {attn_mask.dtype} is invalid; accepted: torch.bool (True = take part) "
                        "or a float additive mask (float32, float16, bfloat16)")
    if attn_mask.requires_grad:
        raise ValueError("attn_mask requires a gradient, which backend='triton' does not compute; accepted: "
                         "a mask without gradient (attn_mask.detach()), or backend='emulated'")
    want = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if tuple(attn_mask.shape) != want:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} is invalid; accepted: shape {want} "
                         "(B, H, Nq, Nk), broadcast dimensions expanded (attn_mask.expand(...), stride 0)")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask on {attn_mask.device} is invalid; accepted: on q's device {q.device}")


def _point(point: str) -> tuple[Format, bool] | None:
    """(format, stochastic) of a rounding point the kernels implement: bf16, e8mY with 1 ≤ Y ≤ 6,
    fp16, fp8 e5m2 or e4m3, each nearest-even or stochastic; fp32 nearest-even (nothing rounded);
    None otherwise."""
    fmt, mode = parse_point(point)
    if fmt.name == "fp32":
        return (Format.FP32, False) if mode == "rne" else None
    if mode not in ("rne", "stochastic"):
        return None
    e8 = fmt.exp_bits == 8 and fmt.bias == 127 and fmt.has_inf and 1 <= fmt.man_bits <= 6
    found = Format(fmt.man_bits) if e8 else Format.named(fmt.name)
    return None if found is None or found is Format.FP32 else (found, mode == "stochastic")


def _precision(policy: PrecisionPolicy, dtype: torch.dtype) -> dict:
    """KernelConfig's precision fields for ``policy`` (δ source already resolved); ValueError if
    the kernels cannot run it. Under "fa2" O may be narrowed (or fp32), under "paper" ℓ, Ō and O:
    those not in fp32 share one format and rounding mode. P̄ may be fp32 (no tensor-core rounding
    of P̄) or a format of its own, and ``hp_heads`` (heads 0-30) keep P̄, Ō, ℓ and O in fp32. The
    kernels hand O back in the input dtype (as the emulated backend does); where the policy's O is
    fp32 (``out=fp32`` or fp32 heads) and δ comes from dO·O, the forward keeps that O in fp32 for δ
    (DeltaSource.DO_O_FP32). fp16 inputs: the "fa2" preset and δ sources only."""
    low = "fp16" if dtype == torch.float16 else "bf16"
    for arithmetic, narrowable in ((Arithmetic.FA2, ("out",)), (Arithmetic.PAPER, ("acc", "row_sum", "out"))):
        emu = arithmetic is Arithmetic.PAPER
        preset = replace(PrecisionPolicy.preset(arithmetic.value, low), name="custom")
        free = {f: getattr(preset, f) for f in (*narrowable, "p_bar", "v_bar")}
        base = replace(policy, delta="dO·O", name="custom", hp_heads=(), **free)
        p_bar = _point(policy.p_bar) if policy.p_bar not in (preset.p_bar, "fp32") else None
        if base != preset or (emu and low != "bf16") or (policy.p_bar not in (preset.p_bar, "fp32") and (
                low != "bf16" or p_bar is None or p_bar[1])):
            continue
        delta = DeltaSource.named(policy.delta)
        if low != "bf16":                       # O rounded to fp16 by its store; nothing else narrowed
            if all(getattr(policy, f) == v for f, v in free.items()) and not policy.hp_heads:
                return dict(arithmetic=arithmetic, narrow=Format.FP16, narrow_out=True, delta=delta)
            continue
        points = {f: _point(getattr(policy, f)) for f in narrowable}
        narrow = {m for m in points.values() if m != (Format.FP32, False)}
        if None in points.values() or len(narrow) > 1:
            continue
        if policy.hp_heads and max(policy.hp_heads) > HP_HEAD_LIMIT:
            raise ValueError(f"hp_heads={policy.hp_heads} has a head above {HP_HEAD_LIMIT}; backend='triton' keeps "
                             f"heads 0-{HP_HEAD_LIMIT} in fp32 — use backend='emulated' for higher heads")
        fmt, stochastic = narrow.pop() if narrow else (Format.FP32, False)
        fp8_product = policy.narrows_v          # V narrowed too: only as an fp8 product, V in P̄'s fp8 format
        if fp8_product and (p_bar is None or not p_bar[0].fp8 or policy.v_bar != policy.p_bar):
            continue
        if emu and delta.o16:
            raise ValueError(f"delta={policy.delta!r} with policy={policy.describe()}: backend='triton' computes the 16-bit "
                             "product for δ only under 'fa2' arithmetic; accepted under 'paper': delta 'dO·O', "
                             "'dO·O32', 'dP·P' or 'recompute_fp32' — or use backend='emulated'")
        if (points["out"] == (Format.FP32, False) or policy.hp_heads) and delta is DeltaSource.DO_O:
            delta = DeltaSource.DO_O_FP32
        narrowed = {f for f, m in points.items() if m != (Format.FP32, False)}
        return dict(arithmetic=arithmetic, narrow=fmt, narrow_acc="acc" in narrowed,
                    narrow_row_sum="row_sum" in narrowed, narrow_out="out" in narrowed, stochastic=stochastic,
                    p_bar=Format.FP32 if policy.p_bar == "fp32" else None if p_bar is None else p_bar[0],
                    fp8_product=fp8_product, delta=delta, hp_heads=policy.hp_heads)
    raise ValueError(f"policy={policy.describe()} is not implemented by backend='triton'; accepted: "
                     f"{SUPPORT['policies']} — use backend='emulated' for any other policy")


@memoize
def kernel_config(policy: PrecisionPolicy, rule: ShiftRule, dtype: torch.dtype, softcap: float | None = None,
                  block_k: int | None = None) -> KernelConfig:
    """The kernels' configuration for a call (arguments positional: memoized, the per-call cost
    being a lookup); ValueError if they cannot run it. ``rule``: its shift capped for P̄'s format
    (tied entries' P̄ stays normal there); ``softcap`` > 0 or None; ``block_k``: the forward's key
    block, which is part of the "paper" emulation's arithmetic (ℓ and Ō are rounded after every
    key block), so the kernels take one only for a policy they run in that mode, and only a size
    in KEY_BLOCKS (whether its tile holds a head_dim: ``op.key_block_config``)."""
    policy = resolve_delta(policy)                   # δ source "consistent": the one consistent_delta_source names
    precision = _precision(policy, dtype)
    if block_k is not None:
        if precision["arithmetic"] is not Arithmetic.PAPER:
            raise ValueError(f"block_k={block_k} with policy={policy.describe()}: backend='triton' takes a key block "
                             "only under the 'paper' emulation, where it sets where ℓ and Ō are rounded; accepted: "
                             "block_k=None (the kernel's own tiles), or backend='emulated' for this policy")
        if block_k not in KEY_BLOCKS:
            raise ValueError(f"block_k={block_k} is not a key block the kernels take; accepted: one of {KEY_BLOCKS}")
    rule = rule.capped_for(policy.point("p_bar")[0].min_normal)
    return KernelConfig(rule=RuleKind.of(rule.kind), beta=float(rule.beta), eps=float(rule.eps),
                        min_shift=float(rule.min_shift), max_shift=float(rule.max_shift),
                        softcap=float(softcap) if softcap else None, block_k=block_k, **precision)


def stabilized_config(dtype: torch.dtype = torch.bfloat16) -> KernelConfig:
    """The kernels' configuration of ``flash_attention(q, k, v)`` with its defaults (``stabilize=True``,
    no policy) for inputs of ``dtype``, resolved as the API resolves it: what the benchmarks and
    tests that call the kernels directly compare with."""
    from stableflash.attention.stabilization import parse_stabilize
    stab = parse_stabilize(True)
    return kernel_config(stab.policy_for(resolve_policy(None, dtype)), stab.rule, dtype)


# the standard row maximum, made once: the checks below ask ``kernel_config`` with it on every call
_STANDARD_RULE = ShiftRule()


def check_policy(policy: PrecisionPolicy, dtype: torch.dtype) -> None:
    """ValueError, naming what the kernels accept, if they cannot run ``policy`` for ``dtype`` inputs."""
    kernel_config(policy, _STANDARD_RULE, dtype)


def check_key_block(block_k: int | None, policy: PrecisionPolicy, dtype: torch.dtype, head_dim: int | None) -> int:
    """The forward's key block for ``block_k`` (0: the kernel's own, for None); ValueError where
    ``kernel_config`` refuses it, or where its tile cannot hold ``head_dim`` (None: the block's
    size alone is checked)."""
    block_k = kernel_config(policy, _STANDARD_RULE, dtype, None, block_k).block_k
    if block_k is None:
        return 0
    if head_dim is not None:
        key_block_config(block_k, head_dim)
    return block_k


def _masks(masking: Masking, n_q: int, n_k: int, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
           max_seqlen_k, dropout_p: float) -> tuple[bool, Masks]:
    """(the kernels' CAUSAL switch, the rest of the call's masks). A causal mask whose diagonal
    starts at the top-left corner (top-left alignment, or n_q = n_k), without a window and
    without packed sequences, is the kernels' own CAUSAL switch; any other band is BAND's."""
    varlen = cu_seqlens_q is not None
    left, right = masking.bounds
    corner = masking.align is Alignment.TOP_LEFT or n_q == n_k
    causal = masking.causal and masking.window.unbounded and corner and not varlen
    band = None
    if not causal and (left, right) != (None, None):
        band = (UNBOUNDED if left is None else min(left, UNBOUNDED), UNBOUNDED if right is None else min(right, UNBOUNDED),
                masking.align is Alignment.BOTTOM_RIGHT)
    return causal, Masks(band, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q if varlen else 0,
                         max_seqlen_k if varlen else 0, float(dropout_p))


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, masking: Masking, scale: float,
                     rule: ShiftRule, policy: PrecisionPolicy, softcap: float | None = None,
                     block_k: int | None = None, attn_mask: torch.Tensor | None = None,
                     cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                     dropout_p: float = 0.0, packed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernels: (O, LSE), O differentiable, LSE (B, H, Nq) fp32 natural log without
    gradient, −inf on rows that see no key (their O is 0). Inputs validated by the API and
    ``check_inputs``; q, k, v (B, H, N, d) views whose last dimension is contiguous. ``masking``:
    causal, its alignment and a window (``masking.visible``). ``attn_mask``: None, or bool (True =
    take part) or float (added to the scores after the soft cap) already expanded to (B, H, Nq,
    Nk). Packed sequences: ``cu_seqlens_q``/``cu_seqlens_k`` int32 (n_seq + 1,) on q's device,
    ``max_seqlen_q``/``max_seqlen_k`` the longest sequence's lengths, q, k, v (1, H, total, d);
    positions (and the alignment) counted within each sequence. ``dropout_p``: attention dropout
    (``masking.dropout_keep``; the seed drawn per call from torch's default generator and kept
    for the backward). ``block_k``: the forward's key block under the "paper" emulation
    (``kernel_config``). ``packed``: the (B, N, 3, H, d) tensor q, k and v are views of
    (``op.unpack_qkv``), or None; given, O is differentiable with respect to it and its gradient is
    written as one tensor (no join of dQ, dK and dV)."""
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None) or (varlen and (max_seqlen_q is None or max_seqlen_k is None)):
        raise ValueError("packed sequences need cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k together; "
                         f"got cu_seqlens_q {'set' if varlen else 'None'}, cu_seqlens_k "
                         f"{'None' if cu_seqlens_k is None else 'set'}, max_seqlen_q={max_seqlen_q}, "
                         f"max_seqlen_k={max_seqlen_k}")
    if varlen:
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if t.dtype != torch.int32 or t.dim() != 1 or t.device != q.device:
                raise ValueError(f"{name} of dtype {t.dtype}, shape {tuple(t.shape)} on {t.device} is invalid; "
                                 f"accepted: int32 of shape (n_seq + 1,) on q's device {q.device}")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                             "must have the same number of sequences")
    config = _checked_config(policy, rule, q.dtype, softcap, block_k, q.shape[-1])
    causal, masks = _masks(masking, q.shape[2], k.shape[2], attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, dropout_p)
    o, lse = attention(q, k, v, causal, scale, config, masks, packed)
    return o, lse.detach()


def _checked_config(policy: PrecisionPolicy, rule: ShiftRule, dtype: torch.dtype, softcap: float | None,
                    block_k: int | None, head_dim: int) -> KernelConfig:
    config = kernel_config(policy, rule, dtype, softcap, block_k)
    if config.block_k is not None:
        key_block_config(config.block_k, head_dim)     # the key block's tile holds this head_dim
    return config


def kernel_call(q: torch.Tensor, k: torch.Tensor, *, masking: Masking, rule: ShiftRule, policy: PrecisionPolicy,
                softcap: float | None = None, block_k: int | None = None,
                dropout_p: float = 0.0) -> tuple[KernelConfig, bool, Masks]:
    """What ``triton_attention`` hands the kernels besides the tensors and the scale, for a call
    without an ``attn_mask`` or packed sequences: (configuration, the CAUSAL switch, masks). It
    reads q's and k's shapes and q's dtype alone, so a caller may keep it for a call signature
    and run ``run_kernels`` with it on later calls' tensors."""
    config = _checked_config(policy, rule, q.dtype, softcap, block_k, q.shape[-1])
    causal, masks = _masks(masking, q.shape[2], k.shape[2], None, None, None, None, None, dropout_p)
    return config, causal, masks


def run_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, call: tuple[KernelConfig, bool, Masks],
                packed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_attention``'s result for tensors of the signature ``kernel_call`` made ``call`` for:
    (O, LSE), LSE without gradient. ``packed``: as ``triton_attention``'s (then q, k, v are not read)."""
    config, causal, masks = call
    o, lse = attention(q, k, v, causal, scale, config, masks, packed)
    return o, lse.detach()
