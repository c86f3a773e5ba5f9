"""Hugging Face transformers: stableflash as a model's attention implementation.

    import stableflash.integrations.hf as sf_hf
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=sf_hf.register())   # "stable_attention"

``register`` adds an attention function and its mask function to transformers'
``AttentionInterface`` / ``AttentionMaskInterface`` under one name, which ``from_config``,
``from_pretrained`` and ``set_attn_implementation`` then take. The name must not contain "flash":
transformers reads any such name as a request for a FlashAttention kernel from the hub.

What the attention function does with what the model passes — the same as transformers' own
FlashAttention path, through ``stableflash.attention.flash_style``:

- No padding: ``flash_attn_func`` on the (batch, seq, heads, head_dim) views, causal aligned to the
  bottom right, so a prefill that continues a KV cache and decoding one token are right.
- A padding mask: the mask function hands over the 2D (batch, keys) mask of the keys that hold a
  token — None when every key does, so unpadded batches skip the next step. The attention function
  unpads the tokens, runs ``flash_attn_varlen_func`` (each sequence its own causal diagonal, bottom
  right) and pads the output back with zeros at the padded queries. Keys past the mask's length (a
  static cache's unfilled slots) take no part. The query tokens are the last ``seq_q`` of the mask,
  as in every cache layout transformers has (left padding for batched generation).
- Packed sequences without padding (batch 1, ``position_ids`` restarting at each document, as
  ``DataCollatorWithFlattening`` makes them; or its ``cu_seq_lens_q``/``cu_seq_lens_k`` and
  ``max_length_q``/``max_length_k`` keyword arguments): varlen over the documents. Under
  torch.compile only the explicit ``cu_seq_lens`` arguments are read (finding the documents from
  ``position_ids`` is a data-dependent branch).
- A 4D mask built by the caller: ``flash_attention(attn_mask=...)`` with the mask as SDPA reads it
  (bool True = take part, or additive), not causal (the mask holds the causal part).
- ``dropout`` (the models pass the config's attention dropout in training) while the module is in
  training mode; ``scaling``; ``sliding_window`` (w: a query sees itself and the w − 1 keys before
  it, transformers' convention); ``softcap`` (Gemma 2's logit soft-capping); ``is_causal`` (or the
  module's ``is_causal``).
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from stableflash.attention import flash_style as fs
from stableflash.attention.api import BACKENDS, flash_attention
from stableflash.attention.policy import resolve_policy
from stableflash.attention.stabilization import Stabilization, parse_stabilize

DEFAULT_NAME = "stable_attention"


def _sliding_window_size(sliding_window) -> tuple[int, int]:
    """transformers' sliding_window w (a query sees w positions: itself and w − 1 on each side it may
    look) as FlashAttention's window_size; (-1, -1) for None."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r} is invalid; accepted: None or an int >= 1")
    return (int(sliding_window) - 1, int(sliding_window) - 1)


def _unpad(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(batch, seq, heads, d) -> (tokens, heads, d): the rows at ``indices`` of the flattened batch."""
    return x.reshape(-1, *x.shape[2:])[indices]


def _lengths(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token indices, int32 cu_seqlens and the longest length of a (batch, seq) bool mask."""
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten()).flatten()
    cu = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu, int(lengths.max())


