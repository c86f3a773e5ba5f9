"""ckpt_format=sharded (torch.distributed.checkpoint) in one process: a resume continues to exactly the
uninterrupted losses, a save killed half-way keeps the last complete checkpoint and leaves nothing that
loads, the full and sharded formats resume each other, and a folder that could run code, is damaged,
or was made by another config is refused with a message naming it (exit 2), nothing in it run.
The two-rank FSDP runs are in test_fsdp.py."""
import io
import json
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from stableflash.cli import main
from stableflash.train import checkpoint
from stableflash.train.config import make_config
from stableflash.train.loop import Interrupted, train
from stableflash.train.metrics import read_metrics

FIXED = ("device=cpu", "grad_accum=2", "probe_every=0", "ckpt_every=3", "lr_decay_iters=6", "eval_every=3",
         "eval_iters=2")


def cfg(data_dir, *sets):
    return make_config("tiny", overrides=[f"data={data_dir}", *FIXED, *sets])


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r]


def test_sharded_resume_is_exact_a_killed_save_keeps_the_last_and_formats_resume_each_other(data_dir, tmp_path,
                                                                                            monkeypatch):
    whole = tmp_path / "whole"
    train(cfg(data_dir, "max_iters=6", "ckpt_format=sharded"), whole, progress=False)
    assert sorted(p.name for p in (whole / "ckpt").iterdir()) == ["step-6"]
    assert not (whole / "ckpt.pt").exists()
    assert sorted(p.name for p in (whole / "ckpt" / "step-6").iterdir()) == [".metadata", "__0_0.distcp"]

    run = tmp_path / "run"
    train(cfg(data_dir, "max_iters=3", "ckpt_format=sharded"), run, progress=False)

    def killed(self, *args, **kwargs):               # every shard written, the index not yet
        raise KeyboardInterrupt
    monkeypatch.setattr(FileSystemWriter, "finish", killed)
    with pytest.raises(Interrupted):
        train(cfg(data_dir, "max_iters=6", "ckpt_format=sharded"), run, resume=True, progress=False)
    monkeypatch.undo()
    names = sorted(p.name for p in (run / "ckpt").iterdir())
    assert names == [".step-6.tmp", "step-3"]         # the last good one whole; the cut save hidden, unindexed
    assert not (run / "ckpt" / ".step-6.tmp" / ".metadata").exists()
    assert checkpoint.find(run) == run / "ckpt" / "step-3"
    summary = train(cfg(data_dir, "max_iters=6", "ckpt_format=sharded"), run, resume=True, progress=False)
    assert summary["status"] == "finished"
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step-6"]      # the stale temporary removed
    assert losses(run) == losses(whole) and len(losses(whole)) == 6            # bit for bit

    # full -> sharded -> full: each save removes the other format's checkpoint, each resume is exact
    mixed = tmp_path / "mixed"
    train(cfg(data_dir, "max_iters=2", "ckpt_format=full", "ckpt_every=2"), mixed, progress=False)
    assert (mixed / "ckpt.pt").is_file() and not (mixed / "ckpt").exists()
    train(cfg(data_dir, "max_iters=4", "ckpt_format=sharded", "ckpt_every=2"), mixed, resume=True, progress=False)
    assert not (mixed / "ckpt.pt").exists() and checkpoint.find(mixed) == mixed / "ckpt" / "step-4"
    train(cfg(data_dir, "max_iters=6", "ckpt_format=full", "ckpt_every=2"), mixed, resume=True, progress=False)
    assert checkpoint.find(mixed) == mixed / "ckpt.pt" and not (mixed / "ckpt").exists()
    assert losses(mixed) == losses(whole)


@pytest.fixture(scope="module")
def sharded_run(data_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("sharded") / "run"
    train(make_config("tiny", overrides=[f"data={data_dir}", *FIXED, "max_iters=1", "ckpt_every=1",
                                         "ckpt_format=sharded"]), run, progress=False)
    return run


class Payload:
    """Unpickled, it would create the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def _metadata(folder):
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)                         # the test's own file, written just above


def _replace_entry(folder, fqn, blob: bytes):
    """Point ``fqn``'s storage record at ``blob``, appended to the shard file."""
    md = _metadata(folder)
    (key, info), = [(k, v) for k, v in md.storage_data.items() if k.fqn == fqn]
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob)
    md.storage_data[key] = type(info)(relative_path=info.relative_path, offset=offset, length=len(blob),
                                      transform_descriptors=info.transform_descriptors)
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def _resume(run, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "-q", "--resume", str(run), "--set", "max_iters=2"])
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("where", ["metadata", "bytes entry", "tensor entry"])
def test_a_sharded_checkpoint_that_would_run_code_is_refused_unread(sharded_run, tmp_path, capsys, where):
    run = tmp_path / "run"
    shutil.copytree(sharded_run, run)
    folder = run / "ckpt" / "step-1"
    marker = tmp_path / "ran"
    if where == "metadata":                           # DCP itself would pickle.load this file
        md = _metadata(folder)
        md.planner_data = Payload(marker)
        (folder / ".metadata").write_bytes(pickle.dumps(md))
        named = ".metadata"
    else:                                             # DCP itself reads bytes entries with weights_only=False
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        _replace_entry(folder, "train.step" if where == "bytes entry" else "model.lm_head.weight", buf.getvalue())
        named = "train.step" if where == "bytes entry" else "shard files"
    err = _resume(run, capsys)
    assert f"checkpoint {folder}" in err and "was refused unread" in err and named in err, err
    assert "exec" in err and "Traceback" not in err
    assert not marker.exists()                        # nothing ran


@pytest.mark.parametrize("damage, match", [
    ("empty metadata", "cannot be read (EOFError"),
    ("no metadata", "is not complete: it has no .metadata"),
    ("truncated shard", "cannot be read"),
    ("foreign data file", "names the data file '../ckpt.pt', which is not a file of its folder"),
])
def test_a_damaged_sharded_checkpoint_is_a_clear_error(sharded_run, tmp_path, capsys, damage, match):
    run = tmp_path / "run"
    shutil.copytree(sharded_run, run)
    folder = run / "ckpt" / "step-1"
    if damage == "empty metadata":
        (folder / ".metadata").write_bytes(b"")
    elif damage == "no metadata":
        (folder / ".metadata").unlink()
    elif damage == "truncated shard":
        shard = folder / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        md = _metadata(folder)
        key = next(iter(md.storage_data))
        md.storage_data[key] = type(md.storage_data[key])(relative_path="../ckpt.pt", offset=0, length=10)
        (folder / ".metadata").write_bytes(pickle.dumps(md))
    err = _resume(run, capsys)
    assert match in err and str(folder) in err and "Traceback" not in err, err


def test_a_sharded_checkpoint_of_another_config_is_named(sharded_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(sharded_run, run)
    saved = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**saved, "n_embd": 32}))
    err = _resume(run, capsys)
    assert f"checkpoint {run / 'ckpt' / 'step-1'} was made by another config (n_embd: checkpoint None vs now 32)" in err


def test_bad_ckpt_format_is_a_clear_error(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "-q", "--set", f"data={data_dir}",
              "--set", "ckpt_format=dcp"])
    assert exc.value.code == 2
    assert "ckpt_format='dcp' is invalid; accepted: full, sharded, or none" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
