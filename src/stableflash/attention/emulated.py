"""Tiled FlashAttention-2 in PyTorch with every rounding point under a PrecisionPolicy.

This is the analysis instrument: Algorithms 1 (forward) and 2 (backward) of the paper's appendix,
written key block by key block as the fused kernels do, with the row-maximum rule from ``shift``
and each intermediate rounded where the policy says.

Each query row's arithmetic depends only on the key blocks, so the query rows are processed
together — vectorised over batch, heads and rows, one step per key block — and ``block_q`` only
bounds how many rows go at once (memory; ``None``: all), never the result (a test checks this bit
for bit). ``block_k`` changes where the running maximum and the accumulator are updated, and
therefore the rounding. Under a causal mask or a window a key block is applied only to the rows
that see at least one of its keys, as the kernels skip the tiles outside the band.

The masks, dropout and varlen batches follow ``stableflash.attention.masking``: an ``attn_mask``
is added to the (soft-capped) scores and rounded as they are, before the row-maximum rule; a row
that sees no key has O = 0 and L = −inf and passes no gradient; dropout keeps ℓ of the undropped
P̄ and drops P̄ in Ō, and the backward uses the same decisions (every δ source reads the dropped,
scaled P). A varlen batch is computed sequence by sequence (its cu_seqlens read on the host).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from stableflash.attention.policy import O16_SOURCES, PrecisionPolicy, resolve_delta
from stableflash.attention.masking import Masking, draw_seed, segments, visible
from stableflash.attention.reference import keep_mask, resolve_masking
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
    keep_scale: dropout's 1/(1 − p) (1 without dropout), which O = Ō/ℓ·keep_scale carries. A row
    that sees no key has O = 0, ℓ = 0, m = −inf and L = −inf.
    """

    out: torch.Tensor
    lse: torch.Tensor
    acc: torch.Tensor
    row_sum: torch.Tensor
    shift: torch.Tensor
    pbar_ones: torch.Tensor
    o16: torch.Tensor | None = None
    keep_scale: float = 1.0

    def computed_out(self) -> torch.Tensor:
        """O as computed, Ō/ℓ (and dropout's 1/(1 − p)) before the ``out`` rounding; 0 on a row
        that saw no key."""
        return _normalize(self.acc, self.row_sum, self.shift, self.keep_scale)


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
    size = max(n, 1) if size is None else size
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _key_steps(lo: int, hi: int, n_q: int, n_k: int, block_k: int,
               masking: Masking) -> Iterator[tuple[int, int, slice, bool]]:
    """For query rows [lo, hi): (first row, end row, key slice, needs_mask) per key block that
    some of them see. Row i sees keys i + offset − left … i + offset + right (``Masking.bounds``),
    so the rows that see block [j0, j1) are one range, and the positional mask is needed where one
    of them misses a key of the block. Key blocks start at multiples of ``block_k`` from key 0, and
    the blocks no row sees are skipped (causal: those above the diagonal; a window: those outside
    its band), as the kernels skip their tiles."""
    left, right = masking.bounds
    off = masking.offset(n_q, n_k)
    j_lo = 0 if left is None else max(0, lo + off - left)            # the keys rows [lo, hi) can see
    j_hi = n_k if right is None else min(n_k, hi - 1 + off + right + 1)
    for j0 in range((j_lo // block_k) * block_k, j_hi, block_k):
        j1 = min(j0 + block_k, n_k)
        first = lo if right is None else max(lo, j0 - off - right)
        stop = hi if left is None else min(hi, j1 - 1 - off + left + 1)
        if first >= stop:
            continue
        full = ((right is None or first + off + right >= j1 - 1) and
                (left is None or stop - 1 + off - left <= j0))
        yield first, stop, slice(j0, j1), not full


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


@dataclass
class _Masks:
    """The masks of one dense call (one batch, or one sequence of a varlen batch): the positional
    one (``hidden``: True where masked, (Nq, Nk)), an ``attn_mask`` expanded to (B, H, Nq, Nk)
    (boolean: True takes part; or additive), and dropout's keep decisions (B, H, Nq, Nk)."""

    masking: Masking
    hidden: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    keep_scale: float = 1.0

    def block(self, rows: slice, cols: slice, needs_mask: bool, dtype: torch.dtype):
        """(hidden entries or None, additive mask or None, keep decisions or None) of one block."""
        mask = self.hidden[rows, cols] if needs_mask else None
        add = None
        if self.attn_mask is not None:
            am = self.attn_mask[:, :, rows, cols]
            if am.dtype == torch.bool:
                mask = ~am if mask is None else mask | ~am
            else:
                add = am.to(dtype)
        keep = None if self.keep is None else self.keep[:, :, rows, cols]
        return mask, add, keep


def _masks(masking: Masking, attn_mask: torch.Tensor | None, dropout_p: float, seed: int | None,
           shape: tuple[int, int, int, int], device: torch.device, first_batch: int = 0) -> _Masks:
    B, H, n_q, n_k = shape
    hidden = ~visible(n_q, n_k, masking, device) if masking.masks_anything else None
    keep, keep_scale = None, 1.0
    if dropout_p > 0.0:
        keep = keep_mask(seed, dropout_p, B, H, n_q, n_k, device, first_batch)
        keep_scale = 1.0 / (1.0 - dropout_p)
    return _Masks(masking, hidden, attn_mask, keep, keep_scale)


def _block_scores(r: _Rounders, q_i: torch.Tensor, k_j: torch.Tensor, scale: float,
                  mask: torch.Tensor | None, softcap: float | None = None,
                  add: torch.Tensor | None = None) -> torch.Tensor:
    """S = QKᵀ·scale rounded per the policy's ``scores``; soft-capped (softcap·tanh(S/softcap),
    rounded again) when ``softcap`` is given; plus an additive mask ``add`` (rounded again); −inf
    where ``mask`` is True."""
    s = r.scores(torch.matmul(q_i, k_j.transpose(-1, -2)) * scale)
    if softcap is not None:
        s = r.scores(softcap * torch.tanh(s / softcap))
    if add is not None:
        s = r.scores(s + add)
    return s if mask is None else s.masked_fill(mask, -math.inf)


def _cap_slope(s: torch.Tensor, softcap: float | None) -> torch.Tensor | float:
    """d(softcap·tanh(x/softcap))/dx = 1 − (S/softcap)² at the capped scores S (0 where masked)."""
    if softcap is None:
        return 1.0
    return torch.where(torch.isfinite(s), 1 - (s / softcap) ** 2, 0.0)


def _normalize(acc: torch.Tensor, ell: torch.Tensor, m: torch.Tensor, keep_scale: float) -> torch.Tensor:
    """O = Ō / ℓ (times dropout's 1/(1 − p)); 0 on a row that saw no key (m = −inf)."""
    o = torch.where((m == -math.inf).unsqueeze(-1), 0.0, acc / ell.unsqueeze(-1))
    return o if keep_scale == 1.0 else o * keep_scale


def _segments(n_q: int, n_k: int, cu_seqlens_q: torch.Tensor | None,
              cu_seqlens_k: torch.Tensor | None) -> list[tuple[int, slice, slice]]:
    """(batch index for dropout, query rows, key rows) of each dense piece: the whole, or each
    sequence of a varlen batch (cu_seqlens read on the host)."""
    if cu_seqlens_q is None:
        return [(0, slice(0, n_q), slice(0, n_k))]
    return segments(cu_seqlens_q, cu_seqlens_k)


def emulated_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                     policy: PrecisionPolicy, rule: ShiftRule, block_q: int | None = None,
                     block_k: int = 64, softcap: float | None = None, masking: Masking | None = None,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
                     cu_seqlens_q: torch.Tensor | None = None,
                     cu_seqlens_k: torch.Tensor | None = None) -> ForwardResult:
    """Algorithm 1 (with Algorithm 3's rule when ``rule`` is stabilized), rounding per ``policy``;
    ``softcap``: scores soft-capped to softcap·tanh(S/softcap) before the softmax.

    ``masking`` (``causal`` joins it): the positional mask; ``attn_mask``: None, or a boolean
    (True takes part) or additive mask expanded to (B, H, Nq, Nk), added after the soft-cap and
    rounded as the scores are. Dropout (``dropout_p`` > 0, decisions from ``seed``): ℓ sums the
    undropped P̄, Ō the kept P̄ (rounded as ``p_bar`` says, then dropped), and O = Ō/ℓ·1/(1 − p).
    Varlen: q (1, H, total_q, d), k and v (1, H, total_k, d) and ``cu_seqlens_q``/``cu_seqlens_k``;
    each sequence is computed on its own, its key blocks counted from its first key."""
    B, H, n_q, d = q.shape
    masking = resolve_masking(causal, masking)
    policy = resolve_delta(policy)                       # δ source "consistent": the one consistent_delta_source names
    dtype, dev = policy.compute_dtype, q.device
    r = _Rounders(policy, H, dev)
    rule = rule.capped_for(policy.point("p_bar")[0].min_normal)   # tied entries' P̄ stays normal in P̄'s format
    q, k, v = (r.inputs(t.to(dtype)) for t in (q, k, v))
    v_bar = r.v_bar(v)                                   # V as P̄V reads it (fp8 in FP8 attention)
    parts = []
    for b, rows, cols in _segments(n_q, k.shape[2], cu_seqlens_q, cu_seqlens_k):
        qs, ks = q[:, :, rows], k[:, :, cols]
        masks = _masks(masking, attn_mask, dropout_p, seed, (B, H, qs.shape[2], ks.shape[2]), dev, b)
        parts.append(_forward_dense(r, qs, ks, v[:, :, cols], v_bar[:, :, cols], scale=scale, policy=policy,
                                    rule=rule, block_q=block_q, block_k=block_k, softcap=softcap, masks=masks))
    if len(parts) == 1:
        return parts[0]
    cat = {f: None if getattr(parts[0], f) is None else torch.cat([getattr(x, f) for x in parts], dim=2)
           for f in ("out", "lse", "acc", "row_sum", "shift", "pbar_ones", "o16")}
    return ForwardResult(**cat, keep_scale=parts[0].keep_scale)


def _forward_dense(r: _Rounders, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, v_bar: torch.Tensor, *,
                   scale: float, policy: PrecisionPolicy, rule: ShiftRule, block_q: int | None, block_k: int,
                   softcap: float | None, masks: _Masks) -> ForwardResult:
    """The forward of one dense piece; q, k, v rounded and in the compute dtype."""
    B, H, n_q, d = q.shape
    n_k = k.shape[2]
    dtype, dev = policy.compute_dtype, q.device
    out = torch.empty(B, H, n_q, d, dtype=dtype, device=dev)
    acc_all = torch.empty_like(out)
    lse, row_sum, shift = (torch.empty(B, H, n_q, dtype=dtype, device=dev) for _ in range(3))
    ones = torch.zeros(B, H, n_q, dtype=torch.int64, device=dev)
    o16 = torch.empty_like(out) if policy.delta in O16_SOURCES else None
    may_be_empty = masks.attn_mask is not None          # a row of a block may see none of its keys

    for c0, c1 in _chunks(n_q, block_q):                 # line 5: initialise O, ℓ, m for these rows
        n = c1 - c0
        acc = torch.zeros(B, H, n, d, dtype=dtype, device=dev)
        ell = torch.zeros(B, H, n, dtype=dtype, device=dev)
        if o16 is not None:                              # δ sources dO·O16 and dO·(O16+R) only
            acc16, ell16 = acc.clone(), ell.clone()
        m = torch.full((B, H, n), -math.inf, dtype=dtype, device=dev)
        rmax = m.clone()
        for first, stop, cols, needs_mask in _key_steps(c0, c1, n_q, n_k, block_k, masks.masking):
            a, e = first - c0, stop - c0                  # rows [first, stop) see this key block
            mask, add, keep = masks.block(slice(first, stop), cols, needs_mask, dtype)
            m_a = m[:, :, a:e]
            s = _block_scores(r, q[:, :, first:stop], k[:, :, cols], scale, mask, softcap, add)
            m_new, rmax[:, :, a:e] = next_shift(s, m_a, rmax[:, :, a:e], rule)   # row max (or the stabilized shift)
            if r.rounds_shift:
                m_new = bound_rounded_shift(r.shift(m_new), m_a, rmax[:, :, a:e], rule, r.shift_limit)
            m_use = torch.where(m_new == -math.inf, 0.0, m_new) if may_be_empty else m_new   # no key yet: P̄ = 0
            p = torch.exp(r.scores(s - m_use.unsqueeze(-1)))  # P̄ = exp(S − m)
            alpha = torch.exp(m_a - m_use)                    # rescale what came before
            ell[:, :, a:e] = r.row_sum(alpha * ell[:, :, a:e] + p.sum(dim=-1))
            p_low = r.p_bar(p)
            at_one = p_low == 1
            if keep is not None:                              # dropout: the dropped P̄ leave Ō, not ℓ
                p_low, at_one = p_low * keep, at_one & keep
            kept = torch.where(m_new > m_a, 0, ones[:, :, first:stop])   # earlier ones were rescaled by alpha < 1
            ones[:, :, first:stop] = kept + at_one.sum(dim=-1)
            acc[:, :, a:e] = r.acc(alpha.unsqueeze(-1) * acc[:, :, a:e] + torch.matmul(p_low, v_bar[:, :, cols]))
            if o16 is not None:
                ell16[:, :, a:e] = alpha * ell16[:, :, a:e] + p.sum(dim=-1)
                p16 = r.inputs(p) if keep is None else r.inputs(p) * keep
                acc16[:, :, a:e] = alpha.unsqueeze(-1) * acc16[:, :, a:e] + torch.matmul(p16, v[:, :, cols])
            m[:, :, a:e] = m_new
        out[:, :, c0:c1] = r.out(_normalize(acc, ell, m, masks.keep_scale))
        if o16 is not None:
            o16[:, :, c0:c1] = _normalize(acc16, ell16, m, masks.keep_scale)
        lse[:, :, c0:c1] = m + torch.log(ell)
        acc_all[:, :, c0:c1], row_sum[:, :, c0:c1], shift[:, :, c0:c1] = acc, ell, m
    return ForwardResult(out, lse, acc_all, row_sum, shift, ones, o16, masks.keep_scale)


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """P = exp(S − L) of a block; 0 where S is masked (also on a row that sees no key, L = −inf)."""
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.where(s == -math.inf, 0.0, p)


def emulated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, *, causal: bool, scale: float, policy: PrecisionPolicy,
                   block_q: int | None = None, block_k: int = 64, softcap: float | None = None,
                   masks: _Masks | None = None) -> torch.Tensor:
    """δ per the policy's source; q, k, v, do already rounded and in the compute dtype (one dense
    piece; ``masks``: its masks, else ``causal``'s). Under dropout every source reads the dropped,
    scaled P: δ = rowsum(dO ∘ O) of the O the forward returned."""
    if policy.delta in ("dO·O", "dO·O32", "dO·(O+R)", "dO·O16", "dO·(O16+R)"):   # ``out``: the O δ reads
        return (do * out).sum(dim=-1)
    if masks is None:
        masks = _masks(Masking(causal=causal), None, 0.0, None, tuple(q.shape[:3]) + (k.shape[2],), q.device)
    r = _Rounders(policy, q.shape[1], q.device)
    n_q, n_k = q.shape[2], k.shape[2]
    acc = torch.zeros_like(out) if policy.delta == "recompute_fp32" else torch.zeros_like(lse)
    for c0, c1 in _chunks(n_q, block_q):
        for first, stop, cols, needs_mask in _key_steps(c0, c1, n_q, n_k, block_k, masks.masking):
            rows = slice(first, stop)
            mask, add, keep = masks.block(rows, cols, needs_mask, q.dtype)
            p = _probabilities(_block_scores(r, q[:, :, rows], k[:, :, cols], scale, mask, softcap, add),
                               lse[:, :, rows])
            if keep is not None:
                p = p * keep * masks.keep_scale
            if policy.delta == "dP·P":
                dp = torch.matmul(do[:, :, rows], v[:, :, cols].transpose(-1, -2))
                acc[:, :, rows] += (p * dp).sum(dim=-1)
            else:                                         # O = PV again, unrounded
                acc[:, :, rows] += torch.matmul(p, v[:, :, cols])
    return acc if policy.delta == "dP·P" else (do * acc).sum(dim=-1)


