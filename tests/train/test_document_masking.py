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
    # given the number of documents: exactly one entry more
    assert document_cu_seqlens(idx, EOT, len(want) - 1).tolist() == want


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
    (["attn_mask_type=block_causal", "attention=emulated block=32"], "sets block=32, which cannot apply"),
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
    with pytest.raises(SystemExit) as exc:                   # an id outside the model's vocabulary
        main(["train", "--out", str(tmp_path / "r"), "-q", "--set", f"data={data_dir}",
              "--set", "attn_mask_type=block_causal", "--set", "eot_token=256"])
    assert exc.value.code == 2 and "eot_token=256 is invalid" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------ training


def _losses(run) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def test_a_run_with_document_masking_records_it_and_resumes_with_it(data_dir, tmp_path, capsys):
    """The embedded corpus is bytes; a newline (10) as the end-of-text id splits it into lines."""
    common = ["--preset", "tiny", "-q", "--set", f"data={data_dir}", "--set", "ckpt_every=2", "--set", "eval_iters=1"]
    out = tmp_path / "docs"
    assert main(["train", "--out", str(out), *common, "--set", "max_iters=2", "--set", "attn_mask_type=block_causal",
                 "--set", "eot_token=10"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["attn_mask_type"], config["eot_token"]) == ("block_causal", 10)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["attn_mask_type"], summary["eot_token"]) == ("block_causal", 10)
    # the same seed, data and weights under plain causal attention give other losses from step 0
    assert main(["train", "--out", str(tmp_path / "causal"), *common, "--set", "max_iters=1"]) == 0
    assert _losses(tmp_path / "causal")[0] != _losses(out)[0]
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "-q", "--set", "max_iters=4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 4 and (summary["attn_mask_type"], summary["eot_token"]) == ("block_causal", 10)
    assert json.loads((out / "config.json").read_text())["attn_mask_type"] == "block_causal"


def test_the_data_sets_own_token_and_a_missing_one(tmp_path, caplog):
    """eot_token unset: the id from the folder's meta.json; a warning when it never occurs."""
    from stableflash.train.loop import train
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 255, 20_000)              # 255 never occurs
    ids[rng.random(ids.size) < 0.05] = 0                    # documents end with id 0
    d = tmp_path / "data"
    d.mkdir()
    write_split(d / "train.bin", ids, np.uint16)
    write_split(d / "val.bin", ids[:5000], np.uint16)
    (d / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes", "eot_token": 0}))
    for model in ("tiny", "llama-tiny"):
        cfg = make_config("tiny", overrides=[f"data={d}", f"model={model}", "max_iters=1", "eval_iters=1",
                                             "attn_mask_type=block_causal"])
        summary = train(cfg, tmp_path / model, progress=False)
        assert summary["status"] == "finished" and summary["eot_token"] == 0
    (d / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes", "eot_token": 255}))
    cfg = make_config("tiny", overrides=[f"data={d}", "max_iters=1", "eval_iters=1", "attn_mask_type=block_causal"])
    with caplog.at_level("WARNING", logger="stableflash.train.loop"):
        train(cfg, tmp_path / "absent", progress=False)
    assert "the end-of-text token 255 does not occur in the first 20000 tokens" in caplog.text