def _packed_documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """int32 cu_seqlens of the documents packed in one row of ``position_ids`` (a new document
    wherever the position does not step by 1), or None when the row is one document."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(torch.diff(pos) != 1).flatten() + 1      # the documents after the first
    if starts.numel() == 0:
        return None
    return torch.cat([starts.new_zeros(1), starts, starts.new_tensor([pos.numel()])]).to(torch.int32)


def make_attention_function(*, stabilize: bool | str | Stabilization = True, beta: float = 2.0, eps: float = 1e-3,
                            backend: str = "auto", policy=None):
    """An attention function with transformers' calling convention (module docstring), the options
    fixed: ``stabilize``, ``beta``, ``eps``, ``backend``, ``policy`` as ``flash_attention`` takes them."""
    parse_stabilize(stabilize, beta, eps)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; accepted: {', '.join(BACKENDS)}")
    if policy is not None:
        resolve_policy(policy, torch.bfloat16)          # a clear error for an unknown name, here
    options = dict(stabilize=stabilize, beta=beta, eps=eps, backend=backend, policy=policy)

    def stable_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         sliding_window: int | None = None, softcap: float | None = None,
                         is_causal: bool | None = None, **kwargs):
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        dropout_p = float(dropout) if module.training else 0.0
        batch, _, q_len, _ = query.shape
        common = dict(dropout_p=dropout_p, softmax_scale=scaling, causal=causal,
                      window_size=_sliding_window_size(sliding_window), softcap=0.0 if softcap is None else softcap,
                      align="bottom-right", **options)
        # FlashAttention's layout (batch, seq, heads, head_dim), as views
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

        if attention_mask is not None and attention_mask.dim() == 4:
            out = flash_attention(query, key, value, attn_mask=attention_mask, causal=False, scale=scaling,
                                  softcap=softcap, dropout_p=dropout_p, **options)
            return out.transpose(1, 2), None

        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
                raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)} is invalid; accepted: "
                                 f"None, a 2D (batch={batch}, keys) padding mask, or a 4D mask")
            mask = attention_mask.bool()
            n_keys = mask.shape[1]
            if n_keys > k.shape[1] or n_keys < q_len:
                raise ValueError(f"attention_mask covers {n_keys} keys for {q_len} queries over {k.shape[1]} "
                                 "keys; accepted: at least the queries, at most the keys")
            # a static cache's slots past the mask hold no token yet
            k, v = k[:, :n_keys], v[:, :n_keys]
            idx_k, cu_k, max_k = _lengths(mask)
            if q_len == n_keys:
                idx_q, cu_q, max_q = idx_k, cu_k, max_k
            else:                                   # the queries are the last q_len tokens of the mask
                idx_q, cu_q, max_q = _lengths(mask[:, -q_len:])
            out = fs.flash_attn_varlen_func(_unpad(q, idx_q), _unpad(k, idx_k), _unpad(v, idx_k), cu_q, cu_k,
                                            max_q, max_k, **common)
            full = out.new_zeros(batch * q_len, *out.shape[1:]).index_put((idx_q,), out)
            return full.view(batch, q_len, *out.shape[1:]), None

        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        if cu_q is None or cu_k is None or max_q is None or max_k is None:
            cu_q = None
            position_ids = kwargs.get("position_ids")
            if (position_ids is not None and batch == 1 and q_len == k.shape[1] and q_len > 1
                    and not torch.compiler.is_compiling()):
                cu_q = _packed_documents(position_ids)
                if cu_q is not None:
                    cu_k, max_q = cu_q, int(cu_q.diff().max())
                    max_k = max_q
        if cu_q is not None:
            out = fs.flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                            v.reshape(-1, *v.shape[2:]), cu_q.to(torch.int32), cu_k.to(torch.int32),
                                            int(max_q), int(max_k), **common)
            return out.view(batch, q_len, *out.shape[1:]), None

        return fs.flash_attn_func(q, k, v, **common), None

    return stable_attention


def stable_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                          mask_function=None, attention_mask: torch.Tensor | None = None, use_vmap: bool = False,
                          device=None, **kwargs) -> torch.Tensor | None:
    """transformers' mask function for ``stable_attention``: the 2D (batch, keys) bool mask of the
    keys that hold a token, or None when all ``kv_length`` keys do (then the attention function
    skips unpadding). The causal mask, its alignment and a sliding window are the attention
    function's, from its arguments, as in transformers' FlashAttention path."""
    if use_vmap:
        raise ValueError("stable_attention takes padding masks, causal and sliding-window attention; a custom mask "
                         "overlay (or_mask_function / and_mask_function) is not supported; accepted: a model "
                         "without one, or attn_implementation='sdpa' for it")
    if attention_mask is None:
        # the cache positions that hold a token; fewer than kv_length in a static cache, whose query
        # offset is a tensor (read here once per forward; transformers compiles generate()'s decoding
        # step without fullgraph, where this is a graph break)
        filled = int(q_offset + q_length - kv_offset)
        if filled >= kv_length:
            return None
        return torch.ones(batch_size, filled, dtype=torch.bool, device=device if device is not None else "cpu")
    attention_mask = attention_mask[:, -kv_length:]       # a sliding layer's cache keeps the last keys
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register(name: str = DEFAULT_NAME, **options) -> str:
    """Register the attention function and its mask function under ``name`` (default
    "stable_attention"); returns the name, for ``attn_implementation=``.

    ``options`` are ``make_attention_function``'s: stabilize, beta, eps, backend, policy. Registering
    a name again replaces its function (and its options).
    """
    if not isinstance(name, str) or not name or "flash" in name:
        raise ValueError(f"name={name!r} is invalid; accepted: a non-empty string without 'flash', such as the "
                         f"default: register() returns {DEFAULT_NAME!r} (transformers treats any "
                         "attn_implementation containing 'flash' as a FlashAttention kernel to fetch from the hub)")
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, make_attention_function(**options))
    AttentionMaskInterface.register(name, stable_attention_mask)
    return name
