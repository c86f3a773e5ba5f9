"""Optimizers and the learning-rate schedule.

AdamW as nanoGPT configures it (weight decay on matrices only), or torch's Muon with the
RMS-matched learning-rate adjustment ("match_rms_adamw", so it reuses AdamW's learning rate and
weight decay) for the hidden matrices, with AdamW for embeddings, the tied head and 1-D
parameters — the paper's second optimizer.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from stableflash.train.config import TrainConfig


class Optimizers:
    """One or two torch optimizers stepped together; exposes their param groups for the schedule."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.optimizers):
            raise ValueError(f"checkpoint holds optimizers {sorted(state)}, this run uses {sorted(self.optimizers)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr


def _is_embedding(model: nn.Module, param: nn.Parameter) -> bool:
    return any(param is m.weight for m in model.modules() if isinstance(m, nn.Embedding))


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> Optimizers:
    """AdamW, or Muon for hidden matrices plus AdamW for the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = device_type == "cuda"
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return Optimizers({"adamw": torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=fused)})
    hidden = [p for p in params if p.dim() == 2 and not _is_embedding(model, p)]
    hidden_ids = {id(p) for p in hidden}
    rest = [p for p in params if id(p) not in hidden_ids]
    muon = torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=cfg.lr, betas=betas, fused=fused)
    return Optimizers({"muon": muon, "adamw": adamw})


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over ``warmup_iters`` steps, then constant or cosine down to ``min_lr`` at
    ``lr_decay_iters`` (default: ``max_iters``), ``min_lr`` after that."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / (cfg.warmup_iters + 1)
    if cfg.schedule == "constant":
        return cfg.lr
    decay_end = cfg.lr_decay_iters or cfg.max_iters
    if step >= decay_end:
        return cfg.min_lr
    ratio = (step - cfg.warmup_iters) / max(1, decay_end - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)
