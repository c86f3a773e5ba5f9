"""The monitor: which indicator fires when, patience, actions, and no alarm on a healthy run."""
import json
import math
import statistics

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


def test_the_state_names_the_layers_over_threshold_with_their_streak():
    m = Monitor(MonitorConfig(patience=3))
    assert m.state()["over"] == {} and m.state()["loss_ema"] is None and m.state()["best_loss_ema"] is None
    m.observe_probe(0, record([0.05, 0.04, 0.05], [10, 11, 10]))
    m.observe_probe(100, record([0.05, 0.30, 0.05], [10, 11, 10]))
    m.observe_probe(200, record([0.05, 0.40, 0.05], [10, 11, 10]))
    m.observe_loss(300, 2.5)
    state = m.state()
    assert state["over"] == {"repeated_max": {"1": 2}} and state["patience"] == 3 and state["loss_ema"] == 2.5
    assert state["action"] == "warn" and state["acted_on"] == [] and not state["loss_warned"]
    m.observe_probe(300, record([0.05, 0.05, 0.05], [10, 11, 10]))          # back under: the streak resets
    assert m.state()["over"] == {}


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


# ---------------------------------------------------------------- the largest logit against its own level


def logit_record(logits):
    """A probe record whose layers' largest logits (one head each) are ``logits``."""
    return {"row": {"max_logit": [[v, None] for v in logits], "repeated_max_frac": [[0.0, 0.0]] * len(logits)},
            "spectral": {"q_full": [10.0] * len(logits)}}


def test_largest_logit_growth_warns_a_synthetic_failure_long_before_it():
    """Layer 1's largest logit settles at ~41 after warm-up, then grows 1.25× per probe (as before
    the failures replayed in docs/notebook/monitor-evaluation.md) until it passes 1e4, which we call
    the explosion: the indicator (5× the level, a level in no unit of its own) warns at the first
    probe past 5 × 41, 1700 steps before it; the other layers stay quiet."""
    m = Monitor(MonitorConfig(max_logit_growth=5.0, patience=1, warmup_steps=200))
    level = [40.0, 42.0, 41.0]
    warnings, exploded = [], None
    for k in range(40):
        step = 100 * k
        grown = 41.0 * 1.25 ** (k - 4) if k > 4 else (level[k - 2] if k >= 2 else 3.0 * k)
        warnings += m.observe_probe(step, logit_record([35.0, grown, 50.0 if k > 1 else 1.0]))
        if exploded is None and grown > 1e4:
            exploded = step
    assert [(w["step"], w["layer"], w["indicator"]) for w in warnings] == [(1200, 1, "max_logit_growth")]
    assert warnings[0]["threshold"] == pytest.approx(5 * 41.0) and warnings[0]["value"] > 5 * 41.0
    assert exploded - warnings[0]["step"] >= 500


def test_a_synthetic_stabilized_run_with_rising_ties_and_large_logits_gets_no_warning():
    """What the stabilized runs look like: the tie fraction rises (0.05 to 0.2, four-fold, under the
    0.25 level), every layer's W_Q grows alike, and the largest logits wander between their level
    after warm-up and ~2.5× it — 60 to 130 here, levels that pass an absolute 100. Neither the
    defaults nor the logit against its own level (5×) say anything; an absolute 100 would."""
    settings = {"max_logit_growth": 5.0, "patience": 1, "warmup_steps": 200}
    scale_free, absolute = Monitor(MonitorConfig(**settings)), Monitor(MonitorConfig(max_logit=100.0, patience=1))
    said, absolute_said = [], []
    for k in range(60):
        tie = 0.05 + 0.15 * k / 59
        logits = [60.0 + 70.0 * ((k * 7 + layer * 3) % 11) / 10 for layer in range(4)] if k > 1 else [1.0] * 4
        record = {"row": {"max_logit": [[v] for v in logits], "repeated_max_frac": [[tie, tie]] * 4},
                  "spectral": {"q_full": [2.0 + 0.3 * k + 0.1 * layer for layer in range(4)]}}
        said += scale_free.observe_probe(100 * k, record)
        absolute_said += absolute.observe_probe(100 * k, record)
    assert said == []
    assert absolute_said                                   # the absolute level alone would have cried wolf


