"""Optimizers, learning-rate schedule, atomic checkpoints, metrics file."""
import json
import math
import os
from pathlib import Path

import pytest
import torch

from stableflash.train import checkpoint
from stableflash.train.config import make_config
from stableflash.train.metrics import MetricsWriter, read_metrics, truncate_after
from stableflash.train.optim import build_optimizer, lr_at


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)


def test_schedule_warmup_cosine_and_floor():
    cfg = make_config("gpt2-small-paper")
    assert lr_at(0, cfg) == pytest.approx(1e-3 / 2001)
    assert lr_at(1999, cfg) == pytest.approx(1e-3 * 2000 / 2001)
    assert lr_at(2000, cfg) == pytest.approx(1e-3)
    mid = 2000 + (600_000 - 2000) // 2
    assert lr_at(mid, cfg) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5), rel=1e-6)
    assert lr_at(600_000, cfg) == 1e-5 and lr_at(700_000, cfg) == 1e-5
    const = make_config("small")
    assert lr_at(5000, const) == const.lr


def test_adamw_groups_decay_matrices_only():
    cfg = make_config("tiny", overrides=["weight_decay=0.1"])
    opt = build_optimizer(Toy(), cfg, "cpu")
    (adamw,) = opt.optimizers.values()
    decays = sorted((g["weight_decay"], sum(p.numel() for p in g["params"])) for g in adamw.param_groups)
    assert decays == [(0.0, 8 + 8 + 8), (0.1, 80 + 64)]


def test_muon_for_hidden_matrices_adamw_for_the_rest():
    cfg = make_config("gpt2-small-muon")
    opt = build_optimizer(Toy(), cfg, "cpu")
    assert set(opt.optimizers) == {"muon", "adamw"}
    muon_params = [p for g in opt.optimizers["muon"].param_groups for p in g["params"]]
    assert len(muon_params) == 1 and muon_params[0].shape == (8, 8)
    assert opt.optimizers["muon"].defaults["adjust_lr_fn"] == "match_rms_adamw"
    model = Toy()
    opt = build_optimizer(model, cfg, "cpu")
    before = model.hidden.weight.detach().clone()
    model.hidden(model.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    assert not torch.equal(before, model.hidden.weight)


def state_of(step, cfg):
    return {"model": {"w": torch.ones(3)}, "optimizer": {}, "step": step, "config": cfg,
            "rng": {"cpu": torch.get_rng_state(), "cuda": None}, "attention": "sdpa"}


def test_checkpoint_is_atomic_and_checks_config(tmp_path, monkeypatch):
    cfg = make_config("tiny").to_dict()
    checkpoint.save(tmp_path, state_of(1, cfg))
    assert checkpoint.load(tmp_path, cfg)["step"] == 1
    # a save killed half-way (torch.save raising) leaves the previous checkpoint intact, and no temporary file
    def broken_save(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, state_of(2, cfg))
    monkeypatch.undo()
    assert checkpoint.load(tmp_path, cfg)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    other = dict(cfg, n_layer=5, optimizer="muon")
    with pytest.raises(ValueError, match=r"another config \(n_layer: checkpoint None vs now 5, optimizer"):
        checkpoint.load(tmp_path, other)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.load(tmp_path / "nothing", cfg)


def test_metrics_jsonl_events_and_truncation(tmp_path):
    w = MetricsWriter(tmp_path)
    for step in range(5):
        w.write({"step": step, "loss": 1.0 / (step + 1)})
    w.event(4, "nonfinite", loss=math.nan)
    w.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 4] and rows[-1]["loss"] == "nan"
    truncate_after(tmp_path / "metrics.jsonl", 3)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    silent = MetricsWriter(tmp_path / "x", enabled=False) if os.path.isdir(tmp_path) else None
    silent.write({"step": 0, "loss": 1.0})
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_stale_temporary_files_of_killed_saves_are_removed_by_the_next_save(tmp_path):
    """A save killed outright (SIGKILL) leaves .ckpt.pt.tmp-PID behind, up to a checkpoint each: the
    next save removes every such file (they are never valid) and leaves other files alone."""
    cfg = make_config("tiny").to_dict()
    for pid in (12345, os.getpid()):
        (tmp_path / f".ckpt.pt.tmp-{pid}").write_bytes(b"half a checkpoint")
    (tmp_path / "notes.tmp-1").write_text("mine")
    checkpoint.save(tmp_path, state_of(3, cfg))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "notes.tmp-1"]
    assert checkpoint.load(tmp_path, cfg)["step"] == 3


def history_lines(steps):
    return [json.dumps({"step": s, "loss": 1.0 / (s + 1), "pad": "x" * 40}) for s in steps]


def test_truncate_after_streams_an_atomic_rewrite_keeping_every_earlier_record(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    # a long history, with the steps a monitor rollback ran again (5..7 twice) and an event
    lines = history_lines(range(8)) + [json.dumps({"step": 7, "event": "monitor_action"})] + history_lines(range(5, 3000))
    path.write_text("".join(line + "\n" for line in lines))
    original = path.read_bytes()
    # a kill at the rename (the last moment of the rewrite) leaves the file as it was, and no temporary file
    def killed(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        truncate_after(path, 100)
    monkeypatch.undo()
    assert path.read_bytes() == original and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    # streamed: never read whole
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("read the whole file"))
    monkeypatch.setattr(Path, "read_bytes", lambda *a, **k: pytest.fail("read the whole file"))
    seen = []
    assert truncate_after(path, 100, on_kept=seen.append) == 8 + 1 + 95
    monkeypatch.undo()
    kept = [line for line in lines if json.loads(line)["step"] < 100]
    assert path.read_text() == "".join(line + "\n" for line in kept) and seen == [json.loads(line) for line in kept]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_line_cut_short_at_the_end_is_dropped_one_in_the_middle_is_an_error(tmp_path, caplog):
    path = tmp_path / "probes.jsonl"
    good = history_lines(range(4))
    path.write_text("".join(line + "\n" for line in good) + good[3][:17])        # a write cut short by a kill
    with caplog.at_level("WARNING", logger="stableflash.train.metrics"):
        assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
        assert truncate_after(path, 10) == 4
    assert f"{path}: dropped line 5, cut short" in caplog.text
    assert path.read_text() == "".join(line + "\n" for line in good)             # the next record starts a new line
    path.write_text(good[0] + "\n" + good[1])                                    # complete, without its newline
    truncate_after(path, 10)
    assert path.read_text() == good[0] + "\n" + good[1] + "\n"
    damaged = good[0] + "\n" + good[1][:20] + "\n" + good[2] + "\n"
    path.write_text(damaged)
    for read in (read_metrics, lambda p: truncate_after(p, 10)):
        with pytest.raises(ValueError, match=rf"{path} line 2 is not a JSON object with a whole-number step .*records follow it"):
            read(path)
    assert path.read_text() == damaged and sorted(p.name for p in tmp_path.iterdir()) == ["probes.jsonl"]
