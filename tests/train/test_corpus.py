"""The embedded corpus, text preparation, and the tokenizers."""
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from stableflash.cli import main
from stableflash.train import corpus
from stableflash.train.corpus import (corpus_fingerprint, default_data_dir, embedded_corpus,
                                      prepare_embedded, prepare_hf, prepare_text)
from stableflash.train.data import load_split, read_meta
from stableflash.train.tokenizer import ByteTokenizer, get_tokenizer, gpt2_tokenizer

SMALL = 2_000_000


def distinct_8grams(chunk: bytes) -> int:
    return len({chunk[i:i + 8] for i in range(len(chunk) - 7)})


# ------------------------------------------------------------------------------ embedded corpus

def test_prepare_embedded_sizes_fingerprint_and_reuse(tmp_path):
    meta = prepare_embedded(tmp_path / "emb", max_bytes=SMALL)
    fp = corpus_fingerprint(SMALL)
    assert fp == corpus_fingerprint(SMALL)                     # stable across calls
    assert meta["fingerprint"] == fp and fp["python"] == corpus.platform.python_version()
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "bytes" and meta["dtype"] == "uint16"
    assert SMALL - 800_000 < fp["bytes"] <= SMALL and fp["files"] > 20 and len(fp["sha256"]) == 64
    on_disk = json.loads((tmp_path / "emb" / "meta.json").read_text())
    assert on_disk == meta
    train, val = (load_split(tmp_path / "emb", s, vocab_size=256, check="full") for s in ("train", "val"))
    assert len(train) == meta["tokens"]["train"] and len(val) == meta["tokens"]["val"] > 0
    assert len(train) + len(val) == fp["bytes"]
    # The content is the corpus, the split is at a file boundary, the val file is named in meta.
    content = embedded_corpus(SMALL)
    assert np.array_equal(np.concatenate([train, val]), np.frombuffer(content, np.uint8))
    first_val = meta["source"]["first_val_file"]
    assert bytes(val[:200].astype(np.uint8)).startswith(f"# ===== {first_val} =====\n".encode())
    assert 0 < meta["source"]["files"]["val"] < fp["files"]
    # Idempotent: a second call reuses the files as they are.
    mtime = (tmp_path / "emb" / "train.bin").stat().st_mtime_ns
    assert prepare_embedded(tmp_path / "emb", max_bytes=SMALL) == meta
    assert (tmp_path / "emb" / "train.bin").stat().st_mtime_ns == mtime
    # A damaged preparation is token files all the same: replaced only with overwrite=True.
    (tmp_path / "emb" / "val.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="already holds token files .*overwrite"):
        prepare_embedded(tmp_path / "emb", max_bytes=SMALL)
    assert (tmp_path / "emb" / "val.bin").read_bytes() == b"\0\0"
    assert prepare_embedded(tmp_path / "emb", max_bytes=SMALL, overwrite=True) == meta
    assert (tmp_path / "emb" / "val.bin").stat().st_size == 2 * meta["tokens"]["val"]


def test_corpus_files_are_ordered_and_filtered():
    files = corpus.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    parts = {p for f in files for p in f.split("/")[:-1]}
    assert not parts & {"test", "tests", "idlelib", "site-packages"}
    assert not any(f.split("/")[-1].startswith("_sysconfigdata") for f in files)
    assert "os.py" in files and all(f.endswith(".py") for f in files)
    fp = corpus_fingerprint(SMALL)
    assert fp["files"] == len(corpus._embedded(SMALL, str(corpus.stdlib_dir()))[0])
    big = corpus_fingerprint(SMALL + 1_000_000)
    assert big["files"] > fp["files"] and big["sha256"] != fp["sha256"]


def test_corpus_is_not_trivially_repetitive():
    content = embedded_corpus(SMALL)
    window = 100_000
    starts = np.linspace(0, len(content) - window, 8).astype(int)
    counts = [distinct_8grams(content[s:s + window]) for s in starts]
    assert min(counts) >= 1000, counts
    # Real source: tens of thousands of distinct 8-grams per 100 KB; the measure itself can fail.
    assert np.median(counts) > 20_000, counts
    assert distinct_8grams(b"def f(x):\n    return x\n" * 5000) < 30
    # Bytes spread over many values (not one repeated file) and the text is mostly ASCII.
    hist = np.bincount(np.frombuffer(content, np.uint8), minlength=256)
    assert (hist > 0).sum() > 90 and hist[:128].sum() / hist.sum() > 0.99


def test_default_data_dir_prepares_once(tmp_path, monkeypatch):
    d = default_data_dir(cache_dir=tmp_path, max_bytes=SMALL)
    assert d.parent == tmp_path and d.name == f"embedded-{corpus_fingerprint(SMALL)['sha256'][:12]}"
    assert (d / "train.bin").exists() and (d / "meta.json").exists()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert corpus.default_cache_dir() == tmp_path / "xdg" / "stableflash"


def test_prepare_embedded_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="val_fraction=1.5 is invalid; accepted: a number in"):
        prepare_embedded(tmp_path, val_fraction=1.5, max_bytes=SMALL)
    with pytest.raises(ValueError, match="max_bytes=10 holds 0 file"):
        prepare_embedded(tmp_path, max_bytes=10)


