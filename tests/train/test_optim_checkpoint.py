"""Optimizers, learning-rate schedule, atomic checkpoints, metrics file."""
import math
import os

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


def test_checkpoint_is_atomic_and_checks_config(tmp_path, monkeypatch):
    cfg = make_config("tiny").to_dict()
    checkpoint.save(tmp_path, {"step": 1, "config": cfg, "w": torch.ones(3)})
    assert checkpoint.load(tmp_path, cfg)["step"] == 1
    # a save killed half-way (torch.save raising) leaves the previous checkpoint intact
    def broken_save(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, {"step": 2, "config": cfg})
    monkeypatch.undo()
    assert checkpoint.load(tmp_path, cfg)["step"] == 1
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
