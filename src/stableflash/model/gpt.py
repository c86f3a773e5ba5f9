"""GPT-2 with pluggable attention, in the shape of nanoGPT's model.py.

Every layer's attention goes through ``stableflash.attention.flash_attention`` with the layer's
AttentionChoice (see ``spec.py``), so one model can run torch SDPA in most layers and the emulated
low-precision kernel, or the stabilized Triton kernel, in the layers under study — and switch at run
time (``GPT.set_attention``).

Differences from GPT-2 / nanoGPT, on purpose:
- no dropout on the attention probabilities: the flash-attention kernels here have none, so
  ``config.dropout`` applies only to the embeddings, the attention output projection and the MLP;
- the MLP's GELU is the tanh approximation, as in GPT-2;
- the loss is computed in float32 whatever the model's dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from stableflash.attention import flash_attention, flash_attn_qkvpacked_func
from stableflash.attention.api import check_softcap
from stableflash.model.base import DecoderLM, Documents, check_attn_mask, check_tokens, document_attention
from stableflash.model.spec import AttentionChoice, AttentionSpec, as_attention_spec


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``block_size`` is the context length; ``bias`` puts biases in Linear and LayerNorm.
    Architectural controls against attention-logit growth (off in GPT-2): ``qk_norm`` LayerNorms each
    head's q and k before the scores; ``attn_gate`` multiplies each head's attention output by a
    sigmoid gate computed from the block's input (gated attention), before the output projection;
    ``attn_softcap`` soft-caps the attention scores to c·tanh(S/c) (not on the "sdpa" backend).
    ``attn_mask_type`` "block_causal" keeps attention within each document of a row, a document
    ending at the token ``eot_token`` (positions stay absolute: see ``GPT.forward``)."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    bias: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    qk_norm: bool = False
    attn_gate: bool = False
    attn_softcap: float | None = None
    attn_mask_type: str = "causal"
    eot_token: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; accepted: a positive int")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; accepted: "
                             "n_embd a multiple of n_head")
        for name in ("bias", "qk_norm", "attn_gate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} is invalid; accepted: True or False")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout!r} is invalid; accepted: a number with 0 <= dropout < 1")
        check_softcap(self.attn_softcap, "attn_softcap")
        check_attn_mask(self.attn_mask_type, self.eot_token, self.vocab_size)
        if (isinstance(self.init_std, bool) or not isinstance(self.init_std, (int, float))
                or not math.isfinite(self.init_std) or self.init_std <= 0):
            raise ValueError(f"init_std={self.init_std!r} is invalid; accepted: a finite number > 0")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the attention itself is ``flash_attention`` under ``self.choice``."""

    def __init__(self, config: GPTConfig, layer: int, choice: AttentionChoice):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.layer = layer
        self.choice = choice
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)   # rows: Q, K, V
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        hd = config.head_dim
        self.q_norm = nn.LayerNorm(hd, bias=config.bias) if config.qk_norm else None
        self.k_norm = nn.LayerNorm(hd, bias=config.bias) if config.qk_norm else None
        self.c_gate = nn.Linear(config.n_embd, config.n_embd, bias=config.bias) if config.attn_gate else None
        self.softcap = config.attn_softcap
        # diagnostics: called as observer(self, x, q, k, v, y) after the attention, with q, k, v, y
        # in (B, n_head, T, head_dim); it may register a hook on y to see dO. None costs nothing.
        self.observer = None

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        """x (B, T, C); ``docs``: the documents of the rows (attention stays within each), or None."""
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.unbind(2)
        if docs is None:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.q_norm is not None:
            # under autocast LayerNorm returns fp32: back to v's dtype, as attention takes one dtype
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        kwargs = self.choice.kwargs()
        if docs is None and self.q_norm is None and "block_k" not in kwargs:
            # one gradient for the projection's output: the kernels write dQ, dK, dV into it
            y = flash_attn_qkvpacked_func(qkv, causal=True, softcap=self.softcap or 0.0, **kwargs).transpose(1, 2)
        elif docs is None:
            extra = {} if self.softcap is None else {"softcap": self.softcap}
            y = flash_attention(q, k, v, causal=True, **kwargs, **extra)
        else:                           # (B, T, H, d) throughout; the observer sees (B, H, T, d) views
            y = document_attention(q, k, v, docs, kwargs, self.softcap)
            q, k, v, y = (t.transpose(1, 2) for t in (q, k, v, y))
        if self.observer is not None:
            self.observer(self, x, q, k, v, y)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        if self.c_gate is not None:
            y = y * torch.sigmoid(self.c_gate(x))
        return self.resid_dropout(self.c_proj(y))

    # Weights for diagnostics. Head h owns rows h·head_dim:(h+1)·head_dim of W_Q, W_K, W_V
    # (x @ Wᵀ gives its q, k, v) and the same columns of W_O.
    def q_weight(self) -> torch.Tensor:
        """W_Q, (n_embd, n_embd): a view of c_attn.weight."""
        return self.c_attn.weight[: self.n_embd]

    def k_weight(self) -> torch.Tensor:
        """W_K, (n_embd, n_embd): a view of c_attn.weight."""
        return self.c_attn.weight[self.n_embd: 2 * self.n_embd]

    def v_weight(self) -> torch.Tensor:
        """W_V, (n_embd, n_embd): a view of c_attn.weight."""
        return self.c_attn.weight[2 * self.n_embd:]

    def o_weight(self) -> torch.Tensor:
        """W_O = c_proj.weight, (n_embd, n_embd)."""
        return self.c_proj.weight

    def extra_repr(self) -> str:
        return f"layer={self.layer}, attention={str(self.choice)!r}"


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, layer: int, choice: AttentionChoice):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer, choice)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), docs)
        return x + self.mlp(self.ln_2(x))


