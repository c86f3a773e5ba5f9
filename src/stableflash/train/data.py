"""Token files, deterministic batches, and the record/replay of every batch a run consumed.

Token files are nanoGPT's: ``train.bin`` and ``val.bin`` hold raw little-endian token ids
(uint16; uint32 when ``meta.json`` says so, for vocabularies over 65536). ``meta.json`` is ours:
``{"vocab_size", "tokenizer", "dtype", "tokens": {"train", "val"}, "source"}``. A folder without
it is taken to be a nanoGPT GPT-2 preparation (vocab 50257, uint16), so existing OpenWebText
files load unchanged.

Batches are stateless functions of ``(seed, step, micro, rank)``: a run resumed at step ``s``
draws exactly what an uninterrupted run draws at ``s``. :class:`BatchRecorder` writes each drawn
batch's start offsets to ``run_dir/batches/rank{r}.bin`` and :class:`ReplaySampler` serves them
back, so a failing run can be re-run on exactly the same data order (with another attention
kernel, say).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Union

import numpy as np
import torch
from tqdm.auto import tqdm

from stableflash.files import write_text_atomic

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
SPLITS = ("train", "val")
CHECKS = ("sample", "full", "none")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
NANOGPT_META = {"vocab_size": 50257, "tokenizer": "gpt2", "dtype": "uint16", "tokens": None,
                "source": "nanoGPT token files (no meta.json: assumed GPT-2, vocab 50257, uint16)"}
_EDGE = 65536             # check="sample": the first and last 64K ids
_SAMPLE_WINDOWS = 256     # ... plus this many evenly spaced windows
_SAMPLE_WINDOW = 4096     # ... of this many ids each (~1M ids, page-friendly reads)
_FULL_CHUNK = 1 << 24     # check="full": ids per chunk
_PREPARE_HINT = ("prepare one with stableflash.train.corpus (prepare_embedded, prepare_text, "
                 "prepare_hf) or nanoGPT's data/*/prepare.py")


# ------------------------------------------------------------------------------------------ files

def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest token-file dtype name that holds ids ``0..vocab_size-1``."""
    if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} is invalid; accepted: a positive int")
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ValueError(f"vocab_size={vocab_size} does not fit uint32 token files; accepted: <= 2**32")


def _dtype(dtype) -> np.dtype:
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
    return DTYPES[name]