def emulated_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      do: torch.Tensor, *, causal: bool, scale: float, policy: PrecisionPolicy,
                      block_q: int | None = None, block_k: int = 64,
                      softcap: float | None = None, masking: Masking | None = None,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
                      cu_seqlens_q: torch.Tensor | None = None,
                      cu_seqlens_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Algorithm 2: (dQ, dK, dV) in the compute dtype. ``out`` and ``lse`` come from the forward;
    with ``softcap`` dS carries the cap's slope 1 − tanh² before it is rounded. The masks, dropout
    (the same seed) and varlen arguments are the forward's: dV = (P∘Z)ᵀdO/(1 − p), dP = dO·Vᵀ∘Z/(1 − p)
    with Z the keep decisions, dS = P∘(dP − δ)."""
    dtype = policy.compute_dtype
    masking = resolve_masking(causal, masking)
    r = _Rounders(policy, q.shape[1], q.device)
    q, k, v, do = (r.inputs(t.to(dtype)) for t in (q, k, v, do))
    B, H, n_q, _ = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b, rows, cols in _segments(n_q, k.shape[2], cu_seqlens_q, cu_seqlens_k):
        qs, ks, vs, dos = q[:, :, rows], k[:, :, cols], v[:, :, cols], do[:, :, rows]
        masks = _masks(masking, attn_mask, dropout_p, seed, (B, H, qs.shape[2], ks.shape[2]), q.device, b)
        dq[:, :, rows], dk[:, :, cols], dv[:, :, cols] = _backward_dense(
            r, qs, ks, vs, out[:, :, rows], lse[:, :, rows], dos, scale=scale, policy=policy, block_q=block_q,
            block_k=block_k, softcap=softcap, masks=masks)
    return dq, dk, dv


def _backward_dense(r: _Rounders, q, k, v, out, lse, do, *, scale, policy, block_q, block_k, softcap,
                    masks: _Masks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    delta = emulated_delta(q, k, v, out, lse, do, causal=False, scale=scale, policy=policy,
                           block_q=block_q, block_k=block_k, softcap=softcap, masks=masks)
    n_q, n_k = q.shape[2], k.shape[2]
    dropout = masks.keep is not None
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for c0, c1 in _chunks(n_q, block_q):
        for first, stop, cols, needs_mask in _key_steps(c0, c1, n_q, n_k, block_k, masks.masking):
            rows = slice(first, stop)
            mask, add, keep = masks.block(rows, cols, needs_mask, q.dtype)
            q_i, k_j, v_j, do_i = q[:, :, rows], k[:, :, cols], v[:, :, cols], do[:, :, rows]
            s = _block_scores(r, q_i, k_j, scale, mask, softcap, add)
            p = _probabilities(s, lse[:, :, rows])
            dp = torch.matmul(do_i, v_j.transpose(-1, -2))
            if dropout:
                dv[:, :, cols] += torch.matmul(r.bwd(p * keep).transpose(-1, -2), do_i) * masks.keep_scale
                dp = dp * keep * masks.keep_scale
            else:
                dv[:, :, cols] += torch.matmul(r.bwd(p).transpose(-1, -2), do_i)
            ds = r.bwd(p * (dp - delta[:, :, rows].unsqueeze(-1)) * _cap_slope(s, softcap))
            dq[:, :, rows] += torch.matmul(ds, k_j) * scale
            dk[:, :, cols] += torch.matmul(ds.transpose(-1, -2), q_i) * scale
    return dq, dk, dv


class EmulatedAttention(torch.autograd.Function):
    """Autograd wrapper: forward and backward both emulated under the same policy. Returns
    (O, LSE), the log-sum-exp in fp32 without gradient."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, policy, rule, block_q, block_k, softcap=None, masking=None,
                attn_mask=None, dropout_p=0.0, seed=None, cu_seqlens_q=None, cu_seqlens_k=None):
        policy = resolve_delta(policy)
        extra = dict(masking=masking, attn_mask=attn_mask, dropout_p=dropout_p, seed=seed,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        with torch.autocast(q.device.type, enabled=False):
            res = emulated_forward(q, k, v, causal=causal, scale=scale, policy=policy, rule=rule,
                                   block_q=block_q, block_k=block_k, softcap=softcap, **extra)
        # δ from dO·O32 reads O as computed (Ō/ℓ before the ``out`` rounding), in the compute dtype;
        # from dO·(O+R) the stored O plus its residual; from dO·O16 the O of a 16-bit P̄V beside it,
        # from dO·(O16+R) the stored O plus the residual that takes it to that O
        if policy.delta == "dO·O32":
            o_for_delta = res.computed_out()
        elif policy.delta in ("dO·(O+R)", "dO·(O16+R)"):    # O as the model gets it + a residual in q's dtype
            stored = res.out.to(q.dtype).to(res.out.dtype)
            target = res.o16 if policy.delta == "dO·(O16+R)" else res.computed_out()
            o_for_delta = stored + round_to(target - stored, q.dtype)
        elif policy.delta == "dO·O16":
            o_for_delta = res.o16
        else:
            o_for_delta = res.out
        ctx.save_for_backward(q, k, v, o_for_delta, res.lse, attn_mask, cu_seqlens_q, cu_seqlens_k)
        ctx.args = (causal, scale, policy, block_q, block_k, softcap, masking, dropout_p, seed)
        lse = res.lse.float()
        ctx.mark_non_differentiable(lse)
        return res.out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        causal, scale, policy, block_q, block_k, softcap, masking, dropout_p, seed = ctx.args
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = emulated_backward(q, k, v, out, lse, do, causal=causal, scale=scale,
                                           policy=policy, block_q=block_q, block_k=block_k, softcap=softcap,
                                           masking=masking, attn_mask=attn_mask, dropout_p=dropout_p, seed=seed,
                                           cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 13


def emulated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                       policy: PrecisionPolicy, rule: ShiftRule, block_q: int | None = None,
                       block_k: int = 64, softcap: float | None = None, masking: Masking | None = None,
                       attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
                       cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                       return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The emulated backend (inputs already validated by ``api.flash_attention``): O [, LSE].
    Dropout without a ``seed`` draws one (``masking.draw_seed``), kept for the backward."""
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed()
    o, lse = EmulatedAttention.apply(q, k, v, causal, scale, policy, rule, block_q, block_k, softcap, masking,
                                     attn_mask, dropout_p, seed, cu_seqlens_q, cu_seqlens_k)
    return (o, lse) if return_lse else o
