"""The monitor: which indicator fires when, patience, actions, and no alarm on a healthy run."""
import json
import math

import pytest

from stableflash.diagnostics.monitor import DEFAULT_SWITCH, Monitor, MonitorConfig, stabilized_choice_spec
from stableflash.model.spec import parse_attention_spec
from stableflash.train.config import TrainConfig


def record(rep, q_full):
    """A probe record with per-layer repeated-max fractions (2 heads each) and W_Q norms."""
    return {"row": {"repeated_max_frac": [[r, r] for r in rep]}, "spectral": {"q_full": list(q_full)}}


def test_repeated_maxima_rising_in_one_layer_is_flagged_after_patience():
    m = Monitor(MonitorConfig(patience=2))
    assert m.observe_probe(0, record([0.05, 0.04, 0.05], [10, 11, 10])) == []
    assert m.observe_probe(100, record([0.05, 0.30, 0.05], [10, 11, 10])) == []      # once: patience 2
    events = m.observe_probe(200, record([0.05, 0.40, 0.05], [10, 11, 10]))
    assert [(e["indicator"], e["layer"]) for e in events] == [("repeated_max", 1)]
    assert events[0]["value"] == pytest.approx(0.40) and events[0]["event"] == "monitor_warning"
    assert m.observe_probe(300, record([0.05, 0.50, 0.05], [10, 11, 10])) == []      # warned once


def test_high_but_not_grown_fraction_is_not_an_alarm():
    """The paper's rule raises the repeated-maxima fraction itself; a high level from the start
    is not the rising signal."""
    m = Monitor(MonitorConfig(patience=1))
    for step in range(5):
        assert m.observe_probe(step, record([0.30, 0.31], [10, 10])) == []


def test_one_layer_spectral_norm_blowing_up():
    m = Monitor(MonitorConfig(patience=1))
    assert m.observe_probe(0, record([0.0] * 4, [10, 12, 9, 11])) == []
    events = m.observe_probe(1, record([0.0] * 4, [10, 60, 9, 11]))
    assert [(e["indicator"], e["layer"]) for e in events] == [("spectral_q", 1)]
    assert events[0]["threshold"] == pytest.approx(4.0 * 10)


def test_non_finite_spectral_norms_are_left_out_not_multiplied():
    """Weights gone NaN or infinite give a probe record with None norms (JSON has no NaN): those
    layers are left out, the others are still compared among themselves."""
    m = Monitor(MonitorConfig(patience=1))
    assert m.observe_probe(0, record([0.0] * 4, [10, None, 9, 11])) == []
    events = m.observe_probe(1, record([0.0] * 4, [10, None, 60, 11]))
    assert [(e["indicator"], e["layer"]) for e in events] == [("spectral_q", 2)]
    assert events[0]["threshold"] == pytest.approx(4.0 * 10.5)          # median of the finite others
    assert m.observe_probe(2, record([0.0] * 4, [None, None, None, None])) == []
    assert m.observe_probe(3, record([0.0] * 4, [None, 60, None, math.inf])) == []     # no finite other


def test_weights_gone_non_finite_end_the_run_with_the_non_finite_stop(data_dir, tmp_path, monkeypatch):
    """An update that leaves the weights NaN (as lr=inf did before it was refused) is probed right
    after it: the monitor must not fail on the record, and the next step's loss stops the run."""
    import torch

    from stableflash.train import loop
    from stableflash.train.config import make_config
    from stableflash.train.metrics import read_metrics
    real_build = loop.build_optimizer

    def poisoning(model, cfg, device_type):
        opt = real_build(model, cfg, device_type)
        real_step, calls = opt.step, []

        def step():
            real_step()
            calls.append(1)
            if len(calls) == 3:                                  # the update of step 2
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(math.nan)
        opt.step = step
        return opt

    monkeypatch.setattr(loop, "build_optimizer", poisoning)
    cfg = make_config("tiny", overrides=[f"data={data_dir}", "max_iters=10", "probe_every=1", "monitor=switch",
                                         "eval_every=100", "ckpt_every=2"])
    summary = loop.train(cfg, tmp_path / "run", progress=False)
    assert summary["status"] == "nonfinite" and summary["steps"] == 3
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if r.get("event") == "nonfinite"] == [3]
    probes = [json.loads(line) for line in (tmp_path / "run" / "probes.jsonl").read_text().splitlines()]
    assert probes[-1]["step"] == 2 and probes[-1]["spectral"]["q_full"] == [None, None]


def test_loss_spike_after_warmup_only_once():
    m = Monitor(MonitorConfig(warmup_steps=5, loss_spike=1.5, loss_ema=0.5))
    events = []
    for step, loss in enumerate([5, 4, 3, 2.5, 2.2, 2.0, 2.0, 2.1, 3.5, 5.0, 8.0, 9.0]):
        events += m.observe_loss(step, loss)
    assert len(events) == 1 and events[0]["indicator"] == "loss" and events[0]["step"] == 9
    assert m.observe_loss(12, math.nan) == []


def test_delta_drift_is_optional():
    rec = {"delta": {"2": {"running_sum": 5.0}}}
    assert Monitor(MonitorConfig(patience=1)).observe_probe(0, rec) == []
    events = Monitor(MonitorConfig(patience=1, delta_drift=1.0)).observe_probe(0, rec)
    assert [(e["indicator"], e["layer"]) for e in events] == [("delta_drift", 2)]


