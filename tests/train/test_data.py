"""Token files, their validation, deterministic batches and record/replay."""
import json
import logging
import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from stableflash.cli import main
from stableflash.train import data as data_mod
from stableflash.train.data import (BatchRecorder, BatchSampler, ReplaySampler, _sample_regions,
                                    data_fingerprint, eval_batches, get_batch, load_split, read_meta,
                                    write_split)


def write_dir(path, train, val=None, meta=None, dtype="<u2"):
    path.mkdir(parents=True, exist_ok=True)
    np.asarray(train, dtype=dtype).tofile(path / "train.bin")
    np.asarray(train[:100] if val is None else val, dtype=dtype).tofile(path / "val.bin")
    if meta is not None:
        (path / "meta.json").write_text(json.dumps(meta))
    return path


# ---------------------------------------------------------------------------------- token files

def test_nanogpt_files_without_meta_load_as_gpt2(tmp_path):
    ids = np.arange(0, 50257, 7, dtype=np.uint16)          # ids up to 50253, all valid GPT-2 ids
    (tmp_path / "train.bin").write_bytes(ids.astype("<u2").tobytes())   # as nanoGPT writes them
    (tmp_path / "val.bin").write_bytes(ids[:50].astype("<u2").tobytes())
    assert read_meta(tmp_path)["vocab_size"] == 50257
    data = load_split(tmp_path, "train", block_size=64, check="full")
    assert data.dtype == np.uint16 and len(data) == len(ids)
    np.testing.assert_array_equal(data, ids)
    assert int(data[-1]) == 50253
    bad = write_dir(tmp_path / "bad", np.r_[ids, 50257].astype(np.uint16))
    with pytest.raises(ValueError, match=f"token id 50257 at position {len(ids)} is >= vocab_size 50257"):
        load_split(bad, "train", check="sample")     # the last 64K ids are always sampled


def test_uint32_files_when_meta_says_so(tmp_path):
    ids = np.array([0, 70000, 99999, 5, 65536, 1], dtype=np.uint32)
    write_dir(tmp_path, ids, ids, dtype="<u4",
              meta={"vocab_size": 100000, "tokenizer": "x", "dtype": "uint32",
                    "tokens": {"train": 6, "val": 6}, "source": "test"})
    data = load_split(tmp_path, "val", check="full")
    assert data.dtype == np.uint32
    np.testing.assert_array_equal(data, ids)
    with pytest.raises(ValueError, match="vocab_size=50000 is smaller than the data's vocab_size 100000"):
        load_split(tmp_path, "val", vocab_size=50000)


def test_write_split_refuses_ids_that_do_not_fit(tmp_path):
    assert write_split(tmp_path / "a.bin", [1, 2, 65535]) == 3
    assert (tmp_path / "a.bin").stat().st_size == 6
    assert write_split(tmp_path / "a.bin", [7], append=True) == 1
    np.testing.assert_array_equal(np.fromfile(tmp_path / "a.bin", "<u2"), [1, 2, 65535, 7])
    with pytest.raises(ValueError, match=r"ids\[1\] = 65536 does not fit uint16"):
        write_split(tmp_path / "b.bin", [3, 65536])
    with pytest.raises(ValueError, match=r"ids\[0\] = -1 does not fit"):
        write_split(tmp_path / "b.bin", [-1, 3], dtype=np.uint32)
    write_split(tmp_path / "c.bin", [65536, 2**32 - 1], dtype=np.uint32)
    np.testing.assert_array_equal(np.fromfile(tmp_path / "c.bin", "<u4"), [65536, 2**32 - 1])
    with pytest.raises(ValueError, match="dtype=.*int8.* accepted: uint16, uint32"):
        write_split(tmp_path / "d.bin", [1], dtype=np.int8)