def test_the_reference_level_is_taken_after_warm_up_only():
    """Probes before the warm-up's end do not set the level (at initialisation every logit is ~1)."""
    m = Monitor(MonitorConfig(max_logit_growth=2.0, patience=1, warmup_steps=300))
    assert m.observe_probe(0, logit_record([1.0])) == [] and m.observe_probe(100, logit_record([20.0])) == []
    for step in (300, 400, 500):
        assert m.observe_probe(step, logit_record([50.0])) == []
    assert m.reference == {0: [50.0, 50.0, 50.0]}
    assert m.observe_probe(600, logit_record([99.0])) == []
    assert [w["step"] for w in m.observe_probe(700, logit_record([101.0]))] == [700]


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_a_bad_growth_factor_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"monitor max_logit_growth=.* is invalid; accepted: None \(off\)"):
        MonitorConfig(max_logit_growth=value)


def test_the_cli_refuses_a_bad_growth_factor_in_one_line(tmp_path, capsys):
    from stableflash.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["train", "-q", "--out", str(tmp_path / "r"), "--preset", "tiny", "--set", "monitor_max_logit_growth=-2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "monitor_max_logit_growth=-2" in err
    assert not (tmp_path / "r").exists()


def test_replay_gives_the_warnings_a_real_training_run_logged(data_dir, tmp_path):
    """A tiny CPU run trained through the CLI with the indicator set low enough to fire, probes on
    every other step: benchmarks/runs/monitor_replay.py's replay of its probes.jsonl gives the first
    warning it logged, and a Monitor fed the records in order gives every warning it logged."""
    import importlib.util
    from pathlib import Path

    from stableflash.cli import main
    from stableflash.report.runs import load_run
    from stableflash.train.config import make_config, monitor_config

    out = tmp_path / "run"
    assert main(["train", "-q", "--out", str(out), "--preset", "tiny", "--set", f"data={data_dir}",
                 "--set", "max_iters=24", "--set", "warmup_iters=4", "--set", "probe_every=2", "--set", "eval_iters=1",
                 "--set", "monitor_max_logit_growth=1.05", "--set", "monitor_patience=1"]) == 0
    run = load_run(out)
    logged = [(e["step"], e["layer"], e["indicator"]) for e in run.events
              if e.get("event") == "monitor_warning" and e["indicator"] != "loss"]
    assert "max_logit_growth" in {w[2] for w in logged}, "set low enough to fire on a healthy run: a warning to compare"
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "runs" / "monitor_replay.py"
    spec = importlib.util.spec_from_file_location("monitor_replay", path)
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    [found] = replay.find_runs([tmp_path])
    assert found["role"] == "control" and found["warmup"] == 4        # the tiny preset: attention in fp32
    assert replay.first_warning(found, replay.stored_settings(run.config)) == logged[0][0]
    monitor = Monitor(monitor_config(make_config("tiny", overrides=["warmup_iters=4", "monitor_max_logit_growth=1.05",
                                                                    "monitor_patience=1"])))
    assert replay.stored_settings(run.config) == {k: getattr(monitor.config, k) for k in replay.stored_settings(run.config)}
    again, states = [], []
    for r in run.probes:
        again += [(e["step"], e["layer"], e["indicator"]) for e in monitor.observe_probe(r["step"], r)]
        states.append(json.loads(json.dumps(monitor.state()))["over"])
    assert again == logged
    # each probe record carries the monitor's state after it: the same indicators over their threshold
    assert [r["monitor"]["over"] for r in run.probes] == states and any(states)
    assert all(r["monitor"]["action"] == "warn" and math.isfinite(r["monitor"]["loss_ema"]) for r in run.probes)


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_resumed_run_warns_where_the_uninterrupted_run_does(data_dir, tmp_path, fmt):
    """The monitor's state travels in the checkpoint (ckpt.pt, or the sharded folder): a run stopped
    at step 10 and resumed to 16 logs the same warnings, and the same monitor state in its probe
    records, as the run trained to 16 at once — with the growth indicator, whose level is measured
    over the first probes after warm-up, which a monitor started afresh at the resume would measure
    again over the resumed run's first probes."""
    from stableflash.cli import main
    from stableflash.report.runs import load_run

    flags = ["--set", f"data={data_dir}", "--set", "warmup_iters=4", "--set", "probe_every=2", "--set", "eval_iters=1",
             "--set", "monitor_max_logit_growth=1.05", "--set", "monitor_patience=2", "--set", f"ckpt_format={fmt}",
             "--set", "lr_decay_iters=16"]          # the schedule of 16 steps in both
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(["train", "-q", "--out", str(whole), "--preset", "tiny", "--set", "max_iters=16", *flags]) == 0
    assert main(["train", "-q", "--out", str(parts), "--preset", "tiny", "--set", "max_iters=10", *flags]) == 0
    assert main(["train", "-q", "--resume", str(parts), "--set", "max_iters=16"]) == 0

    def warnings(run):
        return [(e["step"], e["layer"], e["indicator"]) for e in run.events if e.get("event") == "monitor_warning"]

    a, b = load_run(whole), load_run(parts)
    assert warnings(a) and any(w[0] > 10 for w in warnings(a)), "set to fire after the resume: something to compare"
    assert warnings(b) == warnings(a)
    assert [p["monitor"] for p in b.probes] == [p["monitor"] for p in a.probes]


def test_a_malformed_monitor_state_is_refused_by_name():
    m = Monitor(MonitorConfig())
    m.observe_probe(0, record([0.05, 0.30], [10, 11]))
    again = Monitor(MonitorConfig())
    again.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert again.state_dict() == m.state_dict() and again.first == m.first
    for bad in ({}, {**m.state_dict(), "warned_loss": "no"}, {**m.state_dict(), "first": [["spectral_q", "x", 1.0]]}):
        with pytest.raises(ValueError, match="monitor state is malformed"):
            Monitor(MonitorConfig()).load_state_dict(bad)


def _replay_tool():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "runs" / "monitor_replay.py"
    spec = importlib.util.spec_from_file_location("monitor_replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("attention, extra, expected", [
    ("triton policy=fa2 p_bar=fp8_e4m3 out=fp8_e4m3", {}, "baseline"),              # stored grammar: not stabilized
    ("triton policy=fa2 p_bar=fp8_e4m3 out=fp8_e4m3 delta=auto", {}, "stabilized"),
    ("triton policy=fa2 p_bar=fp8_e4m3 out=fp8_e4m3 delta=dO*O16", {}, "stabilized"),  # the same δ, spelled out
    ("triton policy=fa2 p_bar=fp8_e4m3 out=fp8_e4m3 delta=dO*O32", {}, "mitigation"),  # not fp8's consistent δ
    ("triton policy=fa2 out=e8m4 rule=ours", {}, "mitigation"),
    ("triton policy=paper acc=e8m5 row_sum=e8m5 out=e8m5 delta=dP*P", {}, "stabilized"),
    ("emulated policy=fa2 p_bar=fp32 acc=fp32 row_sum=fp32 out=fp32", {}, "control"),
    ("triton policy=fa2 out=e8m4", {"qk_norm": True}, "mitigation"),
    ("triton policy=fa2 out=e8m4", {"monitor": "switch"}, "switched"),
])
def test_the_replay_tool_reads_a_runs_role_from_its_config(attention, extra, expected):
    assert _replay_tool().role({"attention": attention, **extra}, 6) == expected


