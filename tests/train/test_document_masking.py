"""Document masking in training (attn_mask_type="block_causal"): the documents of a batch as varlen
cu_seqlens built from the token ids, the data's end-of-text token, and the option through the CLI."""
import json

import numpy as np
import pytest
import torch

from stableflash.cli import main
from stableflash.model.base import document_cu_seqlens
from stableflash.train.config import make_config
from stableflash.train.data import read_meta, write_split

EOT = 7


def brute_cu_seqlens(rows: list[list[int]], eot: int) -> list[int]:
    """Document starts in the flattened rows, each row split after every eot, then the total."""
    starts, base = [], 0
    for row in rows:
        for t in range(len(row)):
            if t == 0 or row[t - 1] == eot:
                starts.append(base + t)
        base += len(row)
    return starts + [base]


@pytest.mark.parametrize("rows", [
    [[1, 2, 3, 4, 5]],                                   # no end-of-text token: one document per row
    [[EOT, 1, 2, EOT, 3], [4, 5, 6, 7, 1]],              # at the row's start; a row without one
    [[1, 2, 3, 4, EOT], [1, EOT, EOT, EOT, 2]],          # at the row's end; consecutive ones
    [[EOT, EOT, EOT, EOT, EOT], [EOT, 1, 1, 1, 1]],      # every token a document
    [[3]],                                               # T = 1
])
def test_cu_seqlens_of_chosen_rows(rows):
    idx = torch.tensor(rows)
    cu = document_cu_seqlens(idx, EOT)
    want = brute_cu_seqlens(rows, EOT)
    n = idx.numel()
    assert cu.dtype == torch.int32 and cu.shape == (n + 1,)
    # the documents, then sequences of length 0 up to the fixed length B·T + 1
    assert cu.tolist() == want + [n] * (n + 1 - len(want))


def test_cu_seqlens_of_random_rows(gen):
    for _ in range(20):
        B, T = (int(v) for v in torch.randint(1, 9, (2,), generator=gen))
        p = float(torch.rand((), generator=gen))
        idx = torch.where(torch.rand(B, T, generator=gen) < p, EOT, torch.randint(0, EOT, (B, T), generator=gen))
        want = brute_cu_seqlens(idx.tolist(), EOT)
        assert document_cu_seqlens(idx, EOT).tolist() == want + [B * T] * (B * T + 1 - len(want))


def test_cu_seqlens_are_built_without_reading_back(gen):
    """Under torch.compile(fullgraph=True) with dynamic shapes: a host read (nonzero, item) would
    be a graph break, so this compiles only as device work."""
    compiled = torch.compile(document_cu_seqlens, fullgraph=True, dynamic=True, backend="eager")
    idx = torch.randint(0, 10, (3, 11), generator=gen)
    assert torch.equal(compiled(idx, EOT), document_cu_seqlens(idx, EOT))


# ---------------------------------------------------------------------------------------- data


def _folder(tmp_path, meta: dict | None, name="d"):
    d = tmp_path / name
    d.mkdir()
    for split in ("train", "val"):
        write_split(d / f"{split}.bin", np.arange(300) % 250, np.uint16)
    if meta is not None:
        (d / "meta.json").write_text(json.dumps(meta))
    return d


def test_the_data_sets_end_of_text_token(tmp_path):
    assert read_meta(_folder(tmp_path, {"vocab_size": 50257, "tokenizer": "gpt2"}, "a"))["eot_token"] == 50256
    assert read_meta(_folder(tmp_path, None, "b"))["eot_token"] == 50256           # nanoGPT's GPT-2 files
    assert read_meta(_folder(tmp_path, {"vocab_size": 256, "tokenizer": "bytes"}, "c"))["eot_token"] is None
    assert read_meta(_folder(tmp_path, {"vocab_size": 256, "eot_token": 3}, "e"))["eot_token"] == 3
    assert read_meta(_folder(tmp_path, {"vocab_size": 50257, "tokenizer": "gpt2", "eot_token": None},
                             "f"))["eot_token"] is None
    bad = _folder(tmp_path, {"vocab_size": 256, "eot_token": 256}, "g")
    with pytest.raises(ValueError, match=r"meta.json: eot_token=256 is invalid; accepted: .*vocab_size=256"):
        read_meta(bad)


def test_prepared_text_records_its_end_of_text_token(tmp_path):
    from stableflash.train.corpus import prepare_text
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document {i}\n" * 20)
    meta = prepare_text(tmp_path, tmp_path / "out", tokenizer="bytes", val_fraction=0.3)
    assert meta["eot_token"] is None and read_meta(tmp_path / "out")["eot_token"] is None


# -------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("sets, match", [
    (["attn_mask_type=document"], "attn_mask_type='document' is invalid; accepted: causal, block_causal"),
    (["eot_token=5"], "eot_token=5 takes effect only with attn_mask_type=block_causal"),
    (["attn_mask_type=block_causal", "eot_token=-1"], "eot_token=-1 is invalid; accepted: None or a non-negative"),
    (["attn_mask_type=block_causal", "eot_token=x"], "eot_token='x' is not a valid int"),
])
def test_invalid_settings_are_named(sets, match, tmp_path, capsys):
    with pytest.raises(ValueError, match=match):
        make_config("tiny", overrides=sets)
    argv = ["train", "--out", str(tmp_path / "r"), "-q"]
    for s in sets:
        argv += ["--set", s]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_data_without_an_end_of_text_token_is_refused(data_dir, tmp_path, capsys):
    """The embedded corpus is bytes: no token ends its documents, so block_causal needs eot_token."""
    with pytest.raises(SystemExit) as exc:
        main(["train", "--out", str(tmp_path / "r"), "-q", "--set", f"data={data_dir}",
              "--set", "attn_mask_type=block_causal"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "attn_mask_type=block_causal needs the end-of-text token" in err and str(data_dir) in err
    assert "tokenizer 'bytes'" in err and "--set eot_token=ID" in err
    assert not (tmp_path / "r").exists()
