"""Training corpora: an embedded default that needs no download, and preparation of your own text.

The embedded corpus is the Python standard library's own source: every ``*.py`` under
``sysconfig.get_paths()["stdlib"]`` in sorted relative-path order (test suites, idlelib,
site-packages and the build-specific ``config-*``/``_sysconfigdata*`` files left out), each file
preceded by a ``# ===== path =====`` line. It is real, varied text a byte-level model can learn,
present wherever Python is, and ~11 MB on CPython 3.11 — too large for a small model to simply
memorise. Its content depends on the Python version, so :func:`corpus_fingerprint` (python
version, files, bytes, sha256) is written to ``meta.json`` for runs to record.

:func:`prepare_text` and :func:`prepare_hf` turn your own text files or a Hugging Face dataset
into the same token files (see :mod:`stableflash.train.data`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import re
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence, Union

import numpy as np
from tqdm.auto import tqdm

from stableflash.files import write_text_atomic
from stableflash.train.data import INCOMPLETE, META_FILES, SPLITS, dtype_for_vocab, write_split
from stableflash.train.tokenizer import ByteTokenizer, GPT2Tokenizer, get_tokenizer

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
DEFAULT_MAX_BYTES = 32_000_000
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
SPLIT_SEED = 2357          # which documents go to validation (nanoGPT's OpenWebText seed)
# temporary files of a preparation: "<file>.tmp<pid>" (write_text_atomic names meta.json's so too)
_TEMP = re.compile(r"^(train\.bin|val\.bin|meta\.json)\.tmp(\d+)$")


# ------------------------------------------------------------------------------ embedded corpus

def stdlib_dir() -> Path:
    """Where this interpreter's standard library source lives."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: PathLike | None = None) -> list[str]:
    """Relative posix paths of the corpus's ``*.py`` files, sorted."""
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library folder {str(root)!r} does not exist; the "
                                f"embedded corpus needs Python's *.py sources (use prepare_text on "
                                f"your own files instead)")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")]
        for f in filenames:
            if f.endswith(".py") and not f.startswith("_sysconfigdata"):
                out.append((Path(dirpath) / f).relative_to(root).as_posix())
    return sorted(out)


def _chunk(rel: str, content: bytes) -> bytes:
    """One file in the corpus: a header line, the file, a newline, a blank line."""
    tail = b"\n" if content.endswith(b"\n") else b"\n\n"
    return f"# ===== {rel} =====\n".encode() + content + tail


@lru_cache(maxsize=2)
def _embedded(max_bytes: int, root: str) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
    """(relative paths, chunks) of the files that fit in max_bytes, in order."""
    rels, chunks, total = [], [], 0
    for rel in tqdm(stdlib_files(root), desc="reading stdlib", unit="file", leave=False):
        chunk = _chunk(rel, (Path(root) / rel).read_bytes())
        if total + len(chunk) > max_bytes:
            break
        rels.append(rel)
        chunks.append(chunk)
        total += len(chunk)
    return tuple(rels), tuple(chunks)


def _check_max_bytes(max_bytes) -> int:
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes!r} is invalid; accepted: a positive int")
    return max_bytes


