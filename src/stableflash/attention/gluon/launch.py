"""The host side of the Gluon Hopper forward: argument checks, TMA descriptors, the launch."""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from stableflash.attention.gluon.hopper_forward import Tiles, attn_fwd_hopper_kernel, descriptor_layout, tiles_for
from stableflash.attention.gluon.support import device_capability
from stableflash.attention.triton import launch_cache

HEAD_DIMS = (64, 128)
LOG2E = 1.0 / math.log(2.0)
MAX_HEAD_PROGRAMS = 65535            # the grid's second axis holds B·H


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None) -> None:
    """Raise an error naming the argument, its value and what is accepted, for anything the kernel
    cannot take. Checked in an order that runs without a GPU up to the device itself: types and
    shapes, dtype, head_dim, memory layout, then the device (CUDA, compute capability 9.0)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} of type {type(t).__name__} is invalid; accepted: a torch.Tensor")
        if t.dim() != 4:
            raise ValueError(f"{name} of shape {tuple(t.shape)} is invalid; accepted: 4 dimensions (B, H, N, d)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} is invalid; accepted: True or False")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale={scale!r} is invalid; accepted: None (1/sqrt(head_dim)) or a finite number > 0")
    B, H, n_q, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k of shape {tuple(k.shape)} and v of shape {tuple(v.shape)} must have the same shape")
    if k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"k of shape {tuple(k.shape)} does not match q of shape {tuple(q.shape)}; accepted: "
                         "the same batch B and head_dim d")
    if k.shape[1] == 0 or H % k.shape[1]:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({k.shape[1]}) for grouped-query attention")
    if min(B, H, n_q, k.shape[2]) == 0:
        raise ValueError(f"q of shape {tuple(q.shape)} and k of shape {tuple(k.shape)}: every dimension must be "
                         "at least 1")
    if B * H > MAX_HEAD_PROGRAMS:
        raise ValueError(f"B·H = {B * H} is invalid; accepted: at most {MAX_HEAD_PROGRAMS} (the grid's second axis)")
    if B * H * n_q >= 2**31:
        raise ValueError(f"B·H·N_q = {B * H * n_q} is invalid; accepted: below 2**31 (the kernel indexes the "
                         "log-sum-exp in int32)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} of dtype {t.dtype} is invalid; accepted: torch.bfloat16")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d} is invalid; accepted: one of {HEAD_DIMS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        strides = t.stride()
        if strides[3] != 1:
            raise ValueError(f"{name} with strides {strides} is invalid; accepted: the last dimension contiguous "
                             f"(stride 1), e.g. {name}.contiguous()")
        if any(s == 0 or (s * 2) % 16 for s in strides[:3]) or t.data_ptr() % 16:
            raise ValueError(f"{name} with strides {strides} (bf16) and data_ptr % 16 = {t.data_ptr() % 16} is "
                             "invalid for TMA; accepted: a 16-byte aligned base and strides that are nonzero "
                             f"multiples of 8 elements, e.g. {name}.contiguous()")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} on device {t.device} is invalid; accepted: a CUDA device of compute "
                             "capability 9.0 (Hopper: H100, H200)")
        if t.device != q.device:
            raise ValueError(f"{name} on {t.device} is invalid; accepted: q's device {q.device}")
    cap = device_capability(q.device)
    if cap != (9, 0):
        raise ValueError(f"q on {q.device} of compute capability {cap} is invalid; accepted: compute capability "
                         "(9, 0) (the kernel is compiled for sm_90a: Hopper's wgmma and TMA)")


# TensorDescriptor's fields with defaults (padding, and what a release adds), as its constructor sets them
_DESCRIPTOR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorDescriptor)
                        if f.default is not dataclasses.MISSING}


def tensor_descriptor(t: torch.Tensor, rows: int, layout, cols: int | None = None) -> TensorDescriptor:
    """A rank-4 TMA descriptor over t (B, H, N, d) as it is laid out, blocks of (1, 1, rows, cols) in
    ``layout`` (cols None: d, whole rows): the object ``TensorDescriptor(...)`` makes, without its constructor's checks (a
    launch builds up to seven; the checks cost more than the kernels at small shapes). The callers
    have checked what those checks do — the strides TMA-aligned, the last one 1 — for the inputs
    (``check_inputs``, ``route.why_not``), and allocate the outputs themselves; the base's 16-byte
    alignment is checked here."""
    if t.data_ptr() % 16:
        raise ValueError(f"a tensor at data_ptr % 16 = {t.data_ptr() % 16} is invalid for TMA; accepted: a 16-byte "
                         "aligned base")
    return _unchecked_descriptor(t, [1, 1, rows, t.shape[3] if cols is None else cols], layout)


def _unchecked_descriptor(t: torch.Tensor, block_shape: list, layout) -> TensorDescriptor:
    """The object ``TensorDescriptor(t, t.shape, t.stride(), block_shape, layout)`` makes, without its
    constructor's checks (the callers' own: ``tensor_descriptor``, ``vector_descriptor``)."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(_DESCRIPTOR_DEFAULTS, base=t, shape=list(t.shape), strides=list(t.stride()),
                         block_shape=block_shape, layout=layout)
    return desc


