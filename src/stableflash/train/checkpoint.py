"""Checkpoints in two formats, both written atomically and both read without running any code they
may hold. A file or folder that is not a complete checkpoint of this harness, or does not fit the
model, is a ValueError naming it.

- **full**: ``RUN/ckpt.pt``, one file with the whole model (written by rank 0; under FSDP gathered
  there first): a temporary file in the same folder, fsynced, then renamed over the old one; read
  with ``torch.load(weights_only=True)``, as a checkpoint holds tensors, numbers, strings, lists
  and dicts only.
- **sharded**: ``RUN/ckpt/step-N/``, a ``torch.distributed.checkpoint`` (DCP) folder in which every
  rank writes its own shard (``__R_0.distcp``) and rank 0 the index (``.metadata``), as torchtitan
  writes ``checkpoint/step-N``. It is written into ``RUN/ckpt/.step-N.tmp`` and renamed once every
  rank has finished, so a save killed half-way leaves the last complete folder whole and no folder
  that loads as complete; the older folder is removed only after. It loads at any world size
  (DCP reshards). DCP reads ``.metadata`` with ``pickle`` and the non-tensor entries with
  ``torch.load(weights_only=False)``: :class:`SafeReader` and :class:`SafeLoadPlanner` read them
  with an unpickler that admits DCP's own metadata classes only and with ``weights_only=True``.

``--resume`` reads whichever a run folder holds (:func:`find`); after a save in one format the
other's checkpoint, now older, is removed."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch

from stableflash.files import atomic_write, fsync_dir, remove_stale_temps

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
    for key in ("attention", "monitor"):           # optional: a monitor's switched spec, the monitor's state
        if not isinstance(state.get(key, ""), str):
            wrong.append(f"{key} (a {type(state[key]).__name__})")
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
    have = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state["model"].items()}
    _check_shapes(have, model, path)


def _check_shapes(have: dict, model: torch.nn.Module, path: Path) -> None:
    """``have``: the checkpoint's weight names and shapes (None: not a tensor). A ValueError naming
    ``path`` unless they are the model's (whole shapes, also of a model sharded by FSDP)."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"{k} is missing" for k in want if k not in have]
    problems += [f"{k} is not in the model" for k in have if k not in want]
    problems += [f"{k} has shape {have[k] or ()} in the checkpoint, {v} in the model"
                 for k, v in want.items() if k in have and have[k] != v]
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


# ----------------------------------------------------------------------------- sharded (DCP)

SHARDED = "ckpt"                      # RUN/ckpt/step-N/: the sharded checkpoint of step N
_STEP_DIR = re.compile(r"step-(\d+)")
_TEMP_DIR = re.compile(r"\.step-\d+\.tmp")
_METADATA = ".metadata"               # DCP's index of a checkpoint folder (written last, by rank 0)
_TRAIN_KEYS = ("step", "config", "attention")


def _sharded_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """The complete sharded checkpoints of ``run_dir`` (renamed into place), by step."""
    folder = Path(run_dir) / SHARDED
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def find(run_dir: Path) -> Path | None:
    """The checkpoint ``--resume`` reads in ``run_dir``: ``ckpt.pt``, or the sharded folder of the
    latest step under ``ckpt/``; where both exist (a save in one format cut short before it removed
    the other's), the one written last. None when there is neither."""
    run_dir = Path(run_dir)
    full = run_dir / CHECKPOINT
    full = full if full.is_file() else None
    dirs = _sharded_dirs(run_dir)
    sharded = dirs[-1][1] if dirs else None
    if full and sharded:
        written = (sharded / _METADATA) if (sharded / _METADATA).exists() else sharded
        return sharded if written.stat().st_mtime_ns >= full.stat().st_mtime_ns else full
    return full or sharded


