"""Launchers for the Triton kernels, registered as ``torch.library`` custom ops with autograd.

Two pairs of ops run the same ``_forward`` and ``_backward_impl``. ``stableflash::attn_fwd`` and
``stableflash::attn_bwd`` are opaque to torch.compile: it traces past them with their fake
implementations (no graph break) and calls their Python body on every step. Their inline twins
``stableflash::attn_fwd_inline`` and ``stableflash::attn_bwd_inline`` (``torch.library.triton_op``)
show torch.compile their Triton kernels, each launch wrapped in ``torch.library.wrap_triton``: it
traces the body once and launches the kernels from its own generated code, without this module's
Python on the step's path. Under torch.compile ``attention`` calls the inline forward, whose body
hands a call to the opaque op where it must (``why_not_inline``: the interpreter, a per-call seed,
the Gluon Hopper forward); the autograd formulas call the matching backward op. In eager mode
``attention`` goes through a plain autograd.Function instead: the custom-op dispatch costs about
55 µs of Python per call (measured on this project's CPU machine), as much as a small attention
kernel takes on the GPU. The opaque backward ops need no autograd formula and are registered through
``torch.library.Library`` directly (``_opaque_op``), which halves their dispatch; so is the opaque
forward the inline forward's body hands a call to (``stableflash::attn_fwd_opaque``), whose gradient
the inline op's formula gives. Inputs whose last dimension is not contiguous are copied first.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import math
from typing import NamedTuple, Optional

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton
from triton.runtime import _allocation
from triton.runtime.autotuner import Autotuner
from triton.runtime.interpreter import InterpretedFunction

from stableflash.attention.gluon import route as hopper_route
from stableflash.attention.gluon.support import device_capability
from stableflash.attention.masking import draw_seed, drop_threshold
from stableflash.attention.triton import launch_cache
from stableflash.attention.triton.backward import (attn_bwd_dkdv_kernel, attn_bwd_dq_kernel,
                                                   delta_dot_kernel, delta_pass_kernel)
from stableflash.attention.triton.common import NO_FORMAT
from stableflash.attention.triton.config import Format, KernelConfig
from stableflash.attention.triton.forward import attn_fwd_kernel

LOG2E = 1.0 / math.log(2.0)
HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)


# fixed when the kernels were defined (TRITON_INTERPRET=1 then); a module constant, which
# torch.compile reads without tracing an isinstance() on a Triton kernel
_INTERPRETING = isinstance(attn_fwd_kernel, InterpretedFunction)


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1 when the kernels were defined)."""
    return _INTERPRETING


