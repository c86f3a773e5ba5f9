"""Drop-in replacements for ``torch.nn.functional.scaled_dot_product_attention``.

``scaled_dot_product_attention(q, k, v, is_causal=True)`` takes SDPA's arguments and returns what
SDPA returns, computed by ``flash_attention`` with its default stabilization ("consistent-delta"). What the fused kernels
cannot do (an explicit ``attn_mask``, dropout) raises a ValueError instead of silently doing
something else.
"""
from __future__ import annotations

import torch
from torch import nn

from stableflash.attention.api import BACKENDS, flash_attention
from stableflash.attention.stabilization import Stabilization, parse_stabilize


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
                                 stabilize: bool | str | Stabilization = True, beta: float = 2.0, eps: float = 1e-3,
                                 backend: str = "auto") -> torch.Tensor:
    """SDPA's signature (plus the stabilization keywords), computed by ``flash_attention``."""
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported by stableflash attention; accepted: None "
                         "(use is_causal=True for causal masking, or torch's SDPA for custom masks)")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p!r} is not supported; accepted: 0.0")
    if key.dim() == 4 and query.dim() == 4 and key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}; pass enable_gqa=True for "
                         "grouped-query attention (as with torch's SDPA)")
    return flash_attention(query, key, value, causal=is_causal, scale=scale, stabilize=stabilize, beta=beta,
                           eps=eps, backend=backend)


class StableAttention(nn.Module):
    """Module form: ``StableAttention()(q, k, v, is_causal=True)``; options fixed at construction."""

    def __init__(self, *, stabilize: bool | str | Stabilization = True, beta: float = 2.0, eps: float = 1e-3,
                 backend: str = "auto"):
        super().__init__()
        parse_stabilize(stabilize, beta, eps)          # a bad option fails here, not at the first call
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is unknown; accepted: {', '.join(BACKENDS)}")
        self.options = dict(stabilize=stabilize, beta=beta, eps=eps, backend=backend)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
                scale: float | None = None) -> torch.Tensor:
        return flash_attention(query, key, value, causal=is_causal, scale=scale, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
