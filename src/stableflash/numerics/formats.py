"""Binary floating-point formats described by their bit layout.

A :class:`FloatFormat` is a sign bit, ``exp_bits`` exponent bits and ``man_bits`` stored mantissa
(fraction) bits, with an exponent bias. Two families are modelled:

* IEEE-like formats (``has_inf=True``): the all-ones exponent is reserved; with a zero mantissa it
  encodes +-infinity, with a nonzero mantissa NaN. bf16, fp16, fp32, fp64 and fp8 e5m2 are of
  this kind, and so is every custom ``"eXmY"`` format.
* Finite-only "fn" formats (``has_inf=False``), like float8_e4m3fn: there are no infinities, the
  all-ones exponent holds normal numbers, and only the all-ones exponent *and* mantissa pattern is
  NaN. These formats saturate on overflow (as torch's float8_e4m3fn cast does).

Every format here fits inside float64, so each of its values is exactly a Python float.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

__all__ = ["FloatFormat", "get_format", "FORMAT_NAMES"]

_OVERFLOW_MODES = ("inf", "saturate")
_MIN_EXP_BITS, _MAX_EXP_BITS = 2, 11
_MAX_MAN_BITS = 52
# float64's own limits: every format must be a subset of float64.
_F64_EMIN, _F64_MAN_BITS = -1022, 52


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, ``exp_bits`` exponent bits, ``man_bits``
    mantissa bits, exponent ``bias``; ``has_inf`` tells IEEE-like formats (with infinities) from
    finite-only "fn" ones; ``overflow`` is ``"inf"`` (round-to-nearest overflows to infinity) or
    ``"saturate"`` (overflow clamps to the largest finite value)."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    has_inf: bool = True
    overflow: str = "inf"

    def __post_init__(self) -> None:
        _check_int("exp_bits", self.exp_bits, _MIN_EXP_BITS, _MAX_EXP_BITS)
        _check_int("man_bits", self.man_bits, 0 if self.has_inf else 1, _MAX_MAN_BITS)
        if not isinstance(self.bias, int) or isinstance(self.bias, bool):
            raise TypeError(f"bias must be an int, got {self.bias!r}")
        if self.overflow not in _OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {_OVERFLOW_MODES}, got {self.overflow!r}")
        if not self.has_inf and self.overflow == "inf":
            raise ValueError(
                f"overflow='inf' needs a format with infinities; format {self.name!r} has "
                "has_inf=False, so use overflow='saturate'")
        if self.emin - self.man_bits < _F64_EMIN - _F64_MAN_BITS or self.emax > 1023:
            raise ValueError(
                f"format {self.name!r} (exp_bits={self.exp_bits}, man_bits={self.man_bits}, "
                f"bias={self.bias}, has_inf={self.has_inf}) does not fit inside float64: its "
                f"exponents run from {self.emin} to {self.emax}, float64's from -1022 to 1023")

    @property
    def bits(self) -> int:
        """Total width in bits: sign + exponent + mantissa."""
        return 1 + self.exp_bits + self.man_bits

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite number."""
        top = (1 << self.exp_bits) - 1
        return (top - 1 if self.has_inf else top) - self.bias

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal number (1 - bias)."""
        return 1 - self.bias

    @property
    def max_finite(self) -> float:
        """Largest finite value. fn formats lose the all-ones mantissa at emax to NaN."""
        top_significand = (1 << (self.man_bits + 1)) - (1 if self.has_inf else 2)
        return math.ldexp(top_significand, self.emax - self.man_bits)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2**emin."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value, 2**(emin - man_bits)."""
        return math.ldexp(1.0, self.emin - self.man_bits)

    @property
    def eps(self) -> float:
        """Distance from 1 to the next larger value, 2**-man_bits."""
        return math.ldexp(1.0, -self.man_bits)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype with exactly this layout and overflow behaviour, or None."""
        return _TORCH_DTYPES.get(self._layout())

    def _layout(self) -> tuple[int, int, int, bool, str]:
        return (self.exp_bits, self.man_bits, self.bias, self.has_inf, self.overflow)

    def __str__(self) -> str:
        kind = "" if self.has_inf else "fn"
        return (f"{self.name} (e{self.exp_bits}m{self.man_bits}{kind}, bias {self.bias}, "
                f"max {self.max_finite:.6g}, overflow: {self.overflow})")


def _check_int(arg: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{arg} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{arg} must be between {lo} and {hi}, got {value}")


def _ieee(name: str, exp_bits: int, man_bits: int) -> FloatFormat:
    return FloatFormat(name, exp_bits, man_bits, (1 << (exp_bits - 1)) - 1, True, "inf")


def _fn(name: str, exp_bits: int, man_bits: int) -> FloatFormat:
    return FloatFormat(name, exp_bits, man_bits, (1 << (exp_bits - 1)) - 1, False, "saturate")


BF16 = _ieee("bf16", 8, 7)
FP16 = _ieee("fp16", 5, 10)
FP32 = _ieee("fp32", 8, 23)
FP64 = _ieee("fp64", 11, 52)
FP8_E4M3 = _fn("fp8_e4m3", 4, 3)
FP8_E5M2 = _ieee("fp8_e5m2", 5, 2)

_CANONICAL = {f.name: f for f in (BF16, FP16, FP32, FP64, FP8_E4M3, FP8_E5M2)}
FORMAT_NAMES: tuple[str, ...] = tuple(_CANONICAL)

_ALIASES = {
    "bf16": BF16, "bfloat16": BF16,
    "fp16": FP16, "float16": FP16, "half": FP16,
    "fp32": FP32, "float32": FP32, "single": FP32,
    "fp64": FP64, "float64": FP64, "double": FP64,
    "fp8_e4m3": FP8_E4M3, "fp8_e4m3fn": FP8_E4M3, "e4m3": FP8_E4M3, "e4m3fn": FP8_E4M3,
    "fp8_e5m2": FP8_E5M2, "e5m2": FP8_E5M2,
}

_DTYPE_FORMATS = {
    torch.bfloat16: BF16, torch.float16: FP16, torch.float32: FP32, torch.float64: FP64,
    torch.float8_e4m3fn: FP8_E4M3, torch.float8_e5m2: FP8_E5M2,
}
_TORCH_DTYPES = {f._layout(): dtype for dtype, f in _DTYPE_FORMATS.items()}
_BY_LAYOUT = {f._layout(): f for f in _CANONICAL.values()}

_CUSTOM = re.compile(r"e(\d+)m(\d+)(fn)?")


def get_format(fmt: FloatFormat | torch.dtype | str) -> FloatFormat:
    """Return the :class:`FloatFormat` for ``fmt``.

    ``fmt`` may be a FloatFormat (returned as is), a torch dtype (bfloat16, float16, float32,
    float64, float8_e4m3fn, float8_e5m2) or a case-insensitive name: one of the aliases
    ("bf16", "fp16", "half", "fp8_e4m3", ...), or a custom layout "eXmY" (IEEE-like with
    infinities, bias 2**(X-1)-1) or "eXmYfn" (finite-only, saturating), 2 <= X <= 11,
    0 <= Y <= 52 (Y >= 1 for fn). A custom layout equal to a named format returns that format
    (e.g. "e8m7" gives bf16).
    """
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, torch.dtype):
        return _from_dtype(fmt)
    if isinstance(fmt, str):
        return _from_name(fmt)
    raise TypeError(
        f"fmt must be a FloatFormat, a torch.dtype or a format name, got {fmt!r} "
        f"of type {type(fmt).__name__}")


def _from_dtype(dtype: torch.dtype) -> FloatFormat:
    try:
        return _DTYPE_FORMATS[dtype]
    except KeyError:
        accepted = ", ".join(str(d) for d in _DTYPE_FORMATS)
        raise ValueError(f"fmt: unsupported torch dtype {dtype}; accepted dtypes: {accepted}") from None


def _from_name(name: str) -> FloatFormat:
    key = name.strip().lower()
    if key in _ALIASES:
        return _ALIASES[key]
    match = _CUSTOM.fullmatch(key)
    if match is None:
        raise ValueError(
            f"fmt: unknown format name {name!r}; accepted names: {', '.join(_ALIASES)}, "
            "or a custom layout 'eXmY' (IEEE-like, with infinities) or 'eXmYfn' (finite-only, "
            "saturating) with 2 <= X <= 11 exponent bits and 0 <= Y <= 52 mantissa bits "
            "(Y >= 1 for fn), e.g. 'e8m4' or 'e3m2fn'")
    return _custom(name, int(match.group(1)), int(match.group(2)), match.group(3) is not None)


def _custom(name: str, exp_bits: int, man_bits: int, finite_only: bool) -> FloatFormat:
    if not _MIN_EXP_BITS <= exp_bits <= _MAX_EXP_BITS:
        raise ValueError(
            f"fmt: format {name!r} has {exp_bits} exponent bits; accepted: {_MIN_EXP_BITS} to "
            f"{_MAX_EXP_BITS} (the format must fit inside float64)")
    lo = 1 if finite_only else 0
    if not lo <= man_bits <= _MAX_MAN_BITS:
        raise ValueError(
            f"fmt: format {name!r} has {man_bits} mantissa bits; accepted: {lo} to {_MAX_MAN_BITS}"
            + (" (an fn format needs at least 1 mantissa bit)" if finite_only else "")
            + " (the format must fit inside float64)")
    label = f"e{exp_bits}m{man_bits}" + ("fn" if finite_only else "")
    try:
        fmt = (_fn if finite_only else _ieee)(label, exp_bits, man_bits)
    except ValueError as exc:
        raise ValueError(f"fmt: format {name!r} is not accepted: {exc}") from None
    return _BY_LAYOUT.get(fmt._layout(), fmt)
