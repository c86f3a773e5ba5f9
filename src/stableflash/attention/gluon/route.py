"""Which forwards and backwards of the Triton backend's op run on the Gluon Hopper kernels, and their launches.

``triton.op._forward`` asks ``why_not`` first: where it answers None the forward runs on
``hopper_forward`` (the same O, log-sum-exp and residual R, in the same layouts, so that either
backward takes them as the Triton forward's); anywhere else on the Triton forward, which stays
the portable path and the reference the Gluon kernels are tested against. A forward qualifies
when all of these hold:

- the switch ``ENABLED`` is on and this triton has the Gluon Hopper API (``support``);
- the configuration is ``flash_attention``'s default for bf16 (``stabilize=True``: the standard
  row maximum, δ from dO·(O + R), no policy, soft-cap or key block of its own) — any ``beta``/``eps`` —
  or the same with ``stabilize=False`` (δ from dO·O as stored: the forward stores no R, the
  backward's δ kernel reads O alone);
- bf16 inputs at a head_dim of ``HEAD_DIMS`` with at least ``FORWARD_MIN_KEYS[(head_dim, causal)]``
  keys: where the Gluon forward was measured faster than the Triton forward (docs/kernels.md; at
  head_dim 64 short causal sequences lose to the Triton forward's several programs per SM);
- no mask beyond top-left causal (no window, ``attn_mask``, varlen or dropout);
- q, k, v TMA-aligned: 16-byte base, strides nonzero multiples of 8 elements, the last one 1;
- B·H ≤ 65535 and B·H·N_q < 2³¹ (the kernel's grid and indexing);
- a CUDA device of compute capability 9.0 (sm_90a), not Triton's interpreter.

``triton.op._backward_impl`` asks ``why_not_backward``: where it answers None the backward runs on
``hopper_backward``'s kernels — the one that adds dQ up by TMA reduce-adds (``BackwardTiles.atomic_dq``,
``atomic_backward_tiles``), or, under ``torch.use_deterministic_algorithms``, at head_dim 128 the
dK/dV kernel and the dQ kernel of the default tiles, which sum every gradient in one fixed order —
for the same configurations, masks, alignment (dO too) and devices as the forward, and

- head_dim in ``BACKWARD_HEAD_DIMS`` and at least ``BACKWARD_MIN_KEYS[head_dim]`` keys (in
  deterministic mode ``DETERMINISTIC_MIN_KEYS[head_dim]``): where that backward was measured faster
  than the Triton backward (docs/kernels.md; shorter sequences lose to the Triton kernels' several
  programs per SM, or tie with them);
- in deterministic mode a head_dim of ``DETERMINISTIC_MIN_KEYS``: the reduce-adds' sums come in no
  fixed order, so dQ may differ in the last bits from run to run; at head_dim 64, with no
  deterministic Gluon backward faster than the Triton one, the Triton backward runs, bit for bit
  repeatable;
- B·H_kv ≤ 65535 (its grid).

Imports nothing from Gluon at module level (the kernel is imported at its first launch).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

import torch

from stableflash.attention.gluon.support import device_capability, unavailable_reason

# off: every call on the Triton kernels (the benchmarks' "stableflash-portable" provider). A
# torch.compile'd graph keeps the choice made while it was traced (an inline op or the opaque one), and
# inductor's cache, which does not key on this switch, may hand a later process a graph traced under
# the other setting: switch it with a fresh cache (TORCHINDUCTOR_CACHE_DIR) when compiling
ENABLED = True
# the head dims routed here, from this many keys (per head_dim and causal) on: where the Gluon forward is
# faster than the Triton forward, at 1024 keys causal through the forward and backward and on the GPT-2
# small training step too (docs/kernels.md, "Hopper path"); shorter causal sequences at head_dim 64 run
# faster on the Triton forward's several programs per SM
HEAD_DIMS = (64, 128)
FORWARD_MIN_KEYS = {(64, True): 1024, (64, False): 1024, (128, True): 0, (128, False): 0}
# the backward's: where the Gluon backward adding dQ up by TMA reduce-adds is faster than the Triton
# backward, from this many keys on (docs/kernels.md, "Hopper path"); in deterministic mode the two
# Gluon kernels', per head_dim they run at
BACKWARD_HEAD_DIMS = (64, 128)
BACKWARD_MIN_KEYS = {64: 1024, 128: 512}
DETERMINISTIC_MIN_KEYS = {128: 4096}
MAX_HEAD_PROGRAMS = 65535


def settings() -> tuple:
    """Every switch and threshold the route's answers read beyond a call's own arguments (``ENABLED``,
    the head dims and key counts, the grid's limit), by value: a plan that skips the route's checks keys
    on them, so that changing one (a benchmark holding a kernel back, a test) reaches the next call."""
    return (ENABLED, HEAD_DIMS, tuple(FORWARD_MIN_KEYS.items()), BACKWARD_HEAD_DIMS, tuple(BACKWARD_MIN_KEYS.items()),
            tuple(DETERMINISTIC_MIN_KEYS.items()), MAX_HEAD_PROGRAMS)


@contextlib.contextmanager
def triton_only():
    """Within the block every call runs on the Triton kernels (``ENABLED`` off, restored after): the
    reference the Gluon kernel is compared with, and the benchmarks' portable provider."""
    global ENABLED
    was, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = was


@functools.lru_cache(maxsize=64)
def _config_reason(config) -> str | None:
    from stableflash.attention.triton.config import DeltaSource
    from stableflash.attention.triton.launch import stabilized_config
    ref = stabilized_config(torch.bfloat16)
    # δ's sources the Gluon kernels compute: dO·(O + R) (stabilize=True) and dO·O (stabilize=False)
    if replace(config, beta=ref.beta, eps=ref.eps, min_shift=ref.min_shift, max_shift=ref.max_shift,
               delta=ref.delta) != ref or config.delta not in (DeltaSource.DO_O_R, DeltaSource.DO_O):
        return ("the configuration is not flash_attention's default for bf16 (stabilize=True or stabilize=False, "
                "no policy)")
    return None


def _misaligned(named: dict[str, torch.Tensor]) -> str | None:
    for name, t in named.items():
        strides = t.stride()
        size = t.element_size()
        if strides[-1] != 1 or t.data_ptr() % 16:
            return f"{name} with strides {strides} is not TMA-aligned"
        for s in strides[:-1]:
            if s == 0 or (s * size) % 16:
                return f"{name} with strides {strides} is not TMA-aligned"
    return None


def why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config, masks, interpreting: bool = False,
            pointers: bool = True, causal: bool = True) -> str | None:
    """None where this forward runs on the Gluon Hopper kernel (the module docstring's list); else
    the first reason it does not, in words. ``masks``: the op's ``Masks``; ``causal``: the call's
    top-left causal switch. ``pointers`` off: the tensors' addresses and strides are not checked
    (traced tensors have none): None then means the call may run here."""
    reason = _first_reason(q, interpreting)
    if reason is not None:
        return reason
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        return f"head_dim {d} (routed: {HEAD_DIMS})"
    d = int(d)                  # traced: a symbolic size, specialized (the kernels take it as a constant)
    if not forward_routed(d, causal, k.shape[2]):
        return (f"{k.shape[2]} keys (the {'causal ' if causal else ''}forward at head_dim {d} is routed from "
                f"{FORWARD_MIN_KEYS[(d, bool(causal))]} on)")
    return _common_reason(q, k, v, config, masks, pointers, {"q": q, "k": k, "v": v})


