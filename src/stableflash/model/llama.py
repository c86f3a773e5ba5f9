"""A Llama-style decoder beside GPT-2, with the same pluggable attention.

Rotary position embeddings (half-split rotation, as Llama), RMSNorm before attention and MLP, a
SwiGLU MLP, no biases, optional grouped-query attention (``n_kv_head`` < ``n_head``) and optional
QK-norm (an RMSNorm over each head's q and k before the rotation, as OLMo 2 and Qwen 3 do). It
offers the interface the harness and the diagnostics use on GPT (``attention_layers``,
``set_attention``, q/k/v/o weights per head, ``flops_per_token``), so training, probes, the monitor
and the reproduction run on it unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from stableflash.attention import flash_attention
from stableflash.model.base import DecoderLM, Documents, check_attn_mask, check_tokens, document_attention
from stableflash.model.spec import AttentionChoice, AttentionSpec, as_attention_spec


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape. ``n_kv_head`` divides ``n_head`` (grouped-query attention when smaller);
    the SwiGLU hidden width is 8/3·n_embd rounded up to a multiple of ``multiple_of``.
    ``attn_mask_type`` "block_causal" keeps attention within each document of a row, a document
    ending at the token ``eot_token`` (rotary positions stay the row's: see ``Llama.forward``)."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    n_kv_head: int | None = None
    multiple_of: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False
    tie_embeddings: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    attn_mask_type: str = "causal"
    eot_token: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "multiple_of"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; accepted: a positive int")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must be n_head={self.n_head} times an even head_dim "
                             "(rotary embeddings rotate pairs)")
        kv = self.kv_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or self.n_head % kv:
            raise ValueError(f"n_kv_head={self.n_kv_head!r} is invalid; accepted: None or a positive divisor of "
                             f"n_head={self.n_head}")
        for name in ("qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} is invalid; accepted: True or False")
        for name, low in (("rope_theta", 1.0), ("norm_eps", 0.0), ("init_std", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= low:
                raise ValueError(f"{name}={value!r} is invalid; accepted: a finite number > {low:g}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout!r} is invalid; accepted: a number with 0 <= dropout < 1")
        check_attn_mask(self.attn_mask_type, self.eot_token, self.vocab_size)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_hidden(self) -> int:
        return self.multiple_of * math.ceil(8 * self.n_embd / 3 / self.multiple_of)


def rope_tables(head_dim: int, block_size: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position·θ^(−2i/head_dim), shape (block_size, head_dim/2), float32."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_dim: int = -2) -> torch.Tensor:
    """Rotate (x[..., :d/2], x[..., d/2:]) pairs of x (B, H, T, d), or (B, T, H, d) with ``seq_dim=-3``,
    by the angles of positions 0..T−1."""
    T, half = x.shape[seq_dim], x.shape[-1] // 2
    c, s = cos[:T].to(x.dtype), sin[:T].to(x.dtype)
    if seq_dim == -3:
        c, s = c[:, None], s[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


class LlamaAttention(nn.Module):
    """Causal self-attention with rotary positions, optional QK-norm and grouped-query K/V; the
    attention itself is ``flash_attention`` under ``self.choice``."""

    def __init__(self, config: LlamaConfig, layer: int, choice: AttentionChoice):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.n_embd, self.layer, self.choice = config.n_embd, layer, choice
        kv = self.n_kv_head * self.head_dim
        self.wq = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.wk = nn.Linear(config.n_embd, kv, bias=False)
        self.wv = nn.Linear(config.n_embd, kv, bias=False)
        self.wo = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.resid_dropout = nn.Dropout(config.dropout)
        self.observer = None            # as CausalSelfAttention.observer (diagnostics)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Documents | None = None) -> torch.Tensor:
        """x (B, T, C); ``docs``: the documents of the rows (attention stays within each), or None."""
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim)
        if docs is None:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        seq_dim = -2 if docs is None else -3
        q, k = apply_rope(q, cos, sin, seq_dim), apply_rope(k, cos, sin, seq_dim)
        if docs is None:
            y = flash_attention(q, k, v, causal=True, **self.choice.kwargs())
        else:                           # (B, T, H, d) throughout; the observer sees (B, H, T, d) views
            y = document_attention(q, k, v, docs, self.choice.kwargs())
            q, k, v, y = (t.transpose(1, 2) for t in (q, k, v, y))
        if self.observer is not None:
            self.observer(self, x, q, k, v, y)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.wo(y))

    # Weights for diagnostics: head h owns rows h·head_dim:(h+1)·head_dim of W_Q (of W_K and W_V:
    # K/V head h // group) and the same columns of W_O.
    def q_weight(self) -> torch.Tensor:
        return self.wq.weight

    def k_weight(self) -> torch.Tensor:
        return self.wk.weight

    def v_weight(self) -> torch.Tensor:
        return self.wv.weight

    def o_weight(self) -> torch.Tensor:
        return self.wo.weight

    def extra_repr(self) -> str:
        return f"layer={self.layer}, kv_heads={self.n_kv_head}, attention={str(self.choice)!r}"


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)     # gate
        self.w3 = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)     # up
        self.w2 = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)     # down
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int, choice: AttentionChoice):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = LlamaAttention(config, layer, choice)
        self.mlp_norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, docs)
        return x + self.mlp(self.mlp_norm(x))


class Llama(DecoderLM):
    """Token embedding, ``n_layer`` Llama blocks, final RMSNorm, output head (tied to the embedding
    when ``tie_embeddings``). ``attention`` as for GPT: a spec string, AttentionChoice or AttentionSpec."""

    def __init__(self, config: LlamaConfig, attention: AttentionSpec | AttentionChoice | str = "sdpa"):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config={config!r} is invalid; accepted: a LlamaConfig (see model_config)")
        spec = as_attention_spec(attention)
        spec.check(config.n_layer, config.n_head)
        self.config, self.attention_spec = config, spec
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(LlamaBlock(config, i, spec.choice(i)) for i in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.tok_embeddings.weight = self.output.weight
        cos, sin = rope_tables(config.head_dim, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=config.init_std)
        resid_std = config.init_std / math.sqrt(2 * config.n_layer)     # residual projections, as GPT-2
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, mean=0.0, std=resid_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) token ids, T ≤ block_size → (logits, mean float32 cross-entropy or None).

        Under ``attn_mask_type="block_causal"`` attention stays within each document of a row
        (:meth:`documents`); the rotary angles stay those of the row's positions 0..T−1 (a rotation
        of q and k by the same offset leaves their scores unchanged, so a document's attention is
        what it would be at the start of the row).
        """
        check_tokens(idx, targets, self.config.block_size)
        x = self.drop(self.tok_embeddings(idx))
        docs = self.documents(idx)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin, docs)
        return self._with_loss(self.output(self.norm(x)), targets)

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.attn for layer in self.layers]

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; ``non_embedding`` drops the input embedding unless it is tied to the head."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n
