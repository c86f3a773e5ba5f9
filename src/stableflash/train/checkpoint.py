"""Checkpoints written atomically (a temporary file in the same folder, fsynced, then renamed over
the old one), so a save killed half-way never destroys the last good checkpoint, and read with
``torch.load(weights_only=True)``, so a ``ckpt.pt`` from elsewhere cannot run code when loaded:
a checkpoint holds tensors, numbers, strings, lists and dicts only. A file that is not a complete
checkpoint of this harness, or does not fit the model, is a ValueError naming it."""
from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from stableflash.files import atomic_write, remove_stale_temps

CHECKPOINT = "ckpt.pt"
# config keys that must match for a checkpoint to be resumed (they shape the model, the
# optimizer state or the data stream); the rest (max_iters, eval cadence...) may change
MUST_MATCH = ("model", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "optimizer",
              "batch_size", "grad_accum", "data", "seed")
# what every checkpoint of train() holds (``attention`` too, optional in earlier ones)
KEYS = {"model": dict, "optimizer": dict, "step": int, "config": dict, "rng": dict}
_WRITTEN_BY = "a checkpoint written by stableflash train"


def save(run_dir: Path, state: dict) -> Path:
    """Write ``state`` to run_dir/ckpt.pt atomically; returns the path. Temporary files of earlier
    saves that were killed are removed first."""
    path = Path(run_dir) / CHECKPOINT
    remove_stale_temps(path)
    with atomic_write(path, "wb") as f:
        torch.save(state, f)
    return path


def _weights_only_refusal(exc: Exception) -> tuple[bool, str]:
    """Whether torch's weights-only unpickler refused an object that could run code (a Python
    global, a call), and its reason in a few words."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return True, f"it names the Python object {found.group(1)}"
    reason = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    reason = reason.group(1).strip() if reason else text.splitlines()[0]
    return "allowlisted" in text or "reduce" in text, reason


def read(path: Path, map_location="cpu") -> dict:
    """The checkpoint at ``path``, loaded without running any code it may hold, its layout checked."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        hostile, reason = _weights_only_refusal(exc)
        if hostile:
            raise ValueError(f"checkpoint {path} was refused unread: {reason}, and loading it could run code; "
                             f"accepted: {_WRITTEN_BY} (tensors, numbers, strings, lists and dicts only)") from None
        raise ValueError(f"checkpoint {path} cannot be read ({path.stat().st_size} bytes; {reason}); it is damaged "
                         f"or truncated, or not a PyTorch checkpoint; accepted: {_WRITTEN_BY}") from None
    except MemoryError:
        raise
    except OSError as exc:
        raise ValueError(f"checkpoint {path} cannot be read: {exc.strerror or exc}") from None
    except Exception as exc:          # torch.load's errors for a damaged file vary: EOFError, RuntimeError, ...
        size = path.stat().st_size
        reason = "it is empty" if size == 0 else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
        raise ValueError(f"checkpoint {path} cannot be read ({size} bytes; {reason}); it is damaged or "
                         f"truncated, or not a PyTorch checkpoint; accepted: {_WRITTEN_BY}") from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} holds a {type(state).__name__}; accepted: {_WRITTEN_BY} (a dict "
                         f"with {', '.join(KEYS)})")
    wrong = [f"{k} (missing)" if k not in state else f"{k} (a {type(state[k]).__name__})"
             for k, kind in KEYS.items()
             if k not in state or not isinstance(state[k], kind) or isinstance(state[k], bool)]
    if not wrong and not (isinstance(state["rng"].get("cpu"), torch.Tensor) and state["rng"]["cpu"].dtype == torch.uint8):
        wrong.append("rng.cpu (not a uint8 tensor)")
    if not wrong and state["step"] < 0:
        wrong.append(f"step ({state['step']})")
    if not isinstance(state.get("attention", ""), str):
        wrong.append(f"attention (a {type(state['attention']).__name__})")
    if wrong:
        raise ValueError(f"checkpoint {path} is not {_WRITTEN_BY}: wrong or missing {', '.join(wrong)}; "
                         f"accepted: a dict with {', '.join(f'{k} ({t.__name__})' for k, t in KEYS.items())}")
    return state


