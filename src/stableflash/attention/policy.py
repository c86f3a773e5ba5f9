"""PrecisionPolicy: every rounding point of flash attention as a named, configurable field.

Each experiment of the paper's Section 3.2 is a policy, not a code edit. A rounding point is a
format name, optionally with a rounding mode after a colon: ``"bf16"``, ``"fp16:rtz"``,
``"e8m4:stochastic"``. Arithmetic between rounding points happens in ``compute`` (fp32, as on
the GPU, or fp64 for exactness checks).

| field    | what is rounded                                   | fa2  | paper | fp32 |
|----------|---------------------------------------------------|------|-------|------|
| inputs   | Q, K, V and dO on entry                           | low  | low   | fp32 |
| scores   | S = QKᵀ·scale, and S − m before exp               | fp32 | low   | fp32 |
| p_bar    | P̄ before the P̄V product                           | low  | low   | fp32 |
| acc      | the Ō accumulator, after every key block          | fp32 | low   | fp32 |
| row_sum  | ℓ, after every key block                          | fp32 | low   | fp32 |
| out      | O as stored (and used for δ = rowsum(dO∘O))       | low  | low   | fp32 |
| bwd      | P and dS before the backward matmuls              | low  | low   | fp32 |
| v_bar    | V for P̄V, where narrower than ``inputs`` (fp8: FP8 attention) | fp32 | fp32 | fp32 |
| delta    | δ source: "dO·O", "dO·O32", "dO·(O+R)", "dO·O16", "dO·(O16+R)", "dP·P", "recompute_fp32", "consistent" | dO·O | dO·O | dO·O |
| hp_heads | heads whose p_bar, v_bar, acc, row_sum, out use compute | () | () | () |

δ sources: "dO·O" reads O as stored (``out``); "dO·O32" reads O as computed, Ō/ℓ before the
``out`` rounding (the forward keeps it in fp32: exact O for δ while the model gets the stored
format); "dO·(O+R)" reads O as stored plus its rounding residual R = O as computed − O as stored,
R rounded to the inputs' format (what the forward keeps instead of an fp32 O: 2 bytes per element
instead of 4, O to about twice the inputs' bits); "dO·O16" reads the O that a 16-bit kernel computes beside the policy's: P̄ rounded as the
inputs are (bf16 or fp16, not ``p_bar``), Ō, ℓ and O unrounded in ``compute`` (one more P̄V product
in the forward; for a ``p_bar`` narrower than the inputs, such as fp8); "dO·(O16+R)" keeps that O
as dO·(O+R) keeps O as computed: as the residual of the O store in the inputs' format, which δ adds
to the stored O (2 bytes per element instead of 4); "dP·P" sums dP ∘ P with
dP = dO·Vᵀ (a pass over the keys); "recompute_fp32" recomputes O = PV in fp32. "consistent" is the
source consistent with the backward's P for the policy's kind of rounding: the one that held on
every failing configuration measured with that rounding (``consistent_delta_source``;
docs/mitigations.md), what ``flash_attention``'s default stabilization applies ("auto" is its
earlier spelling, still read from stored runs).

``low`` is bf16 unless the preset is built for another format (fp16 inputs, or an explicit
``PrecisionPolicy.preset("paper", low="fp16")``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import torch

from stableflash.numerics import ROUNDING_MODES, FloatFormat, get_format

PRESETS = ("fa2", "paper", "fp32", "fp64")
DELTA_SOURCES = ("dO·O", "dO·O32", "dO·(O+R)", "dO·O16", "dO·(O16+R)", "dP·P", "recompute_fp32", "consistent")
O16_SOURCES = ("dO·O16", "dO·(O16+R)")     # the δ sources that need the 16-bit product beside the policy's
_DELTA_ALIASES = {"dO·O": "dO·O", "dO*O": "dO·O", "do_o": "dO·O", "dO·O32": "dO·O32", "dO*O32": "dO·O32",
                  "do_o32": "dO·O32", "dO·(O+R)": "dO·(O+R)", "dO*(O+R)": "dO·(O+R)", "do_o_r": "dO·(O+R)",
                  "dO·O16": "dO·O16", "dO*O16": "dO·O16", "do_o16": "dO·O16",
                  "dO·(O16+R)": "dO·(O16+R)", "dO*(O16+R)": "dO·(O16+R)", "do_o16_r": "dO·(O16+R)",
                  "dP·P": "dP·P", "dP*P": "dP·P",
                  "dp_p": "dP·P", "recompute_fp32": "recompute_fp32", "recompute": "recompute_fp32",
                  "consistent": "consistent", "auto": "consistent"}
ROUNDING_POINTS = ("inputs", "scores", "p_bar", "acc", "row_sum", "out", "bwd", "v_bar")
COMPUTE_FORMATS = ("fp32", "fp64")


def parse_point(spec: str, field: str = "rounding point") -> tuple[FloatFormat, str]:
    """``"bf16"`` → (bf16, "rne"); ``"bf16:stochastic"`` → (bf16, "stochastic")."""
    if not isinstance(spec, str):
        raise TypeError(f"{field}={spec!r} is not a string; accepted: a format name with an "
                        f"optional ':mode', e.g. 'bf16' or 'bf16:stochastic'")
    name, _, mode = spec.partition(":")
    mode = mode or "rne"
    if mode not in ROUNDING_MODES:
        raise ValueError(f"{field}={spec!r} has rounding mode {mode!r}; accepted: {', '.join(ROUNDING_MODES)}")
    try:
        fmt = get_format(name)
    except ValueError as exc:
        raise ValueError(f"{field}={spec!r}: {exc}") from None
    return fmt, mode


@dataclass(frozen=True)
class PrecisionPolicy:
    """Where flash attention rounds, and to what. See the module docstring for the fields."""

    inputs: str = "bf16"
    scores: str = "fp32"
    p_bar: str = "bf16"
    acc: str = "fp32"
    row_sum: str = "fp32"
    out: str = "bf16"
    bwd: str = "bf16"
    v_bar: str = "fp32"
    delta: str = "dO·O"
    hp_heads: tuple[int, ...] = ()
    compute: str = "fp32"
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.compute not in COMPUTE_FORMATS:
            raise ValueError(f"compute={self.compute!r} is invalid; accepted: {', '.join(COMPUTE_FORMATS)}")
        wide = get_format(self.compute)
        for point in ROUNDING_POINTS:
            fmt, _ = parse_point(getattr(self, point), point)
            if fmt.exp_bits > wide.exp_bits or fmt.man_bits > wide.man_bits:
                raise ValueError(f"{point}={getattr(self, point)!r} is wider than compute={self.compute!r}; "
                                 f"accepted: formats that fit in {self.compute}, or compute='fp64'")
        if self.delta not in _DELTA_ALIASES:
            raise ValueError(f"delta={self.delta!r} is invalid; accepted: {', '.join(DELTA_SOURCES)}")
        object.__setattr__(self, "delta", _DELTA_ALIASES[self.delta])
        heads = tuple(self.hp_heads)
        if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in heads):
            raise ValueError(f"hp_heads={self.hp_heads!r} is invalid; accepted: non-negative head indices")
        object.__setattr__(self, "hp_heads", tuple(sorted(set(heads))))

    @classmethod
    def preset(cls, name: str, low: str | FloatFormat = "bf16") -> "PrecisionPolicy":
        """One of ``PRESETS``, with ``low`` as the low-precision format (fa2 and paper only)."""
        if cls is PrecisionPolicy:
            return _preset(name, get_format(low).name)      # cached: policies are immutable
        return cls._build_preset(name, get_format(low).name)

    @classmethod
    def _build_preset(cls, name: str, low_name: str) -> "PrecisionPolicy":
        if name == "fa2":
            return cls(inputs=low_name, scores="fp32", p_bar=low_name, acc="fp32", row_sum="fp32",
                       out=low_name, bwd=low_name, name="fa2")
        if name == "paper":
            return cls(inputs=low_name, scores=low_name, p_bar=low_name, acc=low_name, row_sum=low_name,
                       out=low_name, bwd=low_name, name="paper")
        if name in ("fp32", "fp64"):
            return cls(**{p: name for p in ROUNDING_POINTS}, compute=name, name=name)
        raise ValueError(f"policy={name!r} is not a preset; accepted: {', '.join(PRESETS)} "
                         "or a PrecisionPolicy")

    def replace(self, **changes) -> "PrecisionPolicy":
        """A copy with some fields changed (validated again); named after the base preset."""
        changes.setdefault("name", f"{self.name}*" if changes else self.name)
        return replace(self, **changes)

    def point(self, field: str) -> tuple[FloatFormat, str]:
        """(format, rounding mode) of one rounding point."""
        return parse_point(getattr(self, field), field)

    @property
    def narrows_v(self) -> bool:
        """Whether ``v_bar`` rounds V below the inputs' format for the P̄V product (else V as input)."""
        v, inputs = self.point("v_bar")[0], self.point("inputs")[0]
        return v.man_bits < inputs.man_bits or v.exp_bits < inputs.exp_bits

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.compute == "fp64" else torch.float32

    def describe(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if f.name not in ("name",) and getattr(self, f.name) != ()]
        return f"{self.name}({', '.join(parts)})"


