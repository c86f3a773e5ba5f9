"""The host side of the Gluon Hopper backward: argument checks, δ, TMA descriptors, the launches."""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from stableflash.attention.gluon.hopper_backward import (BackwardTiles, attn_bwd_dkdv_hopper_kernel,
                                                         attn_bwd_dq_hopper_kernel, attn_bwd_hopper_kernel,
                                                         backward_tiles_for, route_backward_tiles)
from stableflash.attention.gluon.launch import LOG2E, _descriptor, check_inputs, tensor_descriptor, vector_descriptor
from stableflash.attention.triton import launch_cache
from stableflash.attention.triton.common import cast
from stableflash.attention.triton.op import delta_dot, delta_dot_kernel, delta_dot_launch


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


@functools.cache
def dq_buffer_layout(rows: int, cols: int):
    """The shared-memory layout of a (1, 1, rows, cols) fp32 TMA block of the dQ buffer."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], gl.float32)


def dq_buffer(q: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The fp32 buffer into which ``attn_bwd_hopper_kernel`` adds dQ up, seen as (B, H, N_q, d), not
    yet cleared (the δ kernel clears it: ``_delta``'s ``clear``): contiguous, or, where the kernel
    adds dQᵀ (``transposed``: ``BackwardTiles.dq_transposed``), the transpose of a (B, H, d, N')
    tensor whose rows N' = N_q rounded up to a multiple of 4 keep them 16-byte aligned for TMA."""
    return _dq_view(_dq_storage(q, transposed), q.shape[2], transposed)


