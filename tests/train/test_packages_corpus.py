"""The installed-packages corpus: which files become documents, the BPE, the splits, the preset."""
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from stableflash.cli import main                                                     # noqa: E402
from stableflash.train import packages_corpus as pc                                  # noqa: E402
from stableflash.train.data import load_split, read_meta                             # noqa: E402
from stableflash.train.tokenizer import BPETokenizer, get_tokenizer                  # noqa: E402

VOCAB = 400


def _module(i: int) -> str:
    words = ["tensor", "gradient", "attention", "softmax", "kernel", "block", "row", "maximum", "round"]
    body = "\n".join(f"def {words[(i + k) % 9]}_{k}(x, y={k}):\n    return x * {i} + y  # {words[k % 9]}"
                     for k in range(6 + i % 5))
    return f'"""Module {i}: {words[i % 9]} and {words[(3 * i) % 9]}."""\n{body}\n'


def fake_site_packages(root: Path) -> list[str]:
    """A site-packages folder; returns the relative paths expected as documents, in order."""
    files = {f"pkg_a/mod{i:02d}.py": _module(i) for i in range(24)}
    files.update({"pkg_a/README.md": "# pkg_a\n\nSome *documentation* text: ünïcode too.\n",
                  "pkg_a/include/api.h": "#pragma once\nint add(int a, int b);\n",
                  "pkg_c/notes.txt": "a literal <|endoftext|> inside a document stays text\n",
                  "pkg_c/kern.cu": "__global__ void k(float* x) { x[threadIdx.x] = 0.f; }\n"})
    expected = sorted(files)
    skipped = {"pkg_a/__pycache__/mod00.py": "x = 1\n",                       # bytecode folder
               "pkg_a-1.0.dist-info/LICENSE.txt": "MIT\n",                       # install record
               "stableflash/own.py": "ours = True\n",                            # this package
               "__editable___pkg_finder.py": "MAPPING = {'/home/me': 1}\n",      # names local paths
               "pkg_b/_vendor/mod00.py": _module(0),                             # byte-identical copy
               "pkg_b/data.json": '{"a": 1}\n',                                  # not a text suffix
               "pkg_b/empty.md": "  \n",                                         # blank
               "pkg_b/big.py": "x = 0\n" * 400}                                  # over max_file_bytes
    for rel, text in {**files, **skipped}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "pkg_b/nul.c").write_bytes(b"int x;\x00\n")
    (root / "pkg_b/latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    return expected


def test_documents_are_the_text_files_deduplicated_in_path_order(tmp_path):
    expected = fake_site_packages(tmp_path / "sp")
    docs = pc.read_documents([tmp_path / "sp"], max_file_bytes=2000)
    assert [d.rel for d in docs] == expected
    assert docs[0].text == (tmp_path / "sp" / expected[0]).read_text(encoding="utf-8")
    fp = pc.documents_fingerprint(docs)
    assert fp["documents"] == len(expected) and fp["bytes"] == sum(len(d.text.encode()) for d in docs)
    assert pc.documents_fingerprint(pc.read_documents([tmp_path / "sp"], max_file_bytes=2000)) == fp
    (tmp_path / "sp/pkg_c/notes.txt").write_text("changed\n")
    assert pc.documents_fingerprint(pc.read_documents([tmp_path / "sp"], max_file_bytes=2000))["sha256"] != fp["sha256"]


def test_prepare_writes_documents_each_followed_by_end_of_text(tmp_path):
    expected = fake_site_packages(tmp_path / "sp")
    out = tmp_path / "data"
    meta = pc.prepare_packages(out, roots=[tmp_path / "sp"], vocab_size=VOCAB, val_fraction=0.1, max_file_bytes=2000)
    eot = meta["eot_token"]
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == eot + 1 <= VOCAB and meta["dtype"] == "uint16"
    assert meta["documents"] == {"train": len(expected) - 3, "val": 3}          # ceil(0.1 · 28)
    assert read_meta(out)["vocab_size"] == eot + 1 and read_meta(out)["eot_token"] == eot
    tok = get_tokenizer(str(out / "tokenizer.json"))
    assert isinstance(tok, BPETokenizer) and tok.eot_token == eot and tok.vocab_size == eot + 1
    texts = {rel: (tmp_path / "sp" / rel).read_text(encoding="utf-8") for rel in expected}
    got = {}
    for split in ("train", "val"):
        ids = np.asarray(load_split(out, split, vocab_size=eot + 1, check="full"))
        assert len(ids) == meta["tokens"][split] and ids[-1] == eot
        assert int((ids == eot).sum()) == meta["documents"][split]
        got[split] = tok.decode(ids).split("<|endoftext|>")[:-1]
    # the end-of-text text inside notes.txt is ordinary text, so the literal splits it in two here;
    # joined back, every document comes out exactly, train in path order
    everything = "<|endoftext|>".join(got["train"] + got["val"])
    assert sorted(everything.split("<|endoftext|>")) == sorted(
        "<|endoftext|>".join(texts[r] for r in expected).split("<|endoftext|>"))
    train_docs = [t for t in "<|endoftext|>".join(got["train"]).split("<|endoftext|>")]
    order = [r for r in expected if texts[r] in train_docs]
    assert [t for t in train_docs if t in texts.values()] == [texts[r] for r in order]
    literal = tok.encode("x <|endoftext|> y")
    assert list(literal).count(eot) == 1 and literal[-1] == eot           # only the document's end


def test_prepare_is_deterministic_and_reuses_an_identical_preparation(tmp_path):
    fake_site_packages(tmp_path / "sp")
    kw = dict(roots=[tmp_path / "sp"], vocab_size=VOCAB, val_fraction=0.1, max_file_bytes=2000)
    meta = pc.prepare_packages(tmp_path / "a", **kw)
    pc.prepare_packages(tmp_path / "b", **kw)
    for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    stamp = (tmp_path / "a" / "train.bin").stat().st_mtime_ns
    assert pc.prepare_packages(tmp_path / "a", **kw) == meta                  # reused, not rewritten
    assert (tmp_path / "a" / "train.bin").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="already holds token files"):
        pc.prepare_packages(tmp_path / "a", **{**kw, "vocab_size": VOCAB - 50})