def remove_stale_sharded(run_dir: Path) -> list[Path]:
    """Remove the temporary folders that killed sharded saves left in ``run_dir/ckpt`` (never valid)."""
    folder = Path(run_dir) / SHARDED
    stale = [p for p in folder.iterdir() if _TEMP_DIR.fullmatch(p.name)] if folder.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def remove_other_format(run_dir: Path, kept: Path) -> None:
    """After a save of ``kept``: remove the run's checkpoints of the other format, now older."""
    run_dir = Path(run_dir)
    if kept.is_dir():
        with contextlib.suppress(FileNotFoundError):
            (run_dir / CHECKPOINT).unlink()
    elif (run_dir / SHARDED).is_dir():
        shutil.rmtree(run_dir / SHARDED)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def _quiet_one_process():
    """DCP warns on every save and load in one process that it assumes one process: so it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier() -> None:
    if _distributed():
        torch.distributed.barrier()


def save_sharded(run_dir: Path, model: torch.nn.Module, optimizer, step: int, config: dict, attention: str,
                 rng: dict, rank: int = 0, monitor: str | None = None) -> Path:
    """Write the sharded checkpoint of ``step`` (every rank must call it, with the same step, config,
    attention, ``rng`` — rank 0's RNG states, as ``ckpt.pt`` keeps — and ``monitor``, rank 0's
    monitor state as JSON text, or None). Model and optimizer state are
    taken as ``torch.distributed.checkpoint.state_dict`` gives them (each rank's shards under FSDP),
    so nothing is gathered. Returns the folder; the older sharded folders and ``ckpt.pt`` are removed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    folder = Path(run_dir) / SHARDED
    tmp = folder / f".step-{step}.tmp"
    if rank == 0:
        remove_stale_sharded(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
    _barrier()                                        # no rank writes into a folder being cleaned
    state = {"model": get_model_state_dict(model),
             "optimizer": {name: get_optimizer_state_dict(model, opt) for name, opt in optimizer.optimizers.items()},
             "train": {"step": int(step), "config": json.dumps(config), "attention": str(attention),
                       "rng": {k: v for k, v in rng.items() if v is not None},
                       **({"monitor": monitor} if monitor is not None else {})}}
    try:
        with _quiet_one_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not _distributed())
    except dcp.CheckpointException as exc:            # DCP turns any failure, Ctrl-C included, into this
        failures = [e for e, _ in exc.failures.values()]
        if any(isinstance(e, KeyboardInterrupt) for e in failures):
            raise KeyboardInterrupt from None         # a second Ctrl-C: stopped at once, as elsewhere
        first = failures[0] if failures else exc
        raise OSError(f"the sharded checkpoint of step {step} could not be written to {tmp} "
                      f"({type(first).__name__}: {first}); the checkpoint before it is kept") from None
    _barrier()                                        # every rank's shard is written and fsynced
    final = folder / f"step-{step}"
    if rank == 0:
        old = [p for _, p in _sharded_dirs(run_dir)]
        if final.exists():                            # the same step again (a monitor rollback, then a stop)
            retired = folder / f".step-{step}.tmp-retired"
            os.replace(final, retired)                # a temporary name: removed below, or as stale
            old = [retired if p == final else p for p in old]
        os.replace(tmp, final)
        fsync_dir(folder)
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        remove_other_format(run_dir, final)
    _barrier()                                        # the new folder is in place before any rank reads it
    return final


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the objects DCP's ``.metadata`` is made of, and nothing else: DCP's metadata dataclasses
    and enums, its storage record, ``torch.Size``, dtypes, layouts, memory formats, and paths."""

    _EXACT = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    _PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}

    def find_class(self, module: str, name: str):
        if (module, name) in self._EXACT or (module in ("pathlib", "pathlib._local") and name in self._PATHS):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module == "torch.distributed.checkpoint.metadata":
            import torch.distributed.checkpoint.metadata as md
            obj = getattr(md, name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"it names the Python object {module}.{name}")


def _refused(path: Path, reason: str) -> ValueError:
    return ValueError(f"checkpoint {path} was refused unread: {reason}, and loading it could run code; accepted: "
                      f"{_WRITTEN_BY} (sharded: torch.distributed.checkpoint metadata, tensors, numbers, strings, "
                      "lists and dicts only)")


def _naming(what: str, reason: str) -> str:
    """"its entry X" + "it names the Python object Y" → "its entry X names the Python object Y"."""
    return f"{what} {reason[3:]}" if reason.startswith("it ") else f"{what} ({reason})"


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """A ``FileSystemReader`` whose ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, and
        whose storage records must name files inside the folder."""

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
            path = Path(self.path) / _METADATA
            try:
                with open(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except FileNotFoundError:
                raise ValueError(f"checkpoint {path.parent} is not complete: it has no {_METADATA}; accepted: "
                                 f"{_WRITTEN_BY}") from None
            except pickle.UnpicklingError as exc:
                if str(exc).startswith("it names"):
                    raise _refused(path, str(exc)) from None
                raise ValueError(f"checkpoint {path} cannot be read ({exc}); it is damaged or truncated") from None
            except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
                raise ValueError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}); it is damaged "
                                 f"or truncated, or not {_WRITTEN_BY}") from None
            if not isinstance(metadata, Metadata):
                raise ValueError(f"checkpoint {path} holds a {type(metadata).__name__}; accepted: "
                                 "torch.distributed.checkpoint metadata")
            for info in (metadata.storage_data or {}).values():
                name = getattr(info, "relative_path", None)
                if not isinstance(name, str) or name != Path(name).name or name in ("", ".", ".."):
                    raise ValueError(f"checkpoint {path} names the data file {name!r}, which is not a file of its "
                                     "folder; accepted: the folder's own __R_0.distcp files")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    return SafeReader


def _planner(path: Path):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, reading the non-tensor entries with ``torch.load(weights_only=True)``."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            key = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                hostile, reason = _weights_only_refusal(exc)
                if hostile:
                    raise _refused(path, _naming(f"its entry {key}", reason)) from None
                raise ValueError(f"checkpoint {path} cannot be read: its entry {key} is damaged ({reason})") from None
            except Exception as exc:
                raise ValueError(f"checkpoint {path} cannot be read: its entry {key} is damaged "
                                 f"({type(exc).__name__})") from None
            vetted = io.BytesIO()                     # the vetted value, handed on to DCP's own placement
            torch.save(obj, vetted)
            vetted.seek(0)
            super().load_bytes(read_item, vetted)

    return SafeLoadPlanner()


def _dcp_load(path: Path, state: dict) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` from the folder ``path``, through the safe
    reader and planner (every rank must call it); its failures as one ValueError naming ``path``."""
    import torch.distributed.checkpoint as dcp
    try:
        with _quiet_one_process():
            dcp.load(state, storage_reader=_reader_class()(path), planner=_planner(path), no_dist=not _distributed())
    except dcp.CheckpointException as exc:
        failures = list(exc.failures.values())
        first = failures[0][0] if failures else exc
        if isinstance(first, ValueError) and str(first).startswith("checkpoint "):
            raise ValueError(str(first)) from None
        if isinstance(first, pickle.UnpicklingError):          # a shard's tensor, read by torch.load(weights_only=True)
            hostile, reason = _weights_only_refusal(first)
            if hostile:
                raise _refused(path, _naming("a tensor entry of its shard files", reason)) from None
        text = str(first).strip().splitlines()
        raise ValueError(f"checkpoint {path} cannot be read ({type(first).__name__}: {text[0] if text else ''}); "
                         f"it is damaged or truncated, or not {_WRITTEN_BY}") from None


def read_metadata(path: Path):
    """The DCP metadata of the sharded checkpoint folder ``path``, read safely."""
    return _reader_class()(path).read_metadata()


def load_sharded_checkpoint(path: Path, config: dict, model: torch.nn.Module, optimizer) -> dict:
    """Load the sharded checkpoint folder ``path`` into ``model`` and ``optimizer`` (sharded by FSDP
    or whole: DCP reshards to this world size). Every rank must call it. Returns {"step", "config",
    "attention", "rng"} and, where the checkpoint holds it, "monitor", as ``read`` returns them for ``ckpt.pt``, after checking that the checkpoint
    was made by a compatible config and fits the model."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    path = Path(path)
    metadata = read_metadata(path)
    entries = metadata.state_dict_metadata
    missing = [f"train.{k}" for k in (*_TRAIN_KEYS, "rng.cpu") if f"train.{k}" not in entries]
    if missing:
        raise ValueError(f"checkpoint {path} is not {_WRITTEN_BY}: it has no {', '.join(missing)}")
    train = {k: None for k in _TRAIN_KEYS}
    if "train.monitor" in entries:                    # optional: the monitor's state
        train["monitor"] = None
    train["rng"] = {}
    for device in ("cpu", "cuda"):
        md = entries.get(f"train.rng.{device}")
        if isinstance(md, TensorStorageMetadata):
            train["rng"][device] = torch.empty(md.size, dtype=md.properties.dtype)
    _dcp_load(path, {"train": train})
    wrong = [f"{k} (a {type(train[k]).__name__})" for k, kind in (("step", int), ("config", str), ("attention", str))
             if not isinstance(train[k], kind) or isinstance(train[k], bool)]
    if not isinstance(train.get("monitor", ""), str):
        wrong.append(f"monitor (a {type(train['monitor']).__name__})")
    saved = None
    if not wrong:
        try:
            saved = json.loads(train["config"])
        except json.JSONDecodeError:
            pass
        if not isinstance(saved, dict):
            wrong.append("config (not a JSON object)")
        if train["step"] < 0:
            wrong.append(f"step ({train['step']})")
        if not (isinstance(train["rng"].get("cpu"), torch.Tensor) and train["rng"]["cpu"].dtype == torch.uint8):
            wrong.append("rng.cpu (not a uint8 tensor)")
    if wrong:
        raise ValueError(f"checkpoint {path} is not {_WRITTEN_BY}: wrong {', '.join(wrong)}")
    differ = [k for k in MUST_MATCH if saved.get(k) != config.get(k)]
    if differ:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {config.get(k)!r}" for k in differ)
        raise ValueError(f"checkpoint {path} was made by another config ({detail})")
    have = {k[len("model."):]: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
            for k, md in entries.items() if k.startswith("model.")}
    _check_shapes(have, model, path)
    names = sorted({k.split(".")[1] for k in entries if k.startswith("optimizer.")})
    if names != sorted(optimizer.optimizers):
        raise ValueError(f"checkpoint {path} holds optimizers {names}, this run uses {sorted(optimizer.optimizers)}")
    state = {"model": get_model_state_dict(model),
             "optimizer": {name: get_optimizer_state_dict(model, opt) for name, opt in optimizer.optimizers.items()}}
    _dcp_load(path, state)
    set_model_state_dict(model, state["model"])
    for name, opt in optimizer.optimizers.items():
        set_optimizer_state_dict(model, opt, state["optimizer"][name])
    return {"step": train["step"], "config": saved, "attention": train["attention"], "rng": train["rng"],
            **({"monitor": train["monitor"]} if "monitor" in train else {})}
