"""Training configuration: one dataclass, named presets, a config file, and ``key=value`` overrides.

Every field has a type; ``--set`` values are parsed by it, unknown keys are rejected by name with
the nearest valid ones suggested, and ``validate`` checks values before anything runs.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import tomllib
import typing
from dataclasses import dataclass, fields
from pathlib import Path


# the grammar of the attention specs in a config (model.spec); see TrainConfig.config_version
CONFIG_VERSION = 2


@dataclass
class TrainConfig:
    """Everything a run needs. ``None`` for a model field means: take it from the model preset."""

    # model
    model: str = "tiny"
    n_layer: int | None = None
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None
    vocab_size: int | None = None
    bias: bool | None = None
    qk_norm: bool | None = None                 # GPT and Llama: norm of each head's q and k
    attn_gate: bool | None = None               # GPT: sigmoid-gated attention output
    attn_softcap: float | None = None           # GPT: attention scores soft-capped to c·tanh(S/c)
    dropout: float | None = None
    attention: str = "sdpa"
    # "causal", or "block_causal": each token attends only within its own document of the row, a
    # document ending at the end-of-text token eot_token (None: the data's, see data.read_meta)
    attn_mask_type: str = "causal"
    eot_token: int | None = None
    # data
    data: str = "embedded"
    replay: str | None = None
    batch_size: int = 8
    grad_accum: int | None = None               # micro-batches per step over all ranks; None: one per rank
    # how a torchrun launch of several processes splits the model: "ddp" (a full replica per rank) or
    # "fsdp" (PyTorch's FSDP2, fully_shard per transformer block, then the whole model)
    parallel: str = "ddp"
    # how checkpoints are written: "full" (ckpt.pt, one file holding the whole model, written by rank 0)
    # or "sharded" (ckpt/step-N/, torch.distributed.checkpoint: every rank writes its own shard);
    # None: sharded under parallel=fsdp, full otherwise. --resume reads either, at any world size
    ckpt_format: str | None = None
    # optimisation
    optimizer: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-5
    schedule: str = "cosine"
    warmup_iters: int = 20
    lr_decay_iters: int | None = None
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # run
    max_iters: int = 200
    eval_every: int = 50
    eval_iters: int = 10
    log_every: int = 1
    ckpt_every: int = 100
    dtype: str = "bf16"
    compile: bool = False
    seed: int = 0
    device: str = "auto"
    peak_tflops: float | None = None              # one GPU's dense peak for MFU (None: known GPUs' own)
    tensorboard: bool = False
    stop_on_nonfinite: bool = True
    # stop once the loss has stayed above 2 × its running minimum for this many steps in a row (0: never);
    # (status and event "exploded"; report.runs.explosion_step counts such a run as exploded)
    stop_after_explosion: int = 0
    # diagnostics (stableflash.diagnostics): probes every probe_every steps (0: off), the δ analysis
    # on the comma-separated delta_layers, and the monitor's action on its warnings
    probe_every: int = 100
    probe_seqs: int = 2
    delta_layers: str = ""
    delta_policy: str = "paper"
    monitor: str = "warn"
    monitor_repeated_max: float = 0.25
    monitor_spectral_ratio: float = 4.0
    monitor_growth: float = 3.0
    monitor_loss_spike: float = 1.5
    monitor_patience: int = 2
    monitor_delta_drift: float | None = None
    monitor_max_logit: float | None = None    # warn when a layer's largest attention logit passes this
    monitor_max_logit_growth: float | None = None   # ... or passes this multiple of its level after warm-up
    monitor_max_logit_rise: float | None = None     # ... or this multiple of the median of its last probes
    monitor_switch_to: str = "delta=consistent"   # what "switch"/"rollback" change on a flagged layer
    monitor_scope: str = "flagged"            # which layers they change: the flagged ones, or all
    notes: str = ""
    # the grammar of the attention specs in this config (model.spec): a run folder's config.json
    # without it was written in the earlier grammar, which ``upgrade_stored`` rewrites on load
    config_version: int = CONFIG_VERSION

    def model_overrides(self) -> dict:
        """The model fields this config sets explicitly (None means: the preset's value)."""
        return {k: getattr(self, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "dropout",
                                             "qk_norm", "attn_gate", "attn_softcap")
                if getattr(self, k) is not None}

    def delta_layer_list(self) -> tuple[int, ...]:
        """``delta_layers`` as a tuple of ints ("2,5" → (2, 5))."""
        text = self.delta_layers.strip()
        try:
            return tuple(int(t) for t in text.split(",")) if text else ()
        except ValueError:
            raise ValueError(f"delta_layers={self.delta_layers!r} is invalid; accepted: comma-separated layer "
                             "indices, e.g. '2' or '2,5'") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "constant")