def _cfg(bm: int, bn: int, warps: int, stages: int, maxnreg: int | None = None, **extra) -> triton.Config:
    """A tile; ``maxnreg`` caps the registers per thread (ptxas spills above it), which lets more
    programs share a multiprocessor."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, **extra}, num_warps=warps, num_stages=stages,
                         maxnreg=maxnreg)


def _fits(configs, named_args, **kwargs):
    """At head_dim 256, drop tiles whose shared-memory footprint cannot fit on the chip."""
    d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    kept = [c for c in configs if d < 256 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64]
    return kept or configs[-1:]


# candidates from benchmarks/tools/tune_attention.py on an H200 (benchmarks/results/tune-*.json)
FWD_CONFIGS = [_cfg(64, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 128, 8, 3), _cfg(128, 64, 4, 3),
               _cfg(64, 32, 4, 2)]
# the dK/dV tile 32×64 twice: as compiled (three programs a multiprocessor on sm_90) and capped at 128
# registers (four; the tuner times both: docs/kernels.md, "Register caps")
DKDV_CONFIGS = [_cfg(32, 64, 4, 3), _cfg(32, 64, 4, 3, maxnreg=128), _cfg(64, 128, 8, 3), _cfg(32, 128, 4, 3),
                _cfg(64, 64, 4, 3), _cfg(16, 64, 4, 2)]
DQ_CONFIGS = [_cfg(64, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 2), _cfg(128, 32, 8, 3),
              _cfg(64, 16, 4, 2)]
_KEY = ["n_q", "n_k", "HEAD_DIM", "CAUSAL", "BAND", "VARLEN", "MASK_KIND", "MASK_ROWS", "DROPOUT"]
# the forward's switches from the configuration (forward_switches), and its grid
_FWD_MODE = ["STAB", "EMU", "FMT", "SR", "ACC_NARROW", "ROW_NARROW", "O_NARROW", "PBAR32", "HP", "PFMT", "FP8_PV",
             "SOFTCAP", "DELTA_SRC", "PERSISTENT"]
_prune = {"early_config_prune": _fits}


def _with_tma(configs: list[triton.Config], tma: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """The pointer configs (TMA=False) plus the given tiles reading through tensor descriptors."""
    return ([_cfg(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, TMA=False) for c in configs]
            + [_cfg(*t, TMA=True) for t in tma])


# where TMA is possible the forward's tuner also tries the key loop through tensor descriptors
# (faster at head_dim 128, slower at 64; the backward kernels gain nothing end to end from it:
# docs/notebook/kernel-optimisation-log.md has the timings and their commands)
_fwd_tuned = triton.autotune(FWD_CONFIGS, key=_KEY + _FWD_MODE, prune_configs_by=_prune)(attn_fwd_kernel)
_fwd_tma_tuned = triton.autotune(_with_tma(FWD_CONFIGS, [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]),
                                 key=_KEY + _FWD_MODE, prune_configs_by=_prune)(attn_fwd_kernel)
_dkdv_tuned = triton.autotune(DKDV_CONFIGS, key=_KEY + ["EMU", "SOFTCAP"], prune_configs_by=_prune)(attn_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(DQ_CONFIGS, key=_KEY + ["EMU", "SOFTCAP", "FUSE_DELTA", "HAS_R"],
                            prune_configs_by=_prune)(attn_bwd_dq_kernel)
# the δ pass (dP·P or an fp32 recompute) does the forward's two products per key block: the forward's tiles
_delta_tuned = triton.autotune(FWD_CONFIGS, key=_KEY + ["EMU", "DELTA_SRC", "SOFTCAP"],
                             prune_configs_by=_prune)(delta_pass_kernel)
TUNERS = {"fwd": _fwd_tuned, "fwd_tma": _fwd_tma_tuned, "dkdv": _dkdv_tuned, "dq": _dq_tuned,
          "delta_pass": _delta_tuned}


def tuned_choices() -> dict[str, dict[str, str]]:
    """Each tuner's choices so far in this process, {kernel: {key: config}}: Triton tunes anew in
    every process, so two runs of a benchmark may time different tiles (``stableflash bench
    attention`` records, per row, the choices that row made)."""
    return {name: {str(key): str(cfg) for key, cfg in t.cache.items()} for name, t in TUNERS.items()}


def tuner_timings(names) -> dict[str, dict[str, list[float]]]:
    """The named tuners' timings of their candidates at their last tuning, {kernel: {config: ms}}
    (Triton's median, 20th and 80th percentile): how close the choice was."""
    out = {}
    for name in names:
        timings = getattr(TUNERS[name], "configs_timings", None) or {}
        out[name] = {str(cfg): [float(x) for x in (ms if isinstance(ms, (list, tuple)) else [ms])]
                     for cfg, ms in timings.items()}
    return out


# under the interpreter: one small tile, so that short test sequences still span several blocks
_INTERP = {"BLOCK_M": 32, "BLOCK_N": 16}
# with AUTOTUNE off (the tests: correctness needs no tuning, and tuning compiles every config),
# one fixed config per kernel and head_dim class
AUTOTUNE = True
_FIXED = {_fwd_tuned: {True: _cfg(64, 64, 4, 3), False: _cfg(64, 32, 4, 2)},
          _dkdv_tuned: {True: _cfg(32, 64, 4, 3), False: _cfg(16, 64, 4, 2)},
          _dq_tuned: {True: _cfg(64, 64, 4, 3), False: _cfg(64, 16, 4, 2)},
          _delta_tuned: {True: _cfg(64, 64, 4, 3), False: _cfg(64, 32, 4, 2)}}


def key_block(head_dim: int) -> int:
    """The forward's key block size under the "paper" emulation, and whenever AUTOTUNE is off (or
    under the interpreter): an emulation that is to match the kernel must use the same block_k."""
    if interpreting():
        return _INTERP["BLOCK_N"]
    return _FIXED[_fwd_tuned][head_dim <= 128].kwargs["BLOCK_N"]


# a key block chosen by the caller (the "paper" emulation's block_k, e.g. the isolation ladder's
# "tiling off"): a power of two, with K and V tiles within shared memory (block_k · head_dim ≤ this)
KEY_BLOCKS = (16, 32, 64, 128, 256, 512)
KEY_BLOCK_AREA = 512 * 64


def key_block_config(block_k: int, head_dim: int) -> triton.Config:
    """The forward's tile for a chosen key block: fewer query rows as the key block grows, so that
    the scores tile stays at ≤ 8192 fp32 values (compiled for sm_90 without register failures:
    benchmarks/tools/compile_check.py), one pipeline stage once K and V tiles fill shared memory."""
    if block_k not in KEY_BLOCKS or block_k * head_dim > KEY_BLOCK_AREA:
        raise ValueError(f"block_k={block_k} with head_dim={head_dim} is not a key block the kernels take; "
                         f"accepted: one of {KEY_BLOCKS} with block_k·head_dim ≤ {KEY_BLOCK_AREA}")
    block_m = max(16, min(64, 8192 // block_k))
    return _cfg(block_m, block_k, 8 if block_k >= 256 else 4, 1 if block_k * head_dim >= 16384 else 2)


def _launch(tuned, raw, grid, *args, tma_tuned=None, tma: bool | None = None, fixed: bool = False,
            config: triton.Config | None = None, via=None, **meta) -> tuple | None:
    """Run ``raw`` through its tuner, its fixed config, or the interpreter's tile. A kernel with a
    TMA switch gets ``tma`` (alignment and GPU checked by the caller): when true it may read through
    tensor descriptors — each config of ``tma_tuned`` says whether it does; a fixed config does.
    ``fixed``: use the fixed config even when tuning — the forward's "paper" emulation rounds Ō and
    ℓ after every key block, so its key block is part of its arithmetic (``key_block``). ``config``:
    this tile and no other (a key block the caller chose: ``key_block_config``); the caller passes
    tma=False with it. Inside the inline ops' bodies every launch goes through
    ``torch.library.wrap_triton``. Returns the launch made, (kernel or tuner, grid, arguments,
    keyword arguments), None under the interpreter; ``via`` launches it in place of ``_run``."""
    tune = AUTOTUNE and not fixed and config is None
    run = via or _run
    if tma:
        _ensure_allocator()
        if tune and not interpreting():
            kwargs = {**meta, "INTERP": False}
            run(tma_tuned, grid, *args, **kwargs)
            return tma_tuned, grid, args, kwargs
    if tma is not None:
        meta["TMA"] = tma
    if interpreting():                             # a chosen key block keeps its BLOCK_N
        tile = _INTERP if config is None else {**_INTERP, "BLOCK_N": config.kwargs["BLOCK_N"]}
        raw[grid(tile)](*args, **meta, **tile, INTERP=True)
        return None
    if tune:
        entry, kwargs = tuned, {**meta, "INTERP": False}
    else:
        cfg = config or _FIXED[tuned][meta["HEAD_DIM"] <= 128]
        entry, grid = raw, grid(cfg.kwargs)
        kwargs = {**meta, **cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "INTERP": False}
    run(entry, grid, *args, **kwargs)
    return entry, grid, args, kwargs


@dataclasses.dataclass(frozen=True)
class _InlineBody:
    """Set while an inline op's body runs: its launches go through ``wrap_triton``, which
    torch.compile records as kernel calls of its own graph. ``tune_here``: a tuned kernel gets the
    tuner's choice for the traced shapes (``_tuned_here``), as an eager call would; else the tuner
    itself, which inductor then tunes on its own."""

    tune_here: bool


_INLINE: contextvars.ContextVar[Optional[_InlineBody]] = contextvars.ContextVar("stableflash_inline_body",
                                                                                default=None)
# the gradient of qkv a packed backward op's body has the kernels write dQ, dK and dV into; None: new tensors
_GRADS: contextvars.ContextVar[Optional[torch.Tensor]] = contextvars.ContextVar("stableflash_packed_grad",
                                                                              default=None)


def _with_defaults(entry, n_args: int, kwargs: dict) -> dict:
    """``kwargs`` plus the default of each of the kernel's parameters after the first ``n_args``
    that they leave out: torch.compile's copy of a kernel gives such a parameter None instead of
    its default (torch 2.11), which would turn the switches of paths not taken (masks, dropout) on."""
    fn = entry
    while not isinstance(fn, triton.JITFunction):
        fn = fn.fn
    return {**{p.name: p.default for p in fn.params[n_args:] if p.has_default and p.name not in kwargs}, **kwargs}


def _run(entry, grid, *args, **kwargs) -> None:
    """``entry[grid](*args, **kwargs)`` for a compiled (not interpreted) kernel or tuner: through
    ``wrap_triton`` inside an inline op's body, else through ``launch_cache``."""
    body = _INLINE.get()
    if body is None:
        launch_cache.launch(entry, grid, *args, **kwargs)
        return
    # tuned with the arguments an eager call passes (the tuners' keys see the defaults left out)
    choice = _tuned_here(entry, grid, args, kwargs) if body.tune_here and isinstance(entry, Autotuner) else None
    kwargs = _with_defaults(entry, len(args), kwargs)
    if choice is None:
        wrap_triton(entry)[grid](*args, **kwargs)
        return
    meta, options = choice
    wrap_triton(entry.fn)[grid(meta)](*args, **kwargs, **meta, **options)


def _hint(x):
    """A traced integer's value in the call being traced (a plain value as it is); None if it has none."""
    return x.node.hint if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) else x


def _real_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's dtype, device, sizes, strides and storage offset (their traced values),
    filled with normal values (integers: zeros)."""
    size, stride, offset = [_hint(n) for n in t.shape], [_hint(s) for s in t.stride()], _hint(t.storage_offset())
    if None in size or None in stride or offset is None:
        raise LookupError("a size without a value")
    numel = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset + 1
    base = torch.empty(numel, dtype=t.dtype, device=t.device)
    if t.dtype.is_floating_point:
        base.copy_(torch.randn(numel, device=t.device))
    else:
        base.zero_()
    return base.as_strided(size, stride, offset)


def _tuned_here(tuner: Autotuner, grid, args: tuple, kwargs: dict) -> tuple[dict, dict] | None:
    """(the kernel's meta-parameters, num_warps and num_stages) the tuner picks for traced arguments
    like these: this process's recorded choice for their key (``launch_cache``), or the tuner run
    on real tensors of their shapes, outside the tracing modes. None where a traced size has no
    value (an unbacked size), or the launch cache is off."""
    try:
        with torch.utils._python_dispatch._disable_current_modes():
            real = [_real_tensor(a) if isinstance(a, torch.Tensor) else _hint(a) for a in args]
            named = {k: _real_tensor(a) if isinstance(a, torch.Tensor) else _hint(a) for k, a in kwargs.items()}
            chosen = launch_cache.recorded_choice(tuner, tuple(real), named)
            if chosen is None:
                launch_cache.launch(tuner, lambda meta: tuple(_hint(g) for g in grid(meta)), *real, **named)
                chosen = launch_cache.recorded_choice(tuner, tuple(real), named)
    except LookupError:
        return None
    if chosen is None:
        return None
    params = set(tuner.fn.arg_names)
    return ({k: v for k, v in chosen.items() if k in params},
            {k: chosen[k] for k in ("num_warps", "num_stages") if k in chosen})


# whether the forward may read K and V through tensor descriptors (Hopper's TMA); its tuner decides
TMA = True
# δ = rowsum(dO ∘ O) (or with O + R) computed inside the dQ kernel, which then runs before the dK/dV
# kernel, instead of by a kernel of its own: where no mask, window, varlen or dropout is on.
FUSED_DELTA = True
# under torch.compile the ops whose kernels it launches from its own generated code (attn_fwd_inline,
# attn_bwd_inline; ``why_not_inline`` names the calls that stay opaque); off: the opaque ops alone
INLINE_OPS = True
# the forward's persistent grid: this many programs per SM, each walking tiles longest first over
# every head (0: one program per tile). Off: 5-44% slower than one program per tile at every shape
# timed on an H200 (docs/notebook/kernel-optimisation-log.md, item 21).
PERSISTENT = 0


def _programs(device: torch.device) -> int:
    """How many programs a persistent forward launches: PERSISTENT per SM (2 SMs under the interpreter)."""
    sms = 2 if interpreting() else _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return PERSISTENT * sms


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _has_data(t: torch.Tensor) -> bool:
    """Not a traced tensor (torch.compile's fake tensors); a plain tensor skips ``is_fake``'s checks."""
    return type(t) is torch.Tensor or not is_fake(t)


def _address(t: torch.Tensor) -> int:
    """t's data address; for a traced tensor (torch.compile's fake tensors) its byte offset into its
    storage, whose base torch.compile keeps 16-byte aligned (inductor copies a graph input that is not)."""
    return t.data_ptr() if _has_data(t) else t.storage_offset() * t.element_size()


def _use_tma(*ts: torch.Tensor) -> bool:
    """TMA needs compute capability ≥ 9, 16-byte aligned head bases and row strides (otherwise the
    pointer path runs)."""
    if not TMA or interpreting() or device_capability(ts[0].device)[0] < 9:
        return False
    bytes_ = ts[0].element_size()
    return not any(_address(t) % 16 or any((s * bytes_) % 16 for s in t.stride()[:3]) for t in ts)


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need a global scratch buffer, which torch provides. Triton
    keeps its allocator in a context variable, i.e. per thread, and autograd runs the backward on
    its own thread: so check on every TMA launch, and leave an allocator the user set alone."""
    if interpreting():
        return
    current, null = getattr(_allocation, "_allocator", None), getattr(_allocation, "NullAllocator", None)
    if current is None or null is None or isinstance(current.get(), null):
        triton.set_allocator(_torch_scratch)


def _units(emu: bool, scale: float, eps: float, lo: float, hi: float) -> tuple[float, ...]:
    """Kernel arguments in the kernel's units: log2 (fa2) or natural (paper emulation)."""
    if emu:
        return scale, eps, lo, hi, math.log(2.0)
    return scale * LOG2E, eps * LOG2E, lo * LOG2E, hi * LOG2E, 1.0


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _empty_like_layout(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of t's shape and dtype whose memory follows t's order of dimensions
    (largest stride first), as the kernel will see t (last dimension contiguous). A model's q, k, v
    are (B, N, H, d) buffers seen as (B, H, N, d); outputs laid out the same way make its transpose
    back free, and the three gradients cheap to join into the gradient of the fused QKV projection
    (from (B, H, N, d) gradients that join costs a GPT-2 small step about 6% of its time:
    docs/notebook/training-speed-log.md has the profile and its command). Used by the ops and their fakes alike,
    so that torch.compile sees the strides the kernels produce."""
    t = _last_dim_contiguous(t)
    if _has_data(t):                           # a real tensor's sizes are ints: its strides, made once
        return launch_cache.empty(t.shape, _layout_strides(t.shape, t.stride()), t.dtype, t)
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    return torch.empty_permuted(t.shape, order, dtype=t.dtype, device=t.device)


@functools.lru_cache(maxsize=1024)
def _layout_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The strides ``_empty_like_layout`` gives a tensor of ``shape`` laid out as one of ``strides``:
    ``torch.empty_permuted``'s, computed once per pair (an allocation with them known takes the host
    half the time)."""
    order = sorted(range(len(shape)), key=lambda i: -strides[i])
    return torch.empty_permuted(shape, order, device="meta").stride()


def varlen_grid(longest: int, block: int, programs: int) -> tuple[int, int]:
    """A packed batch's grid: sequence·head on the first axis, which takes up to 2³¹ − 1 programs
    (the second and third take 65,535: a step of many short documents has more sequence·heads
    than that), and the blocks of the longest sequence on the second."""
    return programs, launch_cache.cdiv(longest, block)


def _v_for_fp8_product(v: torch.Tensor, fmt: Format) -> torch.Tensor:
    """V in the fp8 product's format (``fmt``: FP8_E4M3 or FP8_E5M2), converted once per call instead of
    once per query block, and laid out (B, H_kv, d, N), keys contiguous: the operand layout Hopper's
    fp8 tensor cores take, which the kernel can then copy to shared memory as it is. torch's casts
    round to nearest-even as the kernels' ``round_format`` does (tests compare the two); e4m3
    saturates at ±448, which torch 2.11's cast does not (it gives NaN), so V is clamped first —
    exact, since every value beyond 448 saturates to it. The interpreter gets the same values in
    V's dtype."""
    B, H, n, d = v.shape
    e4m3 = fmt is Format.FP8_E4M3
    v8 = torch.empty(B, H, d, n, dtype=torch.float8_e4m3fn if e4m3 else torch.float8_e5m2, device=v.device)
    v8.copy_(v.transpose(-1, -2).clamp(-448.0, 448.0) if e4m3 else v.transpose(-1, -2))
    return v8.to(v.dtype) if interpreting() else v8


# an unbounded side of the band: a bound beyond every index (sequences stay below 2**29 tokens)
UNBOUNDED = 1 << 30


class Masks(NamedTuple):
    """What a call masks beyond the kernel's own CAUSAL switch (top-left causal, no window):
    ``band`` (left, right, bottom-right aligned) of a window or of a causal diagonal off the top-left
    corner — None: none; each side an int, UNBOUNDED for none — an ``attn_mask`` (B, H, Nq, Nk),
    packed sequences (``cu_q``, ``cu_k``, ``max_q``, ``max_k``; then q, k, v are (1, H, total, d)),
    and dropout's probability. ``Masks()``: nothing beyond CAUSAL, the kernels compiled without
    any of these switches."""

    band: Optional[tuple[int, int, bool]] = None
    attn_mask: Optional[torch.Tensor] = None
    cu_q: Optional[torch.Tensor] = None
    cu_k: Optional[torch.Tensor] = None
    max_q: int = 0
    max_k: int = 0
    dropout_p: float = 0.0

    @property
    def any(self) -> bool:
        return self.band is not None or self.attn_mask is not None or self.cu_q is not None or self.dropout_p > 0

    def op_args(self) -> tuple:
        """The custom ops' arguments for these masks (``MASK_ARGS``, after the configuration's)."""
        return (None if self.band is None else [int(x) for x in self.band], self.attn_mask, self.cu_q, self.cu_k,
                self.max_q, self.max_k, self.dropout_p)

    @classmethod
    def from_op_args(cls, band, attn_mask, cu_q, cu_k, max_q, max_k, dropout_p) -> "Masks":
        return cls(None if band is None else (band[0], band[1], bool(band[2])), attn_mask, cu_q, cu_k, max_q, max_k,
                   dropout_p)


def _mask_launch(masks: Masks, scale_u: float, seed: int) -> tuple[dict, dict]:
    """The kernels' trailing arguments (by name) and switches for ``masks`` (none: empty, so that a call
    without masks launches exactly the kernels without these switches); ``scale_u`` the forward's
    score scale in its units (the additive mask's multiplier is log2 e / scale_u), ``seed`` the
    dropout seed."""
    if not masks.any:
        return {}, {}
    varlen = masks.cu_q is not None
    band = masks.band
    if band is None and varlen:                # packed sequences: every sequence's own ragged edge
        band = (UNBOUNDED, UNBOUNDED, False)
    mask = masks.attn_mask
    kind, rows, mstrides = 0, False, (0, 0, 0, 0)
    if mask is not None:
        kind = 1 if mask.dtype == torch.bool else 2
        mstrides = mask.stride()
        rows = bool(mstrides[2] != 0 and mask.shape[2] > 1)
        mask = mask.view(torch.uint8) if kind == 1 else mask
    p = masks.dropout_p
    args = dict(CU_Q=masks.cu_q, CU_K=masks.cu_k, MASK=mask, stride_mb=mstrides[0], stride_mh=mstrides[1],
                stride_mm=mstrides[2], stride_mn=mstrides[3], mask_mul=LOG2E / scale_u,
                left=band[0] if band else 0, right=band[1] if band else 0, align_br=int(band[2]) if band else 0,
                drop_seed=seed, drop_thr=drop_threshold(p) - 2**31, drop_scale=1.0 / (1.0 - p))
    meta = dict(BAND=band is not None, VARLEN=varlen, MASK_KIND=kind, MASK_ROWS=rows, DROPOUT=p > 0)
    return args, meta


@functools.lru_cache(maxsize=256)
def forward_switches(config: KernelConfig) -> dict:
    """The forward kernel's compile-time switches for ``config`` (all but the shapes, tiles and
    grid): the values of its enums (``common`` names them in the kernels), its bools, and what
    derives from them — P̄'s format or NO_FORMAT, and DELTA_SRC as the forward sees the δ source.
    Memoized (one dict per configuration, read and never changed by the launch)."""
    own = config.p_bar not in (None, Format.FP32)          # P̄ rounded to a format of its own
    return dict(STAB=config.rule.value, EMU=config.emulated, FMT=config.narrow.value, SR=config.stochastic,
                ACC_NARROW=config.narrow_acc, ROW_NARROW=config.narrow_row_sum, O_NARROW=config.narrow_out,
                PBAR32=config.p_bar_fp32, HP=bool(config.hp_heads), PFMT=config.p_bar.value if own else NO_FORMAT.value,
                FP8_PV=config.fp8_product, SOFTCAP=config.softcap is not None,
                DELTA_SRC=config.delta.for_forward.value)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
             config: KernelConfig, masks: Masks = Masks(),
             drop_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O, LSE, O32): O like q, LSE (B, H, Nq) fp32 in natural log, O32 what the forward keeps for
    δ (``config.delta.keeps_o``: an fp32 O, or the O store's residual in O's dtype; else an empty
    tensor). Stochastic rounding takes a seed drawn from torch's default generator (so
    ``torch.manual_seed`` makes a run reproducible and checkpoints carry the stream on). The fp32
    heads reach the kernel as one int, bit h set for head h. A key block (``config.block_k``)
    walks the keys in blocks of that size (``key_block_config``). ``masks``: what the call masks
    beyond CAUSAL; ``drop_seed``: dropout's seed (``masking.draw_seed``, drawn by the caller,
    which keeps it for the backward). Where ``gluon.route.why_not`` accepts the call, the Gluon
    Hopper forward writes the same three outputs. Runs on q's device (``launch_cache.elsewhere``)."""
    if launch_cache.elsewhere(q):
        with torch.cuda.device(q.device):
            return _forward(q, k, v, causal, scale, config, masks, drop_seed)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    B, H, n_q, d = q.shape
    d = int(d)                                 # a compile-time constant of the kernels (traced: specialized)
    n_k = k.shape[2]
    emu, softcap, delta = config.emulated, config.softcap, config.delta
    o = _empty_like_layout(q)
    lse = launch_cache.empty_contiguous((B, H, n_q), torch.float32, q)
    o32 = launch_cache.empty_contiguous(q.shape if delta.keeps_o else (0,),
                                        q.dtype if delta.residual else torch.float32, q)
    tensors, key, plan = (q, k, v, o, lse, o32), None, None
    # a plan: not for a seed drawn per call (dropout, stochastic rounding), nor in a traced body
    if launch_cache.PLANS and launch_cache.ENABLED and not masks.any and not config.stochastic \
            and _INLINE.get() is None and not _INTERPRETING:
        key = launch_cache.plan_key(tensors[:3], causal, scale, config, hopper_route.settings(), AUTOTUNE, TMA,
                                    PERSISTENT, fresh=tensors[3:])
        plan = _forward_plans.get(key)
        if plan is not None and not plan.current:
            plan = None
        elif plan is not None and not launch_cache.VERIFY:
            plan(tensors)
            return o, lse, o32
    # under VERIFY a plan's replay is checked against the launch built here, and runs in its place
    via = (lambda entry, grid, *args, **kwargs: plan.checking(tensors, ())(0, entry, grid, args, kwargs)) \
        if plan is not None else None
    if _INLINE.get() is None and hopper_route.why_not(q, k, v, config, masks, interpreting(), causal=causal) is None:
        launched = hopper_route.forward(q, k, v, causal, scale, o, lse, o32, via=via)
        _keep_forward_plan(key, plan, tensors, launched)
        return o, lse, o32
    scale_u, eps_u, lo, hi, period = _units(emu, scale, config.eps, config.min_shift, config.max_shift)
    cap_in = cap_out = 0.0
    if softcap is not None:   # "paper": S = bf16(QKᵀ·scale) capped in natural units; "fa2": QKᵀ into log2 units
        cap_in, cap_out = (1.0 / softcap, softcap) if emu else (scale / softcap, softcap * LOG2E)
        scale_u = scale_u if emu else 1.0
    # streams seed − 1 (O) and seed + 3b, seed + 3b + 1 (Ō, ℓ of key block b) stay positive int32
    seed = int(torch.randint(1, 2**30, (1,))) if config.stochastic else 0
    hp_mask = sum(1 << h for h in config.hp_heads)
    extra, switches = _mask_launch(masks, scale_u, drop_seed)
    varlen = masks.cu_q is not None
    if varlen:                                 # (query blocks of the longest sequence, sequences · heads)
        n_seq = masks.cu_q.shape[0] - 1
        grid = lambda meta: varlen_grid(masks.max_q, meta["BLOCK_M"], n_seq * H)  # noqa: E731
    elif PERSISTENT and not masks.any:
        programs = _programs(q.device)
        grid = lambda meta: (min(launch_cache.cdiv(n_q, meta["BLOCK_M"]) * B * H, programs),)  # noqa: E731
    else:
        grid = lambda meta: (launch_cache.cdiv(n_q, meta["BLOCK_M"]), B * H)  # noqa: E731
    tile = key_block_config(config.block_k, d) if config.block_k else None
    v8 = _v_for_fp8_product(v, config.p_bar) if config.fp8_product else v
    launched = _launch(_fwd_tuned, attn_fwd_kernel, grid, q, k, v, v8, o, lse, o32, *_strides(q), *_strides(k),
                       *_strides(v), *_strides(o), H, H // k.shape[1], n_q, n_k, B * H, scale_u, config.beta, eps_u, lo,
                       hi, period, seed, hp_mask, cap_in, cap_out, **extra, tma_tuned=_fwd_tma_tuned,
                       tma=_use_tma(k, v) and tile is None and not varlen, fixed=emu, config=tile, via=via, HEAD_DIM=d,
                       CAUSAL=causal, **forward_switches(config), PERSISTENT=PERSISTENT > 0 and not masks.any,
                       **switches)
    _keep_forward_plan(key, plan, tensors, launched)
    return o, lse, o32


# the forwards' launches kept by ``launch_cache.plan_key`` of (q, k, v, O, L, O32), causal, scale, the
# configuration and the switches that choose the kernel: the Gluon route's settings, tuning, TMA, persistent
_forward_plans: dict = {}


def _keep_forward_plan(key, plan, tensors: tuple, launched) -> None:
    """Record the plan of a forward that built and launched ``launched`` (none where a plan ran it, the
    key is None, or the interpreter ran it)."""
    if key is not None and plan is None and launched is not None:
        launch_cache.keep_plan(_forward_plans, key, launch_cache.Plan.record(tensors, (), [launched]))


# the masks' arguments of both ops, after (q, k, v, causal, scale) and the configuration (``KernelConfig.op_key``)
MASK_ARGS = ("band", "attn_mask", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p")
N_MASK_ARGS = len(MASK_ARGS)


def _forward_op(inline: bool):
    """The forward op's implementation: ``_forward`` with the op's arguments; ``inline``: the
    launches through ``wrap_triton`` (``attn_fwd_inline``), except where a call needs the opaque
    op — which it then calls."""

    def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, config: str,
                 band: Optional[list[int]] = None, attn_mask: Optional[torch.Tensor] = None,
                 cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                 max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                 dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(O, LSE, O32, seed) as ``_forward`` for the KernelConfig whose ``op_key`` ``config`` is and the
        masks (``Masks.op_args``); seed: with dropout, dropout's seed as a CPU
        int64 tensor of one value for the backward op, drawn here on every call (also under
        torch.compile, where the op is opaque); without, an empty int64 tensor on q's device, so that
        a step with no dropout has no CPU output (torch.compile's CUDA graphs cannot record one)."""
        key, config = config, KernelConfig.from_op_key(config)
        masks = Masks.from_op_args(band, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   dropout_p)
        if inline and why_not_inline(q, k, v, config, masks, causal) is not None:
            return attn_fwd_opaque(q, k, v, causal, scale, key, *masks.op_args())
        seed = draw_seed() if masks.dropout_p > 0 else 0
        token = _INLINE.set(_InlineBody(tune_here=not masks.any) if inline else None)
        try:
            o, lse, o32 = _forward(q, k, v, causal, scale, config, masks, seed)
        finally:
            _INLINE.reset(token)
        return o, lse, o32, _seed_output(seed, dropout_p, q)

    return attn_fwd


# torch.compile leaves an opaque op's body alone (it runs as Python on every call); it traces an
# inline op's body and launches its Triton kernels from its own generated code
attn_fwd = torch.library.custom_op("stableflash::attn_fwd", mutates_args=())(_forward_op(False))


# the ops without an autograd formula (the backward ops, and the forward an inline op's traced body
# calls), defined through torch.library's own registration (``_opaque_op``)
_LIBRARY = torch.library.Library("stableflash", "FRAGMENT")


def _opaque_op(name: str, fn, fake) -> torch._ops.OpOverload:
    """``stableflash::<name>``, opaque to torch.compile: its schema inferred from ``fn``'s signature
    (``torch.library.infer_schema``), ``fn`` its implementation on every device, ``fake`` its fake.
    For an op that needs no autograd formula (a backward; the forward an inline op's body calls, whose
    gradient the inline op's own formula gives), so not a ``torch.library.custom_op``, whose Python
    layers around the implementation (its autograd wrapper, which runs on every call of an op whose
    inputs require grad even with grad mode off, a redispatch, checks of the outputs) double the host
    time of each call of 32 arguments (CPU: scratch measurements in the training-speed notebook)."""
    _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=()))
    _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"stableflash::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.stableflash, name).default


def why_not_inline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: KernelConfig, masks: Masks,
                   causal: bool = True) -> str | None:
    """None where the inline ops run a call; else why it runs on the opaque ops: Triton's
    interpreter (whose kernels ``wrap_triton`` does not take), a seed drawn per call (dropout,
    stochastic rounding: torch.compile would fix it at trace time), or a forward the Gluon Hopper
    kernel may take (``gluon.route``, which the opaque op asks with the tensors' addresses)."""
    if interpreting():
        return "Triton's interpreter runs the kernels"
    if masks.dropout_p > 0 or config.stochastic:
        return "dropout or stochastic rounding draws a seed on every call"
    if hopper_route.why_not(q, k, v, config, masks, pointers=False, causal=causal) is None:
        return "the Gluon Hopper forward may take the call"
    return None


