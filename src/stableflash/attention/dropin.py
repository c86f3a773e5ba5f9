"""Drop-in replacements for ``torch.nn.functional.scaled_dot_product_attention``.

``scaled_dot_product_attention(q, k, v, attn_mask=..., dropout_p=..., is_causal=True)`` takes
SDPA's arguments and returns what SDPA returns, computed by ``flash_attention`` with its default
stabilization ("consistent-delta"): a boolean (True takes part) or additive ``attn_mask``
broadcastable to (batch, heads, seq_q, seq_k), dropout applied whenever ``dropout_p`` > 0 (as
SDPA's), grouped-query attention with ``enable_gqa=True``. What it cannot take (a mask of another
dtype or shape, tensors that are not 4-D) is a clear error, never a silent change of meaning.
"""
from __future__ import annotations

import torch
from torch import nn

from stableflash.attention.api import BACKENDS, check_dropout, flash_attention
from stableflash.attention.stabilization import Stabilization, parse_stabilize


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
                                 stabilize: bool | str | Stabilization = True, beta: float = 2.0, eps: float = 1e-3,
                                 backend: str = "auto") -> torch.Tensor:
    """SDPA's signature (plus the stabilization keywords), computed by ``flash_attention``.

    query (batch, heads, seq_q, head_dim), key and value (batch, heads_kv, seq_k, head_dim);
    ``attn_mask``: None, or a boolean (True = takes part) or floating (added to the scores) tensor
    broadcastable to (batch, heads, seq_q, seq_k); ``dropout_p``: applied whenever > 0, as SDPA's
    (pass 0.0 at evaluation); ``is_causal``: top-left aligned, as SDPA's (with an ``attn_mask``
    too, both apply, where SDPA refuses the pair); ``enable_gqa``: key and value may have fewer
    heads than query."""
    if key.dim() == 4 and query.dim() == 4 and key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}; pass enable_gqa=True for "
                         "grouped-query attention (as with torch's SDPA)")
    return flash_attention(query, key, value, causal=is_causal, scale=scale, stabilize=stabilize, beta=beta,
                           eps=eps, backend=backend, attn_mask=attn_mask, dropout_p=dropout_p)


class StableAttention(nn.Module):
    """Module form: ``StableAttention()(q, k, v, is_causal=True)``; options fixed at construction.

    ``dropout_p`` (default 0.0) is attention dropout applied in training mode only, as
    ``nn.MultiheadAttention``'s ``dropout``: ``model.eval()`` turns it off. ``forward`` takes an
    ``attn_mask`` as ``scaled_dot_product_attention`` does."""

    def __init__(self, *, stabilize: bool | str | Stabilization = True, beta: float = 2.0, eps: float = 1e-3,
                 backend: str = "auto", dropout_p: float = 0.0):
        super().__init__()
        parse_stabilize(stabilize, beta, eps)          # a bad option fails here, not at the first call
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is unknown; accepted: {', '.join(BACKENDS)}")
        self.dropout_p = check_dropout(dropout_p)
        self.options = dict(stabilize=stabilize, beta=beta, eps=eps, backend=backend)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
                scale: float | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        return flash_attention(query, key, value, causal=is_causal, scale=scale, attn_mask=attn_mask,
                               dropout_p=self.dropout_p if self.training else 0.0, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in {**self.options, "dropout_p": self.dropout_p}.items())