DTYPES = ("bf16", "fp16", "fp32")
PARALLEL = ("ddp", "fsdp")
CKPT_FORMATS = ("full", "sharded")

# The paper's GPT-2 small recipe: AdamW β=(0.9, 0.95), wd 0, cosine from 1e-3 to 1e-5 after a
# 2000-step warm-up, clip 1.0, bf16 autocast, 524,288 tokens per step (32 × 1024 × 16 micro-batches,
# split across DDP ranks).
PAPER = dict(model="gpt2-small", data="data/openwebtext", batch_size=32, grad_accum=16, lr=1e-3, min_lr=1e-5,
             warmup_iters=2000, max_iters=600_000, lr_decay_iters=600_000, weight_decay=0.0, eval_every=1000,
             eval_iters=100, ckpt_every=1000, log_every=10, compile=True)

PRESETS: dict[str, dict] = {
    # trains on 2 CPU cores in well under a minute; the tests and the CPU demo use it
    "tiny": dict(model="tiny", batch_size=8, max_iters=150, warmup_iters=10, lr=3e-3, min_lr=3e-4, eval_every=50,
                 eval_iters=4, ckpt_every=50, dtype="fp32"),
    # the byte-level setup of the first reproduction leads (6 layers, 384 wide, context 512)
    "small": dict(model="small", batch_size=64, lr=3e-3, min_lr=3e-3, schedule="constant", warmup_iters=200,
                  max_iters=6000, eval_every=250, eval_iters=20, ckpt_every=500, log_every=10),
    "gpt2-small-paper": PAPER,
    "gpt2-small-muon": {**PAPER, "optimizer": "muon", "lr": 5e-4, "weight_decay": 0.01},
    "gpt2-medium-paper": {**PAPER, "model": "gpt2-medium", "max_iters": 100_000, "lr_decay_iters": 100_000},
}


def _field_types() -> dict[str, typing.Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in fields(TrainConfig)}


def _unknown(key: str) -> ValueError:
    names = [f.name for f in fields(TrainConfig)]
    close = difflib.get_close_matches(key, names, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; accepted: {', '.join(names)}"
    return ValueError(f"unknown config key {key!r}{hint}")


def parse_value(key: str, text: str):
    """Parse ``text`` as the type of field ``key`` (``none`` for optional fields)."""
    types = _field_types()
    if key not in types:
        raise _unknown(key)
    tp = types[key]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    if text.strip().lower() in ("none", "null") and type(None) in typing.get_args(tp):
        return None
    try:
        if base is bool:
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return low in ("true", "1", "yes")
        if base is int:
            return int(text.replace("_", ""))
        if base is float:
            return float(text)
        return text
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a valid {base.__name__}") from None


def _typed(key: str, value):
    """A value from a config file, checked against the field's type (ints are fine for floats)."""
    tp = _field_types()[key]
    allowed = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if value is None and type(None) in typing.get_args(tp):
        return None
    base = allowed[0]
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    raise ValueError(f"{key}={value!r} is not a valid {base.__name__}")


def apply_overrides(cfg: TrainConfig, pairs: dict | list[str]) -> TrainConfig:
    """A copy with ``key=value`` strings (from --set) or a dict (from a file) applied."""
    if isinstance(pairs, dict):
        items = list(pairs.items())
    else:
        items = []
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"--set {pair!r} is not key=value")
            items.append((key.strip(), value))
    changes = {}
    for key, value in items:
        if key not in _field_types():
            raise _unknown(key)
        changes[key] = parse_value(key, value) if isinstance(value, str) else _typed(key, value)
    return dataclasses.replace(cfg, **changes)