def load(run_dir: Path, config: dict, map_location="cpu") -> dict:
    """The checkpoint of ``run_dir``, after checking it was made by a compatible config."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; a run writes one every ckpt_every steps")
    state = read(path, map_location)
    saved = state["config"]
    differ = [k for k in MUST_MATCH if saved.get(k) != config.get(k)]
    if differ:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {config.get(k)!r}" for k in differ)
        raise ValueError(f"checkpoint {path} was made by another config ({detail})")
    return state


def check_fits(state: dict, model: torch.nn.Module, path: Path) -> None:
    """Raise a ValueError naming ``path`` unless the checkpoint's weights have the model's names and shapes."""
    have = state["model"]
    want = model.state_dict()
    problems = [f"{k} is missing" for k in want if k not in have]
    problems += [f"{k} is not in the model" for k in have if k not in want]
    problems += [f"{k} has shape {tuple(getattr(have[k], 'shape', ()))} in the checkpoint, {tuple(v.shape)} in the model"
                 for k, v in want.items()
                 if k in have and (not isinstance(have[k], torch.Tensor) or have[k].shape != v.shape)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"checkpoint {path} does not fit this model: {'; '.join(problems[:3])}{more}; accepted: "
                         "a checkpoint of the same model configuration")


def check_optimizer_fits(optimizer, path: Path) -> None:
    """After loading: every per-parameter state tensor of the optimizers has its parameter's shape."""
    for name, opt in getattr(optimizer, "optimizers", {"optimizer": optimizer}).items():
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() and value.shape != p.shape:
                        raise ValueError(f"checkpoint {path} does not fit this model: {name} state {key!r} has "
                                         f"shape {tuple(value.shape)} for a parameter of shape {tuple(p.shape)}")


def _numbered(named: dict) -> dict:
    """An optimizer state dict keyed by parameter names (torch.distributed.checkpoint's layout) with
    its parameters numbered in param-group order instead, as ``torch.optim.Optimizer.state_dict`` numbers them."""
    order = {name: i for i, name in enumerate(n for g in named["param_groups"] for n in g["params"])}
    return {"state": {order[name]: value for name, value in named["state"].items()},
            "param_groups": [{**g, "params": [order[n] for n in g["params"]]} for g in named["param_groups"]]}


def sharded_full_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """The model and optimizer state of a model sharded by FSDP2 (``fully_shard``), gathered whole onto
    rank 0's CPU in the layout of an unsharded run's (``model.state_dict()``, and per optimizer
    ``Optimizer.state_dict()``), so a sharded run writes the same single-file checkpoint. Every rank
    must call it (it all-gathers); ranks other than 0 get empty dicts."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = {}
    for name, opt in optimizer.optimizers.items():
        named = get_optimizer_state_dict(model, opt, options=options)
        if named:
            optim_state[name] = _numbered(named)
    return model_state, optim_state


def load_sharded(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load a checkpoint's whole model and optimizer state (as :func:`sharded_full_state` writes it, or
    an unsharded run) into a model sharded by FSDP2 and its optimizers, each rank keeping its shard.
    Every rank must call it, with the same ``state``."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True)
    if set(state["optimizer"]) != set(optimizer.optimizers):
        raise ValueError(f"checkpoint holds optimizers {sorted(state['optimizer'])}, this run uses "
                         f"{sorted(optimizer.optimizers)}")
    set_model_state_dict(model, state["model"], options=options)
    for name, opt in optimizer.optimizers.items():
        saved = state["optimizer"][name]
        names = [n for g in get_optimizer_state_dict(model, opt, options=options)["param_groups"] for n in g["params"]]
        groups = saved["param_groups"]
        if sum(len(g["params"]) for g in groups) != len(names):
            raise ValueError(f"checkpoint's {name} optimizer holds {sum(len(g['params']) for g in groups)} "
                             f"parameters, this model has {len(names)}")
        named = {"state": {names[i]: value for i, value in saved["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}
        set_optimizer_state_dict(model, opt, named, options=options)
