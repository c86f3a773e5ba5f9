"""The stabilization: what ``flash_attention`` changes so that low-precision training does not fail.

A stabilization is two choices, and nothing else:

- the row-maximum rule (``ShiftRule``): which value each softmax row subtracts before exp;
- whether δ = rowsum(dO ∘ O) comes from a source consistent with the backward's P
  (``consistent_delta``), instead of the rounded stored O: the source
  ``policy.consistent_delta_source`` names for the precision policy's kind of rounding.

Every layer takes it as the same value — ``flash_attention(stabilize=...)``, the SDPA drop-in,
``StableAttention``, the Hugging Face function, the attention spec (``stabilize=...``), the
training monitor's switch, the reproduction presets and both benchmarks — either a
``Stabilization`` or one of these names:

================================  ===================  =====================================
name                              row maximum          δ
================================  ===================  =====================================
``"none"`` (or False)             standard             as the policy says (stored O)
``"consistent-delta"`` (or True)  standard             consistent with the backward's P
``"paper"``                       the paper's Alg. 3   as the policy says
``"tie-shift"``                   tie-shift            as the policy says
``"tie-shift+consistent-delta"``  tie-shift            consistent with the backward's P
================================  ===================  =====================================

``"consistent-delta"`` is the default: it held on every failing configuration measured, where the
rules alone did not (docs/mitigations.md). Any rule of ``shift.RULES`` may stand alone or be
joined with ``+consistent-delta`` (``"all-shift"``, ``"paper+consistent-delta"``). A policy that
names its own δ source other than the stored O keeps it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from stableflash.attention.policy import PrecisionPolicy, with_consistent_delta
from stableflash.attention.shift import LEGACY_RULES, RULES, ShiftRule

CONSISTENT_DELTA = "consistent-delta"
NONE = "none"
# the named presets, as the docs list them; every "<rule>" and "<rule>+consistent-delta" is accepted
PRESETS = (NONE, CONSISTENT_DELTA, "paper", "tie-shift", f"tie-shift+{CONSISTENT_DELTA}")
NAMES = (NONE, CONSISTENT_DELTA, *(r for r in RULES if r != "standard"),
         *(f"{r}+{CONSISTENT_DELTA}" for r in RULES if r != "standard"))
# earlier spellings, still read from stored run folders and result files (``from_stored``)
LEGACY_NAMES = {"guard": CONSISTENT_DELTA, "standard": NONE, **LEGACY_RULES,
                **{f"{old}+guard": f"{new}+{CONSISTENT_DELTA}" for old, new in LEGACY_RULES.items()},
                "paper+guard": f"paper+{CONSISTENT_DELTA}"}


@dataclass(frozen=True)
class Stabilization:
    """A row-maximum rule and whether δ comes from a source consistent with the backward's P."""

    rule: ShiftRule = field(default_factory=ShiftRule)
    consistent_delta: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.rule, ShiftRule):
            raise TypeError(f"rule={self.rule!r} is invalid; accepted: a ShiftRule")
        if not isinstance(self.consistent_delta, bool):
            raise TypeError(f"consistent_delta={self.consistent_delta!r} is invalid; accepted: True or False")

    @property
    def name(self) -> str:
        """The name that builds this stabilization (with the rule's beta and eps given apart)."""
        if self.rule.kind == "standard":
            return CONSISTENT_DELTA if self.consistent_delta else NONE
        return f"{self.rule.kind}+{CONSISTENT_DELTA}" if self.consistent_delta else self.rule.kind

    def policy_for(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        """``policy`` with δ from the consistent source where this stabilization asks for it."""
        return with_consistent_delta(policy) if self.consistent_delta else policy

    def __str__(self) -> str:
        return self.name

    @classmethod
    def named(cls, name: str, beta: float = 2.0, eps: float = 1e-3) -> "Stabilization":
        """The stabilization ``name`` (one of ``NAMES``) with the rule's ``beta`` and ``eps``; for a name
        and plain numbers, one frozen object per set of values (every eager attention call asks;
        torch.compile traces it once, and would warn about tracing through the memo)."""
        if type(name) is str and type(beta) in (int, float) and type(eps) in (int, float) \
                and not torch.compiler.is_compiling():
            return _named(cls, name, beta, eps)
        return cls._build(name, beta, eps)

    @classmethod
    def _build(cls, name: str, beta: float, eps: float) -> "Stabilization":
        if not isinstance(name, str) or name not in NAMES:
            raise ValueError(_unknown("stabilize", name))
        if name in (NONE, CONSISTENT_DELTA):
            return cls(ShiftRule("standard", beta, eps), name == CONSISTENT_DELTA)
        kind, _, delta = name.partition("+")
        return cls(ShiftRule(kind, beta, eps), bool(delta))


@functools.lru_cache(maxsize=256, typed=True)
def _named(cls, name: str, beta: float, eps: float) -> Stabilization:
    return cls._build(name, beta, eps)


def _unknown(arg: str, value) -> str:
    renamed = (f" ({value!r} is the earlier name of {LEGACY_NAMES[value]!r})"
               if isinstance(value, str) and value in LEGACY_NAMES else "")
    return (f"{arg}={value!r} is invalid{renamed}; accepted: True (the default, {CONSISTENT_DELTA!r}), False "
            f"({NONE!r}), a Stabilization, or one of {', '.join(repr(n) for n in NAMES)}")


def parse_stabilize(stabilize: "bool | str | Stabilization | None", beta: float = 2.0,
                    eps: float = 1e-3, arg: str = "stabilize") -> Stabilization:
    """The Stabilization an argument names: True → the default ("consistent-delta"), False or None →
    "none", a name of ``NAMES`` (built with ``beta`` and ``eps``), or a Stabilization as it is.
    ValueError naming ``arg``, the value and what is accepted for anything else (an earlier spelling
    such as "guard" or "ours" included, with its current name)."""
    if isinstance(stabilize, Stabilization):
        return stabilize
    if stabilize is True:
        return Stabilization.named(CONSISTENT_DELTA, beta, eps)
    if stabilize is False or stabilize is None:
        return Stabilization.named(NONE, beta, eps)
    if isinstance(stabilize, str) and stabilize in NAMES:
        return Stabilization.named(stabilize, beta, eps)
    raise ValueError(_unknown(arg, stabilize))


def from_stored(name: str) -> str:
    """A stabilization name as stored by an earlier version (``LEGACY_NAMES``) in its current spelling;
    a current name comes back as it is."""
    return LEGACY_NAMES.get(name, name)
