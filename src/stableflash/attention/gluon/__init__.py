"""Attention kernels for Hopper (sm_90a) written in Gluon (``triton.experimental.gluon``).

``flash_forward_hopper(q, k, v, causal, scale=None, residual=True)``: the attention forward with TMA,
mbarriers, asynchronous warpgroup products and warp specialisation (``hopper_forward.py``), computing
what the Triton forward computes for ``stabilize=True`` on the "fa2" policy — O, the log-sum-exp and
the residual of the O store that the stabilized backward reads (``residual=False``: no residual, what
``stabilize=False`` runs). ``flash_attention`` runs it for the forwards ``route.why_not`` accepts
(head_dim 128, bf16, sm_90). ``sass.check(head_dim, causal)`` compiles it for sm_90a without a GPU
and counts its SASS. ``flash_backward_hopper(do, q, k, v, o, residual, lse, causal, scale=None)``:
its backward, (dQ, dK, dV) (``hopper_backward.py``: after the Triton δ kernel, the kernel adding dQ
up by TMA reduce-adds, or the dK/dV kernel and the dQ kernel; ``route.why_not_backward`` says which
backwards ``flash_attention`` runs there); ``sass.check_backward(head_dim, causal)`` compiles and
counts it.

This package imports on any machine: ``available()`` says whether this triton has the Gluon
Hopper API the kernels use, ``unavailable_reason()`` why not; the kernel modules are imported
only when used.
"""
from stableflash.attention.gluon.support import available, unavailable_reason

__all__ = ["available", "flash_backward_hopper", "flash_forward_hopper", "unavailable_reason"]


def flash_forward_hopper(q, k, v, causal: bool = False, scale: float | None = None, *, tiles=None,
                         residual: bool = True):
    """(O, LSE, R) of the Gluon Hopper forward (``launch.flash_forward_hopper``; ``residual`` False: R
    empty); RuntimeError naming the reason where this triton lacks the Gluon Hopper API."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"flash_forward_hopper is not available: {reason}")
    from stableflash.attention.gluon.launch import flash_forward_hopper as forward
    with _device_of(q):
        return forward(q, k, v, causal, scale, tiles=tiles, residual=residual)


def flash_backward_hopper(do, q, k, v, o, residual, lse, causal: bool = False, scale: float | None = None, *,
                          tiles=None):
    """(dQ, dK, dV) of the Gluon Hopper backward (``launch_backward.flash_backward_hopper``);
    RuntimeError naming the reason where this triton lacks the Gluon Hopper API."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"flash_backward_hopper is not available: {reason}")
    from stableflash.attention.gluon.launch_backward import flash_backward_hopper as backward
    with _device_of(q):
        return backward(do, q, k, v, o, residual, lse, causal, scale, tiles=tiles)


def _device_of(t):
    """``torch.cuda.device(t.device)`` where ``t`` is on another CUDA device than the current one (Triton
    launches on the current device: ``launch_cache.elsewhere``), else a context that does nothing."""
    import contextlib

    import torch

    from stableflash.attention.triton.launch_cache import elsewhere
    return torch.cuda.device(t.device) if elsewhere(t) else contextlib.nullcontext()
