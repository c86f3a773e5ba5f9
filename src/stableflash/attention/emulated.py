"""Tiled FlashAttention-2 in PyTorch with every rounding point under a PrecisionPolicy.

This is the analysis instrument: Algorithms 1 (forward) and 2 (backward) of the paper's appendix,
written key block by key block as the fused kernels do, with the row-maximum rule from ``shift``
and each intermediate rounded where the policy says.

Each query row's arithmetic depends only on the key blocks, so the query rows are processed
together — vectorised over batch, heads and rows, one step per key block — and ``block_q`` only
bounds how many rows go at once (memory; ``None``: all), never the result (a test checks this bit
for bit). ``block_k`` changes where the running maximum and the accumulator are updated, and
therefore the rounding. Under a causal mask a key block is applied only to the rows that see at
least one of its keys, as the kernels skip the tiles above the diagonal.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from stableflash.attention.policy import O16_SOURCES, PrecisionPolicy, resolve_delta
from stableflash.attention.reference import causal_mask
from stableflash.attention.shift import ShiftRule, bound_rounded_shift, next_shift
from stableflash.numerics import round_to, ulp

Rounder = Callable[[torch.Tensor], torch.Tensor]
HP_POINTS = ("p_bar", "v_bar", "acc", "row_sum", "out")


@dataclass
class ForwardResult:
    """Everything the forward pass produced, in the compute dtype.

    out: O as stored (rounded to policy.out), (B, H, Nq, d); lse: L = m + log ℓ, (B, H, Nq);
    acc: the final unnormalised Ō, (B, H, Nq, d); row_sum: the final ℓ; shift: the final m;
    pbar_ones: per row, how many P̄ = 1 terms (after rounding to policy.p_bar) enter the final Ō
    with weight exactly 1, i.e. were not rescaled by a later increase of m. Several such terms
    are what the paper's rounding bias needs. o16 (δ sources "dO·O16", "dO·(O16+R)", else None): O as a
    16-bit kernel computes it beside the policy's — P̄ rounded as the inputs are, Ō, ℓ, O unrounded.
    """

    out: torch.Tensor
    lse: torch.Tensor
    acc: torch.Tensor
    row_sum: torch.Tensor
    shift: torch.Tensor
    pbar_ones: torch.Tensor
    o16: torch.Tensor | None = None


def _rounder(policy: PrecisionPolicy, field: str, n_heads: int, device: torch.device) -> Rounder:
    """The rounding function of one policy field; identity where it equals the compute format."""
    fmt, mode = policy.point(field)
    if fmt.name == policy.compute:
        return lambda x: x
    hp = [h for h in policy.hp_heads if h < n_heads] if field in HP_POINTS else []
    if not hp:
        return lambda x: round_to(x, fmt, mode)
    keep = torch.zeros(n_heads, dtype=torch.bool, device=device)
    keep[hp] = True

    def round_except_hp_heads(x: torch.Tensor) -> torch.Tensor:
        mask = keep.view(1, n_heads, *([1] * (x.dim() - 2)))
        return torch.where(mask, x, round_to(x, fmt, mode))

    return round_except_hp_heads


def _chunks(n: int, size: int | None) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of at most ``size`` (None: everything) covering range(n)."""
    size = n if size is None else size
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _key_steps(lo: int, hi: int, n_k: int, block_k: int, causal: bool) -> Iterator[tuple[int, slice, bool]]:
    """For query rows [lo, hi): (first row that sees the block, key slice, needs_mask) per key block
    that some of them see. Causal (top-left aligned) row i sees keys 0..i, so the rows that see
    block [j0, j1) are [max(lo, j0), hi), and the mask is needed while j1 − 1 exceeds that start."""
    for j0 in range(0, n_k, block_k):
        j1 = min(j0 + block_k, n_k)
        first = max(lo, j0) if causal else lo
        if first >= hi:
            return
        yield first, slice(j0, j1), causal and j1 - 1 > first