def read_meta(data_dir: PathLike) -> dict:
    """``data_dir/meta.json``, or nanoGPT's implied GPT-2 meta when there is none."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data_dir {str(data_dir)!r} does not exist or is not a directory; "
                                f"expected a folder with train.bin and val.bin (token ids) and "
                                f"optionally meta.json; {_PREPARE_HINT}")
    path = data_dir / "meta.json"
    if not path.exists():
        return dict(NANOGPT_META)
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete it to treat the folder as "
                         f"nanoGPT GPT-2 files, or prepare the data again") from e
    if not isinstance(meta, dict) or "vocab_size" not in meta:
        raise ValueError(f"{path} has no 'vocab_size'; accepted: an object with vocab_size, "
                         f"tokenizer, dtype, tokens, source")
    meta.setdefault("dtype", dtype_for_vocab(int(meta["vocab_size"])))
    _dtype(meta["dtype"])
    if DTYPES[meta["dtype"]].itemsize == 2 and meta["vocab_size"] > 1 << 16:
        raise ValueError(f"{path}: vocab_size {meta['vocab_size']} does not fit dtype uint16; "
                         f"accepted: dtype uint32 for vocabularies over 65536")
    return meta


def write_split(path: PathLike, ids, dtype=np.uint16, append: bool = False) -> int:
    """Write (or append) token ids to a nanoGPT-style ``.bin`` file; returns the ids written.

    Refuses ids that are negative or do not fit ``dtype`` instead of wrapping them silently.
    """
    dt = _dtype(dtype)
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids has shape {arr.shape}; accepted: a 1-D sequence of token ids")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"ids has dtype {arr.dtype}; accepted: integer token ids")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        limit = np.iinfo(dt).max
        if lo < 0 or hi > limit:
            bad = lo if lo < 0 else hi
            pos = int(np.argmax(arr == bad))
            raise ValueError(f"ids[{pos}] = {bad} does not fit {dt.name} token files for {path}; "
                             f"accepted: 0..{limit} (use dtype=np.uint32 for larger vocabularies)")
    with open(path, "ab" if append else "wb") as f:
        f.write(arr.astype(dt, copy=False).tobytes())
    return int(arr.size)


def _first_bad(arr: np.ndarray, limit: int, offset: int) -> tuple[int, int] | None:
    if arr.size == 0 or int(arr.max()) < limit:
        return None
    i = int(np.argmax(arr >= limit))
    return offset + i, int(arr[i])


def _sample_regions(n: int) -> list[tuple[int, int]]:
    """Sorted, merged [start, stop) regions: first/last 64K ids plus evenly spaced windows."""
    regions = [(0, min(n, _EDGE)), (max(0, n - _EDGE), n)]
    if n > 2 * _EDGE:
        starts = np.linspace(0, n - _SAMPLE_WINDOW, _SAMPLE_WINDOWS).astype(np.int64)
        regions += [(int(s), int(s) + _SAMPLE_WINDOW) for s in starts]
    regions.sort()
    merged: list[tuple[int, int]] = []
    for a, b in regions:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def check_ids(data: np.ndarray, vocab_size: int, check: str = "sample", name: str = "data") -> None:
    """Raise ValueError at the first id >= vocab_size (``check``: "sample", "full" or "none")."""
    if check not in CHECKS:
        raise ValueError(f"check={check!r} is invalid; accepted: {', '.join(CHECKS)}")
    n = len(data)
    bad = None
    if check == "sample":
        for a, b in _sample_regions(n):
            bad = _first_bad(np.asarray(data[a:b]), vocab_size, a)
            if bad:
                break
    elif check == "full":
        with tqdm(total=n, desc=f"checking {name}", unit="tok", unit_scale=True, leave=False) as bar:
            for a in range(0, n, _FULL_CHUNK):
                b = min(n, a + _FULL_CHUNK)
                bad = _first_bad(np.asarray(data[a:b]), vocab_size, a)
                if bad:
                    break
                bar.update(b - a)
    if bad:
        pos, value = bad
        scope = "" if check == "full" else " (sampled check; check='full' scans every id)"
        raise ValueError(f"{name}: token id {value} at position {pos} is >= vocab_size {vocab_size}"
                         f"{scope}; the file is corrupt or was tokenized for a larger vocabulary "
                         f"(fix meta.json's vocab_size/dtype or prepare the data again)")


def load_split(data_dir: PathLike, split: str, vocab_size: int | None = None,
               block_size: int | None = None, check: str = "sample") -> np.memmap:
    """Memory-map ``data_dir/{split}.bin`` after checking size, length and token ids.

    Args:
        data_dir: folder with ``train.bin``/``val.bin`` and optionally ``meta.json``.
        split: ``"train"`` or ``"val"``.
        vocab_size: the model's vocabulary. Without meta.json the ids are checked against it (or
            50257); with meta.json it must be at least meta's vocab_size, and ids are checked
            against meta's.
        block_size: when given, the file must hold more than ``block_size + 1`` tokens.
        check: ``"sample"`` (first/last 64K ids and ~1M ids spread over the file), ``"full"``
            (every id, in chunks, with a progress bar) or ``"none"``.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid; accepted: {', '.join(SPLITS)}")
    if check not in CHECKS:
        raise ValueError(f"check={check!r} is invalid; accepted: {', '.join(CHECKS)}")
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    has_meta = (data_dir / "meta.json").exists()
    if vocab_size is not None and (not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1):
        raise ValueError(f"vocab_size={vocab_size!r} is invalid; accepted: a positive int or None")
    if has_meta:
        limit = int(meta["vocab_size"])
        if vocab_size is not None and vocab_size < limit:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the data's vocab_size {limit} "
                             f"({data_dir / 'meta.json'}, tokenizer {meta.get('tokenizer')!r}); "
                             f"accepted: a model vocab_size >= {limit}")
    else:
        limit = int(vocab_size) if vocab_size is not None else NANOGPT_META["vocab_size"]
    dt = DTYPES[meta["dtype"]]
    path = data_dir / f"{split}.bin"
    if not path.exists():
        present = sorted(p.name for p in data_dir.iterdir())[:10]
        raise FileNotFoundError(f"{path} does not exist; expected train.bin and val.bin in {data_dir} "
                                f"(found: {', '.join(present) or 'nothing'}); {_PREPARE_HINT}")
    size = path.stat().st_size
    if size % dt.itemsize:
        raise ValueError(f"{path} is {size} bytes, not a multiple of {dt.itemsize} ({dt.name} token "
                         f"ids); the file is truncated or meta.json's dtype is wrong")
    n = size // dt.itemsize
    if n == 0:
        raise ValueError(f"{path} is empty; accepted: a file of {dt.name} token ids; {_PREPARE_HINT}")
    expected = (meta.get("tokens") or {}).get(split) if isinstance(meta.get("tokens"), dict) else None
    if expected is not None and int(expected) != n:
        raise ValueError(f"{path} holds {n} tokens but meta.json says {expected}; the file is "
                         f"truncated or belongs to another preparation")
    if block_size is not None:
        if not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is invalid; accepted: a positive int")
        if n <= block_size + 1:
            raise ValueError(f"{path} holds {n} tokens, too few for block_size={block_size}; "
                             f"accepted: more than block_size + 1 = {block_size + 1} tokens")
    data = np.memmap(path, dtype=dt, mode="r")
    check_ids(data, limit, check, name=str(path))
    log.info("loaded %s: %d tokens (%s, vocab %d, tokenizer %s)", path, n, dt.name, limit,
             meta.get("tokenizer"))
    return data