@pytest.mark.parametrize("kw, match", [
    (dict(vocab_size=200), "vocab_size=200 is invalid; accepted: an int from 258"),
    (dict(vocab_size=70000), "vocab_size=70000 is invalid"),
    (dict(val_fraction=1.5), "val_fraction=1.5 is invalid"),
    (dict(max_file_bytes=0), "max_file_bytes=0 is invalid"),
    (dict(max_documents=1), "hold 1 text document"),
])
def test_bad_settings_are_refused_by_name(tmp_path, kw, match):
    fake_site_packages(tmp_path / "sp")
    with pytest.raises(ValueError, match=match):
        pc.prepare_packages(tmp_path / "out", roots=[tmp_path / "sp"], **{"max_file_bytes": 2000, **kw})


def test_missing_root_and_unreadable_tokenizer_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder; accepted: a site-packages folder"):
        pc.prepare_packages(tmp_path / "out", roots=[tmp_path / "nowhere"])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*cannot be read.*tokenizer.json saved by the tokenizers"):
        get_tokenizer(str(tmp_path / "bad.json"))


def test_cli_prepare_and_training_on_the_packages_preset(tmp_path, monkeypatch, capsys):
    """`stableflash data prepare --packages` and `train --set data=packages`, as a user runs them, on a
    site-packages folder of the test's making."""
    fake_site_packages(tmp_path / "sp")
    monkeypatch.setattr(pc, "package_roots", lambda: [tmp_path / "sp"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["data", "prepare", "--packages", "--vocab-size", str(VOCAB), "--out", str(tmp_path / "d")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["source"]["kind"] == "installed-packages" and (tmp_path / "d" / "tokenizer.json").is_file()
    with pytest.raises(SystemExit) as exited:
        main(["data", "prepare", "--packages", "--embedded", "--out", str(tmp_path / "e")])
    assert exited.value.code == 2
    assert "--embedded and --packages name two corpora" in capsys.readouterr().err
    run = tmp_path / "run"
    code = main(["train", "--preset", "tiny", "--out", str(run), "--set", "data=packages", "--set", "max_iters=2",
                 "--set", "eval_every=2", "--set", "eval_iters=1", "--set", "probe_every=0", "-q"])
    assert code == 0
    cached = list((tmp_path / "cache" / "stableflash").glob("packages-*"))
    assert len(cached) == 1 and json.loads((run / "data.json").read_text())
    assert read_meta(cached[0])["source"]["kind"] == "installed-packages"


def test_under_torchrun_rank_0_alone_reads_the_packages(monkeypatch):
    """`data=packages` on several ranks: rank 0 reads (and, the first time, prepares) the corpus once
    and sends its folder; the other ranks take that folder without reading the packages themselves."""
    from pathlib import Path

    from stableflash.train import loop
    from stableflash.train.config import DistInfo

    calls = []
    monkeypatch.setattr(pc, "default_packages_dir", lambda: calls.append(1) or Path("/cache/packages-abc"))

    def broadcast(objects, src):
        assert src == 0
        if objects[0] is None:                         # a rank other than 0 receives rank 0's folder
            objects[0] = "/cache/packages-abc"
    monkeypatch.setattr(loop.torch_dist, "broadcast_object_list", broadcast)
    assert loop.resolve_data_dir("packages", DistInfo(rank=0, world_size=2)) == Path("/cache/packages-abc")
    assert calls == [1]
    assert loop.resolve_data_dir("packages", DistInfo(rank=1, local_rank=1, world_size=2)) == Path("/cache/packages-abc")
    assert calls == [1]
    assert loop.resolve_data_dir("packages") == Path("/cache/packages-abc") and calls == [1, 1]