def forward_routed(head_dim: int, causal: bool, n_keys: int) -> bool:
    """Whether ``why_not``'s head_dim and length rules (``HEAD_DIMS``, ``FORWARD_MIN_KEYS``) let a forward
    of this head_dim, causal switch and key count run on the Gluon kernel; the call's other
    conditions are ``why_not``'s to check."""
    return head_dim in HEAD_DIMS and n_keys >= FORWARD_MIN_KEYS[(int(head_dim), bool(causal))]


def why_not_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config, masks,
                     interpreting: bool = False, pointers: bool = True) -> str | None:
    """``why_not`` for a backward: None where it runs on the Gluon Hopper backward with dQ added up by
    TMA reduce-adds (the module docstring's list); else the first reason it does not."""
    reason = _first_reason(q, interpreting)
    if reason is not None:
        return reason
    d = q.shape[-1]
    if d not in BACKWARD_HEAD_DIMS:
        return f"head_dim {d} (routed backward: {BACKWARD_HEAD_DIMS})"
    d = int(d)                  # as in why_not: a traced size cannot key the tables below
    if torch.are_deterministic_algorithms_enabled():
        if d not in DETERMINISTIC_MIN_KEYS:
            return (f"torch.use_deterministic_algorithms is on (the Gluon backward at head_dim {d} adds dQ in no "
                    "fixed order)")
        if k.shape[2] < DETERMINISTIC_MIN_KEYS[d]:
            return (f"{k.shape[2]} keys under torch.use_deterministic_algorithms (the deterministic backward at "
                    f"head_dim {d} is routed from {DETERMINISTIC_MIN_KEYS[d]} on)")
    elif k.shape[2] < BACKWARD_MIN_KEYS[d]:
        return f"{k.shape[2]} keys (the backward at head_dim {d} is routed from {BACKWARD_MIN_KEYS[d]} on)"
    B, Hk = k.shape[:2]
    if B * Hk > MAX_HEAD_PROGRAMS:
        return f"k of shape {tuple(k.shape)} exceeds the backward's grid"
    return _common_reason(q, k, v, config, masks, pointers, {"q": q, "k": k, "v": v, "do": do})