class _Rounders:
    def __init__(self, policy: PrecisionPolicy, n_heads: int, device: torch.device):
        for field in ("inputs", "scores", "p_bar", "v_bar", "acc", "row_sum", "out", "bwd"):
            setattr(self, field, _rounder(policy, field, n_heads, device))
        if not policy.narrows_v:
            self.v_bar = lambda x: x                     # v_bar only narrows V below the inputs' format
        fmt, _ = policy.point("scores")
        self.rounds_shift = fmt.name != policy.compute
        self.shift_limit = -math.log(policy.point("p_bar")[0].min_normal)   # P̄ of the row max stays normal
        self.shift = (lambda m: _round_up(m, fmt)) if self.rounds_shift else (lambda m: m)


def _round_up(m: torch.Tensor, fmt) -> torch.Tensor:
    """m rounded toward +inf into ``fmt``: a kernel that keeps scores in fmt keeps m there too,
    and rounding up keeps every entry of a stabilized row below its shift."""
    down = round_to(m, fmt, "rtz")
    return torch.where(down < m, down + ulp(down, fmt).to(m.dtype), down)


def _block_scores(r: _Rounders, q_i: torch.Tensor, k_j: torch.Tensor, scale: float,
                  mask: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """S = QKᵀ·scale rounded per the policy's ``scores``; soft-capped (softcap·tanh(S/softcap),
    rounded again) when ``softcap`` is given; −inf where masked."""
    s = r.scores(torch.matmul(q_i, k_j.transpose(-1, -2)) * scale)
    if softcap is not None:
        s = r.scores(softcap * torch.tanh(s / softcap))
    return s if mask is None else s.masked_fill(mask, -math.inf)


def _cap_slope(s: torch.Tensor, softcap: float | None) -> torch.Tensor | float:
    """d(softcap·tanh(x/softcap))/dx = 1 − (S/softcap)² at the capped scores S (0 where masked)."""
    if softcap is None:
        return 1.0
    return torch.where(torch.isfinite(s), 1 - (s / softcap) ** 2, 0.0)


def emulated_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                     policy: PrecisionPolicy, rule: ShiftRule, block_q: int | None = None,
                     block_k: int = 64, softcap: float | None = None) -> ForwardResult:
    """Algorithm 1 (with Algorithm 3's rule when ``rule`` is stabilized), rounding per ``policy``;
    ``softcap``: scores soft-capped to softcap·tanh(S/softcap) before the softmax."""
    B, H, n_q, d = q.shape
    n_k = k.shape[2]
    policy = resolve_delta(policy)                       # δ source "consistent": the one consistent_delta_source names
    dtype, dev = policy.compute_dtype, q.device
    r = _Rounders(policy, H, dev)
    rule = rule.capped_for(policy.point("p_bar")[0].min_normal)   # tied entries' P̄ stays normal in P̄'s format
    q, k, v = (r.inputs(t.to(dtype)) for t in (q, k, v))
    v_bar = r.v_bar(v)                                   # V as P̄V reads it (fp8 in FP8 attention)
    full_mask = causal_mask(n_q, n_k, dev) if causal else None

    out = torch.empty(B, H, n_q, d, dtype=dtype, device=dev)
    acc_all = torch.empty_like(out)
    lse, row_sum, shift = (torch.empty(B, H, n_q, dtype=dtype, device=dev) for _ in range(3))
    ones = torch.zeros(B, H, n_q, dtype=torch.int64, device=dev)
    o16 = torch.empty_like(out) if policy.delta in O16_SOURCES else None

    for c0, c1 in _chunks(n_q, block_q):                 # line 5: initialise O, ℓ, m for these rows
        n = c1 - c0
        acc = torch.zeros(B, H, n, d, dtype=dtype, device=dev)
        ell = torch.zeros(B, H, n, dtype=dtype, device=dev)
        if o16 is not None:                              # δ sources dO·O16 and dO·(O16+R) only
            acc16, ell16 = acc.clone(), ell.clone()
        m = torch.full((B, H, n), -math.inf, dtype=dtype, device=dev)
        rmax = m.clone()
        for first, cols, needs_mask in _key_steps(c0, c1, n_k, block_k, causal):
            a = first - c0                                # rows [first, c1) see this key block
            mask = full_mask[first:c1, cols] if needs_mask else None
            m_a = m[:, :, a:]
            s = _block_scores(r, q[:, :, first:c1], k[:, :, cols], scale, mask, softcap)
            m_new, rmax[:, :, a:] = next_shift(s, m_a, rmax[:, :, a:], rule)   # row max (or the stabilized shift)
            if r.rounds_shift:
                m_new = bound_rounded_shift(r.shift(m_new), m_a, rmax[:, :, a:], rule, r.shift_limit)
            p = torch.exp(r.scores(s - m_new.unsqueeze(-1)))  # P̄ = exp(S − m)
            alpha = torch.exp(m_a - m_new)                    # rescale what came before
            ell[:, :, a:] = r.row_sum(alpha * ell[:, :, a:] + p.sum(dim=-1))
            p_low = r.p_bar(p)
            kept = torch.where(m_new > m_a, 0, ones[:, :, first:c1])   # earlier ones were rescaled by alpha < 1
            ones[:, :, first:c1] = kept + (p_low == 1).sum(dim=-1)
            acc[:, :, a:] = r.acc(alpha.unsqueeze(-1) * acc[:, :, a:] + torch.matmul(p_low, v_bar[:, :, cols]))
            if o16 is not None:
                ell16[:, :, a:] = alpha * ell16[:, :, a:] + p.sum(dim=-1)
                acc16[:, :, a:] = alpha.unsqueeze(-1) * acc16[:, :, a:] + torch.matmul(r.inputs(p), v[:, :, cols])
            m[:, :, a:] = m_new
        out[:, :, c0:c1] = r.out(acc / ell.unsqueeze(-1))
        if o16 is not None:
            o16[:, :, c0:c1] = acc16 / ell16.unsqueeze(-1)
        lse[:, :, c0:c1] = m + torch.log(ell)
        acc_all[:, :, c0:c1], row_sum[:, :, c0:c1], shift[:, :, c0:c1] = acc, ell, m
    return ForwardResult(out, lse, acc_all, row_sum, shift, ones, o16)