def why_not_inline_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            config: KernelConfig, masks: Masks) -> str | None:
    """``why_not_inline`` for a backward: the interpreter, dropout (whose seed the backward reads
    from a tensor), or a backward the Gluon Hopper kernel may take."""
    if interpreting():
        return "Triton's interpreter runs the kernels"
    if masks.dropout_p > 0:
        return "dropout's seed reaches the backward as a tensor"
    if hopper_route.why_not_backward(do, q, k, v, config, masks, pointers=False) is None:
        return "the Gluon Hopper backward may take the call"
    return None


def _seed_output(seed: int, dropout_p: float, q: torch.Tensor) -> torch.Tensor:
    """The forward op's seed output: a CPU int64 tensor holding ``seed`` under dropout, else empty on q's device."""
    if dropout_p > 0:
        return torch.tensor([seed], dtype=torch.int64)
    return launch_cache.empty_contiguous((0,), torch.int64, q)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, causal, scale, config, *mask_args, **kwargs):
    delta = KernelConfig.from_op_key(config).delta
    o32 = q.new_empty(q.shape if delta.keeps_o else (0,), dtype=q.dtype if delta.residual else torch.float32)
    dropout_p = mask_args[MASK_ARGS.index("dropout_p")] if len(mask_args) == N_MASK_ARGS else kwargs.get("dropout_p", 0.0)
    return _empty_like_layout(q), q.new_empty(q.shape[:3], dtype=torch.float32), o32, _seed_output(0, dropout_p, q)


