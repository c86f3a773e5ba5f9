"""The host side of the Gluon Hopper backward: argument checks, δ, TMA descriptors, the launches."""
from __future__ import annotations

import math

import torch
import triton

from stableflash.attention.gluon.hopper_backward import (BackwardTiles, attn_bwd_dkdv_hopper_kernel,
                                                         attn_bwd_dq_hopper_kernel, backward_tiles_for)
from stableflash.attention.gluon.launch import LOG2E, _descriptor, check_inputs
from stableflash.attention.triton.op import delta_dot


def _check_tensor(name: str, t, dims: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} of type {type(t).__name__} is invalid; accepted: a torch.Tensor")
    if t.dim() != dims:
        raise ValueError(f"{name} of shape {tuple(t.shape)} is invalid; accepted: {dims} dimensions {what}")


def check_backward_inputs(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          residual: torch.Tensor | None, lse: torch.Tensor, causal: bool, scale: float | None) -> None:
    """Raise an error naming the argument, its value and what is accepted, for anything the kernels
    cannot take: do, o, residual and lse against q (types and shapes, dtypes, memory layout), then
    ``launch.check_inputs`` for q, k, v, causal and scale (the device last), then the devices of
    do, o, residual and lse. Runs without a GPU up to the device checks."""
    for name, t in (("q", q), ("do", do), ("o", o)):
        _check_tensor(name, t, 4, "(B, H, N, d)")
    _check_tensor("lse", lse, 3, "(B, H, N_q)")
    if residual is not None and not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual of type {type(residual).__name__} is invalid; accepted: a torch.Tensor, or None "
                        "(δ from dO·O)")
    with_r = (("residual", residual),) if residual is not None and residual.numel() else ()
    for name, t in (("do", do), ("o", o)) + with_r:
        if t.shape != q.shape:
            raise ValueError(f"{name} of shape {tuple(t.shape)} is invalid; accepted: q's shape {tuple(q.shape)}")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse of shape {tuple(lse.shape)} is invalid; accepted: q's (B, H, N_q) = "
                         f"{tuple(q.shape[:3])}")
    for name, t in (("do", do), ("o", o)) + with_r:
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} of dtype {t.dtype} is invalid; accepted: torch.bfloat16")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse of dtype {lse.dtype} is invalid; accepted: torch.float32 (the forward's log-sum-exp)")
    strides = do.stride()
    if strides[3] != 1:
        raise ValueError(f"do with strides {strides} is invalid; accepted: the last dimension contiguous "
                         "(stride 1), e.g. do.contiguous()")
    if any(s == 0 or (s * 2) % 16 for s in strides[:3]) or do.data_ptr() % 16:
        raise ValueError(f"do with strides {strides} (bf16) and data_ptr % 16 = {do.data_ptr() % 16} is invalid for "
                         "TMA; accepted: a 16-byte aligned base and strides that are nonzero multiples of 8 "
                         "elements, e.g. do.contiguous()")
    if o.stride(3) != 1:
        raise ValueError(f"o with strides {o.stride()} is invalid; accepted: the last dimension contiguous "
                         "(stride 1), e.g. o.contiguous()")
    check_inputs(q, k, v, causal, scale)
    for name, t in (("do", do), ("o", o), ("lse", lse)) + with_r:
        if t.device != q.device:
            raise ValueError(f"{name} on {t.device} is invalid; accepted: q's device {q.device}")


def launch_args_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dq: torch.Tensor,
                         dk: torch.Tensor, dv: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, causal: bool,
                         scale: float | None, tiles: BackwardTiles | None = None) -> dict:
    """{"dkdv": (grid, arguments, compile-time arguments), "dq": (...)} of the two kernels for checked
    inputs, the outputs they write (dq like q, dk and dv like k) and L, δ (B, H, N_q) fp32
    contiguous, with ``BackwardTiles``' constexprs and options."""
    B, H, n_q, d = q.shape
    Hk, n_k = k.shape[1], k.shape[2]
    t = tiles or backward_tiles_for(d, causal)
    t.check()
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    scalars = (n_q, n_k, H, H // Hk, scale * LOG2E, scale)
    dkdv = ((triton.cdiv(n_k, t.block_n), B * Hk),
            (_descriptor(q, t.block_m), _descriptor(k, 64), _descriptor(v, 64), _descriptor(do, t.block_m),
             _descriptor(dk, 64), _descriptor(dv, 64), lse, delta, *scalars),
            {**t.dkdv_constexprs(d, causal), **t.options})
    dq_ = ((triton.cdiv(n_q, t.dq_block_m), B * H),
           (_descriptor(q, 64), _descriptor(k, t.dq_block_n), _descriptor(v, t.dq_block_n), _descriptor(do, 64),
            _descriptor(dq, 64), lse, delta, *scalars),
           {**t.dq_constexprs(d, causal), **t.options})
    return {"dkdv": dkdv, "dq": dq_}


def flash_backward_hopper(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                          residual: torch.Tensor | None, lse: torch.Tensor, causal: bool = False,
                          scale: float | None = None, tiles: BackwardTiles | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of attention on a Hopper GPU, for the forward that produced o and lse.

    do, q, o (B, H, N_q, d), k and v (B, H_kv, N_k, d), bf16, d 64 or 128, H a multiple of H_kv,
    the last dimension contiguous (do, q, k, v TMA-aligned); lse (B, H, N_q) fp32, the forward's
    natural-log log-sum-exp; residual: R of the O store (what ``flash_forward_hopper`` returns),
    for δ = rowsum(dO ∘ (O + R)), or None / an empty tensor for δ = rowsum(dO ∘ O). causal top-left
    aligned; scale None for 1/sqrt(d). δ comes from the Triton backward's δ kernel
    (``triton.op.delta_dot``), then the Gluon dK/dV and dQ kernels
    (``hopper_backward``) run. Returns dq like q, dk and dv like k (bf16; with grouped-query heads
    dK and dV summed over each group). ``tiles``: a ``BackwardTiles`` other than
    ``backward_tiles_for(d, causal)``."""
    check_backward_inputs(do, q, k, v, o, residual, lse, causal, scale)
    B, H, n_q, d = q.shape
    delta = torch.empty(B, H, n_q, dtype=torch.float32, device=q.device)
    has_r = residual is not None and residual.numel() > 0
    delta_dot(o, residual.contiguous() if has_r else o, do, delta, has_r)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    launches = launch_args_backward(do, q, k, v, dq, dk, dv, lse.contiguous(), delta, causal, scale, tiles)
    for kernel, (grid, args, meta) in ((attn_bwd_dkdv_hopper_kernel, launches["dkdv"]),
                                       (attn_bwd_dq_hopper_kernel, launches["dq"])):
        kernel[grid](*args, **meta)
    return dq, dk, dv
