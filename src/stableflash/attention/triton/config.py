"""The kernels' configuration: one frozen, typed value per call, built by ``launch.kernel_config``.

Each coded meaning is an enum: the arithmetic (which reaches the kernels as the EMU switch), and
the row-maximum rule, the rounding formats and the source of δ, whose values are the numbers the
kernels specialize on (``common`` names them as ``tl.constexpr`` globals). ``KernelConfig`` holds them with the rule's parameters, which points
are narrowed, P̄'s format, the fp32 heads, the soft cap and the key block. The custom ops take
it as one string argument: ``KernelConfig.op_key`` gives it (its fields as JSON, enums as their
values) and ``KernelConfig.from_op_key`` reads it back, memoized: one argument costs torch's
dispatcher a fraction of what seventeen cost. This module imports neither Triton nor torch.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from enum import Enum

HP_HEAD_LIMIT = 30  # hp_heads on the kernels: head indices 0-30 (the launcher hands the kernel one int32 of them)


class Arithmetic(Enum):
    """How the forward computes: "fa2", what fused kernels do (scores in fp32 and log2 units, ℓ
    and Ō in fp32), or "paper", the emulation of the paper's bf16 policy (S, the shift and S − m
    in bf16 natural units, ℓ and Ō rounded after every key block; bf16 inputs only)."""
    FA2 = "fa2"
    PAPER = "paper"


class RuleKind(Enum):
    """The row-maximum rule (``attention.shift``), by its ``ShiftRule.kind``."""
    STANDARD = 0
    PAPER = 1
    TIE_SHIFT = 2
    ALL_SHIFT = 3

    @classmethod
    def of(cls, kind: str) -> RuleKind:
        """The member for a ``ShiftRule.kind`` ("standard", "paper", "tie-shift", "all-shift")."""
        return _RULES[kind]

    @property
    def kind(self) -> str:
        return self.name.lower().replace("_", "-")


class Format(Enum):
    """A format the kernels round to, by the number they specialize on: for bf16 and the e8mY
    formats (fp32's exponent range) the mantissa bits kept, for fp32 its 23 (nothing rounded),
    and three codes for fp16 and the fp8 formats, which have their own exponent ranges."""
    E8M1 = 1
    E8M2 = 2
    E8M3 = 3
    E8M4 = 4
    E8M5 = 5
    E8M6 = 6
    BF16 = 7
    FP32 = 23
    FP16 = 30
    FP8_E5M2 = 31
    FP8_E4M3 = 32

    @classmethod
    def named(cls, name: str) -> Format | None:
        """The member for a format name of ``numerics`` ("bf16", "e8m5", "fp8_e4m3", ...), or None."""
        return _FORMATS.get(name)

    @property
    def fp8(self) -> bool:
        return self in (Format.FP8_E5M2, Format.FP8_E4M3)


class DeltaSource(Enum):
    """Where the backward's δ = rowsum(dO ∘ O) comes from, which also says what the forward keeps
    for it: nothing (DO_O, DP_P, RECOMPUTE_FP32), an fp32 O (DO_O_FP32, DO_O32, DO_O16) or the
    O store's residual in O's dtype (DO_O_R, DO_O16_R). ``named`` maps a policy's δ name."""
    DO_O = 0            # "dO·O": the stored O
    DP_P = 1            # "dP·P": rowsum(P ∘ dP), dP = dO·Vᵀ, one more pass over the keys
    RECOMPUTE_FP32 = 2  # "recompute_fp32": rowsum(dO ∘ PV), PV recomputed in fp32, one more pass
    DO_O_FP32 = 3       # "dO·O" where the policy stores O in fp32 (out=fp32, or fp32 heads): that O, kept
    DO_O32 = 4          # "dO·O32": O as computed, before the store's rounding, kept in fp32
    DO_O16 = 5          # "dO·O16": O of a 16-bit P̄V computed beside the policy's ("fa2" only), in fp32
    DO_O_R = 6          # "dO·(O+R)": the stored O plus its rounding residual R, kept in O's dtype
    DO_O16_R = 7        # "dO·(O16+R)": the 16-bit product's O as the stored O plus a residual

    @classmethod
    def named(cls, name: str) -> DeltaSource:
        """The member for a policy's δ source name ("dO·O", "dP·P", "dO·(O+R)", ...)."""
        return _DELTAS[name]

    @property
    def keeps_o(self) -> bool:
        """The forward keeps a tensor for δ: an fp32 O, or the O store's residual."""
        return self not in (DeltaSource.DO_O, DeltaSource.DP_P, DeltaSource.RECOMPUTE_FP32)

    @property
    def residual(self) -> bool:
        """What the forward keeps is the O store's residual R, in O's dtype; δ reads O + R."""
        return self in (DeltaSource.DO_O_R, DeltaSource.DO_O16_R)

    @property
    def o16(self) -> bool:
        """The forward computes a second P̄V with P̄ in the input dtype for δ."""
        return self in (DeltaSource.DO_O16, DeltaSource.DO_O16_R)

    @property
    def extra_pass(self) -> bool:
        """δ comes from a pass of its own over the keys (the backward's δ kernel)."""
        return self in (DeltaSource.DP_P, DeltaSource.RECOMPUTE_FP32)

    @property
    def for_forward(self) -> DeltaSource:
        """This source as the forward sees it: itself where the forward keeps something for δ,
        else DO_O (the forward keeps nothing, so it compiles once for all three)."""
        return self if self.keeps_o else DeltaSource.DO_O


_RULES = {r.kind: r for r in RuleKind}
_FORMATS = {f.name.lower(): f for f in Format}
_DELTAS = {"dO·O": DeltaSource.DO_O, "dP·P": DeltaSource.DP_P, "recompute_fp32": DeltaSource.RECOMPUTE_FP32,
           "dO·O32": DeltaSource.DO_O32, "dO·O16": DeltaSource.DO_O16, "dO·(O+R)": DeltaSource.DO_O_R,
           "dO·(O16+R)": DeltaSource.DO_O16_R}


@dataclass(frozen=True)
class KernelConfig:
    """Everything the kernels specialize on or read from the policy for one call (not the shapes).

    arithmetic: "fa2" or the "paper" emulation. rule, beta, eps, min_shift, max_shift: the
    row-maximum rule and its parameters (max_shift already capped for P̄'s format). narrow: the
    one format of the narrowed points (FP32: none), which are Ō (narrow_acc, "paper" only), ℓ
    (narrow_row_sum, "paper" only) and O (narrow_out); stochastic: they round stochastically
    instead of to nearest-even. p_bar: the format P̄ is rounded to before P̄V (None: only to V's
    dtype, for the tensor cores; FP32: not rounded, the product in fp32); fp8_product: P̄ and V
    multiplied on the fp8 tensor cores, V in P̄'s fp8 format. delta: the source of δ. hp_heads:
    heads (≤ HP_HEAD_LIMIT) that keep P̄, Ō, ℓ and O in fp32. softcap: scores soft-capped to
    softcap·tanh(S/softcap) (None: off). block_k: the forward's key block under "paper" (None:
    the kernel's own).
    """
    arithmetic: Arithmetic = Arithmetic.FA2
    rule: RuleKind = RuleKind.STANDARD
    beta: float = 2.0
    eps: float = 1e-3
    min_shift: float = 0.0
    max_shift: float = 0.0
    narrow: Format = Format.FP32
    narrow_acc: bool = False
    narrow_row_sum: bool = False
    narrow_out: bool = False
    stochastic: bool = False
    p_bar: Format | None = None
    fp8_product: bool = False
    delta: DeltaSource = DeltaSource.DO_O
    hp_heads: tuple[int, ...] = ()
    softcap: float | None = None
    block_k: int | None = None

    def __post_init__(self) -> None:
        """ValueError for field combinations the kernels have no code for (``launch.kernel_config``
        builds none of them)."""
        if self.narrow is Format.FP32 and (self.narrow_acc or self.narrow_row_sum or self.narrow_out):
            raise ValueError("KernelConfig: narrow=Format.FP32 narrows nothing; accepted: narrow_acc, narrow_row_sum "
                             "and narrow_out False, or a narrower format")
        if self.fp8_product and (self.p_bar is None or not self.p_bar.fp8):
            raise ValueError(f"KernelConfig: fp8_product with p_bar={self.p_bar}; accepted: an fp8 p_bar")
        if self.delta.o16 and self.arithmetic is Arithmetic.PAPER:
            raise ValueError(f"KernelConfig: delta={self.delta} under the paper emulation; accepted: 'fa2' arithmetic")
        if any(h < 0 or h > HP_HEAD_LIMIT for h in self.hp_heads):
            raise ValueError(f"KernelConfig: hp_heads={self.hp_heads}; accepted: heads 0-{HP_HEAD_LIMIT}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"KernelConfig: softcap={self.softcap}; accepted: None (off) or > 0")
        if self.block_k is not None and self.arithmetic is not Arithmetic.PAPER:
            raise ValueError(f"KernelConfig: block_k={self.block_k} under 'fa2'; accepted: None, or the paper emulation")

    @property
    def emulated(self) -> bool:
        """The forward runs the "paper" emulation."""
        return self.arithmetic is Arithmetic.PAPER

    @property
    def p_bar_fp32(self) -> bool:
        """P̄V takes P̄ in fp32 (no rounding of P̄, no tensor cores)."""
        return self.p_bar is Format.FP32

    def __hash__(self) -> int:
        """The fields' hash, computed once (a launch plan's key holds the configuration: every call
        hashes it)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, name) for name in OP_FIELDS))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        """The fields alone: the memoized hash (of strings, which each process hashes its own way) is not
        carried into a copy or a pickle."""
        return {name: getattr(self, name) for name in OP_FIELDS}

    @property
    def op_key(self) -> str:
        """The configuration as the custom ops' ``config`` argument: its fields as a JSON object in
        ``OP_FIELDS`` order, enums as their values, the heads as a list (``from_op_key`` reads it back).
        Written out by hand rather than by ``json``, whose C encoder torch.compile cannot trace."""
        values = (self.arithmetic.value, self.rule.value, self.beta, self.eps, self.min_shift, self.max_shift,
                  self.narrow.value, self.narrow_acc, self.narrow_row_sum, self.narrow_out, self.stochastic,
                  None if self.p_bar is None else self.p_bar.value, self.fp8_product, self.delta.value,
                  self.hp_heads, self.softcap, self.block_k)
        return "{" + ",".join(['"' + name + '":' + _json(value) for name, value in zip(OP_FIELDS, values)]) + "}"

    @staticmethod
    def from_op_key(key: str) -> KernelConfig:
        """The configuration whose ``op_key`` is ``key`` (memoized: the ops read it on every call);
        ValueError naming what is wrong for a string no ``op_key`` gives."""
        return _from_op_key(key)


def _json(value) -> str:
    """``value`` (None, a bool, an int, a float, a str without quotes or escapes, or a tuple of ints) as
    JSON. Numbers go through ``%r`` formatting, which torch.compile specializes (and guards) where a
    traced float is symbolic, as under ``dynamic=True``."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, tuple):
        return "[" + ",".join(["%d" % (h,) for h in value]) + "]"
    text = "%r" % (value,)
    return _NON_FINITE.get(text, text)


_NON_FINITE = {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}      # as json writes them


@functools.lru_cache(maxsize=256)
def _from_op_key(key: str) -> KernelConfig:
    try:
        named = json.loads(key)
    except (TypeError, ValueError) as e:
        raise ValueError(f"KernelConfig.from_op_key: config={key!r} is not JSON ({e}); accepted: a "
                         f"KernelConfig.op_key") from None
    if not isinstance(named, dict) or tuple(named) != OP_FIELDS:
        raise ValueError(f"KernelConfig.from_op_key: config={key!r}; accepted: a JSON object of the fields "
                         f"{', '.join(OP_FIELDS)}, in that order (a KernelConfig.op_key)")
    try:
        p_bar = named["p_bar"]
        return KernelConfig(Arithmetic(named["arithmetic"]), RuleKind(named["rule"]), named["beta"], named["eps"],
                            named["min_shift"], named["max_shift"], Format(named["narrow"]), named["narrow_acc"],
                            named["narrow_row_sum"], named["narrow_out"], named["stochastic"],
                            None if p_bar is None else Format(p_bar), named["fp8_product"],
                            DeltaSource(named["delta"]), tuple(named["hp_heads"]), named["softcap"],
                            named["block_k"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"KernelConfig.from_op_key: config={key!r}: {e}; accepted: a KernelConfig.op_key") from None


# KernelConfig's fields, in order (the keys of its op_key)
OP_FIELDS = tuple(f.name for f in fields(KernelConfig))