def test_largest_logit_is_optional_and_names_its_layer_and_head():
    def rec(layers):
        return {"row": {"max_logit": layers}}
    assert Monitor(MonitorConfig(patience=1)).observe_probe(0, rec([[300.0, 2.0]])) == []     # off by default
    m = Monitor(MonitorConfig(patience=2, max_logit=200.0))
    assert m.observe_probe(0, rec([[40.0, 30.0], [20.0, 10.0]])) == []
    assert m.observe_probe(100, rec([[40.0, 30.0], [150.0, 250.0]])) == []                    # patience 2
    events = m.observe_probe(200, rec([[40.0, math.nan], [180.0, 260.0]]))
    assert [(e["indicator"], e["layer"], e["head"]) for e in events] == [("max_logit", 1, 1)]
    assert events[0]["value"] == 260.0 and events[0]["threshold"] == 200.0
    assert "largest attention logit 260 over 200" in events[0]["message"]
    # an absolute level, not a growth: a layer over it from the first probe is flagged too
    assert [e["layer"] for e in Monitor(MonitorConfig(patience=1, max_logit=200.0)).observe_probe(
        0, rec([[201.0], [1.0]]))] == [0]
    for bad in (0, -1.0, math.inf):
        with pytest.raises(ValueError, match="monitor max_logit=.* is invalid; accepted: None"):
            MonitorConfig(max_logit=bad)


def test_actions_choose_layers_once():
    warn = Monitor(MonitorConfig(action="warn"))
    ev = [{"layer": 1}, {"layer": None}]
    assert warn.layers_to_act_on(ev) == []
    switch = Monitor(MonitorConfig(action="switch"))
    assert switch.layers_to_act_on(ev) == [1]
    assert switch.layers_to_act_on([{"layer": 1}, {"layer": 3}]) == [3]
    off = Monitor(MonitorConfig(action="off"))
    assert off.observe_probe(0, record([0.9], [1, 100])) == [] and off.observe_loss(100, 1e9) == []


def test_healthy_noisy_run_raises_no_false_alarm():
    import random
    rng = random.Random(0)
    m = Monitor(MonitorConfig())
    events = []
    for step in range(0, 5000, 100):
        rep = [max(0.0, 0.04 + rng.gauss(0, 0.01)) for _ in range(6)]
        q = [10 + step / 1000 + rng.gauss(0, 0.5) for _ in range(6)]
        events += m.observe_probe(step, record(rep, q))
    for step in range(5000):
        events += m.observe_loss(step, 5.5 * math.exp(-step / 800) + 0.7 + rng.gauss(0, 0.05))
    assert events == []


@pytest.mark.parametrize("current,cuda,want", [
    ("sdpa", True, "triton"), ("sdpa", False, "emulated policy=fa2"),
    ("emulated stabilize=none policy=paper", False, "emulated policy=paper"),
    ("emulated stabilize=paper policy=paper", True, "emulated stabilize=paper+consistent-delta policy=paper"),
    ("triton stabilize=tie-shift", True, "triton stabilize=tie-shift+consistent-delta")])
def test_stabilized_choice(current, cuda, want):
    """The default switch target adds flash_attention's consistent δ to the layer's own rule."""
    got = stabilized_choice_spec(current, cuda)
    assert parse_attention_spec(got) == parse_attention_spec(want)
    assert parse_attention_spec(got).default.stabilization.consistent_delta


def test_training_switches_to_the_monitors_default_target():
    """The training config spells the default switch target out (it imports no torch): it must stay
    the monitor's."""
    assert TrainConfig().monitor_switch_to == DEFAULT_SWITCH == "delta=consistent"


@pytest.mark.parametrize("current,cuda,switch_to,want", [
    ("triton policy=paper acc=e8m5 row_sum=e8m5 out=e8m5", True, "delta=dP*P",
     "triton policy=paper acc=e8m5 row_sum=e8m5 out=e8m5 delta=dP*P"),
    ("triton stabilize=tie-shift delta=dO*O", True, "delta=dP*P stabilize=paper beta=4", "triton delta=dP*P stabilize=paper beta=4"),
    ("sdpa", False, "delta=dP*P", "emulated stabilize=none policy=fa2 delta=dP*P")])
def test_switch_target_replaces_only_the_keys_it_names(current, cuda, switch_to, want):
    assert stabilized_choice_spec(current, cuda, switch_to) == want


@pytest.mark.parametrize("bad", ["", "oops", "delta=", "=dP*P"])
def test_bad_switch_target_is_named(bad):
    with pytest.raises(ValueError, match="monitor_switch_to="):
        stabilized_choice_spec("sdpa", True, bad)


def test_scope_all_acts_on_every_layer_once_on_any_warning():
    m = Monitor(MonitorConfig(action="switch", scope="all"))
    loss_warning = [{"layer": None, "indicator": "loss"}]
    assert m.layers_to_act_on([], 4) == []
    assert m.layers_to_act_on(loss_warning, 4) == [0, 1, 2, 3]
    assert m.layers_to_act_on([{"layer": 2}], 4) == []            # already switched
    flagged = Monitor(MonitorConfig(action="switch"))
    assert flagged.layers_to_act_on(loss_warning, 4) == []          # the loss names no layer
    with pytest.raises(ValueError, match="scope='everything' is invalid; accepted: flagged, all"):
        MonitorConfig(scope="everything")


def test_bad_config():
    with pytest.raises(ValueError, match="action='panic'"):
        MonitorConfig(action="panic")
    with pytest.raises(ValueError, match="patience=0"):
        MonitorConfig(patience=0)