# the opaque forward without an autograd formula: what the inline forward's traced body calls where a call
# must run on the opaque op (``why_not_inline``) — the inline op's formula gives its gradient, so the
# compiled step's graph calls it without torch.library.custom_op's Python layers
attn_fwd_opaque = _opaque_op("attn_fwd_opaque", _forward_op(False), _attn_fwd_fake)


class _Body:
    """An op's implementation as torch.library.triton_op takes it (its signature and globals for
    the schema, a call), without the function's source: triton_op parses a function's source to
    find the kernels it launches (which does not follow this module's helpers, and imports
    torch._inductor, a second at import time); ``_triton_op`` names them instead."""

    def __init__(self, fn):
        self._fn = fn
        self.__name__, self.__globals__ = fn.__name__, fn.__globals__
        self.__signature__ = inspect.signature(fn)

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


def _triton_op(name: str, body, kernels) -> torch.library.CustomOpDef:
    """``torch.library.triton_op(name)(body)``, ``kernels`` named as the Triton kernels it launches
    (torch.compile's cache key includes the source of each kernel an op names)."""
    op = torch.library.triton_op(name, mutates_args=())(_Body(body))
    table = getattr(getattr(torch._library, "triton", None), "triton_ops_to_kernels", None)
    if isinstance(table, dict):
        table[name] = list(kernels)
    return op


