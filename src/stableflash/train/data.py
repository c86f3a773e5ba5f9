"""Token files, deterministic batches, and the record/replay of every batch a run consumed.

Token files are nanoGPT's: ``train.bin`` and ``val.bin`` hold raw little-endian token ids
(uint16, or uint32 for vocabularies over 65536). The vocabulary comes from the folder:
``meta.json`` (ours: ``{"vocab_size", "tokenizer", "dtype", "eot_token", "tokens": {"train",
"val"}, "source"}``), else nanoGPT's ``meta.pkl`` (``{"vocab_size", "itos", "stoi"}``, read without
running code), else the folder is taken to be nanoGPT's GPT-2 preparation (vocab 50257, uint16),
as nanoGPT's ``train.py`` takes it, so OpenWebText folders load unchanged.

A run records the fingerprint of its data folder in ``run_dir/data.json`` (:class:`RunData`) and
refuses to resume, or to replay another run's batches, on data that changed since.

Batches are stateless functions of ``(seed, step, micro, rank)``: a run resumed at step ``s``
draws exactly what an uninterrupted run draws at ``s``. :class:`BatchRecorder` writes each drawn
batch's start offsets to ``run_dir/batches/rank{r}.bin`` and :class:`ReplaySampler` serves them
back, so a failing run can be re-run on exactly the same data order (with another attention
kernel, say).
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import pickle
from pathlib import Path
from typing import Union

import numpy as np
import torch

from stableflash.files import atomic_write, write_text_atomic
from stableflash.progress import progress_bar

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
SPLITS = ("train", "val")
CHECKS = ("sample", "full", "none")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
NANOGPT_META = {"vocab_size": 50257, "tokenizer": "gpt2", "tokens": None,
                "source": "nanoGPT token files (no meta.json or meta.pkl: taken as GPT-2, vocab 50257)"}
META_FILES = ("meta.json", "meta.pkl")
# a tokenizer's end-of-text id, for data folders whose meta.json does not give eot_token (GPT-2's
# <|endoftext|>, which nanoGPT's OpenWebText preparation appends to every document)
KNOWN_EOT = {"gpt2": 50256}
INCOMPLETE = "incomplete"  # meta.json's key while `data prepare` replaces a folder's files
_EDGE = 65536             # check="sample": the first and last 64K ids
_SAMPLE_WINDOWS = 256     # ... plus this many evenly spaced windows
_SAMPLE_WINDOW = 4096     # ... of this many ids each (~1M ids, page-friendly reads)
_FULL_CHUNK = 1 << 24     # check="full": ids per chunk
_DTYPE_PROBE = 1 << 16    # uint16 words read from each token file to tell uint16 from uint32
_META_PKL_MAX = 64 << 20  # bytes: a nanoGPT meta.pkl is kilobytes
_PREPARE_HINT = ("`stableflash data prepare` makes one (or stableflash.train.corpus's prepare_text, "
                 "prepare_hf, prepare_embedded; or nanoGPT's data/*/prepare.py)")
_FOLDER_HINT = ("a data folder holds train.bin and val.bin (token ids) and meta.json (or nanoGPT's "
                "meta.pkl) naming the vocabulary")
_warned_default: set[str] = set()


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


def _listing(folder: Path, limit: int = 10) -> str:
    try:
        names = sorted(p.name for p in itertools.islice(folder.iterdir(), 10_000))
    except OSError:
        return "unreadable"
    more = f", ... ({len(names)}{'+' if len(names) == 10_000 else ''} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "nothing"


def _data_subfolders(folder: Path, depth: int = 2, budget: int = 500) -> list[Path]:
    """Folders up to ``depth`` levels below ``folder`` that hold a train.bin (a bounded search)."""
    found, level = [], [folder]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                children = sorted(itertools.islice(d.iterdir(), budget))
            except OSError:
                continue
            for c in children:
                if budget <= 0:
                    return found
                budget -= 1
                try:
                    if c.name.startswith(".") or c.is_symlink() or not c.is_dir():
                        continue
                    if (c / "train.bin").is_file():
                        found.append(c)
                    else:
                        nxt.append(c)
                except OSError:
                    continue
        level = nxt
    return found


def check_data_folder(data_dir: PathLike) -> Path:
    """``data_dir`` as a Path, after checking it is a folder holding train.bin and val.bin.

    The error for a folder that is not a data folder (empty, a parent of data folders, ``/proc``)
    names it, says what a data folder holds, and suggests subfolders that hold token files.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data folder {str(data_dir)!r} does not exist or is not a folder; "
                                f"{_FOLDER_HINT}; {_PREPARE_HINT}")
    missing = [s for s in SPLITS if not (data_dir / f"{s}.bin").is_file()]
    if len(missing) == len(SPLITS):
        subs = _data_subfolders(data_dir)
        hint = ""
        if subs:
            shown = ", ".join(str(s) for s in subs[:5]) + (", ..." if len(subs) > 5 else "")
            hint = f"; these subfolders hold token files: {shown} (did you mean data={subs[0]}?)"
        raise FileNotFoundError(f"{data_dir} is not a data folder: it holds no train.bin and no val.bin "
                                f"(found: {_listing(data_dir)}); {_FOLDER_HINT}; {_PREPARE_HINT}{hint}")
    if missing:
        path = data_dir / f"{missing[0]}.bin"
        raise FileNotFoundError(f"{path} does not exist or is not a file; expected train.bin and val.bin "
                                f"in {data_dir} (found: {_listing(data_dir)}); {_PREPARE_HINT}")
    for name in ("train.bin", "val.bin", *META_FILES):
        if (data_dir / name).exists() and not os.access(data_dir / name, os.R_OK):
            raise ValueError(f"{data_dir / name} cannot be read (permission denied); accepted: a readable file")
    return data_dir


