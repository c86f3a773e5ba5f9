"""FlashAttention-style entries: ``flash_attn_func``, ``flash_attn_qkvpacked_func`` and ``flash_attn_varlen_func``.

They take FlashAttention's layouts — (batch, seq, heads, head_dim), a fused QKV projection's
(batch, seq, 3, heads, head_dim), or packed (total, heads, head_dim) with ``cu_seqlens`` — and its argument names and conventions (bottom-right causal
alignment, ``window_size`` with −1 for unbounded, ``softcap`` 0.0 for off), and compute what
``flash_attention`` computes, stabilized by default. The tensors reach the backends as transposed
views: nothing is copied to change the layout.
"""
from __future__ import annotations

import numbers

import torch

from stableflash.attention import api
from stableflash.attention.api import (FLOAT_DTYPES, _check_tensors, _positive_real, attend, check_masking, decide, keep,
                                      remembered, signature)
from stableflash.attention.masking import Alignment
from stableflash.attention.policy import PrecisionPolicy
from stableflash.attention.stabilization import Stabilization

_SEMANTICS = """
    Masks. Query i sees key j when i + offset − left ≤ j ≤ i + offset + right, with
    ``window_size=(left, right)`` (−1: unbounded on that side), right at most 0 when ``causal``,
    and offset = seq_k − seq_q for ``align="bottom-right"`` (the default, FlashAttention's: the last
    query is aligned with the last key, what decoding and a prefill that continues a KV cache
    need) or 0 for ``align="top-left"`` (torch SDPA's ``is_causal``). With seq_q = 2 and
    seq_k = 5, causal (1 = kept, 0 = masked):

        bottom-right    top-left
        1 1 1 1 0       1 0 0 0 0
        1 1 1 1 1       1 1 0 0 0

    A query that sees no key (with seq_q > seq_k under bottom-right causal, or a window that
    leaves it none) gets output 0, log-sum-exp −inf and no gradient — never NaN.

    Dropout. With ``dropout_p`` > 0 each softmax entry is dropped with that probability and the
    others are scaled by 1/(1 − dropout_p), in the forward and identically in the backward; it is
    applied whenever dropout_p > 0 (pass 0.0 at evaluation). The decisions come from a 64-bit seed
    drawn from torch's default generator once per call (``stableflash.attention.masking``), so
    ``torch.manual_seed`` reproduces a call and activation checkpointing replays it; with
    ``stabilize="none"`` on backend "sdpa" torch's own dropout is used instead.

    Log-sum-exp. With ``return_lse=True`` the natural log of each row's sum of exp(scores)
    (before dropout) comes back too, in float32, without gradient.

    Stabilization. As ``stableflash.flash_attention``: with the default ``stabilize=True`` the
    forward is the standard one and the backward takes δ from a source consistent with its P.
"""

_COMMON_ARGS = """        dropout_p: float in [0, 1), default 0.0. Attention dropout probability.
        softmax_scale: float > 0 or None, default None (1 / sqrt(head_dim)). Multiplies Q·Kᵀ.
        causal: bool, default False. Apply the causal mask (aligned as ``align`` says).
        window_size: (left, right), default (-1, -1) (no window). Sliding-window (local)
            attention; each side an int ≥ 0, or −1 for unbounded.
        softcap: float ≥ 0, default 0.0 (off). Scores become softcap·tanh(S / softcap).
        return_lse: bool, default False. Also return the log-sum-exp (above).
        align: "bottom-right" or "top-left", keyword only, default "bottom-right".
        stabilize: keyword only, default True. As ``flash_attention``'s (True, False, a name, or a
            Stabilization).
        beta: float > 1, keyword only, default 2.0. The row-maximum rules' shift factor.
        eps: float ≥ 0, keyword only, default 1e-3. The rules' tie tolerance.
        backend: keyword only, default "auto". As ``flash_attention``'s: "auto", "triton",
            "emulated", "reference" or "sdpa".
        policy: keyword only, default None. As ``flash_attention``'s (a PrecisionPolicy or a preset
            name; honoured by "emulated" and "triton").
"""


def _softcap(softcap) -> float | None:
    if isinstance(softcap, numbers.Real) and not isinstance(softcap, bool) and softcap == 0:
        return None
    return _positive_real(softcap, "softcap", "0.0 is off too")


def _check_layout(tensors: dict, dims: int, layout: str) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must have {dims} dimensions {layout}; got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: float16, bfloat16, float32, float64")