def memoize(fn):
    """``fn`` with an unbounded cache of its results (for pure functions of hashable arguments).

    Under torch.compile the plain function is traced instead, so that Dynamo sees no cache wrapper.
    """
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def call(*args):
        return fn(*args) if torch.compiler.is_compiling() else cached(*args)

    return call


@memoize
def _preset(name: str, low_name: str) -> PrecisionPolicy:
    return PrecisionPolicy._build_preset(name, low_name)


def resolve_policy(policy: "PrecisionPolicy | str | None", dtype: torch.dtype) -> PrecisionPolicy:
    """The policy a backend uses for inputs of ``dtype``.

    None means what a real kernel does for that dtype: "fa2" at bf16 or fp16, and "fp32"/"fp64"
    for float32/float64 inputs. A preset name is built with ``low`` = fp16 for fp16 inputs and
    bf16 otherwise.
    """
    low = "fp16" if dtype == torch.float16 else "bf16"
    if policy is None:
        if dtype == torch.float32:
            return _preset("fp32", "bf16")
        if dtype == torch.float64:
            return _preset("fp64", "bf16")
        return _preset("fa2", low)
    if isinstance(policy, PrecisionPolicy):
        return resolve_delta(policy)
    if isinstance(policy, str):
        return _preset(policy, low)
    raise TypeError(f"policy={policy!r} is invalid; accepted: None, a PrecisionPolicy, or one of "
                    f"{', '.join(PRESETS)}")


