"""The installed-packages corpus: the text files of this interpreter's site-packages, with a BPE.

A machine that cannot download anything still holds real text in its installed packages: Python,
C/C++/CUDA sources and headers, type stubs and documentation. :func:`prepare_packages` makes a
data folder of it in OpenWebText's shape:

* **Documents.** Every file under ``sysconfig.get_paths()["purelib"]`` (and ``platlib`` where it
  differs) whose suffix is in :data:`TEXT_SUFFIXES`, at most ``max_file_bytes`` long, valid UTF-8
  without NUL bytes, in sorted relative-path order. Left out: ``__pycache__``, ``*.dist-info`` and
  ``*.egg-info`` folders (install records, which change whenever anything is installed),
  ``__editable__*`` finders (they name local paths) and this package's own files. A file whose
  content is byte-identical to an earlier one (vendored copies) is one document, as OpenWebText is
  deduplicated.
* **Tokenizer.** A byte-level BPE (GPT-2's pre-tokenization) trained by the ``tokenizers`` package on
  the training documents (every k-th one, at most ``bpe_sample_bytes`` of them), with
  ``vocab_size - 1`` entries (fewer if the text has fewer pairs to merge); the end-of-text token is
  the id after them (GPT-2's 50256 at the default 50257), and meta.json's ``vocab_size`` is one more. It is written beside the token files as ``tokenizer.json`` (plain JSON).
* **Splits.** Each document's ids are followed by the end-of-text id; a seeded random choice of whole
  documents (``val_fraction``) is ``val.bin``, the rest ``train.bin`` in order (uint16).

``meta.json`` records the corpus's fingerprint (python, files, documents, bytes, sha256 of the
paths and contents in order) and the tokenizer's (tokenizers version, sha256 of ``tokenizer.json``),
so a run on another machine with other packages installed is told its data differ.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np
from tqdm.auto import tqdm

from stableflash.train.corpus import (SPLIT_SEED, _check_fraction, _existing_meta, _replace_outputs, _start,
                                      _val_documents)
from stableflash.train.data import write_split

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
TEXT_SUFFIXES = frozenset({".py", ".pyi", ".pyx", ".pxd", ".pxi", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp",
                           ".hxx", ".cu", ".cuh", ".md", ".rst", ".txt"})
SKIP_DIR_SUFFIXES = (".dist-info", ".egg-info")
OWN_PACKAGE = "stableflash"
EOT_TEXT = "<|endoftext|>"
DEFAULT_VOCAB = 50257                 # GPT-2's: 50256 BPE entries, then the end-of-text id
DEFAULT_MAX_FILE_BYTES = 1 << 20
DEFAULT_BPE_SAMPLE_BYTES = 256 << 20
DEFAULT_VAL_FRACTION = 0.001
_ENCODE_CHUNK = 2048                  # documents per encode_batch call


@dataclass(frozen=True)
class Document:
    rel: str                          # the file's path relative to its site-packages folder
    text: str


def package_roots() -> list[Path]:
    """This interpreter's site-packages folders (purelib, and platlib where it differs)."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["purelib"])]
    if Path(paths["platlib"]).resolve() != roots[0].resolve():
        roots.append(Path(paths["platlib"]))
    return roots


def _skipped_dir(name: str) -> bool:
    return name == "__pycache__" or name.endswith(SKIP_DIR_SUFFIXES)


