"""Checkpoints written atomically: a temporary file in the same folder, fsynced, then renamed over
the old one, so a save killed half-way never destroys the last good checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

import torch

CHECKPOINT = "ckpt.pt"
# config keys that must match for a checkpoint to be resumed (they shape the model, the
# optimizer state or the data stream); the rest (max_iters, eval cadence...) may change
MUST_MATCH = ("model", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "optimizer",
              "batch_size", "grad_accum", "data", "seed")


def save(run_dir: Path, state: dict) -> Path:
    """Write ``state`` to run_dir/ckpt.pt atomically; returns the path."""
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT
    tmp = run_dir / f".{CHECKPOINT}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load(run_dir: Path, config: dict, map_location="cpu") -> dict:
    """The checkpoint of ``run_dir``, after checking it was made by a compatible config."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; a run writes one every ckpt_every steps")
    state = torch.load(path, map_location=map_location, weights_only=False)
    saved = state.get("config", {})
    differ = [k for k in MUST_MATCH if saved.get(k) != config.get(k)]
    if differ:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {config.get(k)!r}" for k in differ)
        raise ValueError(f"checkpoint {path} was made by another config ({detail})")
    return state