def _decided(key: tuple | None, kept: api.Call | None, views: tuple, dropout_p, softmax_scale, causal, window_size,
             softcap, return_lse, align, stabilize, beta, eps, backend, policy) -> api.Call:
    """The checked decision of a call without varlen on (batch, heads, seq, head_dim) ``views``, kept
    for ``key`` (``api.keep``; ``kept``: the one kept before, compared under ``api.VERIFY``)."""
    _check_tensors(*views)
    masking = check_masking(causal, align, window_size, "window_size", unbounded=(-1,))
    return keep(key, decide(*views, masking=masking, scale=softmax_scale, stabilize=stabilize, beta=beta, eps=eps,
                            backend=backend, policy=policy, block_q=None, block_k=64, softcap=_softcap(softcap),
                            attn_mask=None, dropout_p=dropout_p, return_lse=return_lse, depth=2), kept)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, return_lse: bool = False, *,
                    align: str | Alignment = "bottom-right", stabilize: bool | str | Stabilization = True,
                    beta: float = 2.0, eps: float = 1e-3, backend: str = "auto",
                    policy: PrecisionPolicy | str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    key = signature((q, k, v), (dropout_p, softmax_scale, causal, window_size, softcap, return_lse, align, stabilize,
                                beta, eps, backend, policy))
    call = remembered(key)
    if call is None or api.VERIFY:
        _check_layout({"q": q, "k": k, "v": v}, 4, "(batch, seq, heads, head_dim)")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if call is None or api.VERIFY:
        call = _decided(key, call, (qt, kt, vt), dropout_p, softmax_scale, causal, window_size, softcap, return_lse,
                        align, stabilize, beta, eps, backend, policy)
    res = call.run(qt, kt, vt)
    if return_lse:
        return res[0].transpose(1, 2), res[1]
    return res.transpose(1, 2)


flash_attn_func.__doc__ = """softmax(Q·Kᵀ·scale)·V in FlashAttention's (batch, seq, heads, head_dim) layout, stabilized.

    ``flash_attn_func(q, k, v, causal=True)`` takes the arguments of FlashAttention-2's
    ``flash_attn_func`` and returns what it returns. Grouped-query attention: k and v may have
    fewer heads than q when that number divides q's; query head h uses key/value head
    h // (heads_q // heads_kv).
""" + _SEMANTICS + """
    Arguments:
        q: (batch, seq_q, heads_q, head_dim), float16, bfloat16, float32 or float64.
        k: (batch, seq_k, heads_kv, head_dim), q's dtype and device; heads_kv divides heads_q.
        v: (batch, seq_k, heads_kv, head_dim), like k.
""" + _COMMON_ARGS + """
    Returns:
        O: (batch, seq_q, heads_q, head_dim) in q's dtype (a transposed view of the backend's
        (batch, heads, seq, head_dim) result), differentiable with respect to q, k and v. With
        ``return_lse``: (O, lse), lse (batch, heads_q, seq_q) float32.

    Raises:
        TypeError or ValueError naming the argument, the value given and what is accepted.
    """


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              return_lse: bool = False, *, align: str | Alignment = "bottom-right",
                              stabilize: bool | str | Stabilization = True, beta: float = 2.0, eps: float = 1e-3,
                              backend: str = "auto",
                              policy: PrecisionPolicy | str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    key = signature((qkv,), (dropout_p, softmax_scale, causal, window_size, softcap, return_lse, align, stabilize,
                             beta, eps, backend, policy))
    call = remembered(key)
    if call is None or api.VERIFY:
        _check_layout({"qkv": qkv}, 5, "(batch, seq, 3, heads, head_dim)")
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must hold q, k and v along dimension 2, of size 3; got shape {tuple(qkv.shape)}")
        call = _decided(key, call, api._views(qkv), dropout_p, softmax_scale, causal, window_size, softcap,
                        return_lse, align, stabilize, beta, eps, backend, policy)
    res = call.run(None, None, None, packed=qkv)       # q, k, v: qkv's views, made where a backend reads them
    if return_lse:
        return res[0].transpose(1, 2), res[1]
    return res.transpose(1, 2)


flash_attn_qkvpacked_func.__doc__ = """Self-attention on a fused QKV projection's output, (batch, seq, 3, heads, head_dim), stabilized.

    ``flash_attn_qkvpacked_func(qkv, causal=True)`` takes the arguments of FlashAttention-2's
    ``flash_attn_qkvpacked_func`` and returns what it returns: ``flash_attn_func`` on
    ``qkv[:, :, 0]``, ``qkv[:, :, 1]`` and ``qkv[:, :, 2]``. A model whose projection gives
    (batch, seq, 3·heads·head_dim) passes ``.view(batch, seq, 3, heads, head_dim)`` of it. On the
    "triton" backend the gradient of qkv is one tensor, into which the backward's kernels write
    dQ, dK and dV: with three separate inputs autograd joins three gradients into it instead, a
    copy of the whole of it per layer.
""" + _SEMANTICS + """
    Arguments:
        qkv: (batch, seq, 3, heads, head_dim), float16, bfloat16, float32 or float64; q, k and v
            at index 0, 1 and 2 of dimension 2.
""" + _COMMON_ARGS + """
    Returns:
        O: (batch, seq, heads, head_dim) in qkv's dtype (a transposed view of the backend's
        (batch, heads, seq, head_dim) result), differentiable with respect to qkv. With
        ``return_lse``: (O, lse), lse (batch, heads, seq) float32.

    Raises:
        TypeError or ValueError naming the argument, the value given and what is accepted.
    """


