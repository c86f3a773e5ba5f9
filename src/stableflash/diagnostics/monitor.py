"""An online monitor: watches the paper's leading indicators and acts before the loss explodes.

Indicators, each checked per layer on every probe record (``probes.probe_record``):
- repeated row maxima: the layer's fraction of rows whose maximum is attained more than once
  (mean over heads) above ``repeated_max`` and at least ``growth`` × its first measured value —
  the paper's Fig. 13 signal, which rose in the failing layer before the loss went;
- spectral norm of W_Q: the layer's norm above ``spectral_ratio`` × the median of the other
  layers and at least ``growth`` × its own first value (the paper's Fig. 3: one layer's W_Q grows);
- δ bias: the magnitude of the running sum of Σ_T(δ_lp − δ_hp) above ``delta_drift`` (off by
  default: its scale depends on the model);
- the largest attention logit: the layer's largest score (over heads and the probed rows) above
  ``max_logit`` (off by default: its scale depends on the model; docs/diagnostics.md has what it
  did on the project's failing runs);
- the largest attention logit against the layer's own level: above ``max_logit_growth`` × the
  median of the layer's largest logits on the first ``REFERENCE_PROBES`` probes at or after
  ``warmup_steps`` (the end of the learning-rate warm-up in training) — the same indicator in no
  unit of its own, for a model whose logits sit at another level (off by default);
- the largest attention logit against its recent past: above ``max_logit_rise`` × the median of
  the layer's largest logits on its last ``RISE_WINDOW`` probes at or after ``warmup_steps``,
  checked once ``REFERENCE_PROBES`` of them are in. A runaway multiplies a layer's logits within a few
  probes; a healthy layer's logits drift, and the median of its recent probes drifts with them, so
  a level that is large but grows slowly stays under it (off by default);
and on every step:
- the loss itself: its exponential average above ``loss_spike`` × the lowest average so far.

A layer is flagged after ``patience`` consecutive probe records over a threshold. Actions:
"warn" only writes events; "switch" moves the flagged layers (or, with scope "all", every layer)
to stabilized attention from the next step; "rollback" also restores the last good checkpoint
first. Every warning and action is returned as an event dict for metrics.jsonl.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from stableflash.model.spec import with_settings

ACTIONS = ("off", "warn", "switch", "rollback")
REFERENCE_PROBES = 3       # probes whose median is a layer's reference level (max_logit_growth)
RISE_WINDOW = 10           # a layer's latest probes whose median is its recent level (max_logit_rise)
SCOPES = ("flagged", "all")


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def largest_logits(record: dict):
    """(layer, largest logit over its heads, that head) of one probe record (``row.max_logit``),
    non-finite values left out: the monitor's largest-logit indicator."""
    rows = (record.get("row") or {}).get("max_logit")
    for layer, heads in enumerate(rows or []):
        finite = [(h, v) for h, v in enumerate(heads) if isinstance(v, (int, float)) and math.isfinite(v)]
        if finite:
            head, value = max(finite, key=lambda hv: hv[1])
            yield layer, value, head


@dataclass
class MonitorConfig:
    action: str = "warn"
    repeated_max: float = 0.25
    spectral_ratio: float = 4.0
    growth: float = 3.0
    delta_drift: float | None = None
    max_logit: float | None = None
    max_logit_growth: float | None = None
    max_logit_rise: float | None = None
    loss_spike: float = 1.5
    loss_ema: float = 0.1
    warmup_steps: int = 50
    patience: int = 2
    scope: str = "flagged"          # which layers "switch"/"rollback" change: the flagged ones, or all

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"monitor action={self.action!r} is invalid; accepted: {', '.join(ACTIONS)}")
        for name in ("repeated_max", "spectral_ratio", "growth", "loss_spike", "loss_ema"):
            if not _finite_positive(getattr(self, name)):
                raise ValueError(f"monitor {name}={getattr(self, name)!r} is invalid; accepted: a finite number > 0")
        for name in ("delta_drift", "max_logit", "max_logit_growth", "max_logit_rise"):   # optional: None is off
            if getattr(self, name) is not None and not _finite_positive(getattr(self, name)):
                raise ValueError(f"monitor {name}={getattr(self, name)!r} is invalid; accepted: None (off) or a "
                                 "finite number > 0")
        if self.patience < 1:
            raise ValueError(f"monitor patience={self.patience!r} is invalid; accepted: >= 1")
        if self.scope not in SCOPES:
            raise ValueError(f"monitor scope={self.scope!r} is invalid; accepted: {', '.join(SCOPES)}")