def emulated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, *, causal: bool, scale: float, policy: PrecisionPolicy,
                   block_q: int | None = None, block_k: int = 64, softcap: float | None = None) -> torch.Tensor:
    """δ per the policy's source; q, k, v, do already rounded and in the compute dtype."""
    if policy.delta in ("dO·O", "dO·O32", "dO·(O+R)", "dO·O16", "dO·(O16+R)"):   # ``out``: the O δ reads
        return (do * out).sum(dim=-1)
    r = _Rounders(policy, q.shape[1], q.device)
    full_mask = causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
    acc = torch.zeros_like(out) if policy.delta == "recompute_fp32" else torch.zeros_like(lse)
    for c0, c1 in _chunks(q.shape[2], block_q):
        for first, cols, needs_mask in _key_steps(c0, c1, k.shape[2], block_k, causal):
            rows = slice(first, c1)
            mask = full_mask[rows, cols] if needs_mask else None
            p = torch.exp(_block_scores(r, q[:, :, rows], k[:, :, cols], scale, mask, softcap)
                          - lse[:, :, rows].unsqueeze(-1))
            if policy.delta == "dP·P":
                dp = torch.matmul(do[:, :, rows], v[:, :, cols].transpose(-1, -2))
                acc[:, :, rows] += (p * dp).sum(dim=-1)
            else:                                         # O = PV again, unrounded
                acc[:, :, rows] += torch.matmul(p, v[:, :, cols])
    return acc if policy.delta == "dP·P" else (do * acc).sum(dim=-1)