# --------------------------------------------------------------------------------- text files

def test_prepare_text_round_trip_bytes(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    texts = {"a.txt": "alpha\n", "b.txt": "βeta ünïcode ✓\n", "sub/c.txt": "gamma " * 50,
             "sub/d.txt": "delta\n", "skip.md": "not matched"}
    for name, text in texts.items():
        (src / name).write_text(text, encoding="utf-8")
    meta = prepare_text([src], tmp_path / "out", tokenizer="bytes", val_fraction=0.2)
    docs = [texts[n].encode() for n in ("a.txt", "b.txt", "sub/c.txt", "sub/d.txt")]
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "bytes" and meta["dtype"] == "uint16"
    assert meta["documents"] == {"train": 3, "val": 1}          # ceil(0.2 * 4) = 1 document
    train = load_split(tmp_path / "out", "train", check="full").tobytes()
    val = load_split(tmp_path / "out", "val", check="full")
    val_bytes = val.astype(np.uint8).tobytes()
    # val is exactly one whole document; train is the other three, in order.
    assert val_bytes in docs
    rest = [d for d in docs if d != val_bytes]
    assert np.array_equal(np.frombuffer(train, "<u2"), np.frombuffer(b"".join(rest), np.uint8))
    assert meta["tokens"] == {"train": sum(map(len, rest)), "val": len(val_bytes)}
    on_disk = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert on_disk == meta and on_disk["source"]["files"] == 4 and on_disk["source"]["pattern"] == "*.txt"
    # Deterministic: the same inputs give the same split.
    again = prepare_text([src], tmp_path / "out2", tokenizer="bytes", val_fraction=0.2)
    assert again == {**meta, "source": again["source"]}
    assert (tmp_path / "out2" / "val.bin").read_bytes() == (tmp_path / "out" / "val.bin").read_bytes()
    assert not list((tmp_path / "out").glob("*.tmp*"))


def test_prepare_text_single_file_and_errors(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(bytes(range(32, 127)) * 20)                   # 1900 bytes
    meta = prepare_text(f, tmp_path / "out", tokenizer="bytes", val_fraction=0.1)
    assert meta["tokens"] == {"train": 1710, "val": 190}
    both = np.concatenate([load_split(tmp_path / "out", s) for s in ("train", "val")])
    assert both.astype(np.uint8).tobytes() == f.read_bytes()
    with pytest.raises(FileNotFoundError, match="input .*missing.txt' does not exist"):
        prepare_text([tmp_path / "missing.txt"], tmp_path / "o", tokenizer="bytes")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"hold no files matching '\*.txt'"):
        prepare_text([tmp_path / "empty"], tmp_path / "o", tokenizer="bytes")
    with pytest.raises(ValueError, match="tokenizer='bpe' is unknown; accepted: bytes, gpt2, auto"):
        prepare_text(f, tmp_path / "o", tokenizer="bpe")


# -------------------------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — 日本語 🙂\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and tok.name == "bytes" and tok.eot_token is None
    assert list(ids) == list(text.encode("utf-8")) and len(ids) == len(text.encode()) > len(text)
    assert tok.decode(ids) == text and tok.decode(list(ids)) == text
    assert tok.encode(b"\xff\x00").tolist() == [255, 0]
    assert tok.decode([0x66, 0xFF, 0x67]) == "f\ufffdg"           # invalid UTF-8 is replaced
    with pytest.raises(ValueError, match="ids contains 256; accepted: byte ids 0..255"):
        tok.decode([1, 256])
    with pytest.raises(TypeError, match="text is a int"):
        tok.encode(5)


def test_gpt2_offline_error_without_tiktoken(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)            # import tiktoken -> ImportError
    with pytest.raises(ValueError, match="not available offline.*--tokenizer bytes"):
        get_tokenizer("gpt2")
    assert get_tokenizer("auto").name == "bytes"


def test_gpt2_offline_error_when_vocab_download_fails(monkeypatch):
    fake = types.ModuleType("tiktoken")

    def get_encoding(name):
        raise ConnectionError("no route to openaipublic.blob.core.windows.net")
    fake.get_encoding = get_encoding
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    with pytest.raises(ValueError, match="ConnectionError.*not available offline"):
        gpt2_tokenizer()
    assert get_tokenizer("auto").name == "bytes"


def test_gpt2_wrapper_appends_eot(monkeypatch):
    class FakeEncoding:                   # tiktoken's interface, without its vocabulary
        n_vocab, eot_token = 50257, 50256

        def encode_ordinary(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids if i != 50256)
    fake = types.ModuleType("tiktoken")
    fake.get_encoding = lambda name: FakeEncoding()
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    tok = get_tokenizer("gpt2")
    assert tok.name == "gpt2" and tok.vocab_size == 50257
    assert tok.encode("hi").tolist() == [104, 105, 50256]
    assert tok.encode(b"hi").tolist() == [104, 105, 50256]


def test_real_gpt2_if_available():
    try:
        tok = gpt2_tokenizer()
    except ValueError as e:
        assert "--tokenizer bytes" in str(e)
        pytest.skip(f"GPT-2 vocabulary not available here: {e}")
    ids = tok.encode("Hello world")
    assert ids.tolist() == [15496, 995, 50256] and tok.decode(ids[:-1]) == "Hello world"


def test_prepare_text_gpt2_eot_between_documents(tmp_path, monkeypatch):
    class FakeEncoding:
        n_vocab, eot_token = 50257, 50256

        def encode_ordinary(self, text):
            return [ord(c) for c in text]
    fake = types.ModuleType("tiktoken")
    fake.get_encoding = lambda name: FakeEncoding()
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text(f"doc{i}")
    meta = prepare_text([tmp_path], tmp_path / "out", tokenizer="gpt2", val_fraction=0.25)
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257
    train = load_split(tmp_path / "out", "train", check="full")
    assert len(train) == 3 * 5 and train[4::5].tolist() == [50256] * 3


# ---------------------------------------------------------------------------------- HF datasets

def test_prepare_hf_without_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="needs the `datasets` package.*pip install datasets"):
        prepare_hf("openwebtext", tmp_path, tokenizer="bytes")