def _vocab(value, source: Path) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value <= 1 << 32:
        raise ValueError(f"{source}: vocab_size={value!r} is invalid; accepted: an int in 1..2**32")
    return int(value)


def _read_meta_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} is not a file; accepted: a JSON object with vocab_size (and "
                         f"tokenizer, dtype, tokens, source)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete it to treat the folder as "
                         f"nanoGPT GPT-2 files, or prepare the data again") from e
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e})") from e
    if isinstance(meta, dict) and meta.get(INCOMPLETE):
        raise ValueError(f"{path} marks a preparation that was stopped while it replaced the folder's "
                         f"token files, which are now a mix of two preparations; prepare the data again "
                         f"(stableflash data prepare --out {path.parent} ...)")
    if not isinstance(meta, dict) or "vocab_size" not in meta:
        raise ValueError(f"{path} has no 'vocab_size'; accepted: an object with vocab_size, "
                         f"tokenizer, dtype, tokens, source")
    return meta


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _PlainValues(pickle.Unpickler):
    """An unpickler that loads plain values (dicts, lists, strings, numbers) and nothing else:
    every global a pickle names (a class, a function such as ``os.system``) is refused, so loading
    runs no code from the file."""

    def find_class(self, module, name):
        raise _RefusedGlobal(f"it refers to the global {module}.{name}")