def test_in_time_is_500_steps_or_a_fifth_of_the_steps_to_the_explosion():
    in_time = _replay_tool().in_time
    assert in_time(2500, 3000) and not in_time(2510, 3000) and not in_time(None, 3000) and not in_time(3100, 3000)
    assert in_time(520, 650) and not in_time(530, 650)               # 20% of 650 = 130 steps


# ---------------------------------------------------------------- the largest logit against its recent past


def settled(k):
    """A layer's largest logit settled after warm-up: 32 to 48, wandering from probe to probe."""
    return 40.0 + 4.0 * ((k * 7) % 5 - 2)


def test_rise_warns_a_synthetic_runaway_within_three_probes():
    """Layer 1 settles at ~40 after warm-up, then from step 2000 grows 1.5× per probe (a compounding
    runaway) until it passes 1e4, which we call the explosion (step 3300): 2.5× the median of its
    last probes warns at the third probe of the runaway (135 against 2.5 × 44), 1100 steps before;
    the layers that stay settled get nothing."""
    m = Monitor(MonitorConfig(max_logit_rise=2.5, patience=1, warmup_steps=200))
    warnings, exploded = [], None
    for k in range(40):
        step = 100 * k
        runaway = 40.0 * 1.5 ** (k - 19) if k >= 20 else settled(k)
        warnings += m.observe_probe(step, logit_record([settled(k + 1), runaway if k > 1 else 1.0, settled(k + 2)]))
        if exploded is None and runaway > 1e4:
            exploded = step
    assert [(w["step"], w["layer"], w["indicator"]) for w in warnings] == [(2200, 1, "max_logit_rise")]
    last_ten = [settled(k) for k in range(12, 20)] + [60.0, 90.0]
    assert warnings[0]["value"] == pytest.approx(135.0)
    assert warnings[0]["threshold"] == pytest.approx(2.5 * statistics.median(last_ten)) == pytest.approx(110.0)
    assert exploded == 3300 and exploded - warnings[0]["step"] >= 500