def test_prepare_hf_load_failure_names_dataset(tmp_path, monkeypatch):
    fake = types.ModuleType("datasets")

    def load_dataset(*a, **k):
        raise FileNotFoundError("Couldn't reach the Hub")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(ValueError, match="could not load dataset 'someone/corpus'.*Couldn't reach"):
        prepare_hf("someone/corpus", tmp_path, tokenizer="bytes")


def test_prepare_hf_with_a_stand_in_dataset(tmp_path, monkeypatch):
    class Rows(list):
        column_names = ["text", "id"]
    rows = Rows({"text": f"row {i}\n", "id": i} for i in range(10))
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda *a, **k: rows
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(ValueError, match="text_field='body' is not a column.*'text', 'id'"):
        prepare_hf("x", tmp_path, text_field="body", tokenizer="bytes")
    meta = prepare_hf("x", tmp_path / "out", tokenizer="bytes", val_fraction=0.2, max_documents=8)
    assert meta["documents"] == {"train": 6, "val": 2} and meta["source"]["dataset"] == "x"
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == 8 * 6


# ------------------------------------------------------------------ preparations cut short

def text_inputs(tmp_path, letter="a"):
    src = tmp_path / f"src-{letter}"
    src.mkdir()
    for i in range(4):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + letter * 3000)
    return src