def upgrade_stored(saved: dict) -> dict:
    """A run's stored config (config.json, or a checkpoint's config) in the current grammar: one
    without ``config_version`` spelled its attention specs as ``model.spec.upgrade_stored_spec``
    describes, and its monitor switch as ``upgrade_stored_settings`` does; both are rewritten with
    their meaning, and the version set. A current config comes back as it is."""
    if not isinstance(saved, dict) or "config_version" in saved:
        return saved
    from stableflash.model.spec import upgrade_stored_settings, upgrade_stored_spec
    out = dict(saved, config_version=CONFIG_VERSION)
    if isinstance(out.get("attention"), str):
        out["attention"] = upgrade_stored_spec(out["attention"])
    out["monitor_switch_to"] = upgrade_stored_settings(out.get("monitor_switch_to", "delta=auto"))
    return out


def is_run_config(path: Path) -> bool:
    """Whether ``path`` is the config.json of a run folder (one that holds metrics.jsonl)."""
    path = Path(path)
    return path.name == "config.json" and (path.parent / "metrics.jsonl").is_file()


def load_file(path: Path) -> dict:
    """A config file: TOML (``.toml``) or JSON (anything else), a flat table of TrainConfig keys. A
    run folder's config.json of the earlier grammar is upgraded (``upgrade_stored``)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config file {path} is a folder; accepted: a TOML (.toml) or JSON file")
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); accepted: a "
                         "TOML (.toml) or JSON file") from None
    except OSError as exc:
        raise ValueError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"config file {path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {exc}")
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table of keys; got {type(data).__name__}")
    return upgrade_stored(data) if is_run_config(path) else data


def make_config(preset: str | None = "tiny", config_file: Path | None = None,
                overrides: list[str] | None = None) -> TrainConfig:
    """Preset, then file, then --set overrides; validated. A ``grad_accum`` none of them sets is one
    micro-batch per rank of this launch (torchrun's WORLD_SIZE; 1 without torchrun)."""
    cfg = TrainConfig()
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset={preset!r} is unknown; accepted: {', '.join(PRESETS)}")
        cfg = dataclasses.replace(cfg, **PRESETS[preset])
    if config_file is not None:
        cfg = apply_overrides(cfg, load_file(config_file))
    if overrides:
        cfg = apply_overrides(cfg, overrides)
    validate(cfg)
    return resolve_grad_accum(cfg, DistInfo.from_env().world_size)


def resolve_grad_accum(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """``cfg`` with ``grad_accum`` for ``world_size`` ranks: unset (None), one micro-batch per rank;
    set, the micro-batches per step over all ranks (nanoGPT's gradient_accumulation_steps), which
    the ranks must divide."""
    if cfg.grad_accum is None:
        return dataclasses.replace(cfg, grad_accum=world_size)
    if cfg.grad_accum % world_size:
        raise ValueError(f"grad_accum={cfg.grad_accum} (micro-batches per step over all ranks) is not a multiple of "
                         f"the {world_size} ranks; accepted: a multiple of {world_size}, or grad_accum unset (none) "
                         "for one micro-batch per rank")
    return cfg


def ckpt_format(cfg: TrainConfig) -> str:
    """The checkpoint format of ``cfg``: its ``ckpt_format``, or when that is unset (None) "sharded"
    under parallel=fsdp (as torchtitan writes) and "full" (nanoGPT's single ckpt.pt) otherwise."""
    if cfg.ckpt_format is not None:
        return cfg.ckpt_format
    return "sharded" if cfg.parallel == "fsdp" else "full"


def check_parallel(cfg: TrainConfig, world_size: int) -> None:
    """A clear error when ``cfg.parallel`` cannot run on ``world_size`` ranks or with the rest of ``cfg``."""
    if cfg.parallel != "fsdp":
        return
    if world_size == 1:
        raise ValueError("parallel=fsdp shards the model over the ranks of a torchrun launch, and this is one "
                         "process (WORLD_SIZE unset or 1); accepted: parallel=ddp (the default) in one process, or "
                         "parallel=fsdp under torchrun --nproc_per_node=N with N >= 2")
    if cfg.dtype == "fp16":
        raise ValueError("dtype=fp16 cannot apply with parallel=fsdp (the loss scaler unscales whole gradients, "
                         "FSDP holds sharded ones); accepted: dtype=bf16 or fp32 with parallel=fsdp, or parallel=ddp")


# The accepted range of every numeric field: (lowest, lowest allowed?, highest or None, highest allowed?);
# every lowest is 0.
# Floats must also be finite; a field typed ``| None`` may be None (the preset's value, or off).
RANGES: dict[str, tuple] = {
    **{name: (0, False, None, False) for name in (
        "batch_size", "grad_accum", "max_iters", "eval_every", "eval_iters", "log_every", "ckpt_every",
        "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "probe_seqs", "monitor_patience",
        "peak_tflops", "attn_softcap", "monitor_repeated_max", "monitor_spectral_ratio", "monitor_growth",
        "monitor_loss_spike", "monitor_delta_drift", "monitor_max_logit", "monitor_max_logit_growth",
        "monitor_max_logit_rise")},
    **{name: (0, True, None, False) for name in (
        "warmup_iters", "lr_decay_iters", "probe_every", "stop_after_explosion", "seed", "eot_token",
        "min_lr", "weight_decay", "grad_clip")},                      # grad_clip 0: no clipping
    **{name: (0, True, 1, False) for name in ("beta1", "beta2", "dropout")},
    # above about 3e37 the optimizers' float32 step overflows (a RuntimeError inside torch); 1e6 is far
    # above any learning rate AdamW or Muon trains with, and far below that
    "lr": (0, False, 1e6, True),
}


def _accepted(name: str) -> str:
    """What ``RANGES`` accepts for ``name``, in words."""
    low, low_ok, high, high_ok = RANGES[name]
    kind = "integer" if _field_base(name) is int else "finite number"
    if high is None:                                  # every range starts at 0
        bound = f"a {'non-negative' if low_ok else 'positive'} {kind}"
    else:
        bound = f"a {kind} with {low:g} {'<=' if low_ok else '<'} {name} {'<=' if high_ok else '<'} {high:g}"
    optional = type(None) in typing.get_args(_field_types()[name])
    return f"None or {bound}" if optional else bound


def _field_base(name: str) -> type:
    tp = _field_types()[name]
    return next((a for a in typing.get_args(tp) if a is not type(None)), tp)


def _check_range(cfg: TrainConfig, name: str) -> None:
    value = getattr(cfg, name)
    if value is None and type(None) in typing.get_args(_field_types()[name]):
        return
    low, low_ok, high, high_ok = RANGES[name]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = (number and math.isfinite(value) and (value >= low if low_ok else value > low)
          and (high is None or (value <= high if high_ok else value < high)))
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid; accepted: {_accepted(name)}")


def validate(cfg: TrainConfig) -> None:
    """Reject bad values by name before anything runs."""
    for name in RANGES:
        _check_range(cfg, name)
    if cfg.min_lr > cfg.lr:
        raise ValueError(f"min_lr={cfg.min_lr} is above lr={cfg.lr}; accepted: min_lr <= lr")
    for name, value, accepted in (("optimizer", cfg.optimizer, OPTIMIZERS), ("schedule", cfg.schedule, SCHEDULES),
                                  ("dtype", cfg.dtype, DTYPES), ("parallel", cfg.parallel, PARALLEL)):
        if value not in accepted:
            raise ValueError(f"{name}={value!r} is invalid; accepted: {', '.join(accepted)}")
    if cfg.ckpt_format is not None and cfg.ckpt_format not in CKPT_FORMATS:
        raise ValueError(f"ckpt_format={cfg.ckpt_format!r} is invalid; accepted: {', '.join(CKPT_FORMATS)}, or none "
                         "(sharded under parallel=fsdp, full otherwise)")
    from stableflash.model.base import ATTN_MASK_TYPES
    if cfg.attn_mask_type not in ATTN_MASK_TYPES:
        raise ValueError(f"attn_mask_type={cfg.attn_mask_type!r} is invalid; accepted: {', '.join(ATTN_MASK_TYPES)}")
    if cfg.eot_token is not None and cfg.attn_mask_type != "block_causal":
        raise ValueError(f"eot_token={cfg.eot_token} takes effect only with attn_mask_type=block_causal; accepted: "
                         "attn_mask_type=block_causal with it, or eot_token unset (none)")
    for layer in cfg.delta_layer_list():
        if layer < 0:
            raise ValueError(f"delta_layers={cfg.delta_layers!r} has a negative layer; accepted: indices >= 0")
    if cfg.config_version != CONFIG_VERSION:
        raise ValueError(f"config_version={cfg.config_version!r} is invalid; accepted: {CONFIG_VERSION} (a run "
                         "folder's config.json of an earlier version is upgraded when it is loaded)")
    monitor_config(cfg)
    from stableflash.diagnostics.monitor import stabilized_choice_spec
    from stableflash.model import MODEL_PRESETS, model_config, parse_attention_spec
    for current in ("sdpa", "emulated policy=paper"):         # a bad switch target is named now, not mid-run
        try:
            parse_attention_spec(stabilized_choice_spec(current, False, cfg.monitor_switch_to))
        except ValueError as exc:
            if str(exc).startswith("monitor_switch_to="):
                raise
            raise ValueError(f"monitor_switch_to={cfg.monitor_switch_to!r} is invalid: {exc}") from None
    if cfg.device not in ("auto", "cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise ValueError(f"device={cfg.device!r} is invalid; accepted: auto, cpu, cuda, cuda:N")
    if cfg.model not in MODEL_PRESETS:
        raise ValueError(f"model={cfg.model!r} is unknown; accepted: {', '.join(MODEL_PRESETS)}")
    mcfg = model_config(cfg.model, **cfg.model_overrides())        # a field the model family lacks, named now
    spec = parse_attention_spec(cfg.attention)
    if cfg.attn_mask_type == "block_causal":
        blocks = sorted({c.block for c in spec.choices(mcfg.n_layer) if c.backend != "sdpa" and c.block != 64})
        if blocks:
            raise ValueError(f"attention={cfg.attention!r} sets block={blocks[0]}, which cannot apply with "
                             "attn_mask_type=block_causal (packed documents run key blocks of 64); accepted: the "
                             "default block")
    if getattr(mcfg, "attn_softcap", None) is not None:
        sdpa = [i for i, c in enumerate(spec.choices(mcfg.n_layer)) if c.backend == "sdpa"]
        if sdpa:
            raise ValueError(f"attn_softcap={mcfg.attn_softcap} cannot apply to the layers on backend 'sdpa' "
                             f"({sdpa}) of attention={cfg.attention!r}; accepted: attn_softcap with 'triton' or "
                             "'emulated' attention in every layer")


def monitor_config(cfg: TrainConfig):
    """The MonitorConfig of a training config (validated): every field from its ``monitor_<field>``
    key, the action from ``monitor`` and the warm-up from ``warmup_iters``."""
    from stableflash.diagnostics.monitor import MonitorConfig
    settings = {f.name: getattr(cfg, f"monitor_{f.name}") for f in dataclasses.fields(MonitorConfig)
                if hasattr(cfg, f"monitor_{f.name}")}
    return MonitorConfig(action=cfg.monitor, warmup_steps=cfg.warmup_iters, **settings)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in a torchrun launch (rank 0 of 1 without torchrun)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "DistInfo":
        """Read torchrun's RANK, LOCAL_RANK and WORLD_SIZE."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        return cls(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world)
