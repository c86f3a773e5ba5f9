"""Probes and the monitor inside real (tiny, CPU) training runs, and the report of such runs."""
import json

import pytest

from stableflash.cli import main
from stableflash.train.config import make_config
from stableflash.train.loop import train
from stableflash.train.metrics import read_metrics

# thresholds low enough that the monitor fires on a healthy tiny run: this tests the plumbing
TRIGGER = ("monitor_repeated_max=1e-9", "monitor_growth=1e-9", "monitor_patience=1", "monitor_spectral_ratio=1e9")


def run(data_dir, path, *extra):
    cfg = make_config("tiny", overrides=[f"data={data_dir}", "max_iters=20", "ckpt_every=5", *extra])
    return train(cfg, path, progress=False)


def test_probes_are_written_with_delta_running_sums(data_dir, tmp_path):
    run(data_dir, tmp_path / "r", "probe_every=5", "delta_layers=1", "monitor=off")
    records = [json.loads(line) for line in (tmp_path / "r" / "probes.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 5, 10, 15]
    first = records[0]
    assert len(first["spectral"]["q_full"]) == 2 and len(first["row"]["repeated_max_frac"][0]) == 2
    sums = [r["delta"]["1"]["sum_over_tokens"] for r in records]
    running = [r["delta"]["1"]["running_sum"] for r in records]
    assert running == pytest.approx([sum(sums[: i + 1]) for i in range(4)], rel=1e-6)


def test_probes_off_write_nothing(data_dir, tmp_path):
    run(data_dir, tmp_path / "r", "probe_every=0")
    assert not (tmp_path / "r" / "probes.jsonl").exists()


def test_monitor_switch_moves_flagged_layers_to_stabilized_attention(data_dir, tmp_path):
    summary = run(data_dir, tmp_path / "r", "probe_every=5", "monitor=switch", *TRIGGER)
    events = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "event" in r]
    warnings = [e for e in events if e["event"] == "monitor_warning"]
    actions = [e for e in events if e["event"] == "monitor_action"]
    assert warnings and {w["layer"] for w in warnings} == {0, 1} and all("loss" in e for e in events)
    assert [a["action"] for a in actions] == ["switch"] and actions[0]["layers"] == [0, 1]
    assert summary["status"] == "finished" and summary["steps"] == 20
    assert summary["final_attention"] == "sdpa; 0-1: emulated policy=fa2"      # the default stabilization


def test_monitor_switch_to_another_mitigation(data_dir, tmp_path):
    """monitor_switch_to picks what a flagged layer changes to: here δ from dP·P, keeping the policy."""
    summary = run(data_dir, tmp_path / "r", "probe_every=5", "monitor=switch", *TRIGGER,
                  "attention=emulated policy=paper", "monitor_switch_to=delta=dP*P")
    actions = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if r.get("event") == "monitor_action"]
    assert len(actions) == 1 and "(delta=dP*P)" in actions[0]["message"]
    assert summary["final_attention"] == "emulated policy=paper; 0-1: emulated policy=paper delta=dP·P"


def test_monitor_scope_all_switches_every_layer(data_dir, tmp_path):
    """Only the loss indicator can fire here (probes off), and it names no layer: scope "all"
    switches the whole model."""
    cfg = make_config("tiny", overrides=[f"data={data_dir}", "max_iters=30", "ckpt_every=10", "probe_every=0",
                                         "monitor=switch", "monitor_scope=all", "monitor_loss_spike=1e-6",
                                         "warmup_iters=5"])
    summary = train(cfg, tmp_path / "r", progress=False)
    actions = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if r.get("event") == "monitor_action"]
    assert len(actions) == 1 and actions[0]["layers"] == [0, 1]
    assert summary["final_attention"] == "sdpa; 0-1: emulated policy=fa2"      # the default stabilization


def test_bad_switch_target_fails_before_training(data_dir, tmp_path):
    with pytest.raises(ValueError, match="monitor_switch_to='stabilize=nonsense' is invalid: .*stabilize='nonsense'"):
        make_config("tiny", overrides=[f"data={data_dir}", "monitor_switch_to=stabilize=nonsense"])
    with pytest.raises(ValueError, match="monitor_switch_to='rule=ours' is invalid: .*key 'rule' is now 'stabilize'"):
        make_config("tiny", overrides=[f"data={data_dir}", "monitor_switch_to=rule=ours"])


def test_monitor_rollback_restores_the_checkpoint_then_continues_stabilized(data_dir, tmp_path):
    # patience 2: the warning comes at the second probe (step 7), after the checkpoint of step 5
    summary = run(data_dir, tmp_path / "r", "probe_every=7", "monitor=rollback", *TRIGGER, "monitor_patience=2")
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    rollback = [r for r in rows if r.get("action") == "rollback"]
    assert len(rollback) == 1 and rollback[0]["step"] == 7 and rollback[0]["to_step"] == 5
    steps = [r["step"] for r in rows if "event" not in r]
    assert steps == list(range(0, 8)) + list(range(5, 20))      # steps 5..7 run again after the rollback
    assert summary["status"] == "finished" and summary["final_attention"].endswith("emulated policy=fa2")


def test_report_of_training_runs(data_dir, tmp_path, capsys):
    run(data_dir, tmp_path / "a", "probe_every=5", "delta_layers=1")
    run(data_dir, tmp_path / "b", "probe_every=5", "attention=emulated policy=fa2 stabilize=tie-shift")
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep.html")]) == 0
    html = (tmp_path / "rep.html").read_text()
    for fig in ("fig-loss", "fig-grad-norm", "fig-spectral-a", "fig-repeated-max-b", "fig-delta", "fig-monitor"):
        assert f'id="{fig}"' in html
    summary = json.loads((tmp_path / "rep.json").read_text())
    runs = summary["runs"] if isinstance(summary, dict) else summary
    assert {r["name"] for r in runs} == {"a", "b"}


def test_an_acting_monitor_without_the_logit_indicator_says_what_it_misses(data_dir, tmp_path, caplog):
    """monitor=switch (or rollback) with the default indicators logs that they acted too late on
    most failures measured and names monitor_max_logit; with a logit indicator set (the level, its
    growth or its rise), or with monitor=warn, no such warning."""
    with caplog.at_level("WARNING", logger="stableflash.train.loop"):
        run(data_dir, tmp_path / "a", "max_iters=2", "probe_every=0", "monitor=switch")
    assert any("monitor_max_logit=200" in r.getMessage() and "monitor=switch" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="stableflash.train.loop"):
        run(data_dir, tmp_path / "b", "max_iters=2", "probe_every=0", "monitor=switch", "monitor_max_logit=200")
        run(data_dir, tmp_path / "c", "max_iters=2", "probe_every=0", "monitor=warn")
        run(data_dir, tmp_path / "d", "max_iters=2", "probe_every=0", "monitor=rollback", "monitor_max_logit_rise=2.5")
    assert not any("monitor_max_logit" in r.getMessage() for r in caplog.records)