@dataclass
class Monitor:
    """Keeps the indicators' history; ``observe_*`` return the events to log."""

    config: MonitorConfig = field(default_factory=MonitorConfig)
    first: dict = field(default_factory=dict)          # (indicator, layer) -> first value seen
    streak: dict = field(default_factory=dict)         # (indicator, layer) -> consecutive exceedances
    flagged: set = field(default_factory=set)          # layers already acted on
    reference: dict = field(default_factory=dict)      # layer -> its largest logits at or after warm-up (up to
                                                       # REFERENCE_PROBES of them: max_logit_growth's level)
    recent: dict = field(default_factory=dict)         # layer -> its largest logits on its last RISE_WINDOW probes
                                                       # at or after warm-up (max_logit_rise's level)
    ema: float | None = None
    best_ema: float = math.inf
    warned_loss: bool = False

    @property
    def enabled(self) -> bool:
        return self.config.action != "off"

    def observe_loss(self, step: int, loss: float) -> list[dict]:
        """The loss indicator (every step)."""
        if not self.enabled or not math.isfinite(loss):
            return []
        a = self.config.loss_ema
        self.ema = loss if self.ema is None else (1 - a) * self.ema + a * loss
        if step < self.config.warmup_steps:
            return []
        self.best_ema = min(self.best_ema, self.ema)
        if self.ema > self.config.loss_spike * self.best_ema and not self.warned_loss:
            self.warned_loss = True
            return [self._warning(step, None, None, "loss", self.ema, self.config.loss_spike * self.best_ema,
                                  f"loss average {self.ema:.3f} is {self.ema / self.best_ema:.2f}× its minimum")]
        return []

    def observe_probe(self, step: int, record: dict) -> list[dict]:
        """The per-layer indicators of one probe record; warnings for layers newly over threshold."""
        if not self.enabled:
            return []
        events = []
        for layer, value, head in self._repeated_max(record):
            events += self._check(step, "repeated_max", layer, head, value, self.config.repeated_max)
        for layer, value, limit in self._spectral(record):
            events += self._check(step, "spectral_q", layer, None, value, limit)
        if self.config.max_logit is not None:
            for layer, value, head in largest_logits(record):
                events += self._check(step, "max_logit", layer, head, value, self.config.max_logit, use_growth=False)
        if self.config.max_logit_growth is not None and step >= self.config.warmup_steps:
            for layer, value, head in largest_logits(record):
                level = self.reference.setdefault(layer, [])
                if len(level) < REFERENCE_PROBES:             # still measuring the layer's own level
                    level.append(value)
                    continue
                events += self._check(step, "max_logit_growth", layer, head, value,
                                      self.config.max_logit_growth * statistics.median(level), use_growth=False)
        if self.config.max_logit_rise is not None and step >= self.config.warmup_steps:
            for layer, value, head in largest_logits(record):
                events += self._rise(step, layer, head, value)
        if self.config.delta_drift is not None:
            for layer, info in (record.get("delta") or {}).items():
                running = info.get("running_sum")
                if running is not None and math.isfinite(running):
                    events += self._check(step, "delta_drift", int(layer), None, abs(running), self.config.delta_drift,
                                          use_growth=False)
        return events

    def state(self) -> dict:
        """What the monitor holds now, for the probe records: its action, the loss average and its
        minimum, whether the loss warning was given, each indicator's layers over their threshold
        (with their consecutive-probe streak; a warning comes at ``patience``), and the layers acted on."""
        over: dict[str, dict[str, int]] = {}
        for (indicator, layer), streak in sorted(self.streak.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            if streak:
                over.setdefault(indicator, {})[str(layer)] = streak
        return {"action": self.config.action, "loss_ema": self.ema,
                "best_loss_ema": self.best_ema if math.isfinite(self.best_ema) else None,
                "loss_warned": self.warned_loss, "over": over, "patience": self.config.patience,
                "acted_on": sorted(self.flagged)}

    def state_dict(self) -> dict:
        """Everything the monitor has learnt, as plain JSON values, for a checkpoint: a resumed run's
        monitor then warns where the uninterrupted run's would (``load_state_dict``)."""
        return {"first": [[i, layer, v] for (i, layer), v in self.first.items()],
                "streak": [[i, layer, n] for (i, layer), n in self.streak.items()],
                "flagged": sorted(self.flagged),
                "reference": [[layer, list(values)] for layer, values in self.reference.items()],
                "recent": [[layer, list(values)] for layer, values in self.recent.items()],
                "ema": self.ema, "best_ema": self.best_ema if math.isfinite(self.best_ema) else None,
                "warned_loss": self.warned_loss}

    def load_state_dict(self, state: dict) -> None:
        """Take back what ``state_dict`` gave; a malformed state is a ValueError naming what is wrong."""
        try:
            first = {(str(i), int(layer)): float(v) for i, layer, v in state["first"]}
            streak = {(str(i), int(layer)): int(n) for i, layer, n in state["streak"]}
            flagged = {int(layer) for layer in state["flagged"]}
            reference = {int(layer): [float(v) for v in values] for layer, values in state["reference"]}
            # a state saved without the rise indicator's history: none measured yet
            recent = {int(layer): [float(v) for v in values][-RISE_WINDOW:]
                      for layer, values in state.get("recent", [])}
            ema = None if state["ema"] is None else float(state["ema"])
            best = math.inf if state["best_ema"] is None else float(state["best_ema"])
            warned = state["warned_loss"]
            if not isinstance(warned, bool):
                raise TypeError(f"warned_loss is a {type(warned).__name__}, not a bool")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"monitor state is malformed ({type(exc).__name__}: {exc}); accepted: what "
                             "Monitor.state_dict returns") from None
        self.first, self.streak, self.flagged, self.reference, self.recent = first, streak, flagged, reference, recent
        self.ema, self.best_ema, self.warned_loss = ema, best, warned

    def layers_to_act_on(self, events: list[dict], n_layers: int | None = None) -> list[int]:
        """Layers that switch / rollback change for these warnings and that no action has covered
        yet: those the warnings name, or with scope "all" every one of the ``n_layers`` on any
        warning (the loss warning too, which names no layer)."""
        if self.config.action not in ("switch", "rollback"):
            return []
        if self.config.scope == "all" and events:
            if n_layers is None:
                raise ValueError("scope='all' needs n_layers, the model's number of layers")
            wanted = set(range(n_layers))
        else:
            wanted = {e["layer"] for e in events if e.get("layer") is not None}
        layers = sorted(wanted - self.flagged)
        self.flagged.update(layers)
        return layers

    # -- indicators -----------------------------------------------------------------------------
    @staticmethod
    def _repeated_max(record: dict):
        rows = (record.get("row") or {}).get("repeated_max_frac")
        for layer, heads in enumerate(rows or []):
            values = [h if isinstance(h, (int, float)) and math.isfinite(h) else None for h in heads]
            finite = [h for h in values if h is not None]
            if finite:
                worst = max(range(len(values)), key=lambda h: -math.inf if values[h] is None else values[h])
                yield layer, sum(finite) / len(finite), worst

    def _spectral(self, record: dict):
        # a non-finite norm is written as None (probes.probe_record): weights gone NaN or infinite
        # leave the layer out, and the loss's own non-finite stop ends the run
        norms = (record.get("spectral") or {}).get("q_full") or []
        finite = {layer: n for layer, n in enumerate(norms) if isinstance(n, (int, float)) and math.isfinite(n)}
        for layer, value in finite.items():
            others = [n for i, n in finite.items() if i != layer]
            if others:
                yield layer, value, self.config.spectral_ratio * statistics.median(others)

    def _rise(self, step: int, layer: int, head, value: float) -> list[dict]:
        """The rise indicator for one layer's largest logit: checked against the median of the layer's
        last probes once ``REFERENCE_PROBES`` of them are in, then added to them."""
        recent = self.recent.setdefault(layer, [])
        events = []
        if len(recent) >= REFERENCE_PROBES:
            events = self._check(step, "max_logit_rise", layer, head, value,
                                 self.config.max_logit_rise * statistics.median(recent), use_growth=False)
        recent.append(value)
        del recent[:-RISE_WINDOW]
        return events

    def _check(self, step, indicator, layer, head, value, limit, use_growth=True) -> list[dict]:
        key = (indicator, layer)
        self.first.setdefault(key, value)
        over = value > limit and (not use_growth or value >= self.config.growth * max(self.first[key], 1e-12))
        self.streak[key] = self.streak.get(key, 0) + 1 if over else 0
        if self.streak[key] != self.config.patience:
            return []
        what = {"repeated_max": "fraction of rows with repeated maxima", "spectral_q": "spectral norm of W_Q",
                "delta_drift": "running δ bias", "max_logit": "largest attention logit",
                "max_logit_growth": "largest attention logit against its level after warm-up",
                "max_logit_rise": "largest attention logit against the median of its last probes"}[indicator]
        return [self._warning(step, layer, head, indicator, value, limit,
                              f"layer {layer}: {what} {value:.3g} over {limit:.3g} "
                              f"(first seen {self.first[key]:.3g}) for {self.config.patience} probes")]

    @staticmethod
    def _warning(step, layer, head, indicator, value, limit, message) -> dict:
        return {"step": step, "event": "monitor_warning", "layer": layer, "head": head, "indicator": indicator,
                "value": value, "threshold": limit, "message": message}


