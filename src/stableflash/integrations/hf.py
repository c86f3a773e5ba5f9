"""Hugging Face transformers: use stableflash as a model's attention implementation.

    import stableflash.integrations.hf as sf_hf
    name = sf_hf.register()                      # "stable_attention"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

The name must not contain "flash": transformers reads any such name as a request for a
FlashAttention kernel from the hub and refuses it, so ``register`` refuses it first.

The attention function receives (B, H, N, d) query/key/value from the model and returns
(B, N, H, d), as transformers' own implementations do. Causal models without padding work
(transformers then passes no mask); an explicit mask — padding, or a prefill that continues a
KV cache — raises a clear error, since the fused kernels take none.
"""
from __future__ import annotations

import torch

from stableflash.attention.api import BACKENDS, flash_attention
from stableflash.attention.stabilization import Stabilization, parse_stabilize


def make_attention_function(*, stabilize: bool | str | Stabilization = True, beta: float = 2.0, eps: float = 1e-3,
                            backend: str = "auto"):
    """An attention function with transformers' calling convention."""
    parse_stabilize(stabilize, beta, eps)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; accepted: {', '.join(BACKENDS)}")

    def stableflash_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None, **kwargs):
        if kwargs.get("softcap") is not None:
            raise ValueError("stableflash attention does not support softcap; accepted: None")
        if dropout and module.training:
            raise ValueError(f"attention dropout={dropout} is not supported in training; accepted: 0.0")
        if attention_mask is not None:
            raise ValueError("stableflash attention takes no attention mask (padding, custom masks, or a prefill "
                             "after a KV cache); accepted: unpadded causal batches, or decoding one token")
        q_len, k_len = query.shape[2], key.shape[2]
        causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and q_len > 1
        if causal and q_len != k_len:
            raise ValueError(f"causal attention with {q_len} queries over {k_len} keys (a KV cache) is not "
                             "supported; accepted: equal lengths, or one query token")
        out = flash_attention(query, key, value, causal=causal, scale=scaling, stabilize=stabilize, beta=beta,
                              eps=eps, backend=backend)
        return out.transpose(1, 2).contiguous(), None

    return stableflash_attention


DEFAULT_NAME = "stable_attention"


def register(name: str = DEFAULT_NAME, **options) -> str:
    """Register the attention function (and transformers' SDPA mask builder, which passes no mask
    for unpadded causal batches) under ``name``; returns the name for ``attn_implementation``.

    ``options`` are ``make_attention_function``'s (stabilize, beta, eps, backend).
    """
    if not isinstance(name, str) or not name or "flash" in name:
        raise ValueError(f"name={name!r} is invalid; accepted: a non-empty string without 'flash' "
                         "(transformers treats any attn_implementation containing 'flash' as a hub "
                         "FlashAttention kernel)")
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, make_attention_function(**options))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
