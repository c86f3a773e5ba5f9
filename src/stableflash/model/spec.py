"""Which attention each layer of a model uses, written as one readable string.

A spec is a list of entries separated by ``;``. Each entry is ``[LAYERS:] BACKEND [key=value ...]``:

    sdpa                                             every layer: torch SDPA
    triton                                           every layer: fused kernels, stabilized as
                                                     flash_attention(backend="triton") is
    triton stabilize=none                            the same kernels, not stabilized
    sdpa; 2: emulated policy=paper stabilize=none    layer 2 emulated under the paper's policy
    *: emulated policy=paper stabilize=paper beta=4; 0-1,5: sdpa
    2: emulated policy=paper acc=fp32 delta=dP*P     (no default entry: the others use sdpa)

LAYERS is ``*``, a layer index, an inclusive range ``2-5``, or a comma list of those. An entry
without LAYERS (or with ``*``) sets the default for every layer; entries apply in order, so a later
entry overrides an earlier one for the layers it names (a later default resets them all).

Keys: ``stabilize`` (a stabilization name: none, consistent-delta, paper, tie-shift, all-shift, or a
rule + ``+consistent-delta``; ``stableflash.attention.stabilization``), ``beta``, ``eps`` (the
rule's parameters), ``block`` (key block of the emulated backend, and of the triton kernels under
the "paper" policy), ``policy`` (a preset: fa2, paper, fp32, fp64), ``low`` (the preset's low
format), and the PrecisionPolicy fields ``inputs``, ``scores``, ``p_bar``, ``acc``, ``row_sum``,
``out``, ``bwd``, ``v_bar``, ``delta``, ``hp_heads`` (e.g. ``1,7,8``), ``compute``.

``stabilize`` means what ``flash_attention``'s argument means, with the same default: triton,
emulated and reference entries are stabilized with "consistent-delta" unless they say otherwise;
sdpa cannot be stabilized and takes only ``stabilize=none``. ``delta=consistent`` is the same as
adding ``+consistent-delta`` to the stabilization, and is written that way. ``policy=paper`` alone
stays the preset *name*, which ``flash_attention`` builds for the input dtype (fp16 inputs get
``low=fp16``); with ``low`` or any field the policy is built here, as
``PrecisionPolicy.preset(policy or "fa2", low or "bf16").replace(**fields)``, so an fp16 model
that wants overrides should say ``low=fp16``. (fp32 and fp64 have no low format: a policy equal
to one of them is kept as its name.)

Run folders written before this grammar (``config_version`` 1) spelled stabilization with the keys
``rule`` (standard, paper, ours, bounded) and ``delta=auto``, and a bare triton or emulated entry
was not stabilized; ``upgrade_stored_spec`` rewrites such text in this grammar, with its meaning.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Iterable

from stableflash.attention.policy import PRESETS, ROUNDING_POINTS, PrecisionPolicy, resolve_policy
from stableflash.attention.stabilization import (CONSISTENT_DELTA, NONE, Stabilization, from_stored,
                                                 parse_stabilize)
from stableflash.numerics import get_format

BACKENDS = ("sdpa", "triton", "emulated", "reference")
DEFAULT_BLOCK = 64
POLICY_FIELDS = (*ROUNDING_POINTS, "delta", "hp_heads", "compute")
KEYS = ("stabilize", "beta", "eps", "block", "policy", "low", *POLICY_FIELDS)
# the keys of the earlier grammar, with what replaced them
RENAMED_KEYS = {"rule": "stabilize"}


def with_consistent_delta_name(name: str) -> str:
    """A stabilization name with the consistent δ added ("none" → "consistent-delta", "paper" →
    "paper+consistent-delta"); a name that has it already comes back as it is."""
    if name in (NONE, CONSISTENT_DELTA):
        return CONSISTENT_DELTA
    return name if name.endswith(f"+{CONSISTENT_DELTA}") else f"{name}+{CONSISTENT_DELTA}"


def default_stabilization(backend: str) -> str:
    """What an entry of ``backend`` runs without a ``stabilize`` key: what ``flash_attention``'s
    default does ("consistent-delta"), except for sdpa, which cannot be stabilized ("none")."""
    return NONE if backend == "sdpa" else CONSISTENT_DELTA


def _listing(names: Iterable[str]) -> str:
    return ", ".join(names)


def _check_kernel_block(block: int, policy: PrecisionPolicy | str | None) -> None:
    """The fused kernels take a key block only under the "paper" emulation, and only a power of two
    from 16 to 512 (``attention.triton.launch.check_key_block``; head_dim is checked at the call).
    Without Triton installed the check waits for the call."""
    try:
        from stableflash.attention.triton.launch import check_key_block
    except ImportError:
        return
    import torch

    from stableflash.attention.policy import resolve_policy
    check_key_block(block, resolve_policy(policy, torch.bfloat16), torch.bfloat16, None)


@dataclass(frozen=True)
class AttentionChoice:
    """One layer's attention: backend, stabilization (a name, with the rule's beta and eps), policy.

    ``stabilize`` is a stabilization name (``stableflash.attention.stabilization.NAMES``) or None,
    the backend's default (``default_stabilization``). ``policy`` is None (what a real kernel does
    for the input dtype), a preset name, or a PrecisionPolicy; only the emulated and triton backends
    take one. ``block`` is the emulated backend's key block (block_k; its query rows all go at
    once), and the triton forward's under the "paper" policy (a power of two, 16-512). Validated and
    put in one canonical form on construction (a policy δ of "consistent" becomes the
    stabilization's ``+consistent-delta``), so that equal choices compare equal.
    """

    backend: str = "sdpa"
    stabilize: str | None = None
    beta: float = 2.0
    eps: float = 1e-3
    policy: PrecisionPolicy | str | None = None
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; accepted: {_listing(BACKENDS)}")
        for name in ("beta", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name}={value!r} is not a number; accepted: a finite float")
            object.__setattr__(self, name, float(value))
        stab = parse_stabilize(default_stabilization(self.backend) if self.stabilize is None else self.stabilize,
                               self.beta, self.eps)               # validates the name, beta > 1 and eps >= 0
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block={self.block!r} is invalid; accepted: a positive int")
        if self.block != DEFAULT_BLOCK and self.backend not in ("emulated", "triton"):
            raise ValueError(f"block={self.block} is the emulated backend's tile size; backend="
                             f"{self.backend!r} chooses its own (accepted: block only with emulated, or with "
                             "triton under the 'paper' policy)")
        if self.policy is not None and not isinstance(self.policy, (str, PrecisionPolicy)):
            raise TypeError(f"policy={self.policy!r} is invalid; accepted: None, a PrecisionPolicy, or one of "
                            f"{_listing(PRESETS)}")
        if isinstance(self.policy, str) and self.policy not in PRESETS:
            raise ValueError(f"policy={self.policy!r} is not a preset; accepted: {_listing(PRESETS)}")
        if self.policy is not None and self.backend in ("sdpa", "reference"):
            raise ValueError(f"backend={self.backend!r} cannot take policy={_policy_label(self.policy)}: "
                             "sdpa rounds as torch does and reference computes in float64; accepted: a policy "
                             "only with backend 'emulated' or 'triton'")
        if isinstance(self.policy, PrecisionPolicy) and self.policy.delta == "consistent":
            stab = Stabilization(stab.rule, consistent_delta=True)       # one spelling of a consistent δ
            object.__setattr__(self, "policy", self.policy.replace(delta="dO·O", name=self.policy.name))
        if self.backend == "sdpa" and stab.name != NONE:
            raise ValueError(f"backend='sdpa' cannot be stabilized (stabilize={stab.name!r}): torch's SDPA "
                             "subtracts the standard row maximum and reads its stored O for δ; accepted with "
                             "sdpa: stabilize=none (use triton or emulated to stabilize)")
        object.__setattr__(self, "stabilize", stab.name)
        if self.block != DEFAULT_BLOCK and self.backend == "triton":
            _check_kernel_block(self.block, self.policy)
        if isinstance(self.policy, PrecisionPolicy):              # one canonical form, so str() round-trips
            base, low, changes = _decompose(self.policy)
            exact = base in ("fp32", "fp64") and not changes     # the same whatever the input dtype
            object.__setattr__(self, "policy", base if exact else _build_policy(base, low, changes))
        # built once, as a plain attribute: a model's layers read it through ``kwargs`` on every forward,
        # where torch.compile traces them (a functools.cached_property takes a lock on Python 3.11, at
        # which torch.compile breaks the graph)
        object.__setattr__(self, "_stabilization", parse_stabilize(self.stabilize, self.beta, self.eps))

    @property
    def stabilization(self) -> Stabilization:
        """The Stabilization this choice runs (its name with beta and eps)."""
        return self._stabilization

    def kwargs(self) -> dict:
        """Keyword arguments for ``stableflash.attention.flash_attention`` (the caller adds ``causal``)."""
        kw = {"backend": self.backend, "stabilize": self.stabilization, "policy": self.policy}
        if self.backend == "emulated" or self.block != DEFAULT_BLOCK:
            kw.update(block_k=self.block)
        return kw

    def delta_source(self, dtype=None) -> str:
        """The δ source this choice runs for inputs of ``dtype`` (default bfloat16), a consistent δ
        resolved to the source it names."""
        import torch
        policy = resolve_policy(self.policy, torch.bfloat16 if dtype is None else dtype)
        return self.stabilization.policy_for(policy).delta

    def __str__(self) -> str:
        parts = [self.backend]
        if self.stabilize != default_stabilization(self.backend):
            parts.append(f"stabilize={self.stabilize}")
        if self.beta != 2.0:
            parts.append(f"beta={_number(self.beta)}")
        if self.eps != 1e-3:
            parts.append(f"eps={_number(self.eps)}")
        if isinstance(self.policy, str):
            parts.append(f"policy={self.policy}")
        elif isinstance(self.policy, PrecisionPolicy):
            parts.extend(_policy_tokens(self.policy))
        if self.block != DEFAULT_BLOCK:
            parts.append(f"block={self.block}")
        return " ".join(parts)


@dataclass(frozen=True)
class AttentionSpec:
    """A default AttentionChoice and per-layer overrides: ((layer, choice), ...) sorted by layer.

    Overrides equal to the default are dropped, so two specs that route every layer the same way
    compare equal. ``parse_attention_spec(str(spec)) == spec``.
    """

    default: AttentionChoice = field(default_factory=AttentionChoice)
    overrides: tuple[tuple[int, AttentionChoice], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.default, AttentionChoice):
            raise TypeError(f"default={self.default!r} is not an AttentionChoice")
        pairs = self.overrides.items() if isinstance(self.overrides, dict) else self.overrides
        table: dict[int, AttentionChoice] = {}
        for pair in pairs:
            layer, choice = pair
            _check_layer(layer)
            if not isinstance(choice, AttentionChoice):
                raise TypeError(f"overrides: layer {layer} has choice {choice!r}; accepted: an AttentionChoice")
            table[layer] = choice
        kept = tuple((layer, c) for layer, c in sorted(table.items()) if c != self.default)
        object.__setattr__(self, "overrides", kept)

    def choice(self, layer: int) -> AttentionChoice:
        """The attention of ``layer`` (0-based)."""
        _check_layer(layer)
        for i, c in self.overrides:
            if i == layer:
                return c
        return self.default

    def choices(self, n_layer: int) -> list[AttentionChoice]:
        """The choice of each of ``n_layer`` layers."""
        return [self.choice(i) for i in range(n_layer)]

    def with_layers(self, layers: int | Iterable[int], choice: "AttentionChoice | str") -> "AttentionSpec":
        """A new spec with ``layers`` switched to ``choice`` (an AttentionChoice or ``"BACKEND key=value ..."``)."""
        if isinstance(choice, str):
            choice = _parse_choice(choice, choice)
        if not isinstance(choice, AttentionChoice):
            raise TypeError(f"choice={choice!r} is invalid; accepted: an AttentionChoice or a string "
                            "'BACKEND key=value ...'")
        layers = [layers] if isinstance(layers, int) else list(layers)
        return AttentionSpec(self.default, (*self.overrides, *((layer, choice) for layer in layers)))

    def check(self, n_layer: int, n_head: int) -> None:
        """ValueError if a layer index is ≥ n_layer or a policy's hp_heads names a head ≥ n_head."""
        for layer, _ in self.overrides:
            if layer >= n_layer:
                raise ValueError(f"attention spec names layer {layer}, but the model has n_layer={n_layer}; "
                                 f"accepted: layers 0 to {n_layer - 1}")
        for c in (self.default, *(c for _, c in self.overrides)):
            if isinstance(c.policy, PrecisionPolicy):
                bad = [h for h in c.policy.hp_heads if h >= n_head]
                if bad:
                    raise ValueError(f"attention spec entry {str(c)!r} has hp_heads={','.join(map(str, bad))} "
                                     f"but the model has n_head={n_head}; accepted: heads 0 to {n_head - 1}")

    def consistent_delta_sources(self, dtype=None) -> list[str]:
        """The δ sources that the choices with a consistent δ run for inputs of ``dtype`` (default
        bfloat16), default first, each once; empty when no choice asks for one (a choice whose policy
        names its own δ source keeps that source, and is not counted)."""
        import torch
        dtype = torch.bfloat16 if dtype is None else dtype
        sources: list[str] = []
        for c in (self.default, *(c for _, c in self.overrides)):
            if c.backend == "sdpa" or not c.stabilization.consistent_delta:
                continue
            policy = resolve_policy(c.policy, dtype)
            source = c.stabilization.policy_for(policy).delta
            if policy.delta == "dO·O" and source not in sources:
                sources.append(source)
        return sources

    def __str__(self) -> str:
        entries = [str(self.default)]
        groups: dict[AttentionChoice, list[int]] = {}
        for layer, c in self.overrides:
            groups.setdefault(c, []).append(layer)
        entries += [f"{_layer_ranges(layers)}: {c}" for c, layers in groups.items()]
        return "; ".join(entries)


def parse_attention_spec(text: str) -> AttentionSpec:
    """The AttentionSpec written in ``text`` (grammar in the module docstring)."""
    if isinstance(text, AttentionSpec):
        return text
    if not isinstance(text, str):
        raise TypeError(f"attention spec {text!r} is not a string; accepted: e.g. 'sdpa; 2: emulated policy=paper'")
    entries = [e.strip() for e in text.split(";")]
    if not any(entries):
        raise ValueError(f"attention spec {text!r} is empty; accepted: e.g. 'sdpa' or 'sdpa; 2: emulated policy=paper'")
    default = AttentionChoice()
    table: dict[int, AttentionChoice] = {}
    for entry in filter(None, entries):
        layers, body = _split_layers(entry)
        choice = _parse_choice(body, entry)
        if layers is None:
            default, table = choice, {}
        else:
            table.update(dict.fromkeys(layers, choice))
    return AttentionSpec(default, tuple(table.items()))


def with_settings(choice_text: str, settings: str) -> str:
    """A single attention choice (text) with ``settings`` (key=value words) in place of its own
    values of those keys: 'emulated policy=paper acc=e8m5' with 'acc=fp32' is
    'emulated policy=paper acc=fp32' (a spec entry may name each key only once)."""
    keys = {w.split("=", 1)[0] for w in settings.split()}
    backend, *words = choice_text.split()
    return " ".join([backend, *(w for w in words if w.split("=", 1)[0] not in keys), *settings.split()])


def as_attention_spec(spec: "AttentionSpec | AttentionChoice | str") -> AttentionSpec:
    """An AttentionSpec from a spec, a single choice (every layer), or a spec string."""
    if isinstance(spec, AttentionChoice):
        return AttentionSpec(spec)
    if isinstance(spec, (AttentionSpec, str)):
        return parse_attention_spec(spec)
    raise TypeError(f"attention={spec!r} is invalid; accepted: an AttentionSpec, an AttentionChoice, or a "
                    "spec string such as 'sdpa; 2: emulated policy=paper'")


# ---- parsing -------------------------------------------------------------------------------

_LAYER_ITEM = re.compile(r"(\d+)(?:-(\d+))?")


def _check_layer(layer: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer {layer!r} is invalid; accepted: a layer index >= 0")


def _split_layers(entry: str) -> tuple[list[int] | None, str]:
    """(layers, rest) of one entry; layers None for a default entry (no prefix, or ``*``)."""
    head, sep, rest = entry.partition(":")
    if not sep or "=" in head:                # a ':' after '=' belongs to a value (bf16:stochastic)
        return None, entry
    head = head.strip()
    if head == "*":
        return None, rest
    layers: list[int] = []
    for item in head.split(","):
        item = item.strip()
        match = _LAYER_ITEM.fullmatch(item)
        if not match:
            why = "is negative" if re.fullmatch(r"-\d+", item) else "is not a layer"
            raise ValueError(f"attention spec entry {entry!r}: {item!r} {why}; accepted: '*', a layer index "
                             ">= 0, an inclusive range such as '2-5', or a comma list of those, followed by ':'")
        lo, hi = int(match[1]), int(match[2] or match[1])
        if hi < lo:
            raise ValueError(f"attention spec entry {entry!r}: range {item!r} ends before it starts; "
                             "accepted: 'a-b' with a <= b")
        layers.extend(range(lo, hi + 1))
    return layers, rest


def _parse_choice(body: str, entry: str) -> AttentionChoice:
    """``"BACKEND key=value ..."`` → AttentionChoice; ``entry`` is quoted in errors."""
    tokens = body.split()
    if not tokens:
        raise ValueError(f"attention spec entry {entry!r} names no backend; accepted: {_listing(BACKENDS)}")
    backend, *pairs = tokens
    if backend not in BACKENDS:
        raise ValueError(f"attention spec entry {entry!r}: backend {backend!r} is unknown; "
                         f"accepted: {_listing(BACKENDS)}")
    values: dict[str, str] = {}
    for token in pairs:
        key, eq, value = token.partition("=")
        if not eq:
            raise ValueError(f"attention spec entry {entry!r}: {token!r} is not key=value; accepted keys: "
                             f"{_listing(KEYS)}")
        if key in RENAMED_KEYS:
            raise ValueError(f"attention spec entry {entry!r}: key {key!r} is now {RENAMED_KEYS[key]!r} "
                             f"(e.g. 'stabilize=tie-shift'; upgrade_stored_spec rewrites text of the earlier "
                             f"grammar); accepted: {_listing(KEYS)}")
        if key not in KEYS:
            raise ValueError(f"attention spec entry {entry!r}: unknown key {key!r}; accepted: {_listing(KEYS)}")
        if key in values:
            raise ValueError(f"attention spec entry {entry!r}: key {key!r} is given twice; accepted: each key "
                             "at most once per entry")
        values[key] = value
    stabilize = values.get("stabilize")
    if values.get("delta") in ("consistent", "auto"):            # a consistent δ: said by the stabilization
        del values["delta"]
        stabilize = with_consistent_delta_name(stabilize or default_stabilization(backend))
    try:
        return AttentionChoice(backend, stabilize=stabilize,
                               beta=_float(values, "beta", 2.0), eps=_float(values, "eps", 1e-3),
                               policy=_policy(values), block=_int(values, "block", DEFAULT_BLOCK))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"attention spec entry {entry!r}: {exc}") from None


def _float(values: dict[str, str], key: str, default: float) -> float:
    if key not in values:
        return default
    try:
        value = float(values[key])
    except ValueError:
        raise ValueError(f"{key}={values[key]!r} is not a number; accepted: a finite number") from None
    if not math.isfinite(value):
        raise ValueError(f"{key}={values[key]!r} is not finite; accepted: a finite number")
    return value


def _int(values: dict[str, str], key: str, default: int) -> int:
    if key not in values:
        return default
    if not values[key].isdigit():
        raise ValueError(f"{key}={values[key]!r} is invalid; accepted: a positive int")
    return int(values[key])


def _policy(values: dict[str, str]) -> PrecisionPolicy | str | None:
    """The policy of one entry: None, a preset name, or a PrecisionPolicy built from the keys."""
    name = values.get("policy")
    if name is not None and name not in PRESETS:
        raise ValueError(f"policy={name!r} is not a preset; accepted: {_listing(PRESETS)}")
    changes = {k: values[k] for k in POLICY_FIELDS if k in values}
    if "hp_heads" in changes:
        changes["hp_heads"] = _heads(changes["hp_heads"])
    if not changes and ("low" not in values or name in ("fp32", "fp64")):     # fp32/fp64 ignore low
        return name
    low = values.get("low", "bf16")
    try:
        get_format(low)
    except ValueError as exc:
        raise ValueError(f"low={low!r}: {str(exc).removeprefix('fmt: ')}") from None
    return _build_policy(name or "fa2", low, changes)


def _heads(text: str) -> tuple[int, ...]:
    items = [s.strip() for s in text.split(",")] if text not in ("", "none") else []
    if not all(s.isdigit() for s in items):
        raise ValueError(f"hp_heads={text!r} is invalid; accepted: a comma list of head indices >= 0 "
                         "such as 1,7,8, or 'none'")
    return tuple(int(s) for s in items)


# ---- policies <-> keys ------------------------------------------------------------------------

def _build_policy(base: str, low: str, changes: dict) -> PrecisionPolicy:
    policy = PrecisionPolicy.preset(base, low=low)
    return policy.replace(**changes) if changes else policy


def _decompose(policy: PrecisionPolicy) -> tuple[str, str, dict]:
    """(preset, low, changed fields) that rebuild ``policy`` with the fewest changes.

    The preset named by the policy (``"paper*"`` → paper) wins ties, then the order of PRESETS.
    """
    named = policy.name.rstrip("*")
    bases = sorted(PRESETS, key=lambda b: (b != named, PRESETS.index(b)))
    lows = ["bf16", *dict.fromkeys(getattr(policy, p).partition(":")[0] for p in ROUNDING_POINTS)]
    best = None
    for base in bases:
        for low in (lows if base in ("fa2", "paper") else ["bf16"]):
            try:
                preset = PrecisionPolicy.preset(base, low=low)
            except ValueError:
                continue
            changes = {f.name: getattr(policy, f.name) for f in fields(policy)
                       if f.name != "name" and getattr(policy, f.name) != getattr(preset, f.name)}
            if best is None or len(changes) < len(best[2]):
                best = (base, low, changes)
    return best


def _policy_tokens(policy: PrecisionPolicy) -> list[str]:
    """``policy=... [low=...] field=value ...``; ``low`` is written whenever needed to tell this
    built policy from the bare preset name (which is resolved for the input dtype)."""
    base, low, changes = _decompose(policy)
    tokens = [f"policy={base}"]
    if low != "bf16" or not changes:
        tokens.append(f"low={low}")
    for key, value in changes.items():
        tokens.append(f"{key}={','.join(map(str, value)) if key == 'hp_heads' else value}")
    return tokens


def _policy_label(policy: PrecisionPolicy | str) -> str:
    return repr(policy) if isinstance(policy, str) else policy.describe()


def _number(x: float) -> str:
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5"."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ---- the earlier grammar (run folders of config_version 1) ------------------------------------

def _upgrade_words(words: list[str]) -> list[str]:
    """key=value words of the earlier grammar with ``rule=`` and ``delta=auto`` as one
    ``stabilize=`` word (always written, "none" included); other words as they are."""
    rule, consistent, kept = "standard", False, []
    for word in words:
        key, _, value = word.partition("=")
        if key == "rule":
            rule = value
        elif key == "delta" and value in ("auto", "consistent"):
            consistent = True
        else:
            kept.append(word)
    name = from_stored(rule)                      # "standard" → "none", "ours" → "tie-shift", ...
    if consistent:
        name = with_consistent_delta_name(name)
    return [f"stabilize={name}", *kept]


def upgrade_stored_spec(text: str) -> str:
    """Attention spec text of the earlier grammar, in which a triton, emulated or reference entry
    without ``rule=`` or ``delta=auto`` was not stabilized, rewritten in this grammar with the same
    meaning: every such entry gets an explicit ``stabilize=`` (``rule=ours delta=auto`` →
    ``stabilize=tie-shift+consistent-delta``, a bare ``triton`` → ``triton stabilize=none``).
    Text that already says ``stabilize=`` somewhere is taken to be of this grammar, and text that is
    not a spec (an entry without a known backend: a label) is returned as it is."""
    if not isinstance(text, str) or "stabilize=" in text:
        return text
    entries = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        head, sep, rest = entry.partition(":")
        prefix, body = (f"{head.strip()}: ", rest) if sep and "=" not in head else ("", entry)
        backend, *words = body.split() or [""]
        if backend not in BACKENDS:
            return text
        entries.append(prefix + " ".join([backend, *(words if backend == "sdpa" else _upgrade_words(words))]))
    return "; ".join(entries)


def upgrade_stored_settings(settings: str) -> str:
    """A monitor switch's key=value settings of the earlier grammar in this one: ``delta=auto`` →
    ``delta=consistent`` (the consistent δ added to the layer's own rule), ``rule=ours`` →
    ``stabilize=tie-shift`` (that rule alone); other words as they are."""
    if not isinstance(settings, str):
        return settings
    words = []
    for word in settings.split():
        key, _, value = word.partition("=")
        if key == "rule":
            word = f"stabilize={from_stored(value)}"
        elif word == "delta=auto":
            word = "delta=consistent"
        words.append(word)
    return " ".join(words)