def _read_meta_pkl(path: Path) -> dict:
    """nanoGPT's meta.pkl (``{"vocab_size", "itos", "stoi"}``), read without running code."""
    size = path.stat().st_size if path.is_file() else -1
    if not 0 < size <= _META_PKL_MAX:
        raise ValueError(f"{path} is {'not a file' if size < 0 else f'{size} bytes'}; accepted: nanoGPT's "
                         f"meta.pkl (a pickled dict with vocab_size, at most {_META_PKL_MAX >> 20} MiB)")
    try:
        meta = _PlainValues(io.BytesIO(path.read_bytes())).load()
    except _RefusedGlobal as e:
        raise ValueError(f"{path} was refused: {e}, and loading it would run that code. meta.pkl is read "
                         f"as plain values only (a dict of ints and strings, as nanoGPT writes it); "
                         f"replace it with a meta.json ({{\"vocab_size\": N}})") from None
    except Exception as e:        # a damaged pickle: EOFError, ValueError, KeyError, MemoryError...
        raise ValueError(f"{path} is not a readable pickle ({type(e).__name__}: {e}); accepted: "
                         f"nanoGPT's meta.pkl, or a meta.json ({{\"vocab_size\": N}}) instead") from None
    if not isinstance(meta, dict) or "vocab_size" not in meta:
        what = "a dict without vocab_size" if isinstance(meta, dict) else f"a {type(meta).__name__}"
        raise ValueError(f"{path} holds {what}; accepted: nanoGPT's meta.pkl, a dict with vocab_size (and "
                         f"itos, stoi)")
    char = isinstance(meta.get("stoi"), dict) or isinstance(meta.get("itos"), dict)
    return {"vocab_size": meta["vocab_size"], "tokenizer": "char" if char else None, "tokens": None,
            "source": f"nanoGPT meta.pkl{' (character-level)' if char else ''}"}