class GPT(DecoderLM):
    """GPT-2: token and learned position embeddings, ``n_layer`` blocks, final LayerNorm, and an
    output head tied to the token embedding.

    ``attention``: an AttentionSpec, an AttentionChoice (every layer) or a spec string such as
    ``"sdpa; 2: emulated policy=paper"``.
    """

    def __init__(self, config: GPTConfig, attention: AttentionSpec | AttentionChoice | str = "sdpa"):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config={config!r} is invalid; accepted: a GPTConfig (see model_config)")
        spec = as_attention_spec(attention)
        spec.check(config.n_layer, config.n_head)
        self.config = config
        self.attention_spec = spec
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config, i, spec.choice(i)) for i in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight            # weight tying
        self.apply(self._init_weights)
        resid_std = config.init_std / math.sqrt(2 * config.n_layer)   # GPT-2: residual projections
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=resid_std)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) token ids, T ≤ block_size → (logits (B, T, vocab), loss or None).

        The loss is the mean float32 cross-entropy over every position whose target is not -1.
        Under ``attn_mask_type="block_causal"`` attention stays within each document of a row
        (:meth:`documents`); the position embeddings stay those of the row's positions 0..T−1,
        as nanoGPT trains on packed documents.
        """
        check_tokens(idx, targets, self.config.block_size)
        T = idx.shape[1]
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        docs = self.documents(idx)
        for block in self.transformer.h:
            x = block(x, docs)
        return self._with_loss(self.lm_head(self.transformer.ln_f(x)), targets)

    # ---- attention routing ----------------------------------------------------------------

    def attention_layers(self) -> list[CausalSelfAttention]:
        """The attention module of each layer, in order."""
        return [block.attn for block in self.transformer.h]

    # ---- size and cost --------------------------------------------------------------------

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. As in nanoGPT, ``non_embedding`` subtracts the position embeddings only:
        the token embedding is also the output head (tied), so it is counted."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n