def test_rise_is_silent_on_a_large_but_slow_run_where_level_indicators_cry_wolf():
    """A healthy layer whose largest logit climbs from 100 to ~1000 over 6000 steps (4% per probe,
    ±25% from probe to probe): the median of its last probes climbs with it, so 2.5× that median is
    never passed; the absolute level (200) and the level against the first probes after warm-up (5×)
    both warn."""
    def run(config):
        m, said = Monitor(config), []
        for k in range(62):
            wobble = 1.0 + 0.25 * (((k * 5) % 9) - 4) / 4
            said += m.observe_probe(100 * k, logit_record([100.0 * 1.04 ** k * wobble if k > 1 else 1.0]))
        return said
    assert run(MonitorConfig(max_logit_rise=2.5, patience=1, warmup_steps=200)) == []
    absolute = run(MonitorConfig(max_logit=200.0, patience=1))
    against_warm_up = run(MonitorConfig(max_logit_growth=5.0, patience=1, warmup_steps=200))
    assert absolute and {w["indicator"] for w in absolute} == {"max_logit"}
    assert against_warm_up and {w["indicator"] for w in against_warm_up} == {"max_logit_growth"}


def test_rise_measures_after_warm_up_and_keeps_the_last_probes_only():
    """Probes before the warm-up's end are not part of the level; the first REFERENCE_PROBES after it
    only measure it; the level is the median of the last RISE_WINDOW (10) probes."""
    from stableflash.diagnostics.monitor import REFERENCE_PROBES, RISE_WINDOW
    assert (REFERENCE_PROBES, RISE_WINDOW) == (3, 10)
    m = Monitor(MonitorConfig(max_logit_rise=2.0, patience=1, warmup_steps=300))
    assert m.observe_probe(0, logit_record([1.0])) == [] and m.observe_probe(100, logit_record([200.0])) == []
    assert m.recent == {}
    for step in (300, 400):                                   # 10 then 1000: measured, not checked
        assert m.observe_probe(step, logit_record([10.0 if step == 300 else 1000.0])) == []
    assert m.observe_probe(500, logit_record([10.0])) == []  # measured; the third
    assert m.observe_probe(600, logit_record([19.0])) == []  # 19 < 2 × median(10, 1000, 10)
    assert [w["step"] for w in m.observe_probe(700, logit_record([30.0]))] == [700]   # > 2 × median(.., 19) = 2 × 14.5
    for k in range(20):
        m.observe_probe(800 + 100 * k, logit_record([float(k)]))
    assert m.recent == {0: [float(k) for k in range(10, 20)]}


def test_the_rise_history_travels_in_the_monitor_state():
    m = Monitor(MonitorConfig(max_logit_rise=2.5, patience=1, warmup_steps=0))
    for k in range(5):
        m.observe_probe(100 * k, logit_record([40.0 + k, 50.0]))
    again = Monitor(MonitorConfig(max_logit_rise=2.5, patience=1, warmup_steps=0))
    again.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert again.recent == m.recent == {0: [40.0, 41.0, 42.0, 43.0, 44.0], 1: [50.0] * 5}
    said = m.observe_probe(500, logit_record([111.0, 50.0]))           # 111 > 2.5 × median(40..44)
    assert [w["layer"] for w in said] == [0] and again.observe_probe(500, logit_record([111.0, 50.0])) == said
    earlier = {k: v for k, v in m.state_dict().items() if k != "recent"}      # a state saved before the indicator
    older = Monitor(MonitorConfig(max_logit_rise=2.5))
    older.load_state_dict(earlier)
    assert older.recent == {}


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan, True, "3"])
def test_a_bad_rise_factor_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"monitor max_logit_rise=.* is invalid; accepted: None \(off\) or a finite "
                                         r"number > 0"):
        MonitorConfig(max_logit_rise=value)