def _looks_uint32(paths: list[Path]) -> tuple[bool, int]:
    """Whether the files read as uint16 have every second word 0 (and not every word 0): the
    pattern of uint32 ids below 65536. Returns (looks so, odd words seen)."""
    odd_words, odd_nonzero, even_nonzero = 0, False, False
    for path in paths:
        with open(path, "rb") as f:
            words = np.frombuffer(f.read(4 * (_DTYPE_PROBE // 2)), dtype="<u2")
        odd_words += len(words[1::2])
        odd_nonzero |= bool(words[1::2].any())
        even_nonzero |= bool(words[0::2].any())
    return odd_words >= 16 and not odd_nonzero and even_nonzero, odd_words


def _infer_dtype(data_dir: Path, meta: dict, origin: str) -> str:
    """The token files' dtype: meta.json's, else from its token counts and the file sizes, else
    uint32 for vocabularies over 65536, else nanoGPT's uint16 unless the files look like uint32."""
    where = data_dir / origin if origin else data_dir
    vocab = int(meta["vocab_size"])
    if meta.get("dtype") is not None:
        name = meta["dtype"]
        if not isinstance(name, str) or name not in DTYPES:
            raise ValueError(f"{where}: dtype={name!r} is not supported; accepted: {', '.join(DTYPES)}")
        if DTYPES[name].itemsize == 2 and vocab > 1 << 16:
            raise ValueError(f"{where}: vocab_size {vocab} does not fit dtype uint16; "
                             f"accepted: dtype uint32 for vocabularies over 65536")
        return name
    sizes = {s: (data_dir / f"{s}.bin").stat().st_size for s in SPLITS}
    tokens = meta.get("tokens") if isinstance(meta.get("tokens"), dict) else {}
    from_counts = set()
    for split in SPLITS:
        count = tokens.get(split)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            by_size = {2 * count: "uint16", 4 * count: "uint32"}
            if sizes[split] not in by_size:
                raise ValueError(f"{data_dir / f'{split}.bin'} is {sizes[split]} bytes, neither 2 (uint16) nor "
                                 f"4 (uint32) bytes for each of the {count} tokens {where} counts; the file "
                                 f"is truncated or belongs to another preparation")
            from_counts.add(by_size[sizes[split]])
    if len(from_counts) > 1:
        raise ValueError(f"{data_dir}: by {where}'s token counts train.bin and val.bin have different "
                         f"dtypes ({sizes}); accepted: files of one preparation (add \"dtype\" to meta.json)")
    if from_counts:
        return from_counts.pop()
    if vocab > 1 << 16:
        return "uint32"
    if all(size % 4 == 0 for size in sizes.values()):
        looks, seen = _looks_uint32([data_dir / f"{s}.bin" for s in SPLITS])
        if looks:
            fix = (f"add \"dtype\": \"uint32\" (or \"uint16\") to {data_dir / 'meta.json'}" if origin == "meta.json"
                   else f"write {data_dir / 'meta.json'} with {{\"vocab_size\": {vocab}, \"dtype\": \"uint32\"}} "
                        f"(or \"uint16\")")
            said = f"{origin} gives no dtype" if origin else "there is no meta.json to give the dtype"
            raise ValueError(f"{data_dir}: the token files look like uint32 ids (every second uint16 word is 0 "
                             f"in the {seen} checked), but {said} and vocab_size {vocab} fits uint16 "
                             f"(nanoGPT's convention), so which it is cannot be told; {fix}")
    return "uint16"


def read_meta(data_dir: PathLike) -> dict:
    """The vocabulary and token dtype of a data folder (see :func:`check_data_folder`).

    From ``meta.json``; else nanoGPT's ``meta.pkl`` (plain values only: a pickle that refers to
    any class or function is refused unrun); else nanoGPT's GPT-2 default (vocab 50257), logged.
    ``dtype`` is meta.json's, else inferred (see docs/training.md, "Data"). ``meta_file`` names
    the file the vocabulary came from (None for the default).
    """
    data_dir = check_data_folder(data_dir)
    origin = next((name for name in META_FILES if (data_dir / name).exists()), None)
    if origin == "meta.json":
        meta = _read_meta_json(data_dir / origin)
    elif origin == "meta.pkl":
        meta = _read_meta_pkl(data_dir / origin)
    else:
        meta = dict(NANOGPT_META)
        key = str(data_dir.resolve())
        if key not in _warned_default:
            _warned_default.add(key)
            log.warning("%s has no meta.json or meta.pkl: taken as nanoGPT's GPT-2 token files "
                        "(vocab_size 50257), as nanoGPT's train.py does; write a meta.json to say otherwise",
                        data_dir)
    meta["vocab_size"] = _vocab(meta["vocab_size"], data_dir / origin if origin else data_dir)
    meta["dtype"] = _infer_dtype(data_dir, meta, origin)
    meta["eot_token"] = _eot_token(meta, data_dir / origin if origin else data_dir)
    meta["meta_file"] = origin
    return meta


def _eot_token(meta: dict, source: Path) -> int | None:
    """The id that ends each document: meta.json's ``eot_token`` when it has the key (null: none),
    else its tokenizer's (KNOWN_EOT), else None."""
    if "eot_token" not in meta:
        return KNOWN_EOT.get(meta.get("tokenizer"))
    value = meta["eot_token"]
    if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
                              or not 0 <= value < int(meta["vocab_size"])):
        raise ValueError(f"{source}: eot_token={value!r} is invalid; accepted: null (no end-of-text token) or "
                         f"the id that ends each document, an int with 0 <= eot_token < vocab_size="
                         f"{meta['vocab_size']}")
    return None if value is None else int(value)


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
    """Raise ValueError at the first id >= vocab_size (``check``: "sample", "full" or "none").

    "full" is one vectorised pass over the memmap in chunks of 16M ids (memory-bound: tens of
    GB/s from the page cache, the disk's speed otherwise).
    """
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
        with progress_bar(total=n, desc=f"checking {name}", unit="tok", unit_scale=True, leave=False,
                          disable=n <= 8 * _FULL_CHUNK) as bar:
            for a in range(0, n, _FULL_CHUNK):
                b = min(n, a + _FULL_CHUNK)
                bad = _first_bad(np.asarray(data[a:b]), vocab_size, a)
                if bad:
                    break
                bar.update(b - a)
    if bad:
        pos, value = bad
        scope = "" if check == "full" else "; sampled check: check='full' scans every id"
        raise ValueError(f"{name}: token id {value} at position {pos} is >= vocab_size {vocab_size} (byte "
                         f"offset {pos * data.dtype.itemsize}{scope}); the file is corrupt or was tokenized "
                         f"for a larger vocabulary (fix meta.json's vocab_size/dtype or prepare the data again)")


def load_split(data_dir: PathLike, split: str, vocab_size: int | None = None,
               block_size: int | None = None, check: str = "sample", meta: dict | None = None) -> np.memmap:
    """Memory-map ``data_dir/{split}.bin`` after checking size, length and token ids.

    Args:
        data_dir: folder with ``train.bin``/``val.bin`` and meta.json or meta.pkl (see
            :func:`read_meta`).
        split: ``"train"`` or ``"val"``.
        vocab_size: the model's vocabulary. It must be at least the folder's (meta.json's or
            meta.pkl's), and ids are checked against the folder's; for a folder without either,
            ids are checked against it (or 50257).
        block_size: when given, the file must hold more than ``block_size + 1`` tokens.
        check: ``"sample"`` (first/last 64K ids and ~1M ids spread over the file), ``"full"``
            (every id, in chunks) or ``"none"``.
        meta: the folder's :func:`read_meta`, when the caller has read it already.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid; accepted: {', '.join(SPLITS)}")
    if check not in CHECKS:
        raise ValueError(f"check={check!r} is invalid; accepted: {', '.join(CHECKS)}")
    data_dir = Path(data_dir)
    meta = read_meta(data_dir) if meta is None else meta
    if vocab_size is not None and (not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool)
                                   or vocab_size < 1):
        raise ValueError(f"vocab_size={vocab_size!r} is invalid; accepted: a positive int or None")
    if meta["meta_file"]:
        limit = int(meta["vocab_size"])
        if vocab_size is not None and vocab_size < limit:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the data's vocab_size {limit} "
                             f"({data_dir / meta['meta_file']}, tokenizer {meta.get('tokenizer')!r}); "
                             f"accepted: a model vocab_size >= {limit}")
    else:
        limit = int(vocab_size) if vocab_size is not None else NANOGPT_META["vocab_size"]
    dt = DTYPES[meta["dtype"]]
    path = data_dir / f"{split}.bin"
    size = path.stat().st_size
    if size % dt.itemsize:
        raise ValueError(f"{path} is {size} bytes, not a multiple of {dt.itemsize} ({dt.name} token "
                         f"ids); the file is truncated or meta.json's dtype is wrong")
    n = size // dt.itemsize
    if n == 0:
        raise ValueError(f"{path} is empty; accepted: a file of {dt.name} token ids; {_PREPARE_HINT}")
    expected = (meta.get("tokens") or {}).get(split) if isinstance(meta.get("tokens"), dict) else None
    if expected is not None and expected != n:
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


# ------------------------------------------------------------------------- the data a run used

FINGERPRINT_SCHEME = "stableflash-data-v1"
RUN_RECORD = "data.json"
_FULL_HASH_MAX = 64 << 20     # files up to 64 MiB are hashed whole
_EDGE_BYTES = 1 << 20         # larger ones: the first and the last MiB,
_BLOCKS = 62                  # ... and 62 evenly spaced blocks
_BLOCK = 1 << 16              # ... of 64 KiB (6 MiB read per file, whatever its size)
_ALLOW_HINT = "--allow-data-change (train(..., allow_data_change=True))"


def _file_digest(path: Path) -> dict:
    """``{"bytes", "sha256", "hashed"}``: the whole file up to 64 MiB, else its size, first and
    last MiB and 62 evenly spaced 64 KiB blocks."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _FULL_HASH_MAX:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
            return {"bytes": size, "sha256": h.hexdigest(), "hashed": "all"}
        h.update(size.to_bytes(8, "little"))
        inner = np.linspace(_EDGE_BYTES, size - _EDGE_BYTES - _BLOCK, _BLOCKS).astype(np.int64)
        for offset, n in [(0, _EDGE_BYTES), *((int(o), _BLOCK) for o in inner), (size - _EDGE_BYTES, _EDGE_BYTES)]:
            f.seek(offset)
            h.update(f.read(n))
    return {"bytes": size, "sha256": h.hexdigest(), "hashed": "sampled"}


def data_fingerprint(data_dir: PathLike, meta: dict | None = None) -> dict:
    """The identity of a data folder's content: ``{"scheme", "sha256", "files", "meta"}``.

    ``files`` has ``{"bytes", "sha256", "hashed"}`` for train.bin, val.bin and the meta file(s)
    present; ``sha256`` combines them. It depends on content only (not on paths or modification
    times), so a copied folder has the same fingerprint. Token files over 64 MiB are hashed at
    their size, first and last MiB and 62 blocks of 64 KiB spread over the file (~6 MiB read):
    any re-preparation changes that, while a full hash of a multi-GB file would cost seconds on
    every start. ``meta`` (:func:`read_meta`'s, read when not given) adds the vocabulary, dtype,
    tokenizer and token counts, for saying what changed.
    """
    data_dir = check_data_folder(data_dir)
    meta = read_meta(data_dir) if meta is None else meta
    files = {name: _file_digest(data_dir / name)
             for name in ("train.bin", "val.bin", *META_FILES) if (data_dir / name).is_file()}
    combined = hashlib.sha256(json.dumps({k: [v["bytes"], v["sha256"]] for k, v in files.items()},
                                         sort_keys=True).encode()).hexdigest()
    return {"scheme": FINGERPRINT_SCHEME, "sha256": combined, "files": files,
            "meta": {k: meta.get(k) for k in ("vocab_size", "dtype", "tokenizer", "tokens")}}


def fingerprint_changes(old: dict, new: dict) -> list[str]:
    """What differs between two :func:`data_fingerprint` results, one phrase per difference."""
    out = []
    of, nf = old.get("files") or {}, new.get("files") or {}
    for name in sorted(set(of) | set(nf)):
        a, b = of.get(name), nf.get(name)
        if a is None:
            out.append(f"{name} added ({b['bytes']:,} bytes)")
        elif b is None:
            out.append(f"{name} removed")
        elif a.get("bytes") != b.get("bytes"):
            out.append(f"{name} {a.get('bytes'):,} -> {b.get('bytes'):,} bytes")
        elif a.get("sha256") != b.get("sha256"):
            out.append(f"{name} has other content (same {b['bytes']:,} bytes)")
    om, nm = old.get("meta") or {}, new.get("meta") or {}
    out += [f"{k} {om.get(k)!r} -> {nm.get(k)!r}" for k in ("vocab_size", "dtype", "tokenizer", "tokens")
            if om.get(k) != nm.get(k)]
    return out


def _record_path(run_or_batches_dir: Path) -> Path:
    d = Path(run_or_batches_dir)
    if not (d / RUN_RECORD).exists() and d.name == "batches":
        return d.parent / RUN_RECORD
    return d / RUN_RECORD


def read_run_record(path: PathLike) -> dict | None:
    """A run folder's data.json (the record :class:`RunData` writes), or None when there is none."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        fp = record["fingerprint"]
        if not isinstance(fp, dict) or not isinstance(fp.get("files"), dict):
            raise TypeError("fingerprint is not an object with files")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}); it records the fingerprint of the "
                         f"data the run was trained on. Delete it to go on without the comparison (the "
                         f"current data is then recorded)") from None
    return record


class RunData:
    """The data folder a run trains on, fingerprinted and compared with what runs recorded.

    ``run_dir/data.json`` holds the folder's :func:`data_fingerprint` and the token files that
    passed the full id-range check. With ``resume=True`` the folder is compared with the run's
    record, with ``replay=RUN`` with RUN's record (its batch offsets index that data): changed
    data raises ValueError naming the folder and what changed, unless ``allow_change`` (then a
    warning, and the record keeps the earlier fingerprints under ``previous``). Nothing is
    written until :meth:`record`.
    """

    def __init__(self, data_dir: PathLike, run_dir: PathLike, meta: dict | None = None, *,
                 resume: bool = False, replay: PathLike | None = None, allow_change: bool = False) -> None:
        self.data_dir, self.run_dir = Path(data_dir), Path(run_dir)
        self.meta = read_meta(self.data_dir) if meta is None else meta
        self.fingerprint = data_fingerprint(self.data_dir, self.meta)
        self.allow_change = bool(allow_change)
        self.previous: list[dict] = []
        self.checked: dict[str, dict] = {}
        self._passed: dict[str, dict] = {}
        if resume:
            path = self.run_dir / RUN_RECORD
            old = read_run_record(path)
            if old is None:
                log.warning("%s does not exist (a run from before data fingerprints were recorded): the data "
                            "in %s cannot be compared with what the run trained on; recording it now",
                            path, self.data_dir)
            elif self._same(old, path, f"the data in {self.data_dir} changed since the run in {self.run_dir} "
                                       f"was trained on it", "Resuming would train the later steps on other "
                                       "tokens than the earlier ones. Restore the data the run was trained on, "
                                       "or resume on the new data anyway with"):
                self._passed = old.get("checked") or {}
                self.previous = list(old.get("previous") or [])
            else:
                self.previous = [*(old.get("previous") or []), old["fingerprint"]]
        if replay:
            path = _record_path(Path(replay))
            old = read_run_record(path)
            if old is None:
                log.warning("replay=%s: no %s there (a run from before data fingerprints were recorded): its "
                            "data cannot be compared with %s", replay, RUN_RECORD, self.data_dir)
            else:
                self._same(old, path, f"replay={replay}: its batches were recorded on other data than "
                                      f"{self.data_dir} holds now", "Its offsets would point at other tokens. "
                                      "Replay on the data it was recorded on, or anyway with")

    def _same(self, old: dict, path: Path, what: str, consequence: str) -> bool:
        fp = old["fingerprint"]
        if fp.get("scheme") != FINGERPRINT_SCHEME:
            log.warning("%s: fingerprint scheme %r is not this version's (%s); the data cannot be compared",
                        path, fp.get("scheme"), FINGERPRINT_SCHEME)
            return True
        if fp.get("sha256") == self.fingerprint["sha256"] and fp.get("meta") == self.fingerprint["meta"]:
            return True
        changes = "; ".join(fingerprint_changes(fp, self.fingerprint)) or "the fingerprint differs"
        message = f"{what} (recorded in {path}): {changes}. {consequence} {_ALLOW_HINT}"
        if not self.allow_change:
            raise ValueError(message)
        log.warning("%s (going on: data changes allowed)", message)
        return False

    def _check_key(self, name: str, vocab_size: int | None) -> dict:
        st = (self.data_dir / name).stat()
        return {"vocab_size": vocab_size, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                "sha256": self.fingerprint["files"][name]["sha256"]}

    def load(self, vocab_size: int | None = None, block_size: int | None = None) -> tuple[np.memmap, np.memmap]:
        """(train, val) memmaps (:func:`load_split`), every id range-checked: a full pass, unless the
        run's record shows these files (same fingerprint, size and modification time) passed it
        for this vocab_size, when the sampled check is enough."""
        out = []
        for split in SPLITS:
            name = f"{split}.bin"
            key = self._check_key(name, vocab_size)
            done = self._passed.get(name) == key
            if done:
                log.info("%s passed the full id-range check before (%s): sampled check only",
                         self.data_dir / name, self.run_dir / RUN_RECORD)
            out.append(load_split(self.data_dir, split, vocab_size, block_size, check="sample" if done else "full",
                                  meta=self.meta))
            self.checked[name] = key
        return out[0], out[1]

    def record(self) -> Path:
        """Write ``run_dir/data.json`` (atomically): the folder, its fingerprint, the checks passed."""
        record = {"data": str(self.data_dir), "fingerprint": self.fingerprint, "checked": self.checked,
                  "previous": self.previous}
        return write_text_atomic(self.run_dir / RUN_RECORD, json.dumps(record, indent=1) + "\n")


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
        else:                             # after a rollback: rewrite the kept rows atomically
            with atomic_write(self.path, "wb") as f:
                f.write(rows[keep].astype("<i8").tobytes())
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