def embedded_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The embedded corpus itself: whole files, in order, until the next would pass max_bytes."""
    return b"".join(_embedded(_check_max_bytes(max_bytes), str(stdlib_dir()))[1])


def corpus_fingerprint(max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """``{"python", "files", "bytes", "sha256"}`` of the embedded corpus on this interpreter."""
    rels, chunks = _embedded(_check_max_bytes(max_bytes), str(stdlib_dir()))
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return {"python": platform.python_version(), "files": len(rels),
            "bytes": sum(len(c) for c in chunks), "sha256": h.hexdigest()}


def _check_fraction(val_fraction) -> float:
    if not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction!r} is invalid; accepted: a number in (0, 1)")
    return float(val_fraction)


def _existing_meta(out_dir: Path) -> dict | None:
    try:
        meta = json.loads((out_dir / "meta.json").read_text())
        for split in ("train", "val"):
            if (out_dir / f"{split}.bin").stat().st_size != 2 * meta["tokens"][split]:
                return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:              # another user's process, running
        return True
    except (OverflowError, ValueError):  # not a pid at all
        return False
    return True


def remove_stale_temp_files(out_dir: PathLike) -> list[Path]:
    """Delete the temporary files (``train.bin.tmp<pid>`` ...) that a killed preparation left in
    ``out_dir``: those of this process and of processes no longer running. Returns them."""
    removed = []
    for path in sorted(Path(out_dir).iterdir()):
        m = _TEMP.match(path.name)
        if not m or not path.is_file():
            continue
        pid = int(m.group(2))
        if pid != os.getpid() and _pid_alive(pid):
            log.warning("%s belongs to process %d, which is running (another preparation into this "
                        "folder?): left alone", path, pid)
            continue
        size = path.stat().st_size
        path.unlink(missing_ok=True)
        removed.append(path)
        log.warning("removed %s (%d bytes), left by a preparation that was killed", path, size)
    return removed


def _holds_a_preparation(out_dir: Path) -> list[str]:
    """The token and meta files in out_dir, unless its meta.json marks an interrupted preparation."""
    present = [n for n in (*(f"{s}.bin" for s in SPLITS), *META_FILES) if (out_dir / n).exists()]
    try:
        if json.loads((out_dir / "meta.json").read_text()).get(INCOMPLETE):
            return []
    except (OSError, ValueError, AttributeError):
        pass
    return present if any(n.endswith(".bin") for n in present) else []


def _start(out_dir: Path, overwrite: bool) -> None:
    """Make out_dir, remove a killed preparation's temporary files, and refuse to replace token
    files already there unless ``overwrite``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir {str(out_dir)!r} is a file; accepted: a folder (created if missing)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out_dir {str(out_dir)!r} cannot be created ({e}); accepted: a folder that can be "
                         f"written") from e
    remove_stale_temp_files(out_dir)
    present = _holds_a_preparation(out_dir)
    if present and not overwrite:
        raise ValueError(f"{out_dir} already holds token files ({', '.join(present)}); preparing into it would "
                         f"replace them, and runs trained on them could not resume. Choose another folder, "
                         f"or replace them with --overwrite (overwrite=True)")


def _replace_outputs(out_dir: Path, tmp: dict[str, Path], meta: dict) -> None:
    """Move finished temporary files into place. meta.json first marks the folder as being replaced
    (a kill among the renames leaves a folder that says so instead of a silent mix of two
    preparations), and is written last with the new content."""
    write_text_atomic(out_dir / "meta.json", json.dumps({INCOMPLETE: True, "note": "stableflash data "
                      "prepare was replacing these files; prepare the data again"}) + "\n")
    (out_dir / "meta.pkl").unlink(missing_ok=True)       # a nanoGPT vocabulary of the files replaced
    for split, path in tmp.items():
        os.replace(path, out_dir / f"{split}.bin")
    write_text_atomic(out_dir / "meta.json", json.dumps(meta, indent=1) + "\n")


def prepare_embedded(out_dir: PathLike, val_fraction: float = 0.01,
                     max_bytes: int = DEFAULT_MAX_BYTES, overwrite: bool = False) -> dict:
    """Write the embedded corpus as byte-level token files; returns meta.json's content.

    The validation split is the last files, cut at the file boundary nearest to the last
    ``val_fraction`` of the bytes (at least one file on each side). When ``out_dir`` already holds
    a complete preparation with the same fingerprint and val_fraction, it is reused as it is;
    other token files there are replaced only with ``overwrite``.
    """
    val_fraction, max_bytes = _check_fraction(val_fraction), _check_max_bytes(max_bytes)
    out_dir = Path(out_dir)
    root = stdlib_dir()
    fp = corpus_fingerprint(max_bytes)
    old = _existing_meta(out_dir) if out_dir.is_dir() else None
    if old and old.get("fingerprint") == fp and old.get("source", {}).get("val_fraction") == val_fraction:
        log.info("%s already holds the embedded corpus (sha256 %s): reused", out_dir, fp["sha256"][:12])
        return old
    rels, chunks = _embedded(max_bytes, str(root))
    if len(rels) < 2:
        raise ValueError(f"max_bytes={max_bytes} holds {len(rels)} file(s) of the standard library; "
                         f"accepted: enough for at least 2 files (a train and a val split), e.g. "
                         f"the default {DEFAULT_MAX_BYTES}")
    _start(out_dir, overwrite)
    ends = np.cumsum([len(c) for c in chunks])            # ends[k-1]: bytes in the first k files
    target = (1 - val_fraction) * ends[-1]
    k = int(np.argmin(np.abs(ends[:-1] - target))) + 1    # train: files [0, k); val: [k, n)
    tmp = {split: out_dir / f"{split}.bin.tmp{os.getpid()}" for split in ("train", "val")}
    try:
        for split, part in (("train", chunks[:k]), ("val", chunks[k:])):
            write_split(tmp[split], np.frombuffer(b"".join(part), dtype=np.uint8), np.uint16)
        meta = {"vocab_size": 256, "tokenizer": "bytes", "dtype": "uint16",
                "tokens": {"train": int(ends[k - 1]), "val": int(ends[-1] - ends[k - 1])},
                "fingerprint": fp,
                "source": {"kind": "embedded-stdlib", "stdlib": str(root), "max_bytes": max_bytes,
                           "val_fraction": val_fraction, "files": {"train": k, "val": len(rels) - k},
                           "first_val_file": rels[k]}}
        _replace_outputs(out_dir, tmp, meta)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    log.info("prepared the embedded corpus in %s: %d files, %d bytes (train %d, val %d), sha256 %s",
             out_dir, len(rels), fp["bytes"], meta["tokens"]["train"], meta["tokens"]["val"],
             fp["sha256"][:12])
    return meta


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/stableflash``, or ``~/.cache/stableflash``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "stableflash"