def test_missing_directory_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist.*a data folder holds train.bin and val.bin"):
        load_split(tmp_path / "nowhere", "train")
    write_dir(tmp_path, np.arange(300))
    (tmp_path / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"val\.bin does not exist.*found: train\.bin"):
        load_split(tmp_path, "val")
    with pytest.raises(ValueError, match="split='test' is invalid; accepted: train, val"):
        load_split(tmp_path, "test")
    with pytest.raises(ValueError, match="check='fast' is invalid"):
        load_split(tmp_path, "train", check="fast")


def test_odd_size_empty_and_too_short(tmp_path):
    write_dir(tmp_path, np.arange(300))
    (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="train.bin is 3 bytes, not a multiple of 2"):
        load_split(tmp_path, "train")
    (tmp_path / "train.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="train.bin is empty"):
        load_split(tmp_path, "train")
    write_dir(tmp_path, np.arange(65))
    assert len(load_split(tmp_path, "train", block_size=63)) == 65     # 65 > 63 + 1
    with pytest.raises(ValueError,
                       match=r"holds 65 tokens, too few for block_size=64.*more than block_size \+ 1 = 65"):
        load_split(tmp_path, "train", block_size=64)


def test_meta_token_count_must_match(tmp_path):
    write_dir(tmp_path, np.arange(300), meta={"vocab_size": 512, "tokenizer": "t", "dtype": "uint16",
                                               "tokens": {"train": 301, "val": 100}, "source": "x"})
    with pytest.raises(ValueError, match="holds 300 tokens but meta.json says 301"):
        load_split(tmp_path, "train")
    assert len(load_split(tmp_path, "val")) == 100


def test_out_of_range_ids_full_and_sampled(tmp_path):
    n = 3_000_000
    ids = (np.arange(n) % 251).astype(np.uint16)
    meta = {"vocab_size": 256, "tokenizer": "bytes", "dtype": "uint16",
            "tokens": {"train": n, "val": 100}, "source": "test"}
    # In the middle, off every sampled window: only the full scan finds it, and reports it exactly.
    regions = _sample_regions(n)
    assert sum(b - a for a, b in regions) < 1_200_000         # ~1M of the 3M ids are sampled
    pos = regions[len(regions) // 2][1] + 100                 # just past a sampled window
    assert not any(a <= pos < b for a, b in regions)
    ids[pos] = 300
    write_dir(tmp_path, ids, meta=meta)
    load_split(tmp_path, "train", check="sample")         # not in the sample: passes
    with pytest.raises(ValueError, match=f"token id 300 at position {pos} is >= vocab_size 256"):
        load_split(tmp_path, "train", check="full")
    # Two bad ids: the full scan reports the first one.
    ids[2_500_000] = 999
    ids[pos] = 1
    ids[77] = 256
    write_dir(tmp_path, ids, meta=meta)
    with pytest.raises(ValueError, match="token id 256 at position 77 is >= vocab_size 256"):
        load_split(tmp_path, "train", check="full")
    # Inside the first 64K ids: the sampled check catches it.
    ids[77] = 0
    ids[40_000] = 257
    write_dir(tmp_path, ids, meta=meta)
    with pytest.raises(ValueError, match="token id 257 at position 40000 .*sampled check"):
        load_split(tmp_path, "train")
    # Without meta.json, a model vocab_size passed in is what ids are checked against.
    write_dir(tmp_path / "plain", np.array([1, 2, 3, 600, 4], dtype=np.uint16))
    with pytest.raises(ValueError, match="token id 600 at position 3 is >= vocab_size 512"):
        load_split(tmp_path / "plain", "train", vocab_size=512)


# --------------------------------------------------------------------------------------- batches

def test_sampler_is_stateless_and_in_range():
    data = np.arange(10_000, dtype=np.uint16)
    s = BatchSampler(data, block_size=32, batch_size=16, seed=7)
    a = s.indices(5, 1)
    assert a.dtype == np.int64 and a.shape == (16,)
    # The draw is exactly default_rng([seed, step, micro, rank]).integers(0, len - T - 1).
    ref = np.random.default_rng([7, 5, 1, 0]).integers(0, 10_000 - 32 - 1, size=16)
    np.testing.assert_array_equal(a, ref)
    # Stateless: order of calls and fresh samplers do not matter.
    s.indices(0, 0), s.indices(99, 3)
    np.testing.assert_array_equal(BatchSampler(data, 32, 16, 7).indices(5, 1), a)
    others = [s.indices(6, 1), s.indices(5, 0), BatchSampler(data, 32, 16, 7, rank=1).indices(5, 1),
              BatchSampler(data, 32, 16, 8).indices(5, 1)]
    for o in others:
        assert not np.array_equal(o, a)
    many = np.concatenate([s.indices(i, m) for i in range(200) for m in range(4)])
    assert many.min() >= 0 and many.max() <= 10_000 - 32 - 2
    assert many.min() < 100 and many.max() > 10_000 - 200      # the whole range is used
    with pytest.raises(ValueError, match="step=-1 is invalid"):
        s.indices(-1)
    with pytest.raises(ValueError, match="holds 33 tokens, too few for block_size=32"):
        BatchSampler(data[:33], 32, 4, 0)


def test_get_batch_shapes_and_shift():
    data = (np.arange(5000) * 3 % 65521).astype(np.uint16)
    s = BatchSampler(data, block_size=16, batch_size=4, seed=0)
    idx = s.indices(3)
    x, y = s.get_batch(idx, "cpu")
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    for row, i in enumerate(idx):
        assert x[row].tolist() == data[i:i + 16].tolist()
        assert y[row].tolist() == data[i + 1:i + 17].tolist()
    assert torch.equal(x[:, 1:], y[:, :-1])
    last = len(data) - 16 - 1           # the last valid offset: y ends on the file's last token
    x, y = get_batch(data, [last], 16)
    assert int(y[0, -1]) == int(data[-1]) and int(x[0, 0]) == int(data[last])
    with pytest.raises(ValueError, match="indices contains 4984; accepted: offsets 0..4983"):
        get_batch(data, [0, last + 1], 16)


@pytest.mark.gpu
def test_get_batch_on_cuda():
    data = np.arange(1000, dtype=np.uint16)
    x, y = get_batch(data, [0, 10], 8, "cuda")
    assert x.is_cuda and y[1, 0].item() == 11


def test_eval_batches_fixed():
    data = np.arange(2000, dtype=np.uint16)
    a = eval_batches(data, 64, 8, 5, seed=3)
    assert a.shape == (5, 8) and a.dtype == np.int64
    np.testing.assert_array_equal(a, eval_batches(data, 64, 8, 5, seed=3))
    assert not np.array_equal(a, eval_batches(data, 64, 8, 5, seed=4))
    assert a.min() >= 0 and a.max() <= 2000 - 64 - 2
    assert len({tuple(r) for r in a}) == 5


# ------------------------------------------------------------------------------ record / replay

def record_steps(run_dir, steps, sampler, **kw):
    with BatchRecorder(run_dir, 0, batch_size=sampler.batch_size, block_size=sampler.block_size,
                       seed=sampler.seed, data_path="d/train.bin", **kw) as rec:
        for step in steps:
            for micro in range(2):
                rec.record(step, micro, sampler.indices(step, micro))


def test_record_and_replay(tmp_path):
    data = np.arange(50_000, dtype=np.uint16)
    s = BatchSampler(data, block_size=64, batch_size=6, seed=11)
    record_steps(tmp_path, range(5), s)
    rows = np.fromfile(tmp_path / "batches" / "rank0.bin", "<i8").reshape(-1, 8)
    assert rows.shape == (10, 8)
    assert rows[:, 0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4] and rows[:, 1].tolist() == [0, 1] * 5
    header = json.loads((tmp_path / "batches" / "rank0.json").read_text())
    assert header["batch_size"] == 6 and header["block_size"] == 64 and header["seed"] == 11
    assert header["data"] == "d/train.bin"
    r = ReplaySampler(tmp_path / "batches", 0, batch_size=6, block_size=64, data=data)
    for step in range(5):
        for micro in range(2):
            np.testing.assert_array_equal(r.indices(step, micro), s.indices(step, micro))
    x1, y1 = r.get_batch(r.indices(2, 1))
    x2, y2 = s.get_batch(s.indices(2, 1))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # A run folder works as well as its batches folder.
    np.testing.assert_array_equal(ReplaySampler(tmp_path, 0, 6).indices(4, 1), s.indices(4, 1))


def test_resumed_recording_truncates_without_duplicates(tmp_path):
    data = np.arange(50_000, dtype=np.uint16)
    s = BatchSampler(data, block_size=64, batch_size=3, seed=1)
    record_steps(tmp_path, range(5), s)           # a run got to step 4, then was killed ...
    path = tmp_path / "batches" / "rank0.bin"
    with open(path, "ab") as f:
        f.write(b"\x01\x02\x03")                  # ... in the middle of writing a row
    record_steps(tmp_path, range(3, 7), s, start_step=3)   # resumed from the step-3 checkpoint
    rows = np.fromfile(path, "<i8").reshape(-1, 5)
    keys = [tuple(r) for r in rows[:, :2]]
    assert keys == [(st, m) for st in range(7) for m in range(2)]     # 14 rows, no duplicates
    r = ReplaySampler(tmp_path / "batches", 0, 3)
    for st in range(7):
        np.testing.assert_array_equal(r.indices(st, 1), s.indices(st, 1))
    # start_step=0 is a fresh recording.
    record_steps(tmp_path, range(2), s, start_step=0)
    assert path.stat().st_size == 4 * 5 * 8
    # Resuming with another batch size is refused.
    with pytest.raises(ValueError,
                       match="batch_size=4 differs from the recording being resumed.*batch_size=3"):
        BatchRecorder(tmp_path, 0, batch_size=4, block_size=64, start_step=1)


def test_recorder_refuses_duplicates_and_wrong_shapes(tmp_path):
    rec = BatchRecorder(tmp_path, 2, batch_size=2, block_size=8)
    rec.record(0, 0, [1, 2])
    with pytest.raises(ValueError, match=r"\(step, micro\)=\(0, 0\) does not come after \(0, 0\)"):
        rec.record(0, 0, [1, 2])
    with pytest.raises(ValueError, match=r"indices has shape \(3,\); accepted: \(2,\)"):
        rec.record(1, 0, [1, 2, 3])
    rec.close()
    assert (tmp_path / "batches" / "rank2.bin").stat().st_size == 4 * 8


def test_replay_errors(tmp_path):
    s = BatchSampler(np.arange(1000, dtype=np.uint16), block_size=8, batch_size=4, seed=0)
    with pytest.raises(FileNotFoundError, match="rank0.bin does not exist.*BatchRecorder"):
        ReplaySampler(tmp_path / "batches", 0, 4)
    record_steps(tmp_path, [0, 1, 2], s)
    with pytest.raises(FileNotFoundError, match="rank1.bin does not exist"):
        ReplaySampler(tmp_path / "batches", 1, 4)
    with pytest.raises(ValueError, match="batch_size=8 differs from the recording's batch_size 4"):
        ReplaySampler(tmp_path / "batches", 0, 8)
    with pytest.raises(ValueError, match="block_size=16 differs from the recording's block_size 8"):
        ReplaySampler(tmp_path / "batches", 0, 4, block_size=16)
    r = ReplaySampler(tmp_path / "batches", 0, 4)
    with pytest.raises(ValueError,
                       match=r"step 3 was never recorded .*holds 3 recorded steps \(steps 0..2, 6 batches\)"):
        r.indices(3, 0)
    with pytest.raises(ValueError, match="micro 2 of step 1 was never recorded"):
        r.indices(1, 2)
    with pytest.raises(ValueError, match="offsets up to .* beyond the 20 tokens"):
        ReplaySampler(tmp_path / "batches", 0, 4, data=np.arange(20, dtype=np.uint16))


# ------------------------------------------------------------------ what a data folder must hold

def cli_error(argv, capsys) -> str:
    """Run the CLI, expect the one-line error and exit code 2, return the message."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def train_argv(tmp_path, data, *extra, out="run"):
    return ["train", "--preset", "tiny", "--out", str(tmp_path / out), "-q", "--set", f"data={data}",
            "--set", "max_iters=2", "--set", "eval_iters=1", "--set", "probe_every=0", *extra]


def test_a_folder_that_is_not_a_data_folder_says_so(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    err = cli_error(train_argv(tmp_path, empty), capsys)
    assert f"{empty} is not a data folder: it holds no train.bin and no val.bin (found: nothing)" in err
    assert "a data folder holds train.bin and val.bin" in err and "stableflash data prepare" in err
    assert "vocab_size" not in err                                 # not the wrong problem
    # A parent of data folders: the subfolder holding token files is suggested.
    parent = tmp_path / "data"
    write_dir(parent / "shakespeare_char", np.arange(300), meta={"vocab_size": 300})
    (parent / "README").write_text("x")
    err = cli_error(train_argv(tmp_path, parent), capsys)
    assert f"{parent} is not a data folder" in err and "(found: README, shakespeare_char)" in err
    assert f"did you mean data={parent / 'shakespeare_char'}?" in err
    if os.path.isdir("/proc"):
        err = cli_error(train_argv(tmp_path, "/proc"), capsys)
        assert "/proc is not a data folder: it holds no train.bin and no val.bin" in err
        assert "vocab_size" not in err


# --------------------------------------------------------------------------- token dtype and ids

def test_token_dtype_is_inferred_or_asked_for(tmp_path):
    ids = (np.arange(4000) * 7 % 1000).astype(np.uint32)          # ids < 1000: fit either dtype
    # meta.json's token counts settle it.
    write_dir(tmp_path / "counts", ids, dtype="<u4", meta={"vocab_size": 1000, "tokens": {"train": 4000, "val": 100}})
    assert read_meta(tmp_path / "counts")["dtype"] == "uint32"
    np.testing.assert_array_equal(load_split(tmp_path / "counts", "train", check="full"), ids)
    # A vocabulary over 65536 needs uint32.
    write_dir(tmp_path / "big", ids + 65000, dtype="<u4", meta={"vocab_size": 70000})
    np.testing.assert_array_equal(load_split(tmp_path / "big", "train", check="full"), ids + 65000)
    # vocab <= 65536 and nothing else said: uint32 files are not read as uint16 (every other id a
    # spurious 0) but refused, asking for the dtype; the same with no meta.json at all.
    write_dir(tmp_path / "vague", ids, dtype="<u4", meta={"vocab_size": 1000})
    with pytest.raises(ValueError, match=r"token files look like uint32 ids .*meta.json gives no dtype.*"
                                         r"add \"dtype\": \"uint32\""):
        load_split(tmp_path / "vague", "train")
    (tmp_path / "vague" / "meta.json").write_text(json.dumps({"vocab_size": 1000, "dtype": "uint32"}))
    np.testing.assert_array_equal(load_split(tmp_path / "vague", "train", check="full"), ids)
    write_dir(tmp_path / "bare", ids, dtype="<u4")
    with pytest.raises(ValueError, match=r"look like uint32 ids .*there is no meta.json to give the dtype"
                                         r".*write .*meta.json"):
        read_meta(tmp_path / "bare")
    # uint16 files (nanoGPT's convention) whose sizes happen to divide by 4 load as uint16.
    write_dir(tmp_path / "u16", ids.astype(np.uint16), dtype="<u2")
    assert read_meta(tmp_path / "u16")["dtype"] == "uint16"
    np.testing.assert_array_equal(load_split(tmp_path / "u16", "train", check="full"), ids)
    # Sizes that fit neither dtype for the counted tokens, and bad values, are named.
    write_dir(tmp_path / "odd", ids, dtype="<u4", meta={"vocab_size": 1000, "tokens": {"train": 3999}})
    with pytest.raises(ValueError, match=r"train.bin is 16000 bytes, neither 2 \(uint16\) nor 4 \(uint32\) "
                                         r"bytes for each of the 3999 tokens"):
        read_meta(tmp_path / "odd")
    for meta, match in (({"vocab_size": "50257"}, r"vocab_size='50257' is invalid"),
                        ({"vocab_size": 100, "dtype": ["uint16"]}, r"dtype=\['uint16'\] is not supported"),
                        ({"vocab_size": 70000, "dtype": "uint16"}, "does not fit dtype uint16")):
        (tmp_path / "u16" / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match=match):
            read_meta(tmp_path / "u16")
    (tmp_path / "u16" / "meta.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="meta.json is not valid JSON"):
        read_meta(tmp_path / "u16")


def make_folder(path, n=400_000, vocab=256, bad_at=None, seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16)
    if bad_at is not None:
        ids[bad_at] = vocab + 44
    write_dir(path, ids, ids[:5000], meta={"vocab_size": vocab, "tokenizer": "bytes", "dtype": "uint16",
                                           "tokens": {"train": n, "val": 5000}})
    return path


def test_a_run_checks_every_token_id_when_it_starts(tmp_path, capsys, monkeypatch):
    # An id past the vocabulary off every sampled window: before, the run trained until a batch
    # touched it and torch raised "IndexError: index out of range in self", naming no file.
    n = 1_500_000
    pos = _sample_regions(n)[100][1] + 10
    assert not any(a <= pos < b for a, b in _sample_regions(n))
    bad = make_folder(tmp_path / "bad", n, bad_at=pos)
    err = cli_error(train_argv(tmp_path, bad), capsys)
    assert f"{bad / 'train.bin'}: token id 300 at position {pos} is >= vocab_size 256 (byte offset {2 * pos})" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # The full check's result is kept in the run's data.json: a resume over the same files samples.
    good = make_folder(tmp_path / "good", n)
    checks = []
    real = data_mod.check_ids
    monkeypatch.setattr(data_mod, "check_ids",
                        lambda d, v, check="sample", name="": (checks.append(check), real(d, v, check, name)))
    assert main(train_argv(tmp_path, good, out="ok")) == 0
    assert checks == ["full", "full"]
    record = json.loads((tmp_path / "ok" / "data.json").read_text())
    assert record["fingerprint"] == data_fingerprint(good) and set(record["checked"]) == {"train.bin", "val.bin"}
    checks.clear()
    assert main(["train", "--resume", str(tmp_path / "ok"), "-q", "--set", "max_iters=3"]) == 0
    assert checks == ["sample", "sample"]
    os.utime(good / "val.bin", ns=(1, 1))                     # touched (same content): checked again
    checks.clear()
    data_mod.RunData(good, tmp_path / "ok", resume=True).load(256, 64)
    assert checks == ["sample", "full"]


# ---------------------------------------------------------------------- the data a run trained on

def test_resume_and_replay_refuse_changed_data(tmp_path, capsys):
    src = tmp_path / "txt"
    src.mkdir()
    for i in range(4):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox " * 60)
    data = tmp_path / "tok"
    prepare = ["data", "prepare", str(src), "--out", str(data), "--tokenizer", "bytes", "--val-fraction", "0.25"]
    assert main(prepare) == 0
    assert main(train_argv(tmp_path, data, "--set", "ckpt_every=2", out="r")) == 0
    before = {f: (data / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json")}
    # Preparing into the folder again is refused without --overwrite; nothing is touched.
    for i in range(4):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + "THE QUICK BROWN FOX " * 60)   # same sizes
    err = cli_error(prepare, capsys)
    assert f"{data} already holds token files (train.bin, val.bin, meta.json)" in err and "--overwrite" in err
    assert {f: (data / f).read_bytes() for f in before} == before
    assert main([*prepare, "--overwrite"]) == 0
    assert (data / "meta.json").read_bytes() == before["meta.json"]        # only the tokens differ
    # The run refuses to resume on them, naming the folder and what changed.
    err = cli_error(["train", "--resume", str(tmp_path / "r"), "-q", "--set", "max_iters=4"], capsys)
    assert f"the data in {data} changed since the run in {tmp_path / 'r'} was trained on it" in err
    assert "train.bin has other content (same" in err and "val.bin has other content" in err
    assert "--allow-data-change" in err
    # Replaying its batches on the changed data is refused too.
    err = cli_error(train_argv(tmp_path, data, "--set", f"replay={tmp_path / 'r'}", out="replay"), capsys)
    assert f"replay={tmp_path / 'r'}: its batches were recorded on other data than {data} holds now" in err
    assert main(train_argv(tmp_path, data, "--set", f"replay={tmp_path / 'r'}", "--allow-data-change",
                           out="replay")) == 0
    # --allow-data-change resumes, and the record keeps the fingerprint it replaced.
    old = json.loads((tmp_path / "r" / "data.json").read_text())["fingerprint"]
    assert main(["train", "--resume", str(tmp_path / "r"), "-q", "--set", "max_iters=4", "--allow-data-change"]) == 0
    record = json.loads((tmp_path / "r" / "data.json").read_text())
    assert record["previous"] == [old] and record["fingerprint"] == data_fingerprint(data) != old
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["data_fingerprint"] == record["fingerprint"]["sha256"]
    (tmp_path / "r" / "data.json").write_text('{"fingerprint": ')           # damaged: named, not a traceback
    err = cli_error(["train", "--resume", str(tmp_path / "r"), "-q", "--set", "max_iters=5"], capsys)
    assert f"{tmp_path / 'r' / 'data.json'} is damaged" in err


def test_fingerprint_of_large_files_samples_them(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "_FULL_HASH_MAX", 1 << 20)       # files over 1 MiB are sampled here
    make_folder(tmp_path / "d", n=2_000_000)
    fp = data_fingerprint(tmp_path / "d")
    assert fp["files"]["train.bin"]["hashed"] == "sampled" and fp["files"]["val.bin"]["hashed"] == "all"
    with open(tmp_path / "d" / "train.bin", "r+b") as f:            # one block of the sample changes
        f.seek(2_000_000)
        f.write(b"\x07" * (1 << 16))
    changed = data_fingerprint(tmp_path / "d")
    assert changed["sha256"] != fp["sha256"]
    assert data_mod.fingerprint_changes(fp, changed) == ["train.bin has other content (same 4,000,000 bytes)"]
    # Content only: a copy (new path, new modification times) has the same fingerprint.
    shutil.copytree(tmp_path / "d", tmp_path / "copy", copy_function=shutil.copyfile)
    assert data_fingerprint(tmp_path / "copy") == changed


# ------------------------------------------------------------------------------ nanoGPT folders

def test_nanogpt_char_meta_pkl_is_read_without_running_code(tmp_path, capsys):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    meta = {"vocab_size": len(chars), "itos": {i: c for i, c in enumerate(chars)}, "stoi": stoi}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    folder = write_dir(tmp_path / "shakespeare_char", ids, ids[:300])
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)                                         # as nanoGPT's prepare.py writes it
    got = read_meta(folder)
    v = len(chars)
    assert got["vocab_size"] == v == 27 and got["tokenizer"] == "char" and got["dtype"] == "uint16"
    # ids are checked against meta.pkl's vocabulary, not GPT-2's
    write_dir(tmp_path / "bad_char", np.r_[ids, v].astype(np.uint16), ids[:300])
    (tmp_path / "bad_char" / "meta.pkl").write_bytes((folder / "meta.pkl").read_bytes())
    with pytest.raises(ValueError, match=f"token id {v} at position {len(ids)} is >= vocab_size {v}"):
        load_split(tmp_path / "bad_char", "train", check="full")
    assert main(train_argv(tmp_path, folder, "--json")) == 0
    assert json.loads(capsys.readouterr().out)["data_meta"]["vocab_size"] == v

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 26, "x": Evil()}))
    with pytest.raises(ValueError, match=r"meta.pkl was refused: it refers to the global (posix|nt)\.system, "
                                         r"and loading it would run that code"):
        read_meta(folder)
    err = cli_error(train_argv(tmp_path, folder, out="evil"), capsys)
    assert "meta.pkl was refused" in err and "meta.json" in err
    assert not marker.exists()
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta)[:40])       # truncated
    with pytest.raises(ValueError, match="meta.pkl is not a readable pickle"):
        read_meta(folder)
    (folder / "meta.pkl").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ValueError, match="meta.pkl holds a list; accepted: nanoGPT's meta.pkl"):
        read_meta(folder)


def test_openwebtext_style_folder_needs_no_vocab_setting(tmp_path, capsys, caplog):
    ids = (np.arange(20_000) * 2531 % 50257).astype(np.uint16)      # GPT-2 ids, no meta at all
    folder = write_dir(tmp_path / "openwebtext", ids, ids[:2000])
    with caplog.at_level(logging.WARNING, logger="stableflash.train.data"):
        assert main(train_argv(tmp_path, folder, "--json", "--set", "batch_size=1")) == 0   # tiny: vocab 256
    summary = json.loads(capsys.readouterr().out)
    assert summary["status"] == "finished" and summary["data_meta"]["vocab_size"] == 50257
    assert "has no meta.json or meta.pkl: taken as nanoGPT's GPT-2 token files (vocab_size 50257)" in caplog.text
    state = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    emb = next(v for k, v in state["model"].items() if k.endswith("wte.weight"))
    assert emb.shape[0] == 50304                                     # 50257 padded to 64, as nanoGPT
    # A vocab_size set explicitly below the data's is still refused, by name.
    err = cli_error(train_argv(tmp_path, folder, "--set", "vocab_size=256", out="small"), capsys)
    assert "vocab_size=256 is smaller than the data's vocabulary (50257)" in err


def test_recording_rewrite_out_of_order_is_atomic(tmp_path, monkeypatch):
    """Rows not in step order (a recording from elsewhere) are rewritten, not cut: a kill during the
    rewrite (here the final rename failing) leaves the recording byte for byte as it was, and the
    rewrite keeps exactly the rows before start_step."""
    rows = np.array([[0, 0, 10, 11], [5, 0, 50, 51], [1, 0, 12, 13], [6, 0, 60, 61], [2, 0, 14, 15]], dtype="<i8")
    path = tmp_path / "batches" / "rank0.bin"
    path.parent.mkdir()
    rows.tofile(path)
    before = path.read_bytes()

    def fail(*_):
        raise OSError("killed")

    monkeypatch.setattr("stableflash.files.os.replace", fail)
    with pytest.raises(OSError, match="killed"):
        BatchRecorder(tmp_path, 0, batch_size=2, block_size=8, start_step=3)
    assert path.read_bytes() == before
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".rank0.bin.tmp")]
    monkeypatch.undo()
    BatchRecorder(tmp_path, 0, batch_size=2, block_size=8, start_step=3).close()
    np.testing.assert_array_equal(np.fromfile(path, dtype="<i8").reshape(-1, 4), rows[[0, 2, 4]])