def text_files(root: PathLike, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> list[str]:
    """Relative posix paths of ``root``'s candidate text files, sorted (content not yet checked)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"root {str(root)!r} is not a folder; accepted: a site-packages folder "
                                f"(default: this interpreter's)")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        top = Path(dirpath) == root
        dirnames[:] = [d for d in dirnames if not _skipped_dir(d) and not (top and d == OWN_PACKAGE)]
        for name in filenames:
            if Path(name).suffix.lower() not in TEXT_SUFFIXES or name.startswith("__editable__"):
                continue
            path = Path(dirpath) / name
            try:
                if not path.is_file() or path.stat().st_size > max_file_bytes:
                    continue
            except OSError:
                continue
            found.append(path.relative_to(root).as_posix())
    return sorted(found)


def read_documents(roots: Sequence[PathLike], max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> list[Document]:
    """The corpus's documents: text files of ``roots`` in order, non-UTF-8, NUL-holding and empty
    files left out, byte-identical repeats kept once (the first in path order)."""
    seen: set[bytes] = set()
    docs = []
    for k, root in enumerate(roots):
        prefix = "" if len(roots) == 1 else f"{k}:"
        for rel in tqdm(text_files(root, max_file_bytes), desc=f"reading {root}", unit="file", leave=False):
            try:
                raw = (Path(root) / rel).read_bytes()
            except OSError:
                continue
            if not raw.strip() or b"\x00" in raw:
                continue
            digest = hashlib.sha256(raw).digest()
            if digest in seen:
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            seen.add(digest)
            docs.append(Document(prefix + rel, text))
    return docs


def documents_fingerprint(docs: Sequence[Document]) -> dict:
    """``{"python", "documents", "bytes", "sha256"}``: sha256 over each document's path and content."""
    h = hashlib.sha256()
    total = 0
    for d in docs:
        data = d.text.encode("utf-8")
        total += len(data)
        h.update(d.rel.encode("utf-8") + b"\x00" + len(data).to_bytes(8, "little") + data)
    return {"python": platform.python_version(), "documents": len(docs), "bytes": total, "sha256": h.hexdigest()}


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise ValueError("the installed-packages corpus needs the `tokenizers` package for its BPE, which is "
                         "not installed: pip install tokenizers (transformers installs it)") from e
    return tokenizers


def train_bpe(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB):
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) with ``vocab_size - 1`` entries, trained
    on ``texts`` by the tokenizers package; the id ``vocab_size - 1`` is left for end-of-text."""
    tk = _tokenizers()
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not len(alphabet) < vocab_size - 1 <= 65535:
        raise ValueError(f"vocab_size={vocab_size!r} is invalid; accepted: an int from {len(alphabet) + 2} (the "
                         f"{len(alphabet)} bytes, one merge and end-of-text) to 65536 (uint16 token files)")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=alphabet, special_tokens=[],
                                     show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    got = tok.get_vocab_size()
    if got > vocab_size - 1:
        raise RuntimeError(f"the BPE trainer made {got} entries for vocab_size - 1 = {vocab_size - 1}")
    return tok


def _bpe_sample(texts: Sequence[str], budget: int) -> list[str]:
    """Every k-th text, k the smallest stride whose texts fit ``budget`` characters' worth of bytes."""
    total = sum(len(t) for t in texts)
    stride = max(1, math.ceil(total / budget))
    return list(texts[::stride])


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid; accepted: a positive int")
    return value


def prepare_packages(out_dir: PathLike, roots: Sequence[PathLike] | None = None, vocab_size: int = DEFAULT_VOCAB,
                     val_fraction: float = DEFAULT_VAL_FRACTION, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                     bpe_sample_bytes: int = DEFAULT_BPE_SAMPLE_BYTES, max_documents: int | None = None,
                     seed: int = SPLIT_SEED, overwrite: bool = False) -> dict:
    """Write the installed-packages corpus (module docstring) to ``out_dir``; returns meta.json's content.

    ``roots`` defaults to :func:`package_roots`; ``max_documents`` keeps the first documents only
    (tests, trials). A folder holding a complete preparation of the same corpus and settings is
    reused as it is; other token files there are replaced only with ``overwrite``.
    """
    val_fraction = _check_fraction(val_fraction)
    _check_positive_int("max_file_bytes", max_file_bytes)
    _check_positive_int("bpe_sample_bytes", bpe_sample_bytes)
    if max_documents is not None:
        _check_positive_int("max_documents", max_documents)
    roots = [Path(r) for r in (roots if roots is not None else package_roots())]
    docs = read_documents(roots, max_file_bytes)[:max_documents]
    return _prepare(Path(out_dir), roots, docs, vocab_size, val_fraction, max_file_bytes, bpe_sample_bytes,
                    max_documents, seed, overwrite)