# the same op inlined: torch.library.triton_op traces its body (also as its fake implementation)
attn_fwd_inline = _triton_op("stableflash::attn_fwd_inline", _forward_op(True), (attn_fwd_kernel,))


def delta_dot(o: torch.Tensor, r: torch.Tensor, do: torch.Tensor, delta: torch.Tensor, has_r: bool,
              clear: torch.Tensor | None = None) -> None:
    """δ = rowsum(dO ∘ O), with ``has_r`` rowsum(dO ∘ (O + R)) (``r`` contiguous (B, H, N_q, d); any
    tensor without), into ``delta`` (B, H, N_q) fp32, by the δ kernel of its own; ``clear``: an fp32
    tensor of o's shape (any strides) the same kernel fills with zeros."""
    grid, args, kwargs = delta_dot_launch(o, r, do, delta, has_r, clear)
    _run(delta_dot_kernel, grid, *args, **kwargs)


def delta_dot_launch(o: torch.Tensor, r: torch.Tensor, do: torch.Tensor, delta: torch.Tensor, has_r: bool,
                     clear: torch.Tensor | None = None) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, arguments, keyword arguments) of ``delta_dot``'s launch of ``delta_dot_kernel``."""
    B, H, n_q, d = o.shape
    d, block = int(d), 64
    zero = {} if clear is None else dict(ZERO=clear, stride_zb=clear.stride(0), stride_zh=clear.stride(1),
                                         stride_zm=clear.stride(2), stride_zd=clear.stride(3), CLEAR=True)
    return ((launch_cache.cdiv(n_q, block), B * H), (o, r, do, delta, *_strides(o), *_strides(do), H, n_q),
            dict(HEAD_DIM=d, BLOCK_M=block, HAS_R=has_r, **zero))