def _dq_storage(q: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The tensor ``dq_buffer`` allocates: (B, H, N_q, d), or (B, H, d, N') where ``transposed``."""
    B, H, n_q, d = q.shape
    shape = (B, H, d, -(-n_q // 4) * 4) if transposed else q.shape
    return torch.empty(shape, dtype=torch.float32, device=q.device)


def _dq_view(storage: torch.Tensor, n_q: int, transposed: bool) -> torch.Tensor:
    """``dq_buffer`` of its storage (``_dq_storage``)."""
    return storage[..., :n_q].transpose(2, 3) if transposed else storage


def _dq_buffer_descriptor(t: torch.Tensor, tiles: BackwardTiles) -> TensorDescriptor:
    """The dQ buffer's descriptor (``dq_buffer``), blocks of ``tiles.dq_tile``: (1, 1, rows, cols) of
    (B, H, N_q, d), or of dQᵀ (1, 1, d, rows) over the (B, H, d, N_q) tensor underneath."""
    rows, cols = tiles.dq_tile(t.shape[3])
    if tiles.dq_transposed(t.shape[3]):
        return tensor_descriptor(t.transpose(2, 3), rows, dq_buffer_layout(rows, cols), cols=cols)
    return tensor_descriptor(t, rows, dq_buffer_layout(rows, cols), cols=cols)


@triton.jit
def scale_dq_kernel(src, dst, n_rows, H, N, src_stride_b, src_stride_h, src_stride_n, src_stride_d, stride_b,
                    stride_h, stride_n, scale, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                    SRC_T: tl.constexpr = False, INTERP: tl.constexpr = False):
    """dQ = bf16(src · scale), rounded to nearest: ``src`` the fp32 sums (B, H, N, d) with the given
    strides, ``dst`` (B, H, N, d) bf16 with the given strides (the last 1); BLOCK_R of the
    n_rows = B·H·N rows per program. SRC_T: src is the transpose of a (B, H, d, N) tensor
    (``dq_buffer`` at head_dim 128), read as (d, rows) tiles along its contiguous N. INTERP: under
    Triton's interpreter (whose cast truncates; ``triton.common.cast``)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HEAD_DIM)
    keep = rows < n_rows
    b, h, n = rows // (H * N), rows // N % H, rows % N
    at_src = b * src_stride_b + h * src_stride_h + n * src_stride_n
    if SRC_T:
        x = tl.trans(tl.load(src + at_src[None, :] + cols[:, None] * src_stride_d, mask=keep[None, :]))
    else:
        x = tl.load(src + at_src[:, None] + cols[None, :] * src_stride_d, mask=keep[:, None])
    at = b * stride_b + h * stride_h + n * stride_n
    tl.store(dst + at[:, None] + cols[None, :], cast(x * scale, tl.bfloat16, INTERP), mask=keep[:, None])


def launch_args_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dq: torch.Tensor,
                         dk: torch.Tensor, dv: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, causal: bool,
                         scale: float | None, tiles: BackwardTiles | None = None) -> dict:
    """{"dkdv": (grid, arguments, compile-time arguments), "dq": (...)} of the two kernels for checked
    inputs, the outputs they write (dq like q, dk and dv like k) and L, δ (B, H, N_q) fp32
    contiguous (the dK/dV kernel reads them through rank-2 TMA descriptors, ``vector_descriptor``; the
    dQ kernel through pointers), with ``BackwardTiles``' constexprs and options."""
    B, H, n_q, d = q.shape
    Hk, n_k = k.shape[1], k.shape[2]
    t = tiles or backward_tiles_for(d, causal)
    t.check(d)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    scalars = (n_q, n_k, H, H // Hk, scale * LOG2E, scale)
    descriptors = (_descriptor(q, t.block_m), _descriptor(k, 64), _descriptor(v, 64), _descriptor(do, t.block_m),
                   _descriptor(dk, 64), _descriptor(dv, 64))
    if t.atomic_dq:                          # the dK/dV kernel's arguments with dQ's fp32 buffer after dV's
        descriptors += (_dq_buffer_descriptor(dq, t),)
    vectors = (vector_descriptor(lse, t.vector_block), vector_descriptor(delta, t.vector_block))
    dkdv = ((launch_cache.cdiv(n_k, t.block_n), B * Hk), (*descriptors, *vectors, *scalars),
            {**t.dkdv_constexprs(d, causal), **t.options})
    if t.atomic_dq:
        return {"fused": dkdv}
    dq_ = ((launch_cache.cdiv(n_q, t.dq_block_m), B * H),
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
    (``hopper_backward``) run — or, with tiles whose ``atomic_dq`` is set (head_dim 64,
    ``atomic_backward_tiles``), the one kernel adding dQ up by TMA reduce-adds and dQ's scaling.
    Returns dq like q, dk and dv like k (bf16; with grouped-query heads dK and dV summed over each
    group). ``tiles``: a ``BackwardTiles`` other than ``backward_tiles_for(d, causal)``."""
    check_backward_inputs(do, q, k, v, o, residual, lse, causal, scale)
    d = q.shape[3]
    t = tiles or backward_tiles_for(d, causal)
    t.check(d)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if t.atomic_dq:
        _atomic_backward(do, q, k, v, o, residual, lse.contiguous(), causal, scale, dq, dk, dv, t)
        return dq, dk, dv
    _two_kernel_backward(do, q, k, v, o, residual, lse.contiguous(), causal, scale, dq, dk, dv, t)
    return dq, dk, dv


def _two_kernel_backward(do, q, k, v, o, residual, lse, causal: bool, scale: float | None, dq, dk, dv,
                         tiles: BackwardTiles | None) -> None:
    """δ by the Triton δ kernel, then the dK/dV kernel and the dQ kernel (``tiles``, None: the
    default ones), writing into ``dq``, ``dk``, ``dv``."""
    launches = launch_args_backward(do, q, k, v, dq, dk, dv, lse, _delta(do, o, residual), causal, scale, tiles)
    for kernel, (grid, args, meta) in ((attn_bwd_dkdv_hopper_kernel, launches["dkdv"]),
                                       (attn_bwd_dq_hopper_kernel, launches["dq"])):
        launch_cache.launch(kernel, grid, *args, **meta)


def _atomic_backward(do, q, k, v, o, residual, lse, causal: bool, scale: float | None, dq, dk, dv,
                     tiles: BackwardTiles) -> None:
    """δ, and the fp32 dQ buffer (``dq_buffer``) cleared by the same kernel; the kernel adding dQ up
    by TMA reduce-adds (``attn_bwd_hopper_kernel``) into it, dK and dV written into ``dk``, ``dv``;
    then dQ·scale into ``dq`` in bf16: three launches."""
    _atomic_launches(do, q, k, v, o, residual, lse, causal, scale, dq, dk, dv, tiles, *_atomic_buffers(q, tiles),
                     _launch)


def _launch(index: int, kernel, grid, args: tuple, kwargs: dict) -> None:
    launch_cache.launch(kernel, grid, *args, **kwargs)


def _atomic_buffers(q: torch.Tensor, tiles: BackwardTiles) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp32 dQ buffer's storage, ``_dq_storage``, and δ (B, H, N_q) fp32): ``_atomic_launches``'
    buffers, uninitialised."""
    return (_dq_storage(q, tiles.dq_transposed(q.shape[3])),
            torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))


def _atomic_launches(do, q, k, v, o, residual, lse, causal: bool, scale: float | None, dq, dk, dv,
                     tiles: BackwardTiles, sums: torch.Tensor, delta: torch.Tensor, launch) -> list:
    """``_atomic_backward``'s three launches with the buffers ``sums`` and ``delta`` (``_atomic_buffers``) —
    δ with the buffer's clear, the backward kernel, dQ's scaling — each handed to ``launch(index,
    kernel, grid, arguments, keyword arguments)`` as soon as it is built (the backward's arguments read
    δ: where N_q is not a multiple of 4, ``vector_descriptor`` copies it into padded rows). Returns the
    launches as (kernel, grid, arguments, keyword arguments)."""
    B, H, n_q, d = q.shape
    transposed = tiles.dq_transposed(d)
    dq_sum = _dq_view(sums, n_q, transposed)
    r, has_r = _delta_source(o, residual)
    grid, args, kwargs = delta_dot_launch(o, r, do, delta, has_r, clear=dq_sum)
    launches = [(delta_dot_kernel, grid, args, kwargs)]
    launch(0, *launches[-1])
    (grid, args, meta), = launch_args_backward(do, q, k, v, dq_sum, dk, dv, lse, delta, causal, scale,
                                               tiles).values()
    launches.append((attn_bwd_hopper_kernel, grid, args, meta))
    launch(1, *launches[-1])
    rows = B * H * n_q
    launches.append((scale_dq_kernel, (launch_cache.cdiv(rows, 64),),
                     (dq_sum, dq, rows, H, n_q, *dq_sum.stride(), *dq.stride()[:3],
                      1.0 / math.sqrt(d) if scale is None else float(scale)),
                     dict(HEAD_DIM=d, BLOCK_R=64, SRC_T=transposed)))
    launch(2, *launches[-1])
    return launches


# the route backward's plans by ``launch_cache.plan_key`` of its tensors, causal and scale
_plans: dict[tuple, launch_cache.Plan] = {}


def backward_into(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  residual: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, dq: torch.Tensor,
                  dk: torch.Tensor, dv: torch.Tensor, key: tuple | None = None) -> None:
    """The route's backward (``route.why_not_backward`` accepted the call), writing into ``dq``, ``dk``,
    ``dv`` (views of one packed gradient included: TMA addresses them as they are): ``_atomic_backward``
    with ``route_backward_tiles``, or under ``torch.use_deterministic_algorithms`` (head_dim 128) δ
    from dO·(O + R) by the Triton δ kernel, then the dK/dV and dQ kernels of the default tiles
    (``backward_tiles_for``). A signature seen before replays its launches (``launch_cache.Plan``);
    ``key``: the plan's key as the caller made it (``replay``), else ``launch_cache.plan_key`` of the
    tensors, causal and scale."""
    given = lse
    lse = lse.contiguous()
    if torch.are_deterministic_algorithms_enabled():
        _two_kernel_backward(do, q, k, v, o, residual, lse, causal, scale, dq, dk, dv, None)
        return
    r, has_r = _delta_source(o, residual)
    if key is not None and (lse is not given or (has_r and r is not residual)):
        key = None              # a copy was launched on: the caller's replays under its key would pass the originals
    tensors = (do, q, k, v, o, r, lse, dq, dk, dv)
    if key is None and launch_cache.PLANS and launch_cache.ENABLED:
        key = launch_cache.plan_key(tensors, causal, scale)
    if key is not None and replay(key, tensors):
        return
    plan = _plans.get(key) if key is not None else None
    tiles = route_backward_tiles(q.shape[3], k.shape[2])
    if plan is not None and plan.current:     # VERIFY: each replay checked against the launch built, then run
        buffers = plan.allocate(q)
        _atomic_launches(do, q, k, v, o, residual, lse, causal, scale, dq, dk, dv, tiles, *buffers,
                         plan.checking(tensors, buffers))
        return
    buffers = _atomic_buffers(q, tiles)
    launches = _atomic_launches(do, q, k, v, o, residual, lse, causal, scale, dq, dk, dv, tiles, *buffers, _launch)
    if key is not None:
        launch_cache.keep_plan(_plans, key, launch_cache.Plan.record(tensors, buffers, launches))


def replay(key: tuple, tensors: tuple) -> bool:
    """Run the plan kept under ``key`` on ``tensors`` (dO, q, k, v, O, R or O, L, dq, dk, dv) and return
    True; False where there is none, it is retired, or ``launch_cache.VERIFY`` is on (the call then goes
    through ``backward_into`` with the same key). The caller's key stands for the route's decision as
    well as for the launches: it holds everything ``route.why_not_backward`` reads."""
    plan = _plans.get(key)
    if plan is None or not plan.current or launch_cache.VERIFY:
        return False
    plan(tensors)
    return True


def _delta(do: torch.Tensor, o: torch.Tensor, residual: torch.Tensor | None,
           clear: torch.Tensor | None = None) -> torch.Tensor:
    """δ (B, H, N_q) fp32 by the Triton δ kernel: rowsum(dO ∘ (O + R)), or rowsum(dO ∘ O) without a
    residual (None or empty); ``clear``: an fp32 tensor of o's shape the same kernel zeroes."""
    delta = torch.empty(o.shape[:3], dtype=torch.float32, device=o.device)
    r, has_r = _delta_source(o, residual)
    delta_dot(o, r, do, delta, has_r, clear)
    return delta


def _delta_source(o: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """(what the δ kernel reads beside O: R contiguous, or O itself without a residual (None or empty);
    whether it is R)."""
    has_r = residual is not None and residual.numel() > 0
    return (residual.contiguous() if has_r else o), has_r