# --------------------------------------------------------------------------------------- batches

def _nonneg_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid; accepted: an int >= 0")
    return int(value)


def _pos_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid; accepted: an int >= 1")
    return int(value)


def _n_starts(data, block_size: int) -> int:
    n = len(data) - block_size - 1
    if n < 1:
        raise ValueError(f"data holds {len(data)} tokens, too few for block_size={block_size}; "
                         f"accepted: more than block_size + 1 = {block_size + 1} tokens")
    return n


def get_batch(data: np.ndarray, indices, block_size: int,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``x = data[i:i+T]`` and targets ``y = data[i+1:i+1+T]`` for each start ``i``.

    Returns int64 tensors of shape (len(indices), block_size). On CUDA the host copies are
    pinned and moved with ``non_blocking=True``.
    """
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1 or idx.size == 0:
        raise ValueError(f"indices has shape {idx.shape}; accepted: a non-empty 1-D array of offsets")
    hi = len(data) - block_size - 1
    if idx.min() < 0 or idx.max() >= hi + 1:
        bad = int(idx[(idx < 0) | (idx > hi)][0])
        raise ValueError(f"indices contains {bad}; accepted: offsets 0..{hi} for {len(data)} tokens "
                         f"and block_size={block_size}")
    buf = np.stack([np.asarray(data[i:i + block_size + 1]) for i in idx]).astype(np.int64)
    x = torch.from_numpy(np.ascontiguousarray(buf[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(buf[:, 1:]))
    device = torch.device(device)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


class BatchSampler:
    """Stateless batch offsets: ``indices(step, micro)`` depends only on (seed, step, micro, rank)."""

    def __init__(self, data: np.ndarray, block_size: int, batch_size: int, seed: int,
                 rank: int = 0) -> None:
        self.data = data
        self.block_size = _pos_int("block_size", block_size)
        self.batch_size = _pos_int("batch_size", batch_size)
        self.seed = _nonneg_int("seed", seed)
        self.rank = _nonneg_int("rank", rank)
        self.high = _n_starts(data, self.block_size)   # offsets drawn from [0, high)

    def indices(self, step: int, micro: int = 0) -> np.ndarray:
        """``batch_size`` int64 start offsets for this (step, micro-batch)."""
        rng = np.random.default_rng([self.seed, _nonneg_int("step", step),
                                     _nonneg_int("micro", micro), self.rank])
        return rng.integers(0, self.high, size=self.batch_size, dtype=np.int64)

    def get_batch(self, indices, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 tensors for ``indices`` (see :func:`get_batch`)."""
        return get_batch(self.data, indices, self.block_size, device)


def eval_batches(data: np.ndarray, block_size: int, batch_size: int, n_batches: int,
                 seed: int = 0) -> np.ndarray:
    """Fixed validation offsets, shape (n_batches, batch_size): the same on every call.

    Iterate over the rows and pass each to :func:`get_batch`.
    """
    block_size = _pos_int("block_size", block_size)
    batch_size, n_batches = _pos_int("batch_size", batch_size), _pos_int("n_batches", n_batches)
    high = _n_starts(data, block_size)
    rng = np.random.default_rng([_nonneg_int("seed", seed), 0xE7A1])
    return rng.integers(0, high, size=(n_batches, batch_size), dtype=np.int64)


# --------------------------------------------------------------------------- record and replay

_FORMAT = "stableflash-batches-v1"


def _batch_paths(batches_dir: Path, rank: int) -> tuple[Path, Path]:
    return batches_dir / f"rank{rank}.bin", batches_dir / f"rank{rank}.json"


class BatchRecorder:
    """Appends every consumed batch to ``run_dir/batches/rank{rank}.bin``.

    Each row is int64: ``step, micro, offset_0 .. offset_{batch_size-1}``; ``rank{rank}.json``
    records batch_size, block_size, seed and the data path. Rows are flushed as they are written,
    so a killed run keeps what it consumed. ``start_step`` is where this run begins: rows with
    step >= start_step are dropped first (a resumed run re-draws them), so the file never holds
    the same batch twice. ``start_step=0`` starts a fresh recording.
    """

    def __init__(self, run_dir: PathLike, rank: int = 0, *, batch_size: int, block_size: int,
                 seed: int | None = None, data_path: PathLike | None = None,
                 start_step: int = 0) -> None:
        self.rank = _nonneg_int("rank", rank)
        self.batch_size = _pos_int("batch_size", batch_size)
        self.block_size = _pos_int("block_size", block_size)
        self.start_step = _nonneg_int("start_step", start_step)
        self.dir = Path(run_dir) / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path, self.header_path = _batch_paths(self.dir, self.rank)
        self.row_len = 2 + self.batch_size
        self.header = {"format": _FORMAT, "rank": self.rank, "batch_size": self.batch_size,
                       "block_size": self.block_size, "seed": seed,
                       "data": None if data_path is None else str(data_path),
                       "row": "int64: step, micro, batch_size start offsets"}
        self._last: tuple[int, int] | None = None
        kept = self._truncate() if self.start_step > 0 else 0
        if self.start_step == 0 and self.path.exists() and self.path.stat().st_size:
            log.info("%s: starting a fresh recording (start_step=0), previous rows dropped", self.path)
        if kept == 0:
            self.path.write_bytes(b"")
        write_text_atomic(self.header_path, json.dumps(self.header, indent=1) + "\n")
        self._file = open(self.path, "ab")

    def _truncate(self) -> int:
        """Keep rows with step < start_step; returns how many rows remain."""
        if not self.path.exists():
            log.warning("%s: resuming at step %d but there is no earlier recording; steps before "
                        "%d will be missing from the replay", self.path, self.start_step, self.start_step)
            return 0
        if self.header_path.exists():
            old = json.loads(self.header_path.read_text())
            for key in ("batch_size", "block_size"):
                if old.get(key) != getattr(self, key):
                    raise ValueError(f"{key}={getattr(self, key)} differs from the recording being "
                                     f"resumed ({self.header_path}: {key}={old.get(key)}); accepted: "
                                     f"the same {key}, or start_step=0 for a fresh recording")
        row_bytes = 8 * self.row_len
        size = self.path.stat().st_size
        n = size // row_bytes
        if size % row_bytes:
            log.warning("%s: dropping a partial row at the end (a run killed mid-write)", self.path)
        rows = np.fromfile(self.path, dtype="<i8", count=n * self.row_len).reshape(n, self.row_len)
        keep = rows[:, 0] < self.start_step
        n_keep = int(keep.sum())
        if keep[:n_keep].all():           # the usual case: steps are in order, cut the tail
            os.truncate(self.path, n_keep * row_bytes)
        else:
            rows[keep].astype("<i8").tofile(self.path)
        if n_keep:
            last_step = int(rows[keep][-1, 0])
            self._last = (last_step, int(rows[keep][-1, 1]))
            if last_step < self.start_step - 1:
                log.warning("%s: resuming at step %d but the recording ends at step %d",
                            self.path, self.start_step, last_step)
        log.info("%s: resumed at step %d, kept %d of %d rows", self.path, self.start_step, n_keep, n)
        return n_keep

    def record(self, step: int, micro: int, indices) -> None:
        """Append one batch's offsets; (step, micro) must increase from call to call."""
        step, micro = _nonneg_int("step", step), _nonneg_int("micro", micro)
        idx = np.asarray(indices, dtype=np.int64)
        if idx.shape != (self.batch_size,):
            raise ValueError(f"indices has shape {idx.shape}; accepted: ({self.batch_size},), the "
                             f"batch_size of this recording")
        if step < self.start_step or (self._last is not None and (step, micro) <= self._last):
            after = self._last if self._last is not None else f"start_step {self.start_step}"
            raise ValueError(f"(step, micro)=({step}, {micro}) does not come after {after}; "
                             f"accepted: increasing (step, micro), each recorded once")
        row = np.empty(self.row_len, dtype="<i8")
        row[0], row[1], row[2:] = step, micro, idx
        self._file.write(row.tobytes())
        self._file.flush()
        self._last = (step, micro)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "BatchRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReplaySampler:
    """Serves exactly the offsets a :class:`BatchRecorder` recorded, by (step, micro).

    ``batches_dir`` is the recording's ``batches`` folder (a run folder holding one works too).
    ``block_size`` and ``data``, when given, are checked against the recording.
    """

    def __init__(self, batches_dir: PathLike, rank: int = 0, batch_size: int | None = None,
                 block_size: int | None = None, data: np.ndarray | None = None) -> None:
        self.rank = _nonneg_int("rank", rank)
        d = Path(batches_dir)
        if not _batch_paths(d, self.rank)[0].exists() and _batch_paths(d / "batches", self.rank)[0].exists():
            d = d / "batches"
        self.path, self.header_path = _batch_paths(d, self.rank)
        for p in (self.path, self.header_path):
            if not p.exists():
                raise FileNotFoundError(f"{p} does not exist; expected rank{self.rank}.bin and "
                                        f"rank{self.rank}.json written by BatchRecorder in "
                                        f"{batches_dir} (a run that recorded its batches)")
        self.header = json.loads(self.header_path.read_text())
        rec_b, rec_t = int(self.header["batch_size"]), int(self.header["block_size"])
        if batch_size is not None and batch_size != rec_b:
            raise ValueError(f"batch_size={batch_size} differs from the recording's batch_size "
                             f"{rec_b} ({self.header_path}); accepted: {rec_b}")
        if block_size is not None and block_size != rec_t:
            raise ValueError(f"block_size={block_size} differs from the recording's block_size "
                             f"{rec_t} ({self.header_path}); accepted: {rec_t}")
        self.batch_size, self.block_size, self.data = rec_b, rec_t, data
        row_len = 2 + rec_b
        size = self.path.stat().st_size
        n = size // (8 * row_len)
        if size % (8 * row_len):
            log.warning("%s: ignoring a partial row at the end (a run killed mid-write)", self.path)
        self.rows = np.fromfile(self.path, dtype="<i8", count=n * row_len).reshape(n, row_len)
        self._where = {(int(s), int(m)): i for i, (s, m) in enumerate(self.rows[:, :2])}
        if len(self._where) != n:
            raise ValueError(f"{self.path} holds the same (step, micro) more than once; the recording "
                             f"is damaged")
        self.steps = np.unique(self.rows[:, 0])
        self._step_set = {int(s) for s in self.steps}
        if data is not None and n:
            hi = _n_starts(data, rec_t)
            if self.rows[:, 2:].max() >= hi:
                raise ValueError(f"{self.path} has offsets up to {int(self.rows[:, 2:].max())}, beyond "
                                 f"the {len(data)} tokens of data given (recorded on "
                                 f"{self.header.get('data')}); accepted: the data it was recorded on")

    def indices(self, step: int, micro: int = 0) -> np.ndarray:
        """The recorded offsets of (step, micro); ValueError when they were never recorded."""
        i = self._where.get((int(step), int(micro)))
        if i is None:
            n = len(self.steps)
            span = f"steps {int(self.steps[0])}..{int(self.steps[-1])}" if n else "no steps"
            what = f"step {step}" if int(step) not in self._step_set else f"micro {micro} of step {step}"
            raise ValueError(f"{what} was never recorded in {self.path}: it holds {n} recorded steps "
                             f"({span}, {len(self.rows)} batches)")
        return self.rows[i, 2:].copy()

    def get_batch(self, indices, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for ``indices`` from the ``data`` given at construction."""
        if self.data is None:
            raise ValueError("ReplaySampler was built without data=; accepted: pass data= (the memmap "
                             "the recording was made on) to use get_batch")
        return get_batch(self.data, indices, self.block_size, device)