@functools.cache
def vector_layout(block: int):
    """The shared-memory layout of a (1, block) fp32 block of L or δ (unswizzled)."""
    return gl.NVMMASharedLayout.get_default_for([1, block], gl.float32)


def vector_descriptor(t: torch.Tensor, block: int) -> TensorDescriptor:
    """A rank-2 TMA descriptor over fp32 t (L or δ, (B, H, N_q), contiguous) as (B·H, N_q), blocks of
    (1, ``block``): the dK/dV kernels' producer loads each query block's L and δ with its Q and dO
    tiles (entries past N_q: TMA's zeros). Rows of N_q entries stay 16-byte aligned where N_q is a
    multiple of 4 and the base is aligned; otherwise t is copied into rows padded to a multiple of 4."""
    B, H, n_q = t.shape
    rows = t.reshape(B * H, n_q)
    if n_q % 4 or rows.data_ptr() % 16:
        padded = t.new_empty(B * H, -(-n_q // 4) * 4)
        padded[:, :n_q] = rows
        rows = padded[:, :n_q]
    return _unchecked_descriptor(rows, [1, block], vector_layout(block))


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A rank-4 TMA descriptor over bf16 t (B, H, N, d) as it is laid out, blocks of (1, 1, rows, d)."""
    return tensor_descriptor(t, rows, descriptor_layout(rows, t.shape[3]))


def flash_forward_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                         scale: float | None = None, *, tiles: Tiles | None = None, residual: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention forward of ``hopper_forward.attn_fwd_hopper_kernel`` on a Hopper GPU.

    q (B, H, N_q, d), k and v (B, H_kv, N_k, d), bf16, d 64 or 128, H a multiple of H_kv, the last
    dimension contiguous and TMA-aligned; causal top-left aligned (query i sees keys j ≤ i); scale
    None for 1/sqrt(d). Returns what the Triton forward returns for ``stabilize=True`` on the "fa2"
    policy (``triton.op._forward`` with δ source "dO·(O+R)"): O like q (bf16), the log-sum-exp
    (B, H, N_q) fp32 in natural log, and R (B, H, N_q, d) bf16 contiguous, the residual of the O
    store (O as computed − O as stored, rounded to bf16). ``tiles``: a ``Tiles`` other than
    ``tiles_for(d, causal)`` (for timing variants). ``residual`` False: what it returns for
    ``stabilize=False`` (δ source "dO·O"), R an empty tensor, not computed."""
    if not isinstance(residual, bool):
        raise TypeError(f"residual={residual!r} is invalid; accepted: True or False")
    check_inputs(q, k, v, causal, scale)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    r = torch.empty(q.shape if residual else (0,), dtype=q.dtype, device=q.device)
    grid, args, meta = launch_args(q, k, v, o, lse, r, causal, scale, tiles)
    launch_cache.launch(attn_fwd_hopper_kernel, grid, *args, **meta)
    return o, lse, r


def launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                residual: torch.Tensor, causal: bool, scale: float | None, tiles: Tiles | None = None
                ) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, arguments, compile-time arguments) of ``attn_fwd_hopper_kernel`` for checked inputs and
    the outputs it writes (o like q, lse (B, H, N_q) fp32 contiguous, residual (B, H, N_q, d) bf16
    contiguous, or an empty tensor: no R stored, ``stabilize=False``), with ``Tiles.constexprs`` and
    ``Tiles.options``."""
    B, H, n_q, d = q.shape
    t = tiles or tiles_for(d, causal)
    t.check()
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    store_r = residual.numel() > 0
    o_desc = _descriptor(o, t.q_rows)
    args = (_descriptor(q, t.q_rows), _descriptor(k, t.block_n), _descriptor(v, t.block_n), o_desc,
            _descriptor(residual, t.q_rows) if store_r else o_desc, lse, n_q, k.shape[2], H, H // k.shape[1], B * H,
            scale * LOG2E)
    if t.persistent:        # one program per SM at most, each taking units of two query blocks (hopper_forward._pair)
        grid = (min(B * H * ((launch_cache.cdiv(n_q, t.block_m) + 1) // 2), _processors(q.device)), 1)
    else:
        grid = (launch_cache.cdiv(n_q, t.block_m), B * H)
    return grid, args, {**t.constexprs(d, causal, store_r), **t.options}


@functools.cache
def _processors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (132 on an H100 SXM or H200); for a tensor on the
    CPU (the compile check through triton's runtime, whose grid is never launched), 132."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
