"""What the GPT-2 and Llama-style models share: token checks, switching attention, cost estimates."""
from __future__ import annotations

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
