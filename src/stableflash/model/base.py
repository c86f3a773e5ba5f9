"""What the GPT-2 and Llama-style models share: token checks, document boundaries, switching attention,
cost estimates."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from stableflash.model.spec import AttentionChoice, AttentionSpec, as_attention_spec


def check_tokens(idx: torch.Tensor, targets: torch.Tensor | None, block_size: int) -> None:
    """Clear errors for token ids (and targets) a language model of context ``block_size`` cannot take."""
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"idx must be an int64 (or int32) tensor of token ids; got "
                        f"{idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__}")
    if idx.dim() != 2:
        raise ValueError(f"idx must have shape (batch, T); got shape {tuple(idx.shape)}")
    T = idx.shape[1]
    if not 1 <= T <= block_size:
        raise ValueError(f"sequence length T={T} is out of range; accepted: 1 <= T <= block_size={block_size}")
    if targets is not None:
        if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
            raise TypeError(f"targets must be an int64 tensor; got "
                            f"{targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__}")
        if targets.shape != idx.shape:
            raise ValueError(f"targets has shape {tuple(targets.shape)}; accepted: idx's shape {tuple(idx.shape)}")


# "causal": every token attends to the tokens before it in its row; "block_causal" (torchtitan's name):
# only to those of its own document, documents ending at an end-of-text token
ATTN_MASK_TYPES = ("causal", "block_causal")


def check_attn_mask(attn_mask_type, eot_token, vocab_size: int) -> None:
    """Clear errors for a model config's ``attn_mask_type`` and ``eot_token``."""
    if attn_mask_type not in ATTN_MASK_TYPES:
        raise ValueError(f"attn_mask_type={attn_mask_type!r} is invalid; accepted: {', '.join(ATTN_MASK_TYPES)}")
    if attn_mask_type == "causal":
        if eot_token is not None:
            raise ValueError(f"eot_token={eot_token!r} takes effect only with attn_mask_type='block_causal'; "
                             "accepted: eot_token None with attn_mask_type='causal'")
        return
    if isinstance(eot_token, bool) or not isinstance(eot_token, int) or not 0 <= eot_token < vocab_size:
        raise ValueError(f"eot_token={eot_token!r} is invalid for attn_mask_type='block_causal'; accepted: the "
                         f"end-of-text token id that ends each document, an int with 0 <= eot_token < "
                         f"vocab_size={vocab_size}")


def document_index(idx: torch.Tensor, eot_token: int) -> torch.Tensor:
    """Each token's document, numbered 0, 1, ... over the flattened rows of ``idx`` (B, T): every row
    is split after each ``eot_token`` (the end-of-text token belongs to the document it ends; the
    token after it starts the next one), and every row starts a document of its own. (B·T,) int64."""
    starts = torch.ones_like(idx, dtype=torch.bool)
    starts[:, 1:] = idx[:, :-1] == eot_token
    return torch.cumsum(starts.reshape(-1), 0) - 1


def document_cu_seqlens(idx: torch.Tensor, eot_token: int, n_docs: int | None = None) -> torch.Tensor:
    """The documents of a batch of token rows (:func:`document_index`), as FlashAttention's varlen
    ``cu_seqlens``: int32 on idx's device, the start of each document in the B·T flattened tokens,
    then B·T. Each document is at most T tokens long, so ``max_seqlen = T``.

    With ``n_docs`` (the number of documents, one int read from the device) it has n_docs + 1
    entries. Without, it has B·T + 1 whatever the data — the documents' starts, then B·T repeated
    (sequences of length 0) — so it is computed without reading anything back to the host
    (torch.compile traces it without a graph break); but every entry is a sequence the kernels
    launch programs for.
    """
    doc = document_index(idx, eot_token)
    return _document_starts(doc, idx.numel() if n_docs is None else n_docs)


def _document_starts(doc: torch.Tensor, count: int) -> torch.Tensor:
    """int32 (count + 1,): where documents 0..count of ``doc`` (:func:`document_index`) start in the
    flattened tokens (B·T past the last one)."""
    wanted = torch.arange(count + 1, device=doc.device, dtype=doc.dtype)
    return torch.searchsorted(doc, wanted, out_int32=True)


