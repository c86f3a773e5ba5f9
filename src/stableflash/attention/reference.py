"""Exact attention in float64: the high-precision ("hp") oracle every other backend is measured by.

Shapes follow torch's scaled_dot_product_attention: q (B, H, Nq, d), k and v (B, H, Nk, d).
``causal`` masks key j for query i when j > i (top-left aligned, as SDPA's ``is_causal``).
"""
from __future__ import annotations

import math

import torch

from stableflash.attention.shift import ShiftRule, row_shift


def causal_mask(n_q: int, n_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean (n_q, n_k) mask, True where key j is hidden from query i (j > i)."""
    i = torch.arange(n_q, device=device).unsqueeze(1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    return j > i


def scores(q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """S = QKᵀ·scale in float64 (soft-capped to softcap·tanh(S/softcap) when given), −inf where masked."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(causal_mask(s.shape[-2], s.shape[-1], s.device), -math.inf)
    return s


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              scale: float | None = None, rule: ShiftRule | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """softmax(S − m)·V in float64, differentiable, with m chosen by ``rule`` (standard if None).

    In real arithmetic the result does not depend on the rule; computing it with each rule in
    float64 is how the tests show that the stabilized rules are exact.
    """
    s = scores(q, k, causal=causal, scale=scale, softcap=softcap)
    m = row_shift(s.detach(), rule or ShiftRule("standard")).unsqueeze(-1)
    p_bar = torch.exp(s - m)
    return torch.matmul(p_bar, v.double()) / p_bar.sum(dim=-1, keepdim=True)


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
                     causal: bool = False, scale: float | None = None) -> tuple[torch.Tensor, ...]:
    """(O, dQ, dK, dV) in float64, gradients by autograd of ``attention``."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o = attention(q64, k64, v64, causal=causal, scale=scale)
    dq, dk, dv = torch.autograd.grad(o, (q64, k64, v64), do.double())
    return o.detach(), dq, dk, dv