def _backward_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   residual: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   config: KernelConfig, masks: Masks = Masks(),
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) for the forward that produced ``o`` and ``lse`` under ``config`` (``o``: the
    fp32 O when the forward kept one, which δ = rowsum(dO ∘ O) then reads; ``residual``: R of δ
    from dO·(O+R), which the δ kernel adds to O, or an empty tensor). ``masks`` and dropout's
    ``seed``: the forward's. Kernels: δ, dK/dV, dQ; with ``FUSED_DELTA`` (no masks, δ a row sum of
    dO ∘ O) dQ computing δ, then dK/dV. Runs on q's device (``launch_cache.elsewhere``)."""
    if launch_cache.elsewhere(q):
        with torch.cuda.device(q.device):
            return _backward_impl(do, q, k, v, o, residual, lse, causal, scale, config, masks, seed)
    do, q, k, v, o = [_last_dim_contiguous(t) for t in (do, q, k, v, o)]
    packed = _GRADS.get()                      # a packed op's gradient of qkv, (B, N, 3, H, d) contiguous
    if packed is None:
        dq, dk, dv = _empty_like_layout(q), _empty_like_layout(k), _empty_like_layout(k)   # dK, dV: one set of strides
        dq_out, dk_out, dv_out, dkv_at = dq, dk, dv, {}
    else:
        # the kernels get the whole tensor, with the views' strides and dK, dV at offsets into it: a
        # traced call's writes into a view are functionalized into writes to a copy, whose layout
        # the view's strides would not describe
        dq, dk, dv = unpack_qkv(packed)
        dq_out, dk_out, dv_out = packed, packed, do         # dv_out: not read (DV_IN_DK)
        dkv_at = dict(dk_offset=packed.stride(2), dv_offset=2 * packed.stride(2), DV_IN_DK=True)
    key = None
    # a route backward seen before runs its kept plan: the key holds what the route's decision reads too
    if launch_cache.PLANS and launch_cache.ENABLED and not masks.any and _INLINE.get() is None \
            and not _INTERPRETING and not torch.are_deterministic_algorithms_enabled():
        from stableflash.attention.gluon import launch_backward
        kept = (do, q, k, v, o, residual if residual.numel() else o, lse, dq, dk, dv)
        # dQ, dK, dV: allocated here, as q and k (``_empty_like_layout``) or as views of one packed gradient
        key = launch_cache.plan_key(kept[:7], causal, scale, config, hopper_route.settings(), packed is None,
                                    fresh=kept[7:])
        if launch_backward.replay(key, kept):
            return dq, dk, dv
    if _INLINE.get() is None and hopper_route.why_not_backward(do, q, k, v, config, masks, interpreting()) is None:
        hopper_route.backward(do, q, k, v, o, residual, lse, causal, scale, dq, dk, dv, key)
        return dq, dk, dv
    emu, softcap = config.emulated, config.softcap or 0.0
    cap = dict(SOFTCAP=config.softcap is not None)
    B, H, n_q, d = q.shape
    d = int(d)
    Hk, n_k = k.shape[1], k.shape[2]
    group = H // Hk
    # the backward's kernels read scores in natural units: an additive mask's multiplier is unused
    extra, switches = _mask_launch(masks, LOG2E, seed)
    extra.pop("mask_mul", None)                # the forward's alone
    n_m, n_n, n_bh, n_bhk = n_q, n_k, B * H, B * Hk
    blocks = lambda n, size, rows: (launch_cache.cdiv(n, size), rows)  # noqa: E731
    if masks.cu_q is not None:                 # programs over the longest sequence, sequences · heads
        n_seq = masks.cu_q.shape[0] - 1
        n_m, n_n, n_bh, n_bhk = masks.max_q, masks.max_k, n_seq * H, n_seq * Hk
        blocks = varlen_grid
    has_r = residual.numel() > 0
    r = residual.contiguous() if has_r else o  # the δ kernels' R (ignored without HAS_R)
    fuse = FUSED_DELTA and not config.delta.extra_pass and not masks.any
    delta = torch.empty(B, H, n_q, dtype=torch.float32, device=q.device)
    common = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))

    def launch_dq(**fused):
        _launch(_dq_tuned, attn_bwd_dq_kernel, lambda meta: blocks(n_m, meta["BLOCK_M"], n_bh),
                q, k, v, do, lse, delta, dq_out, *common, *_strides(dq), H, group, n_q, n_k, scale, softcap, **extra,
                HEAD_DIM=d, CAUSAL=causal, EMU=emu, **cap, **switches, **fused)

    if fuse:                                  # the dQ kernel computes δ and stores it for dK/dV
        launch_dq(O=o, R=r, stride_ob=o.stride(0), stride_oh=o.stride(1), stride_om=o.stride(2), FUSE_DELTA=True,
                  HAS_R=has_r)
    elif not config.delta.extra_pass:         # δ = rowsum(dO ∘ O), O as stored, kept in fp32, or plus R
        delta_dot(o, r, do, delta, has_r)
    else:
        _launch(_delta_tuned, delta_pass_kernel, lambda meta: blocks(n_m, meta["BLOCK_M"], n_bh),
                q, k, v, do, lse, delta, *_strides(q), *_strides(k), *_strides(v), *_strides(do), H, group, n_q, n_k,
                scale, softcap, **extra, HEAD_DIM=d, CAUSAL=causal, DELTA_SRC=config.delta.value, EMU=emu, **cap,
                **switches)
    _launch(_dkdv_tuned, attn_bwd_dkdv_kernel, lambda meta: blocks(n_n, meta["BLOCK_N"], n_bhk),
            q, k, v, do, lse, delta, dk_out, dv_out, *common, *_strides(dk), H, group, n_q, n_k, scale, softcap,
            **extra, HEAD_DIM=d, CAUSAL=causal, EMU=emu, **cap, **switches, **dkv_at)
    if not fuse:
        launch_dq()
    return dq, dk, dv