def default_data_dir(cache_dir: PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """The embedded corpus's token folder, ``<cache_dir>/embedded-<sha256[:12]>``, prepared on first use.

    ``cache_dir`` defaults to :func:`default_cache_dir`.
    """
    fp = corpus_fingerprint(max_bytes)
    out = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"embedded-{fp['sha256'][:12]}"
    prepare_embedded(out, max_bytes=max_bytes, overwrite=True)     # its own cache folder: redone if damaged
    return out


# --------------------------------------------------------------------------------- your own text

def _resolve_tokenizer(tokenizer) -> ByteTokenizer | GPT2Tokenizer:
    if isinstance(tokenizer, str):
        return get_tokenizer(tokenizer)
    if all(hasattr(tokenizer, a) for a in ("encode", "vocab_size", "name")):
        return tokenizer
    raise TypeError(f"tokenizer is a {type(tokenizer).__name__}; accepted: 'bytes', 'gpt2', 'auto' "
                    f"or an object with name, vocab_size and encode()")


def _val_documents(n_docs: int, val_fraction: float, seed: int) -> set[int]:
    n_val = min(n_docs - 1, max(1, math.ceil(val_fraction * n_docs)))
    rng = np.random.default_rng(seed)
    return {int(i) for i in rng.choice(n_docs, size=n_val, replace=False)}


def _write_documents(docs: Iterable, n_docs: int, out_dir: Path, tok, val_fraction: float,
                     seed: int, source: dict, desc: str) -> dict:
    """Tokenize ``n_docs`` documents (str or bytes) into train/val token files and meta.json."""
    if n_docs < 1:
        raise ValueError(f"{desc}: there are no documents to prepare")
    dtype = dtype_for_vocab(int(tok.vocab_size))
    tmp = {s: out_dir / f"{s}.bin.tmp{os.getpid()}" for s in ("train", "val")}
    counts = {"train": 0, "val": 0}
    documents = {"train": 0, "val": 0}
    val = _val_documents(n_docs, val_fraction, seed) if n_docs > 1 else set()
    for path in tmp.values():
        path.write_bytes(b"")
    try:
        for i, doc in enumerate(tqdm(docs, total=n_docs, desc=desc, unit="doc")):
            if i >= n_docs:
                break
            ids = tok.encode(doc)
            if n_docs == 1:   # one document: its last val_fraction of tokens is the val split
                cut = len(ids) - max(1, math.ceil(val_fraction * len(ids)))
                if cut < 1:
                    raise ValueError(f"{desc}: the only document has {len(ids)} tokens; accepted: "
                                     f"at least 2 tokens (better: several documents)")
                log.warning("%s: one document only; its last %d of %d tokens are the val split",
                            desc, len(ids) - cut, len(ids))
                parts = (("train", ids[:cut]), ("val", ids[cut:]))
            else:
                parts = (("val" if i in val else "train", ids),)
            for split, part in parts:
                counts[split] += write_split(tmp[split], part, dtype, append=True)
                documents[split] += 1
        for split, n in counts.items():
            if n == 0:
                raise ValueError(f"{desc}: the {split} split came out empty ({documents} documents, "
                                 f"{counts} tokens); accepted: non-empty documents in both splits")
        meta = {"vocab_size": int(tok.vocab_size), "tokenizer": tok.name, "dtype": dtype,
                "eot_token": getattr(tok, "eot_token", None), "tokens": counts, "documents": documents,
                "source": {**source, "val_fraction": val_fraction, "split_seed": seed}}
        _replace_outputs(out_dir, tmp, meta)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    log.info("prepared %s: %d train / %d val tokens (%s, vocab %d)", out_dir, counts["train"],
             counts["val"], tok.name, tok.vocab_size)
    return meta


def find_text_files(inputs: Sequence[PathLike] | PathLike, pattern: str = "*.txt") -> list[Path]:
    """Files given directly, plus files matching ``pattern`` under directories (recursive, sorted)."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob(pattern) if f.is_file())
            if not found:
                log.warning("%s: no files match %r", p, pattern)
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"input {str(p)!r} does not exist; accepted: text files or "
                                    f"directories (searched recursively for {pattern!r})")
    if not files:
        raise ValueError(f"inputs={[str(i) for i in inputs]} hold no files matching {pattern!r}; "
                         f"accepted: text files, or directories containing files that match pattern")
    return files


def prepare_text(inputs: Sequence[PathLike] | PathLike, out_dir: PathLike, tokenizer="auto",
                 val_fraction: float = 0.0005, pattern: str = "*.txt", seed: int = SPLIT_SEED,
                 overwrite: bool = False) -> dict:
    """Tokenize text files, one document per file, into ``out_dir``; returns meta.json's content.

    The validation split is a seeded random choice of whole documents (``ceil(val_fraction *
    n_docs)``, at least one, order kept); a single file is split at its last val_fraction of
    tokens instead. With gpt2 every document ends with the end-of-text token; with bytes the
    files' bytes are concatenated as they are. Token files already in ``out_dir`` are replaced
    only with ``overwrite``.
    """
    val_fraction = _check_fraction(val_fraction)
    files = find_text_files(inputs, pattern)
    tok = _resolve_tokenizer(tokenizer)
    _start(Path(out_dir), overwrite)
    docs = (f.read_bytes() for f in files)
    source = {"kind": "text", "inputs": [str(i) for i in ([inputs] if isinstance(inputs, (str, os.PathLike))
                                                         else inputs)],
              "pattern": pattern, "files": len(files)}
    return _write_documents(docs, len(files), Path(out_dir), tok, val_fraction, seed, source,
                            desc="tokenizing files")


def prepare_hf(dataset: str, out_dir: PathLike, split: str = "train", text_field: str = "text",
               tokenizer="auto", val_fraction: float = 0.0005, name: str | None = None,
               max_documents: int | None = None, seed: int = SPLIT_SEED, overwrite: bool = False,
               **load_kwargs) -> dict:
    """Tokenize a Hugging Face dataset (``datasets.load_dataset(dataset, name, split=split)``).

    Needs the ``datasets`` package and access to the dataset (the Hub or a local copy). One
    document per row, taken from ``text_field``; splits and ``overwrite`` as in :func:`prepare_text`.
    """
    val_fraction = _check_fraction(val_fraction)
    _start(Path(out_dir), overwrite)
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"prepare_hf(dataset={dataset!r}) needs the `datasets` package, which is not "
                         f"installed: pip install datasets (or save the text as files and use "
                         f"prepare_text)") from e
    try:
        ds = datasets.load_dataset(dataset, name, split=split, **load_kwargs)
    except Exception as e:
        raise ValueError(f"could not load dataset {dataset!r} (name={name!r}, split={split!r}): "
                         f"{type(e).__name__}: {e}") from e
    columns = list(getattr(ds, "column_names", None) or [])
    if text_field not in columns:
        raise ValueError(f"text_field={text_field!r} is not a column of dataset {dataset!r}; "
                         f"accepted: one of {columns}")
    n = len(ds) if max_documents is None else min(len(ds), int(max_documents))
    tok = _resolve_tokenizer(tokenizer)
    docs = (row[text_field] for row in ds)
    source = {"kind": "huggingface", "dataset": dataset, "name": name, "split": split,
              "text_field": text_field, "documents_used": n}
    return _write_documents(docs, n, Path(out_dir), tok, val_fraction, seed, source,
                            desc=f"tokenizing {dataset}")
