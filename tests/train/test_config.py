"""Training config: presets, files, --set overrides, and clear errors."""
import dataclasses
import json
import re
import typing

import pytest

from stableflash.train.config import (PRESETS, RANGES, TrainConfig, apply_overrides, load_file, make_config,
                                      parse_value, resolve_grad_accum)


def numeric_fields(kind) -> list[str]:
    """The TrainConfig fields of type ``kind`` (int or float), optional or not."""
    hints = typing.get_type_hints(TrainConfig)
    return [f.name for f in dataclasses.fields(TrainConfig)
            if kind in (hints[f.name], *typing.get_args(hints[f.name])) and hints[f.name] is not bool]


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
    with pytest.raises(ValueError, match=r"monitor_max_logit=-3.0 is invalid"):
        monitor_config(make_config("tiny", overrides=["monitor_max_logit=-3"]))


def test_every_numeric_field_has_an_accepted_range():
    assert set(numeric_fields(int) + numeric_fields(float)) - {"config_version"} == set(RANGES)


@pytest.mark.parametrize("name", numeric_fields(float))
@pytest.mark.parametrize("text", ["inf", "-inf", "nan"])
def test_a_non_finite_float_is_refused_by_name_with_its_range(name, text):
    extra = ["min_lr=0"] if name == "lr" else []
    with pytest.raises(ValueError) as exc:
        make_config("tiny", overrides=[*extra, f"{name}={text}"])
    message = str(exc.value)
    assert message.startswith(f"{name}={float(text)!r} is invalid; accepted: ") and "finite number" in message, message


@pytest.mark.parametrize("pairs,message", [
    (["lr=inf"], "lr=inf is invalid; accepted: a finite number with 0 < lr <= 1e+06"),
    (["lr=1e38"], "lr=1e+38 is invalid; accepted: a finite number with 0 < lr <= 1e+06"),     # float32 overflow in the step
    (["grad_clip=nan"], "grad_clip=nan is invalid; accepted: a non-negative finite number"),
    (["weight_decay=inf"], "weight_decay=inf is invalid; accepted: a non-negative finite number"),
    (["beta2=1"], "beta2=1.0 is invalid; accepted: a finite number with 0 <= beta2 < 1"),
    (["peak_tflops=-1"], "peak_tflops=-1.0 is invalid; accepted: None or a positive finite number"),
    (["seed=-1"], "seed=-1 is invalid; accepted: a non-negative integer"),
    (["probe_seqs=0"], "probe_seqs=0 is invalid; accepted: a positive integer"),
    (["grad_accum=0"], "grad_accum=0 is invalid; accepted: None or a positive integer"),
])
def test_range_errors_say_what_is_accepted(pairs, message):
    with pytest.raises(ValueError) as exc:
        make_config("tiny", overrides=pairs)
    assert str(exc.value) == message


def test_the_accepted_bounds_themselves_are_accepted():
    cfg = make_config("tiny", overrides=["lr=1e6", "min_lr=0", "grad_clip=0", "weight_decay=0", "beta1=0", "seed=0"])
    assert (cfg.lr, cfg.min_lr, cfg.grad_clip, cfg.beta1, cfg.seed) == (1e6, 0.0, 0.0, 0.0, 0)


def test_non_finite_values_from_config_files_are_refused(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("weight_decay = inf\n")                   # TOML spells infinity and NaN
    with pytest.raises(ValueError, match=re.escape("weight_decay=inf is invalid")):
        make_config("tiny", config_file=toml)
    js = tmp_path / "run.json"
    js.write_text('{"grad_clip": NaN}')                        # and Python's json reads NaN
    with pytest.raises(ValueError, match=re.escape("grad_clip=nan is invalid")):
        make_config("tiny", config_file=js)


def test_a_config_file_that_is_a_folder_or_not_text_is_named(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"config file {tmp_path} is a folder; accepted: a TOML")):
        load_file(tmp_path)
    for name in ("bin.json", "bin.toml"):
        (tmp_path / name).write_bytes(bytes(range(128, 256)) * 4)
        with pytest.raises(ValueError, match=re.escape(f"config file {tmp_path / name} is not UTF-8 text")):
            load_file(tmp_path / name)


def test_grad_accum_unset_is_one_micro_batch_per_rank_and_set_is_global(monkeypatch):
    assert PRESETS["tiny"].get("grad_accum") is TrainConfig().grad_accum is None     # the tiny preset leaves it unset
    assert make_config("tiny").grad_accum == 1                                        # one process
    monkeypatch.setenv("WORLD_SIZE", "4")                                             # rank 1 of a torchrun launch
    monkeypatch.setenv("RANK", "1")
    assert make_config("tiny").grad_accum == 4
    assert make_config("tiny", overrides=["grad_accum=8"]).grad_accum == 8
    assert [resolve_grad_accum(TrainConfig(), w).grad_accum for w in (1, 2, 8)] == [1, 2, 8]   # train() from Python
    paper = make_config("gpt2-small-paper")                               # 16 micro-batches over all ranks
    assert [resolve_grad_accum(paper, w).grad_accum for w in (1, 2, 8)] == [16, 16, 16]
    with pytest.raises(ValueError, match=r"grad_accum=16 \(micro-batches per step over all ranks\) is not a "
                                         r"multiple of the 3 ranks; accepted: a multiple of 3, or grad_accum unset"):
        resolve_grad_accum(paper, 3)
    monkeypatch.delenv("WORLD_SIZE")
    assert make_config("tiny", overrides=["grad_accum=none"]).grad_accum == 1