def _backward_op(inline: bool):
    """The backward op's implementation: ``_backward_impl`` with the op's arguments; ``inline`` as
    for ``_forward_op`` (the backward of dropout reads its seed from a tensor: the opaque op)."""

    def attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 residual: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, config: str,
                 band: Optional[list[int]] = None, attn_mask: Optional[torch.Tensor] = None,
                 cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                 max_seqlen_q: int = 0, max_seqlen_k: int = 0, dropout_p: float = 0.0,
                 seed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dQ, dK, dV) for the forward that produced ``o``, ``lse`` and dropout's ``seed``, with the
        forward's arguments."""
        key, config = config, KernelConfig.from_op_key(config)
        masks = Masks.from_op_args(band, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   dropout_p)
        if inline and why_not_inline_backward(do, q, k, v, config, masks) is not None:
            return attn_bwd_opaque(do, q, k, v, o, residual, lse, causal, scale, key, *masks.op_args(), seed)
        token = _INLINE.set(_InlineBody(tune_here=not masks.any) if inline else None)
        try:
            return _backward_impl(do, q, k, v, o, residual, lse, causal, scale, config, masks,
                                  int(seed[0]) if seed is not None and seed.numel() else 0)
        finally:
            _INLINE.reset(token)

    return attn_bwd


def _attn_bwd_fake(do, q, k, v, o, residual, lse, causal, scale, *args, **kwargs):
    return _empty_like_layout(q), _empty_like_layout(k), _empty_like_layout(k)


attn_bwd = attn_bwd_opaque = _opaque_op("attn_bwd", _backward_op(False), _attn_bwd_fake)


# the kernels a backward op may launch (torch.compile's cache key reads their source)
_BACKWARD_KERNELS = (attn_bwd_dq_kernel, attn_bwd_dkdv_kernel, delta_dot_kernel, delta_pass_kernel)
attn_bwd_inline = _triton_op("stableflash::attn_bwd_inline", _backward_op(True), _BACKWARD_KERNELS)