DEFAULT_SWITCH = "delta=consistent"   # the consistent δ of flash_attention's default, added to the layer's rule


def stabilized_choice_spec(current_choice_text: str, kernels: bool, switch_to: str = DEFAULT_SWITCH) -> str:
    """The attention a flagged layer switches to: the same backend and policy with ``switch_to``'s
    key=value settings in place of its own (default: "delta=consistent", the δ of flash_attention's
    default stabilization — from the source consistent with the backward's P for the policy's
    rounding — added to the layer's row-maximum rule), or, for SDPA (which can be neither stabilized nor re-precisioned), the fused kernel
    where ``kernels`` says it can run (CUDA, attention in bf16 or fp16) and the fa2 emulation
    elsewhere, with those settings. ``switch_to`` "delta=dP*P" takes δ from dP·P whatever the
    policy, "stabilize=tie-shift" the tie-shift row-maximum rule alone (which did not hold alone on
    any failing configuration; docs/mitigations.md)."""
    settings = switch_to.split()
    bad = [s for s in settings if "=" not in s or not s.split("=", 1)[0] or not s.split("=", 1)[1]]
    if bad or not settings:
        raise ValueError(f"monitor_switch_to={switch_to!r} is invalid; accepted: space-separated key=value "
                         "attention settings, e.g. 'delta=consistent' or 'delta=dP*P' or "
                         "'stabilize=paper beta=4'")
    if current_choice_text.split()[0] == "sdpa":
        current_choice_text = "triton stabilize=none" if kernels else "emulated stabilize=none policy=fa2"
    return with_settings(current_choice_text, switch_to)