def emulated_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      do: torch.Tensor, *, causal: bool, scale: float, policy: PrecisionPolicy,
                      block_q: int | None = None, block_k: int = 64,
                      softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Algorithm 2: (dQ, dK, dV) in the compute dtype. ``out`` and ``lse`` come from the forward;
    with ``softcap`` dS carries the cap's slope 1 − tanh² before it is rounded."""
    dtype = policy.compute_dtype
    r = _Rounders(policy, q.shape[1], q.device)
    q, k, v, do = (r.inputs(t.to(dtype)) for t in (q, k, v, do))
    delta = emulated_delta(q, k, v, out, lse, do, causal=causal, scale=scale, policy=policy,
                           block_q=block_q, block_k=block_k, softcap=softcap)
    full_mask = causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for c0, c1 in _chunks(q.shape[2], block_q):
        for first, cols, needs_mask in _key_steps(c0, c1, k.shape[2], block_k, causal):
            rows = slice(first, c1)
            mask = full_mask[rows, cols] if needs_mask else None
            q_i, k_j, v_j, do_i = q[:, :, rows], k[:, :, cols], v[:, :, cols], do[:, :, rows]
            s = _block_scores(r, q_i, k_j, scale, mask, softcap)
            p = torch.exp(s - lse[:, :, rows].unsqueeze(-1))
            dv[:, :, cols] += torch.matmul(r.bwd(p).transpose(-1, -2), do_i)
            dp = torch.matmul(do_i, v_j.transpose(-1, -2))
            ds = r.bwd(p * (dp - delta[:, :, rows].unsqueeze(-1)) * _cap_slope(s, softcap))
            dq[:, :, rows] += torch.matmul(ds, k_j) * scale
            dk[:, :, cols] += torch.matmul(ds.transpose(-1, -2), q_i) * scale
    return dq, dk, dv


class EmulatedAttention(torch.autograd.Function):
    """Autograd wrapper: forward and backward both emulated under the same policy."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, policy, rule, block_q, block_k, softcap=None):
        policy = resolve_delta(policy)
        with torch.autocast(q.device.type, enabled=False):
            res = emulated_forward(q, k, v, causal=causal, scale=scale, policy=policy, rule=rule,
                                   block_q=block_q, block_k=block_k, softcap=softcap)
        # δ from dO·O32 reads O as computed (Ō/ℓ before the ``out`` rounding), in the compute dtype;
        # from dO·(O+R) the stored O plus its residual; from dO·O16 the O of a 16-bit P̄V beside it,
        # from dO·(O16+R) the stored O plus the residual that takes it to that O
        if policy.delta == "dO·O32":
            o_for_delta = res.acc / res.row_sum.unsqueeze(-1)
        elif policy.delta in ("dO·(O+R)", "dO·(O16+R)"):    # O as the model gets it + a residual in q's dtype
            stored = res.out.to(q.dtype).to(res.out.dtype)
            target = res.o16 if policy.delta == "dO·(O16+R)" else res.acc / res.row_sum.unsqueeze(-1)
            o_for_delta = stored + round_to(target - stored, q.dtype)
        elif policy.delta == "dO·O16":
            o_for_delta = res.o16
        else:
            o_for_delta = res.out
        ctx.save_for_backward(q, k, v, o_for_delta, res.lse)
        ctx.args = (causal, scale, policy, block_q, block_k, softcap)
        return res.out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, policy, block_q, block_k, softcap = ctx.args
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = emulated_backward(q, k, v, out, lse, do, causal=causal, scale=scale,
                                           policy=policy, block_q=block_q, block_k=block_k, softcap=softcap)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def emulated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                       policy: PrecisionPolicy, rule: ShiftRule, block_q: int | None = None,
                       block_k: int = 64, softcap: float | None = None) -> torch.Tensor:
    """The emulated backend (inputs already validated by ``api.flash_attention``)."""
    return EmulatedAttention.apply(q, k, v, causal, scale, policy, rule, block_q, block_k, softcap)