def _for_delta(o: torch.Tensor, o32: torch.Tensor, config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """What the backward keeps for δ: (the O it reads, the residual added to it or an empty tensor)."""
    if config.delta.residual:
        return o, o32
    return (o32 if config.delta.keeps_o else o), o32.new_empty(0)




def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, config, *mask_args = inputs
    o, lse, o32, seed = output
    ctx.save_for_backward(q, k, v, lse, *_for_delta(o, o32, KernelConfig.from_op_key(config)), seed)
    ctx.args = (causal, scale, config)
    ctx.mask_args = tuple(mask_args) + tuple(Masks().op_args()[len(mask_args):])
    ctx.mark_non_differentiable(lse, o32, seed)


def _backward_of(op):
    def backward(ctx, do, _dlse, _do32, _dseed):
        q, k, v, lse, o, residual, seed = ctx.saved_tensors
        dq, dk, dv = op(do, q, k, v, o, residual, lse, *ctx.args, *ctx.mask_args, seed)
        return dq, dk, dv, *[None] * (3 + N_MASK_ARGS)

    return backward


attn_fwd.register_autograd(_backward_of(attn_bwd), setup_context=_setup_context)
attn_fwd_inline.register_autograd(_backward_of(attn_bwd_inline), setup_context=_setup_context)


def unpack_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (B, H, N, d) views of a packed (B, N, 3, H, d) tensor, a fused QKV projection's output."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)      # two view operations instead of four


def _into_packed_grad(backward, do: torch.Tensor, qkv: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``backward(do, q, k, v, *args, **kwargs)`` on ``unpack_qkv``'s views of ``qkv``, its kernels
    writing dQ, dK and dV into one new gradient of qkv, laid out as qkv contiguous (``_GRADS``),
    which is returned."""
    return _packed_grad(backward, do, unpack_qkv(qkv), *args, **kwargs)


def _packed_grad(backward, do: torch.Tensor, views: tuple, *args, **kwargs) -> torch.Tensor:
    """``_into_packed_grad`` given the views (q, k, v) of the packed tensor rather than the tensor."""
    B, H, N, d = views[0].shape
    dqkv = launch_cache.empty_contiguous((B, N, 3, H, d), views[0].dtype, views[0])
    token = _GRADS.set(dqkv)
    try:
        backward(do, *views, *args, **kwargs)
    finally:
        _GRADS.reset(token)
    return dqkv


def _packed_signature(fn, returns: str | None) -> inspect.Signature:
    """``fn``'s signature with its parameters q, k, v replaced by one ``qkv`` (and, if given, the
    return annotation ``returns``)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    at = [p.name for p in params].index("q")
    assert [p.name for p in params[at:at + 3]] == ["q", "k", "v"]
    params[at:at + 3] = [params[at].replace(name="qkv")]
    return sig.replace(parameters=params, return_annotation=returns or sig.return_annotation)


class _PackedBody:
    """An op's body with (q, k, v) given as one packed ``qkv`` (B, N, 3, H, d): ``fn`` (an unpacked
    op's body) runs on ``unpack_qkv``'s views. ``grads``: the backward's, which allocates one
    gradient of qkv laid out as qkv contiguous, has the kernels write dQ, dK and dV into it
    (``_GRADS``) and returns it: the gradient of a fused QKV projection without a join of three
    tensors. ``opaque``: for an inline backward, the opaque op it hands a call to where its body
    would (the interpreter, dropout)."""

    def __init__(self, fn, name: str, grads: bool, opaque=None):
        self._fn, self._grads, self._opaque = fn, grads, opaque
        self.__name__, self.__globals__ = name, fn.__globals__
        self.__signature__ = _packed_signature(fn, "torch.Tensor" if grads else None)
        self._names = tuple(self.__signature__.parameters)
        self._defaults = tuple(p.default for p in self.__signature__.parameters.values())
        # the fewest positional arguments a call may give: those after it all have defaults
        self._required = max((i + 1 for i, d in enumerate(self._defaults) if d is inspect.Parameter.empty), default=0)
        self._at = self._names.index("qkv")              # fn's q, k, v there; a backward's dO before it
        assert not grads or self._at == 1

    def __call__(self, *args, **kwargs):
        # torch's dispatcher passes the arguments by position and leaves out trailing ones equal to their
        # defaults (the mask arguments of an unmasked call): those are filled in from the signature's defaults
        if not kwargs and self._required <= len(args) < len(self._names):
            args = args + self._defaults[len(args):]
        elif kwargs or len(args) != len(self._names):
            bound = self.__signature__.bind(*args, **kwargs)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        at = self._at
        if not self._grads:
            return self._fn(*args[:at], *unpack_qkv(args[at]), *args[at + 1:])
        if self._opaque is not None:
            named = dict(zip(self._names, args))
            config = KernelConfig.from_op_key(named["config"])
            masks = Masks.from_op_args(*(named[m] for m in MASK_ARGS))
            if why_not_inline_backward(named["do"], *unpack_qkv(named["qkv"]), config, masks) is not None:
                return self._opaque(*args)
        return _into_packed_grad(self._fn, args[0], args[1], *args[2:])


def _attn_bwd_packed_fake(do, qkv, *args, **kwargs):
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)


attn_bwd_packed = _opaque_op("attn_bwd_packed", _PackedBody(_backward_op(False), "attn_bwd_packed", grads=True),
                             _attn_bwd_packed_fake)


attn_bwd_packed_inline = _triton_op(
    "stableflash::attn_bwd_packed_inline",
    _PackedBody(_backward_op(True), "attn_bwd_packed_inline", grads=True, opaque=attn_bwd_packed), _BACKWARD_KERNELS)

attn_fwd_packed = torch.library.custom_op("stableflash::attn_fwd_packed", mutates_args=())(
    _PackedBody(_forward_op(False), "attn_fwd_packed", grads=False))


@attn_fwd_packed.register_fake
def _(qkv, causal, scale, *args, **kwargs):
    return _attn_fwd_fake(*unpack_qkv(qkv), causal, scale, *args, **kwargs)


attn_fwd_packed_inline = _triton_op("stableflash::attn_fwd_packed_inline",
                                    _PackedBody(_forward_op(True), "attn_fwd_packed_inline", grads=False),
                                    (attn_fwd_kernel,))


def _setup_packed_context(ctx, inputs, output):
    qkv, causal, scale, *rest = inputs
    _setup_context(ctx, (qkv, None, None, causal, scale, *rest), output)


def _packed_backward_of(op):
    def backward(ctx, do, _dlse, _do32, _dseed):
        qkv, _, _, lse, o, residual, seed = ctx.saved_tensors
        dqkv = op(do, qkv, o, residual, lse, *ctx.args, *ctx.mask_args, seed)
        return dqkv, *[None] * (3 + N_MASK_ARGS)

    return backward


attn_fwd_packed.register_autograd(_packed_backward_of(attn_bwd_packed), setup_context=_setup_packed_context)
attn_fwd_packed_inline.register_autograd(_packed_backward_of(attn_bwd_packed_inline),
                                         setup_context=_setup_packed_context)


class _EagerAttention(torch.autograd.Function):
    """The same kernels without the custom-op dispatch, for eager mode."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, config, masks):
        seed = draw_seed() if masks.dropout_p > 0 else 0
        o, lse, o32 = _forward(q, k, v, causal, scale, config, masks, seed)
        ctx.save_for_backward(q, k, v, lse, *_for_delta(o, o32, config))
        ctx.args = (causal, scale, config, masks, seed)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, lse, o, residual = ctx.saved_tensors
        dq, dk, dv = _backward_impl(do, q, k, v, o, residual, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


class _EagerPackedAttention(torch.autograd.Function):
    """``_EagerAttention`` with q, k, v given as one packed qkv: its gradient is one tensor, into whose
    views the backward's kernels write dQ, dK and dV."""

    @staticmethod
    def forward(ctx, qkv, causal, scale, config, masks):
        seed = draw_seed() if masks.dropout_p > 0 else 0
        views = unpack_qkv(qkv)
        o, lse, o32 = _forward(*views, causal, scale, config, masks, seed)
        ctx.save_for_backward(*views, lse, *_for_delta(o, o32, config))    # the views: not made again
        ctx.args = (causal, scale, config, masks, seed)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, lse, o, residual = ctx.saved_tensors
        return _packed_grad(_backward_impl, do, (q, k, v), o, residual, lse, *ctx.args), None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
              config: KernelConfig, masks: Masks = Masks(),
              packed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE): O differentiable, LSE (B, H, Nq) fp32 without gradient — the inline forward op
    under torch.compile (the opaque one with ``INLINE_OPS`` off; ``config`` as its ``op_key``),
    the autograd.Function in eager mode. ``config``: what ``launch.kernel_config`` built;
    ``masks``: what the call masks beyond CAUSAL. ``packed``: the (B, N, 3, H, d) tensor whose
    ``unpack_qkv`` views q, k and v are; then O is differentiable with respect to it, and the
    backward writes dQ, dK and dV into one gradient laid out as it (the packed ops)."""
    if packed is not None:
        if torch.compiler.is_compiling():
            op = attn_fwd_packed_inline if INLINE_OPS else attn_fwd_packed
            o, lse, _, _ = op(packed, causal, scale, config.op_key, *masks.op_args())
            return o, lse
        return _EagerPackedAttention.apply(packed, causal, scale, config, masks)
    if torch.compiler.is_compiling():
        op = attn_fwd_inline if INLINE_OPS else attn_fwd
        o, lse, _, _ = op(q, k, v, causal, scale, config.op_key, *masks.op_args())
        return o, lse
    return _EagerAttention.apply(q, k, v, causal, scale, config, masks)
