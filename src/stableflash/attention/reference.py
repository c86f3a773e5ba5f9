"""Exact attention in float64: the high-precision ("hp") oracle every other backend is measured by.

Shapes follow torch's scaled_dot_product_attention: q (B, H, Nq, d), k and v (B, H, Nk, d).
``causal`` masks key j for query i when j > i (top-left aligned, as SDPA's ``is_causal``);
``masking`` (``stableflash.attention.masking.Masking``) chooses the alignment and a sliding window
instead. The scores follow the shared definition (``masking``'s module docstring): S = QKᵀ·scale,
soft-capped if asked, plus an additive ``attn_mask`` (a boolean one: True takes part, as SDPA's),
then the positional mask. A query that sees no key has output 0, log-sum-exp −inf and no gradient.
Dropout drops P's entries by ``masking.dropout_keep`` (or a keep mask given) and scales the kept
ones by 1/(1 − p); the log-sum-exp is that of the undropped P.
"""
from __future__ import annotations

import math

import torch

from stableflash.attention.masking import Masking, draw_seed, dropout_keep, segments, visible
from stableflash.attention.shift import ShiftRule, row_shift


def causal_mask(n_q: int, n_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean (n_q, n_k) mask, True where key j is hidden from query i (j > i)."""
    i = torch.arange(n_q, device=device).unsqueeze(1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    return j > i


def resolve_masking(causal: bool, masking: Masking | None) -> Masking:
    """The positional mask of ``causal`` and ``masking`` together (causal top-left without one)."""
    if masking is None:
        return Masking(causal=causal)
    return masking._replace(causal=True) if causal and not masking.causal else masking


def scores(q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float | None = None,
           softcap: float | None = None, masking: Masking | None = None,
           attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """S = QKᵀ·scale in float64 (soft-capped to softcap·tanh(S/softcap) when given, plus an
    additive ``attn_mask``, or −inf where a boolean one is False), −inf where masked."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    m = resolve_masking(causal, masking)
    if m.masks_anything:
        s = s.masked_fill(~visible(s.shape[-2], s.shape[-1], m, s.device), -math.inf)
    return s


def keep_mask(seed: int, p: float, batch: int, heads: int, n_q: int, n_k: int,
              device: torch.device | str = "cpu", first_batch: int = 0) -> torch.Tensor:
    """Dropout's keep decisions (batch, heads, n_q, n_k) for batch elements (or varlen sequences)
    numbered from ``first_batch``."""
    bh = (torch.arange(first_batch, first_batch + batch, device=device).view(batch, 1) * heads
          + torch.arange(heads, device=device).view(1, heads))
    return dropout_keep(seed, p, bh, n_q, n_k)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, rule: ShiftRule | None = None,
              softcap: float | None = None, masking: Masking | None = None,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
              keep: torch.Tensor | None = None, first_batch: int = 0,
              return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(S − m)·V in float64, differentiable, with m chosen by ``rule`` (standard if None).

    In real arithmetic the result does not depend on the rule; computing it with each rule in
    float64 is how the tests show that the stabilized rules are exact.

    Dropout (``dropout_p`` > 0): the entries ``keep`` is False at are dropped, the others scaled by
    1/(1 − dropout_p); without ``keep`` the decisions are ``masking.dropout_keep``'s for ``seed``
    (drawn by ``draw_seed`` when None), batch element b counted as ``first_batch`` + b.
    ``return_lse``: also the log-sum-exp of the scores per row (B, H, Nq), float64, no gradient.
    """
    s = scores(q, k, causal=causal, scale=scale, softcap=softcap, masking=masking, attn_mask=attn_mask)
    m = row_shift(s.detach(), rule or ShiftRule("standard"))
    m = torch.where(m == -math.inf, 0.0, m).unsqueeze(-1)         # a row that sees no key: P̄ = 0
    p_bar = torch.exp(s - m)
    ell = p_bar.sum(dim=-1, keepdim=True)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} is invalid; accepted: 0 <= dropout_p < 1")
    if keep is not None and dropout_p == 0.0:
        raise ValueError("keep was given with dropout_p=0; accepted: a keep mask together with dropout_p > 0")
    if dropout_p > 0.0:
        if keep is None:
            B, H, n_q, n_k = s.shape
            keep = keep_mask(draw_seed() if seed is None else seed, dropout_p, B, H, n_q, n_k, s.device,
                             first_batch)
        pv = torch.matmul(p_bar * keep, v.double()) / (1.0 - dropout_p)
    else:
        pv = torch.matmul(p_bar, v.double())
    o = pv / torch.where(ell > 0, ell, 1.0)
    if not return_lse:
        return o
    lse = torch.where(ell > 0, m + torch.log(ell), -math.inf).squeeze(-1).detach()
    return o, lse


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, *, dropout_p: float = 0.0, seed: int | None = None,
                     return_lse: bool = False, **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``attention`` of each packed sequence: q (H, total_q, d) or (1, H, total_q, d), k and v
    likewise over total_k, sequence s being rows cu_seqlens_q[s]:cu_seqlens_q[s + 1] of q and
    cu_seqlens_k[s]:cu_seqlens_k[s + 1] of k and v (positions counted from its start; dropout's
    batch index is s). Returns O in q's layout [and lse (…, H, total_q)]. ``kwargs``: attention's."""
    squeeze = q.dim() == 3
    q4, k4, v4 = (t.unsqueeze(0) if squeeze else t for t in (q, k, v))
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed()
    outs, lses = [], []
    for s, rows, cols in segments(cu_seqlens_q, cu_seqlens_k):
        o, lse = attention(q4[:, :, rows], k4[:, :, cols], v4[:, :, cols], dropout_p=dropout_p, seed=seed,
                           first_batch=s, return_lse=True, **kwargs)
        outs.append(o)
        lses.append(lse)
    o, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    if squeeze:
        o, lse = o.squeeze(0), lse.squeeze(0)
    return (o, lse) if return_lse else o


def unnormalized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shift: torch.Tensor, *,
                 causal: bool = False, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Ō, ℓ) = (exp(S − m)·V, rowsum(exp(S − m))) in float64 for a given shift m of shape (..., Nq).

    A low-precision kernel's Ō is compared against this with the same m it used.
    """
    s = scores(q, k, causal=causal, scale=scale)
    p_bar = torch.exp(s - shift.double().unsqueeze(-1))
    return torch.matmul(p_bar, v.double()), p_bar.sum(dim=-1)


def delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """δ = rowsum(dO ∘ O) in float64, shape (..., Nq)."""
    return (do.double() * o.double()).sum(dim=-1)


def forward_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                     causal: bool = False, scale: float | None = None, **kwargs) -> tuple[torch.Tensor, ...]:
    """(O, dQ, dK, dV) in float64, gradients by autograd of ``attention`` (``kwargs``: its other
    options: masking, attn_mask, softcap, dropout_p with seed or keep)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o = attention(q64, k64, v64, causal=causal, scale=scale, **kwargs)
    dq, dk, dv = torch.autograd.grad(o, (q64, k64, v64), do.double())
    return o.detach(), dq, dk, dv