def _first_reason(q: torch.Tensor, interpreting: bool) -> str | None:
    """The checks both answers start with, the cheapest first (most calls stop at one of them)."""
    if not ENABLED:
        return "the Hopper route is switched off (route.ENABLED)"
    if interpreting:
        return "Triton's interpreter runs the kernels"
    if q.dtype != torch.bfloat16:
        return f"dtype {q.dtype} (the Hopper kernels take bfloat16)"
    return None


def _common_reason(q, k, v, config, masks, pointers: bool, aligned: dict) -> str | None:
    """The checks both answers end with: masks, the Gluon API, the configuration, the grid, the
    alignment of ``aligned``'s tensors (when ``pointers``), the device."""
    if masks.any:
        return "a window, attn_mask, varlen batch or dropout"
    missing = unavailable_reason()
    if missing is not None:
        return missing
    reason = _config_reason(config)
    if reason is not None:
        return reason
    B, H, n_q = q.shape[:3]
    if B * H > MAX_HEAD_PROGRAMS or B * H * n_q >= 2**31:
        return f"q of shape {tuple(q.shape)} exceeds the kernels' grid or int32 indexing"
    reason = _misaligned(aligned) if pointers else None
    if reason is not None:
        return reason
    if q.device.type != "cuda":
        return f"the tensors are on {q.device}, not CUDA"
    cap = device_capability(q.device)
    if cap != (9, 0):
        return f"compute capability {cap} (the kernels are compiled for sm_90a)"
    return None


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, o: torch.Tensor,
            lse: torch.Tensor, residual: torch.Tensor, via=None) -> tuple:
    """The Gluon forward into ``o`` (q's layout), ``lse`` (B, H, N_q) fp32 and ``residual`` (B, H, N_q, d)
    bf16 contiguous, for a call ``why_not`` accepted. Returns its launch, (kernel, grid, arguments,
    keyword arguments); ``via(kernel, grid, *arguments, **keyword arguments)`` launches it in place of
    ``launch_cache.launch`` (the op's plans check their replay there)."""
    from stableflash.attention.gluon.hopper_forward import tiles_for
    from stableflash.attention.gluon.launch import attn_fwd_hopper_kernel, launch_args
    from stableflash.attention.triton import launch_cache
    grid, args, meta = launch_args(q, k, v, o, lse, residual, causal, scale, tiles_for(q.shape[-1], causal))
    (via or launch_cache.launch)(attn_fwd_hopper_kernel, grid, *args, **meta)
    return attn_fwd_hopper_kernel, grid, args, meta


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             residual: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, dq: torch.Tensor,
             dk: torch.Tensor, dv: torch.Tensor, key: tuple | None = None) -> None:
    """The Gluon backward into ``dq`` (q's shape), ``dk`` and ``dv`` (k's), any TMA-aligned layouts
    (views of one packed gradient included), for a call ``why_not_backward`` accepted (its kernels,
    atomic or in deterministic mode the two: ``launch_backward.backward_into``; ``key``: its plan's key,
    as the op made it)."""
    from stableflash.attention.gluon.launch_backward import backward_into
    backward_into(do, q, k, v, o, residual, lse, causal, scale, dq, dk, dv, key)