def _check_cu_seqlens(cu: torch.Tensor, name: str, total: int, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} has dtype {cu.dtype} and shape {tuple(cu.shape)}; accepted: int32, 1-D, "
                         "(n_seq + 1,) with n_seq >= 1")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} and q on {device}; accepted: cu_seqlens on q's device")
    if cu.device.type == "cpu" and not torch.compiler.is_compiling():   # free on the host; a GPU copy would wait
        values = cu.tolist()
        if values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"{name}={values} is invalid; accepted: non-decreasing offsets from 0 to {total} "
                             "(the packed tokens)")


def _check_max_seqlen(value, name: str, cu: torch.Tensor) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid; accepted: an int >= 0, the longest sequence's length")
    if cu.device.type == "cpu" and not torch.compiler.is_compiling():
        longest = int((cu[1:] - cu[:-1]).max())
        if value < longest:
            raise ValueError(f"{name}={value} is below the longest sequence's length {longest} (from "
                             f"{name.replace('max_seqlen', 'cu_seqlens')}); accepted: an int >= {longest}")
    return int(value)


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, return_lse: bool = False,
                           *, align: str | Alignment = "bottom-right",
                           stabilize: bool | str | Stabilization = True, beta: float = 2.0, eps: float = 1e-3,
                           backend: str = "auto",
                           policy: PrecisionPolicy | str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    _check_layout({"q": q, "k": k, "v": v}, 3, "(total_tokens, heads, head_dim)")
    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    _check_tensors(qt, kt, vt)
    _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device)
    _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries and cu_seqlens_k {cu_seqlens_k.numel()}; "
                         "accepted: one entry more than the number of sequences in both")
    max_q = _check_max_seqlen(max_seqlen_q, "max_seqlen_q", cu_seqlens_q)
    max_k = _check_max_seqlen(max_seqlen_k, "max_seqlen_k", cu_seqlens_k)
    masking = check_masking(causal, align, window_size, "window_size", unbounded=(-1,))
    res = attend(qt, kt, vt, masking=masking, scale=softmax_scale, stabilize=stabilize, beta=beta, eps=eps,
                 backend=backend, policy=policy, block_q=None, block_k=64, softcap=_softcap(softcap), attn_mask=None,
                 dropout_p=dropout_p, return_lse=return_lse, varlen=(cu_seqlens_q, cu_seqlens_k, max_q, max_k))
    if return_lse:
        return res[0][0].transpose(0, 1), res[1][0]
    return res[0].transpose(0, 1)


flash_attn_varlen_func.__doc__ = """Attention over packed sequences of different lengths (FlashAttention's varlen layout), stabilized.

    Packing. The sequences of a batch are concatenated along one axis, without padding: sequence s
    is rows cu_seqlens_q[s]:cu_seqlens_q[s + 1] of q and cu_seqlens_k[s]:cu_seqlens_k[s + 1] of k
    and v, and attends only within itself (document masking for packed pre-training,
    padding-free fine-tuning). Positions — for the causal alignment, the window and dropout's
    decisions — are counted from each sequence's start, and dropout's batch index is s. A
    sequence may have length 1 (or 0). Grouped-query attention as in ``flash_attn_func``.
""" + _SEMANTICS + """
    Arguments:
        q: (total_q, heads_q, head_dim), float16, bfloat16, float32 or float64.
        k: (total_k, heads_kv, head_dim), q's dtype and device; heads_kv divides heads_q.
        v: (total_k, heads_kv, head_dim), like k.
        cu_seqlens_q: int32 tensor (n_seq + 1,) on q's device: the sequences' offsets in q,
            non-decreasing from 0 to total_q. Checked on the host when on the CPU (a GPU tensor is
            not read back, so as not to wait for the device: there only dtype, shape and device
            are checked).
        cu_seqlens_k: like cu_seqlens_q, the offsets in k and v (0 to total_k).
        max_seqlen_q: int ≥ 0, the longest query sequence (checked against cu_seqlens_q on the CPU).
        max_seqlen_k: int ≥ 0, the longest key sequence.
""" + _COMMON_ARGS + """
    Returns:
        O: (total_q, heads_q, head_dim) in q's dtype (a transposed view), differentiable with
        respect to q, k and v. With ``return_lse``: (O, lse), lse (heads_q, total_q) float32.

    Raises:
        TypeError or ValueError naming the argument, the value given and what is accepted (torch's
        SDPA takes no varlen batch: backend="sdpa" is refused).
    """
