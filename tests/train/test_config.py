"""Training config: presets, files, --set overrides, and clear errors."""
import json

import pytest

from stableflash.train.config import PRESETS, TrainConfig, apply_overrides, make_config, parse_value


def test_presets_are_valid_and_the_paper_recipe_is_exact():
    for name in PRESETS:
        make_config(name)
    cfg = make_config("gpt2-small-paper")
    assert (cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip) == (0.9, 0.95, 0.0, 1.0)
    assert (cfg.lr, cfg.min_lr, cfg.warmup_iters, cfg.schedule, cfg.dtype) == (1e-3, 1e-5, 2000, "cosine", "bf16")
    assert cfg.batch_size * 1024 * cfg.grad_accum == 524_288
    muon = make_config("gpt2-small-muon")
    assert (muon.optimizer, muon.lr, muon.weight_decay) == ("muon", 5e-4, 0.01)


def test_set_overrides_are_typed():
    cfg = make_config("tiny", overrides=["max_iters=7", "lr=2e-3", "compile=true", "replay=none",
                                         "attention=sdpa; 1: emulated policy=paper", "ckpt_every=3"])
    assert (cfg.max_iters, cfg.lr, cfg.compile, cfg.replay, cfg.ckpt_every) == (7, 2e-3, True, None, 3)
    assert cfg.attention == "sdpa; 1: emulated policy=paper"


@pytest.mark.parametrize("pairs,match", [
    (["max_iter=5"], r"unknown config key 'max_iter'; did you mean max_iters"),
    (["lr=fast"], r"lr='fast' is not a valid float"),
    (["compile=maybe"], r"compile='maybe' is not a valid bool"),
    (["lr"], r"--set 'lr' is not key=value"),
    (["batch_size=0"], r"batch_size=0 is invalid"),
    (["optimizer=sgd"], r"optimizer='sgd' is invalid; accepted: adamw, muon"),
    (["min_lr=1", "lr=0.1"], r"min_lr=1.0 is above lr=0.1"),
    (["model=gpt5"], r"model='gpt5' is unknown"),
    (["attention=flashy"], r"flashy"),
    (["dropout=1.5"], r"dropout=1.5 is invalid"),
    (["device=tpu"], r"device='tpu' is invalid"),
])
def test_bad_values_are_rejected_by_name(pairs, match):
    with pytest.raises(ValueError, match=match):
        make_config("tiny", overrides=pairs)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"preset='huge' is unknown; accepted: tiny"):
        make_config("huge")


def test_config_files_toml_and_json(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('model = "tiny"\nmax_iters = 12\nlr = 1\nattention = "sdpa"\n')
    cfg = make_config("tiny", config_file=toml, overrides=["max_iters=13"])
    assert cfg.max_iters == 13 and cfg.lr == 1.0 and isinstance(cfg.lr, float)
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"seed": 3, "compile": False}))
    assert make_config(None, config_file=js).seed == 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"seed": "three"}))
    with pytest.raises(ValueError, match=r"seed='three' is not a valid int"):
        make_config("tiny", config_file=bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_config("tiny", config_file=tmp_path / "missing.toml")


def test_parse_value_optional_and_underscores():
    assert parse_value("lr_decay_iters", "none") is None
    assert parse_value("max_iters", "600_000") == 600000
    assert apply_overrides(TrainConfig(), {"n_layer": 3}).n_layer == 3


def test_the_monitor_settings_reach_the_monitor():
    from stableflash.train.config import monitor_config
    cfg = make_config("tiny", overrides=["monitor=switch", "monitor_max_logit=200", "monitor_delta_drift=0.5",
                                         "monitor_patience=1", "monitor_spectral_ratio=3"])
    m = monitor_config(cfg)
    assert (m.action, m.max_logit, m.delta_drift, m.patience, m.spectral_ratio) == ("switch", 200.0, 0.5, 1, 3.0)
    assert monitor_config(make_config("tiny")).max_logit is None                 # off by default
    with pytest.raises(ValueError, match=r"monitor max_logit=-3.0 is invalid"):
        monitor_config(make_config("tiny", overrides=["monitor_max_logit=-3"]))