def _prepare(out_dir: Path, roots: list[Path], docs: list[Document], vocab_size: int, val_fraction: float,
             max_file_bytes: int, bpe_sample_bytes: int, max_documents: int | None, seed: int,
             overwrite: bool) -> dict:
    if len(docs) < 2:
        raise ValueError(f"roots={[str(r) for r in roots]} hold {len(docs)} text document(s); accepted: folders "
                         f"with at least 2 (a train and a val split)")
    tk = _tokenizers()
    settings = {"vocab_size": vocab_size, "val_fraction": val_fraction, "max_file_bytes": max_file_bytes,
                "bpe_sample_bytes": bpe_sample_bytes, "max_documents": max_documents, "split_seed": seed,
                "tokenizers": tk.__version__}
    fp = documents_fingerprint(docs)
    old = _existing_meta(out_dir) if out_dir.is_dir() else None
    if (old and old.get("fingerprint") == fp and old.get("source", {}).get("settings") == settings
            and (out_dir / "tokenizer.json").is_file()):
        log.info("%s already holds this corpus (sha256 %s): reused", out_dir, fp["sha256"][:12])
        return old
    _start(out_dir, overwrite)
    val = _val_documents(len(docs), val_fraction, seed)
    train_texts = [d.text for i, d in enumerate(docs) if i not in val]
    sample = _bpe_sample(train_texts, bpe_sample_bytes)
    log.info("training a %d-entry BPE on %d of %d training documents", vocab_size - 1, len(sample), len(train_texts))
    tok = train_bpe(sample, vocab_size)
    del sample, train_texts
    eot = tok.get_vocab_size()          # vocab_size - 1, or fewer where the text holds fewer merges
    tmp = {s: out_dir / f"{s}.bin.tmp{os.getpid()}" for s in ("train", "val")}
    tok_tmp = out_dir / f"tokenizer.json.tmp{os.getpid()}"
    counts = {"train": 0, "val": 0}
    documents = {"train": 0, "val": 0}
    for path in tmp.values():
        path.write_bytes(b"")
    try:
        bar = tqdm(total=len(docs), desc="tokenizing documents", unit="doc")
        for start in range(0, len(docs), _ENCODE_CHUNK):
            chunk = docs[start:start + _ENCODE_CHUNK]
            encoded = tok.encode_batch_fast([d.text for d in chunk]) if hasattr(tok, "encode_batch_fast") \
                else tok.encode_batch([d.text for d in chunk])
            parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
            for i, enc in enumerate(encoded, start):
                split = "val" if i in val else "train"
                parts[split].append(np.asarray(enc.ids, dtype=np.uint16))
                parts[split].append(np.asarray([eot], dtype=np.uint16))
                documents[split] += 1
            for split, arrays in parts.items():
                if arrays:
                    counts[split] += write_split(tmp[split], np.concatenate(arrays), np.uint16, append=True)
            bar.update(len(chunk))
        bar.close()
        tok.save(str(tok_tmp))
        tokenizer_sha = hashlib.sha256(tok_tmp.read_bytes()).hexdigest()
        os.replace(tok_tmp, out_dir / "tokenizer.json")
        meta = {"vocab_size": eot + 1, "tokenizer": "bpe", "tokenizer_file": "tokenizer.json",
                "tokenizer_sha256": tokenizer_sha, "dtype": "uint16", "eot_token": eot, "tokens": counts,
                "documents": documents, "fingerprint": fp,
                "source": {"kind": "installed-packages", "roots": [str(r) for r in roots], "settings": settings}}
        _replace_outputs(out_dir, tmp, meta)
    finally:
        for path in (*tmp.values(), tok_tmp):
            path.unlink(missing_ok=True)
    log.info("prepared the installed-packages corpus in %s: %d documents, %d bytes, %d train / %d val tokens, "
             "sha256 %s", out_dir, fp["documents"], fp["bytes"], counts["train"], counts["val"], fp["sha256"][:12])
    return meta


def default_packages_dir(cache_dir: PathLike | None = None) -> Path:
    """The installed-packages corpus's token folder, ``<cache_dir>/packages-<sha256[:12]>`` (the
    corpus's fingerprint), prepared with the default settings on first use and reused after.

    ``cache_dir`` defaults to :func:`stableflash.train.corpus.default_cache_dir`.
    """
    from stableflash.train.corpus import default_cache_dir

    roots = package_roots()
    docs = read_documents(roots)
    fp = documents_fingerprint(docs)
    out = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"packages-{fp['sha256'][:12]}"
    _prepare(out, roots, docs, DEFAULT_VOCAB, DEFAULT_VAL_FRACTION, DEFAULT_MAX_FILE_BYTES,
             DEFAULT_BPE_SAMPLE_BYTES, None, SPLIT_SEED, overwrite=True)   # its own cache folder: redone if damaged
    return out