class Documents(NamedTuple):
    """The documents of a (B, T) batch: FlashAttention's varlen ``cu_seqlens`` over the B·T flattened
    tokens (:func:`document_cu_seqlens`), ``max_seqlen`` (T, an upper bound of their lengths), and,
    for layers on torch SDPA (which takes no packed sequences), ``mask``: the (B, 1, T, T) boolean
    mask of the same attention (True: the query sees the key), or None."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    mask: torch.Tensor | None = None


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, kwargs: dict,
                       softcap: float | None = None) -> torch.Tensor:
    """Causal attention within each document: q (B, T, H, d), k and v (B, T, H_kv, d) → (B, T, H, d),
    with one layer's attention choice (``kwargs``: ``AttentionChoice.kwargs()``): through
    ``flash_attn_varlen_func``, each document a sequence; on backend "sdpa", which takes no packed
    sequences, through ``flash_attention`` with the documents' boolean mask."""
    from stableflash import flash_attention, flash_attn_varlen_func
    B, T = q.shape[:2]
    kwargs = dict(kwargs)
    if softcap is not None:
        kwargs["softcap"] = softcap
    if kwargs["backend"] == "sdpa":
        o = flash_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=docs.mask, **kwargs)
        return o.transpose(1, 2)
    block_k = kwargs.pop("block_k", 64)
    if block_k != 64:
        raise ValueError(f"attention block={block_k} cannot apply to packed documents: flash_attn_varlen_func runs "
                         "key blocks of 64; accepted with attn_mask_type=block_causal: the default block")
    o = flash_attn_varlen_func(q.reshape(B * T, *q.shape[2:]), k.reshape(B * T, *k.shape[2:]),
                               v.reshape(B * T, *v.shape[2:]), docs.cu_seqlens, docs.cu_seqlens,
                               docs.max_seqlen, docs.max_seqlen, causal=True, **kwargs)
    return o.view(B, T, *o.shape[1:])


def mfu(flops_per_token: int, tokens_per_second: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over ``peak_flops`` (FLOP/s of the hardware)."""
    for name, value in (("tokens_per_second", tokens_per_second), ("peak_flops", peak_flops)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name}={value!r} is invalid; accepted: a number >= 0")
    if peak_flops == 0:
        raise ValueError("peak_flops=0 is invalid; accepted: a number > 0")
    return flops_per_token * tokens_per_second / peak_flops


class DecoderLM(nn.Module):
    """A causal language model whose layers' attention modules (``attention_layers()``, each with a
    ``choice``) route through ``flash_attention``; ``config`` has n_layer, n_head, head_dim and
    block_size, and the subclass counts its parameters (``num_params``)."""

    @staticmethod
    def _with_loss(logits: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, mean float32 cross-entropy over positions whose target is not -1, or None)."""
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)

    def documents(self, idx: torch.Tensor) -> Documents | None:
        """The documents of the rows of ``idx`` under ``attn_mask_type="block_causal"`` (None under
        "causal": each row is one sequence)."""
        c = self.config
        if c.attn_mask_type != "block_causal":
            return None
        B, T = idx.shape
        doc = document_index(idx, c.eot_token)
        # the number of documents, read once per forward for all layers: the kernels launch programs
        # per sequence and head, and B·T + 1 entries (no read) would exceed their grid for large batches
        cu = _document_starts(doc, int(doc[-1]) + 1)
        mask = None
        if any(module.choice.backend == "sdpa" for module in self.attention_layers()):
            d = doc.view(B, T)
            mask = (d[:, :, None] == d[:, None, :]).tril()[:, None]       # same document, key not after query
        return Documents(cu, T, mask)

    def attention_layers(self) -> list[nn.Module]:
        raise NotImplementedError

    def set_attention(self, attention: AttentionSpec | AttentionChoice | str) -> None:
        """Switch every layer to the attention ``attention`` routes it to (validated first)."""
        spec = as_attention_spec(attention)
        spec.check(self.config.n_layer, self.config.n_head)
        for i, module in enumerate(self.attention_layers()):
            module.choice = spec.choice(i)
        self.attention_spec = spec

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), nanoGPT's estimate from the PaLM paper:
        6N for the weights plus 12·L·H·Q·T for attention (T = block_size)."""
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layer * c.n_head * c.head_dim * c.block_size

    def estimate_mfu(self, tokens_per_second: float, peak_flops: float) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over ``peak_flops`` (FLOP/s of the hardware)."""
        return mfu(self.flops_per_token(), tokens_per_second, peak_flops)