def test_a_killed_prepare_leaves_no_temporary_files_behind(tmp_path, monkeypatch, caplog):
    src, out = text_inputs(tmp_path), tmp_path / "tok"

    class Killed(BaseException):
        pass

    # A preparation killed while writing its token files: no cleanup runs (as under SIGKILL).
    real, calls = corpus.write_split, []

    def write_then_die(path, ids, *a, **k):
        calls.append(path)
        if len(calls) == 3:
            real(path, ids[:len(ids) // 2], *a, **k)
            monkeypatch.setattr(Path, "unlink", lambda *a, **k: None)
            raise Killed
        return real(path, ids, *a, **k)

    monkeypatch.setattr(corpus, "write_split", write_then_die)
    with pytest.raises(Killed):
        prepare_text([src], out, tokenizer="bytes", val_fraction=0.25)
    monkeypatch.undo()
    stale = sorted(p.name for p in out.iterdir())
    assert stale == [f"train.bin.tmp{os.getpid()}", f"val.bin.tmp{os.getpid()}"] and calls[-1].name in stale
    # One of them from a process that has ended; beside them a live process's, and another file.
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.rename(out / stale[0], out / f"train.bin.tmp{dead.pid}")
    stale[0] = f"train.bin.tmp{dead.pid}"
    live = out / f"val.bin.tmp{os.getppid()}"
    live.write_bytes(b"x")
    (out / "notes.tmp1").write_bytes(b"y")
    with caplog.at_level(logging.WARNING, logger="stableflash.train.corpus"):
        assert main(["data", "prepare", str(src), "--out", str(out), "--tokenizer", "bytes",
                     "--val-fraction", "0.25"]) == 0
    kept = ["meta.json", "notes.tmp1", "train.bin", "val.bin", live.name]
    assert sorted(p.name for p in out.iterdir()) == sorted(kept)
    assert all(f"removed {out / n}" in caplog.text for n in stale) and f"{live} belongs to process" in caplog.text
    assert len(load_split(out, "train", check="full")) + len(load_split(out, "val")) == 4 * 3000 + 4 * 12


def test_a_prepare_stopped_while_replacing_files_marks_the_folder(tmp_path, monkeypatch):
    out = tmp_path / "tok"
    prepare_text(text_inputs(tmp_path, "a"), out, tokenizer="bytes", val_fraction=0.25)
    old_val = (out / "val.bin").read_bytes()

    class Killed(BaseException):
        pass

    real, calls = os.replace, []

    def replace(a, b):                 # 1: meta.json's mark, 2: train.bin, 3: val.bin, 4: meta.json
        calls.append(b)
        if len(calls) == 3:
            raise Killed
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        prepare_text(text_inputs(tmp_path, "b"), out, tokenizer="bytes", val_fraction=0.25, overwrite=True)
    monkeypatch.setattr(os, "replace", real)
    # new train.bin, old val.bin: never read as a preparation, and no silent nanoGPT default either
    assert (out / "val.bin").read_bytes() == old_val and b"b" * 100 in (out / "train.bin").read_bytes()[::2]
    with pytest.raises(ValueError, match="meta.json marks a preparation that was stopped while it replaced"):
        read_meta(out)
    # The interrupted folder holds nothing to protect: preparing again needs no --overwrite.
    meta = prepare_text(text_inputs(tmp_path, "c"), out, tokenizer="bytes", val_fraction=0.25)
    assert read_meta(out)["tokens"] == meta["tokens"]
    with pytest.raises(ValueError, match="is a file; accepted: a folder"):
        prepare_text(text_inputs(tmp_path, "d"), out / "meta.json", tokenizer="bytes")
