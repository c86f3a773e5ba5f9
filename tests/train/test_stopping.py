"""Stopping exploded runs: the streak rule, its replay on resume, and the loop's stop."""
import math

import pytest
import torch

from stableflash.report.runs import explosion_step, load_run
from stableflash.train.config import make_config
from stableflash.train.loop import train
from stableflash.train.metrics import read_metrics
from stableflash.train.stopping import ExplosionStop


def test_a_streak_above_twice_the_running_minimum_stops_the_run():
    stop = ExplosionStop(after=3)
    losses = [5.0, 3.0, 2.0, 4.5, 4.1, 3.9, 5.0, 6.0, 7.0]      # 4.5, 4.1 > 4.0; 3.9 breaks the streak
    got = [stop.observe(step, loss) for step, loss in enumerate(losses)]
    assert got == [False] * 8 + [True]
    assert stop.above_since == 6 and stop.running_min == 2.0


def test_non_finite_losses_and_after_zero_never_stop():
    stop = ExplosionStop(after=2)
    assert not stop.observe(0, 1.0) and not stop.observe(1, math.nan) and not stop.observe(2, math.inf)
    assert stop.running_min == 1.0 and stop.above_since is None
    never = ExplosionStop(after=0)
    assert not any(never.observe(s, v) for s, v in enumerate([1.0, 9.0, 9.0, 9.0, 9.0]))


def test_replay_rebuilds_the_streak_from_logged_rows_with_gaps():
    rows = [{"step": 0, "loss": 3.0}, {"step": 10, "loss": 1.0}, {"step": 15, "event": "monitor_warning"},
            {"step": 20, "loss": 2.5}, {"step": 30, "loss": 2.6}]
    stop = ExplosionStop(after=25)
    stop.replay(rows)
    assert stop.running_min == 1.0 and stop.above_since == 20
    assert not stop.observe(43, 3.0) and stop.observe(44, 3.0)      # steps 20..44 are 25 steps


def test_the_loop_stops_an_exploded_run_and_keeps_its_outcome(data_dir, tmp_path, monkeypatch):
    from stableflash.model import gpt
    real = gpt.GPT.forward
    calls = {"n": 0}

    def blown_up(self, idx, targets=None):
        logits, loss = real(self, idx, targets)
        if self.training:
            calls["n"] += 1
            if calls["n"] > 10:                       # from step 10 on, the loss is 10 × what it was
                loss = loss * 10.0
        return logits, loss

    monkeypatch.setattr(gpt.GPT, "forward", blown_up)
    cfg = make_config("tiny", overrides=[f"data={data_dir}", "max_iters=40", "ckpt_every=5", "eval_every=100",
                                         "probe_every=0", "stop_after_explosion=6"])
    summary = train(cfg, tmp_path / "r", progress=False)
    assert summary["status"] == "exploded" and summary["steps"] == 15      # steps 10..15 above: stopped at 15
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    events = [r for r in rows if r.get("event") == "exploded"]
    assert len(events) == 1 and events[0]["step"] == 15 and events[0]["since"] == 10
    assert explosion_step(load_run(tmp_path / "r"), window=5) == 10
    state = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=False)
    assert state["step"] == 15


def test_stop_after_explosion_rejects_a_negative_count(data_dir):
    with pytest.raises(ValueError, match="stop_after_explosion=-1 is invalid; accepted: a non-negative"):
        make_config("tiny", overrides=[f"data={data_dir}", "stop_after_explosion=-1"])