def consistent_delta_source(policy: PrecisionPolicy) -> str:
    """The δ source that keeps δ = rowsum(dO ∘ O) consistent with the backward's P under ``policy``'s
    rounding: the cheapest one that held on every seed of the failing configurations of its kind
    (docs/mitigations.md):

    - scores, Ō or ℓ rounded below ``compute`` (the "paper" emulation): the O as computed is itself
      off, and only δ from the backward's own P held → "dP·P";
    - P̄ (or V for P̄V) narrower than the inputs (fp8 attention): δ from the O of a 16-bit P̄V
      computed beside the narrow one held on fp8 e4m3 and e5m2 ("dO·O16"); kept as the stored O
      plus its residual in the inputs' dtype, half the memory of an fp32 O at the same cost → "dO·(O16+R)";
    - otherwise, O stored narrower than ``compute`` (bf16, fp16, or a narrower ``out``): δ from O as
      computed held where δ from the stored O did not ("dO·O32"); kept the same way, as the stored O
      plus its residual → "dO·(O+R)";
    - nothing rounded before δ (fp32/fp64 policies): "dO·O" is already exact.
    """
    wide = get_format(policy.compute).man_bits
    if any(policy.point(f)[0].man_bits < wide for f in ("scores", "acc", "row_sum")):
        return "dP·P"
    if policy.point("p_bar")[0].man_bits < policy.point("inputs")[0].man_bits or policy.narrows_v:
        return "dO·(O16+R)"
    if policy.point("out")[0].man_bits < wide:
        return "dO·(O+R)"
    return "dO·O"


def resolve_delta(policy: PrecisionPolicy) -> PrecisionPolicy:
    """``policy`` with δ source "consistent" replaced by ``consistent_delta_source(policy)`` (the same
    name kept)."""
    return with_consistent_delta(policy) if policy.delta == "consistent" else policy


@memoize
def with_consistent_delta(policy: PrecisionPolicy) -> PrecisionPolicy:
    """``policy`` with δ from ``consistent_delta_source`` where it reads the stored O ("dO·O", the
    default) or says "consistent"; another named source is kept. What the stabilizations with a
    consistent δ (``flash_attention``'s default) run."""
    if policy.delta not in ("dO·O", "consistent"):
        return policy
    return replace(policy, delta=consistent_delta_source(policy))