def test_the_cli_refuses_a_bad_rise_factor_in_one_line_and_passes_a_good_one(tmp_path, capsys):
    from stableflash.cli import main
    from stableflash.train.config import make_config, monitor_config
    with pytest.raises(SystemExit) as exc:
        main(["train", "-q", "--out", str(tmp_path / "r"), "--preset", "tiny", "--set", "monitor_max_logit_rise=-2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "monitor_max_logit_rise=-2" in err
    assert "accepted: None or a positive finite number" in err
    assert not (tmp_path / "r").exists()
    assert monitor_config(make_config("tiny", overrides=["monitor_max_logit_rise=2.5"])).max_logit_rise == 2.5
    assert TrainConfig().monitor_max_logit_rise is None and MonitorConfig().max_logit_rise is None    # off by default


# ---------------------------------------------------------------- the replay tool: forks, new archives


def _run(path, attention, role="baseline", exploded_at=None, probes=()):
    return {"path": path, "archive": "a", "attention": attention, "role": role, "exploded_at": exploded_at,
            "warmup": 0, "probes": list(probes)}


def test_the_replay_tool_tells_a_fork_from_its_parent_by_the_records_it_carries():
    """A folder copied from a run at its checkpoint and resumed: its metrics begin with every line of
    the parent's. Resumed with the parent's attention it is the parent continued (the parent, its first
    part, is left out); with other attention it is a fork from the step after the parent's last."""
    replay = _replay_tool()
    head = [json.dumps({"step": s, "loss": 3.0 - s / 10}).encode() for s in range(4)]
    runs = [_run("parent", "triton policy=paper"), _run("same", "triton policy=paper", exploded_at=9),
            _run("other", "triton policy=paper delta=dP*P", role="stabilized"), _run("alone", "triton policy=paper")]
    lines = {"parent": head, "same": head + [b'{"step": 4, "loss": 9.0}'],
             "other": head + [b'{"step": 4, "loss": 2.5}', b'{"step": 5, "loss": 2.4}'],
             "alone": [b'{"step": 0, "loss": 3.1}'] + head[1:]}
    replay.find_forks(runs, lines)
    got = {r["path"]: (r["role"], r.get("forked_from"), r.get("forked_at"), r.get("continued_by")) for r in runs}
    assert got == {"parent": ("continued", None, None, "same"), "same": ("baseline", None, None, None),
                   "other": ("forked", "parent", 4, None), "alone": ("baseline", None, None, None)}
    scored = replay.score(runs, {r["path"]: None for r in runs})
    assert scored["failures"] == 1 and scored["stabilized_or_control"] == 0        # the fork is left out
    assert scored["not_in_time"] == [["same", None, 9]]


def test_the_replay_tool_counts_a_forks_warnings_from_the_fork_on():
    replay = _replay_tool()
    probes = [{"step": 100 * k, **logit_record([500.0 if k == 2 or k > 5 else 10.0])} for k in range(8)]
    run = _run("fork", "x", probes=probes)
    settings = {"max_logit": 100.0, "patience": 1}
    assert replay.first_warning(run, settings) == 200
    assert replay.first_warning(run, settings, since=400) == 600 and replay.first_warning(run, settings, since=800) is None


CHECKED = ("defaults (W_Q ratio 4, growth 3, repeated maxima 0.25, patience 2)", "largest logit above 150, patience 1",
           "largest logit above 2.5x the median of its last probes, patience 1")


def test_committed_replay_matches_the_code():
    """docs/notebook/results/monitor-replay/replay.json against the committed archives it names: the
    runs and their roles (forks included), the held-out choice, and the scores per part (tuning, held
    out, new) of the defaults and of the two settings docs/diagnostics.md compares are what the
    replay gives now."""
    import tarfile
    import tempfile
    from pathlib import Path

    replay = _replay_tool()
    results = Path(__file__).resolve().parents[2] / "docs" / "notebook" / "results"
    committed = json.loads((results / "monitor-replay" / "replay.json").read_text())
    archives = sorted({r["archive"] for r in committed["runs"]})
    with tempfile.TemporaryDirectory() as tmp:
        for archive in archives:
            with tarfile.open(results / archive / "runs.tar.xz") as tar:
                tar.extractall(Path(tmp) / archive, filter="data")
        runs = replay.find_runs([Path(tmp)])
    assert [{k: v for k, v in r.items() if k != "probes"} for r in runs] == committed["runs"]
    assert replay.held_out_archives([r for r in runs if r["archive"] not in committed["new"]]) == committed["held_out"]
    parts = {"tuning": [r for r in runs if r["archive"] not in committed["held_out"] + committed["new"]],
             "held out": [r for r in runs if r["archive"] in committed["held_out"]],
             "new": [r for r in runs if r["archive"] in committed["new"]]}
    by_name = dict(replay.SETTINGS)
    rows = [row for row in committed["rows"] if row["setting"] in CHECKED]
    assert len(rows) == len(CHECKED)
    for row in rows:
        warned = {r["path"]: replay.first_warning(r, by_name[row["setting"]]) for r in runs}
        for part, rs in parts.items():
            assert replay.score(rs, warned) == row[part], (row["setting"], part)
