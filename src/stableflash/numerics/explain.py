"""The trace of one floating-point addition, bit by bit.

:func:`explain_add` models ``a + b`` as hardware computes it: both operands are represented in an
accumulator format, the smaller one's significand is shifted right to align the exponents, the
significands are added (or subtracted), the sum is normalised, rounded to the accumulator's
precision, and finally stored in a narrower format with round to nearest, ties to even, through
the guard, round and sticky bits. Every step is exact arithmetic on :class:`fractions.Fraction`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction

from stableflash.numerics.formats import FloatFormat, get_format

__all__ = ["AddTrace", "explain_add"]

_REST_LIMIT = 32   # bits shown after the round bit before "..."
_ALIGN_LIMIT = 56  # fraction bits shown in the alignment lines before "..."
_INDENT = "   "


# ----------------------------------------------------------------------------- exact helpers

def _p2(k: int) -> Fraction:
    """2**k as a Fraction (k may be negative)."""
    return Fraction(1 << k) if k >= 0 else Fraction(1, 1 << -k)


def _floor_log2(a: Fraction) -> int:
    """floor(log2(a)) for a > 0."""
    k = a.numerator.bit_length() - a.denominator.bit_length()
    return k - 1 if _p2(k) > a else k


def _to_float(v: Fraction) -> float:
    """Nearest float to v (correctly rounded), +-inf beyond float64's range."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def _frac_bits(sig: Fraction, n: int) -> str:
    """The first n bits after the binary point of sig >= 0."""
    if n <= 0:
        return ""
    frac = sig - math.floor(sig)
    return format(math.floor(frac * (1 << n)), f"0{n}b")


def _bits_after(sig: Fraction, n: int) -> int:
    """How many bits the exact binary expansion of sig has after its first n fraction bits."""
    total = sig.denominator.bit_length() - 1  # sig is dyadic: denominator is a power of two
    return max(total - n, 0)


def _fixed(sig: Fraction, n: int, int_width: int = 2) -> str:
    """sig >= 0 as an aligned binary fixed-point string with n fraction bits ("..." if cut)."""
    text = format(math.floor(sig), "b").rjust(int_width) + "." + _frac_bits(sig, n)
    return text + ("..." if _bits_after(sig, n) else "")


# ----------------------------------------------------------------------------- rounding model

@dataclass
class _Rounded:
    """Round to nearest even of one exact magnitude into a format, with every intermediate."""

    exp: int          # exponent of the binade (>= emin): value = sig * 2**exp
    sig: Fraction     # |v| / 2**exp, in [0, 2)
    kept: int         # floor(sig * 2**M): the significand bits kept, hidden bit included
    guard: int
    round: int
    sticky: int
    up: bool
    carry: bool       # rounding up carried out of the significand: exponent + 1
    overflow: str | None  # None, "inf" or "saturate"
    magnitude: Fraction | None  # the rounded magnitude; None when it overflowed to inf

    @property
    def exact(self) -> bool:
        return not (self.guard or self.round or self.sticky) and self.overflow is None


def _round_nearest_even(a: Fraction, fmt: FloatFormat) -> _Rounded:
    """Round the exact magnitude a >= 0 to fmt (round to nearest, ties to even)."""
    m = fmt.man_bits
    exp = max(_floor_log2(a), fmt.emin) if a else fmt.emin
    sig = a / _p2(exp)
    scaled = sig * (1 << m)
    kept = math.floor(scaled)
    rest = (scaled - kept) * 2
    guard = int(rest >= 1)
    rest = (rest - guard) * 2
    rnd = int(rest >= 1)
    sticky = int(rest - rnd != 0)
    up = bool(guard and (rnd or sticky or kept & 1))
    n, out_exp = kept + up, exp
    carry = n == 1 << (m + 1)
    if carry:
        n, out_exp = n >> 1, exp + 1
    magnitude: Fraction | None = n * _p2(out_exp - m)
    overflow = None
    if magnitude > Fraction(fmt.max_finite):
        overflow = fmt.overflow
        magnitude = Fraction(fmt.max_finite) if overflow == "saturate" else None
    return _Rounded(exp, sig, kept, guard, rnd, sticky, up, carry, overflow, magnitude)


def _round_value(v: float, fmt: FloatFormat) -> tuple[float, _Rounded | None]:
    """Round a float (any value) to fmt; returns the float result and the rounding record
    (None for inf and NaN, which are not rounded)."""
    if math.isnan(v):
        return v, None
    if math.isinf(v):
        return (v if fmt.has_inf else math.copysign(fmt.max_finite, v)), None
    r = _round_nearest_even(abs(Fraction(v)), fmt)
    mag = math.inf if r.magnitude is None else float(r.magnitude)
    return math.copysign(mag, v), r


def _pattern(v: float, fmt: FloatFormat) -> tuple[str, str, str]:
    """Sign, exponent and mantissa bit strings of a value of fmt (NaN gets the canonical NaN)."""
    sign = "1" if math.copysign(1.0, v) < 0 else "0"
    top = (1 << fmt.exp_bits) - 1
    if math.isnan(v):
        man = (1 << fmt.man_bits) - 1 if not fmt.has_inf else 1 << max(fmt.man_bits - 1, 0)
        biased = top
    elif math.isinf(v):
        biased, man = top, 0
    else:
        a = abs(Fraction(v))
        exp = max(_floor_log2(a), fmt.emin) if a else fmt.emin
        n = int(a / _p2(exp - fmt.man_bits))
        normal = n >> fmt.man_bits
        biased = exp + fmt.bias if normal else 0
        man = n - (1 << fmt.man_bits) if normal else n
    exp_str = format(biased, f"0{fmt.exp_bits}b")
    man_str = format(man, f"0{fmt.man_bits}b") if fmt.man_bits else ""
    return sign, exp_str, man_str


def _ulp_at(a: Fraction, fmt: FloatFormat) -> Fraction:
    """Spacing of fmt at the magnitude a."""
    exp = max(_floor_log2(a), fmt.emin) if a else fmt.emin
    return _p2(exp - fmt.man_bits)


def _decision(r: _Rounded) -> str:
    """The round-to-nearest-even decision in words, with the overflow that followed, if any."""
    if not (r.guard or r.round or r.sticky):
        text = "exact (nothing dropped)"
    else:
        text = "round up (magnitude)" if r.up else "round down (truncate)"
    if r.overflow == "inf":
        text += ", overflow to inf"
    elif r.overflow == "saturate":
        text += ", saturated to the largest finite value"
    return text


# ----------------------------------------------------------------------------- the trace

@dataclass
class AddTrace:
    """Everything :func:`explain_add` found; ``str(trace)`` is the step-by-step text."""

    a: float
    b: float
    fmt: str
    acc: str
    a_acc: float          # a as represented in acc
    b_acc: float
    exact: float          # the exact a + b (nearest float)
    acc_result: float     # the sum rounded to acc
    result: float         # the sum stored in fmt
    bits: str             # result's bit pattern in fmt: sign | exponent | mantissa
    error: float          # result - exact (exact difference, nearest float)
    error_ulps: float     # error in ulps of fmt at |exact|
    guard: int            # of the store into fmt
    round: int
    sticky: int
    decision: str
    acc_exact: bool       # the sum was exact in acc
    store_exact: bool     # the store into fmt dropped nothing
    overflow: str | None  # None, or "inf"/"saturate" if the store overflowed fmt
    a_hex: str
    b_hex: str
    a_bits: str           # operands' bit patterns in acc
    b_bits: str
    acc_bits: str         # acc_result's bit pattern in acc
    result_hex: str
    exponent_difference: int | None
    normalisation_shift: int | None  # +1: right by one (carry out); -k: left by k
    steps: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(self.steps)

    def to_dict(self) -> dict:
        """A JSON-serialisable dict of every field (non-finite floats stay floats)."""
        return asdict(self)


class _Builder:
    """Collects the lines of the trace and the numbers found along the way."""

    def __init__(self, a: float, b: float, fmt: FloatFormat, acc: FloatFormat) -> None:
        self.a, self.b, self.fmt, self.acc = a, b, fmt, acc
        self.lines: list[str] = []
        self.number = 0
        self.info: dict = {"exponent_difference": None, "normalisation_shift": None}

    def say(self, text: str) -> None:
        """An indented line under the current step."""
        self.lines.append(_INDENT + text)

    def step(self, title: str) -> None:
        """A numbered step heading."""
        self.number += 1
        self.lines.append(f"{self.number}. {title}")


def explain_add(a: float | str, b: float | str, fmt: FloatFormat | str = "bf16",
                acc: FloatFormat | str = "fp32") -> AddTrace:
    """Trace ``a + b`` computed in the accumulator format ``acc`` and stored in ``fmt``.

    Each operand (anything float() accepts) is first represented in acc (rounded there to nearest
    even if it is not exactly representable, and the trace says so). The exact sum of the acc
    operands is formed by aligning the smaller operand's significand, adding or subtracting, and
    normalising; it is rounded to acc, then stored in fmt with round to nearest, ties to even.
    ``exact`` is the exact a + b of the operands as given; ``error = result - exact``.
    """
    a_f, b_f = _number("a", a), _number("b", b)
    fmt_f, acc_f = _format("fmt", fmt), _format("acc", acc)
    tb = _Builder(a_f, b_f, fmt_f, acc_f)
    tb.lines.append(f"a + b computed in {_describe(acc_f)}, stored in {_describe(fmt_f)}, "
                    "round to nearest, ties to even")

    a_acc = _operand(tb, "a", a_f)
    b_acc = _operand(tb, "b", b_f)
    if all(map(math.isfinite, (a_acc, b_acc))):
        acc_result, acc_exact = _finite_sum(tb, a_acc, b_acc)
    else:
        acc_result, acc_exact = _special_sum(tb, a_acc, b_acc)
    result, store = _store(tb, acc_result)
    return _finish(tb, a_acc, b_acc, acc_result, acc_exact, result, store)


def _number(arg: str, value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{arg} must be a number (anything float() accepts), got {value!r}") from None


def _format(arg: str, value: object) -> FloatFormat:
    """get_format, with errors naming explain_add's argument."""
    try:
        return get_format(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{arg}: {str(exc).removeprefix('fmt: ')}") from None


def _describe(f: FloatFormat) -> str:
    return f"{f.name} (e{f.exp_bits}m{f.man_bits}{'' if f.has_inf else 'fn'})"


def _pattern_str(v: float, f: FloatFormat) -> str:
    return "|".join(p for p in _pattern(v, f) if p)


def _operand(tb: _Builder, label: str, x: float) -> float:
    """Represent operand x in acc; one or two lines of trace."""
    if label == "a":
        tb.step(f"Operands in {tb.acc.name} (sign|exponent|mantissa)")
    v, r = _round_value(x, tb.acc)
    if v == x or (math.isnan(x) and math.isnan(v)):
        note = f"exact in {tb.acc.name}"
    elif r is not None and r.overflow == "inf":
        note = f"overflows {tb.acc.name}: becomes {v!r}"
    elif r is not None and r.overflow == "saturate":
        note = f"overflows {tb.acc.name}: saturates to {v!r}"
    elif math.isinf(x):
        note = f"{tb.acc.name} has no infinity: saturates to {v!r}"
    else:
        note = f"not exact in {tb.acc.name}: rounded to nearest even, {v!r}"
    line = f"{label} = {x!r:<22} = {_pattern_str(v, tb.acc)}"
    if len(line) + len(note) < 100:
        tb.say(f"{line}  {note}")
    else:
        tb.say(line)
        tb.say(f"    {note}")
    return v


def _significand(v: float, f: FloatFormat) -> tuple[int, Fraction]:
    """Exponent (>= emin) and significand in [0, 2) of a finite nonzero float in f."""
    a = abs(Fraction(v))
    exp = max(_floor_log2(a), f.emin)
    return exp, a / _p2(exp)


def _finite_sum(tb: _Builder, a: float, b: float) -> tuple[float, bool]:
    """Align, add, normalise and round to acc; returns the acc result and whether it was exact."""
    acc = tb.acc
    if a == 0 or b == 0:
        return _sum_with_zero(tb, a, b)
    (ea, sa), (eb, sb) = _significand(a, acc), _significand(b, acc)
    big_first = abs(a) >= abs(b)
    (e1, s1, v1, n1), (e2, s2, v2, n2) = (((ea, sa, a, "a"), (eb, sb, b, "b")) if big_first
                                          else ((eb, sb, b, "b"), (ea, sa, a, "a")))
    d = e1 - e2
    tb.info["exponent_difference"] = d
    width = min(acc.man_bits + d, max(_ALIGN_LIMIT, acc.man_bits + 3))
    sign = "-" if v1 < 0 else "+"
    tb.step(f"Align exponents ({n2} has the smaller magnitude)")
    tb.say(f"{n1} = {_signed(v1)}{_fixed(s1, acc.man_bits, 1)} x 2^{e1}")
    tb.say(f"{n2} = {_signed(v2)}{_fixed(s2, acc.man_bits, 1)} x 2^{e2}")
    tb.say(f"exponent difference {e1} - {e2 if e2 >= 0 else f'({e2})'} = {d}: {n2}'s "
           f"significand is shifted right by "
           f"{d} bit{'s' if d != 1 else ''}")
    same = (v1 < 0) == (v2 < 0)
    aligned = s2 / _p2(d)
    total = s1 + aligned if same else s1 - aligned
    tb.say(f"    {_fixed(s1, width)}   |{n1}|")
    tb.say(f"{'+' if same else '-'}   {_fixed(aligned, width)}   |{n2}| >> {d}")
    tb.say(("same signs: the magnitudes add" if same else
            "opposite signs: the smaller magnitude is subtracted") + f", the sign is {sign}")
    exact_sum = (-1 if v1 < 0 else 1) * total * _p2(e1)
    tb.step("Exact significand " + ("sum" if same else "difference"))
    tb.say(f"=   {_fixed(total, width + 1)}   x 2^{e1} = {_to_float(exact_sum)!r}")
    if total == 0:
        tb.say("exact cancellation: the sum is +0 (round to nearest gives +0 for x + (-x))")
        tb.info["normalisation_shift"] = 0
        tb.step(f"Round to {acc.name}: nothing to round; the {acc.name} sum is 0.0")
        return 0.0, True
    return _normalise_and_round(tb, exact_sum, e1, width + 1)


def _signed(v: float) -> str:
    return "-" if math.copysign(1.0, v) < 0 else ""


def _sum_with_zero(tb: _Builder, a: float, b: float) -> tuple[float, bool]:
    tb.info["exponent_difference"] = None
    if a == 0 and b == 0:
        both_neg = _signed(a) == "-" and _signed(b) == "-"
        s = -0.0 if both_neg else 0.0
        tb.step("Both operands are zero: nothing to align or add")
        tb.say(f"the sum is {s!r} ({'both are -0' if both_neg else 'round to nearest gives +0'})")
        tb.info["normalisation_shift"] = 0
        return s, True
    other, name = (b, "b") if a == 0 else (a, "a")
    zero = "a" if a == 0 else "b"
    tb.step(f"{zero} is zero: nothing to align or add; the sum is {name} = {other!r} exactly")
    tb.info["normalisation_shift"] = 0
    return other, True


def _normalise_and_round(tb: _Builder, exact_sum: Fraction, e1: int, width: int) -> tuple[float, bool]:
    acc = tb.acc
    r = _round_nearest_even(abs(exact_sum), acc)
    shift = r.exp - e1
    tb.info["normalisation_shift"] = shift
    if shift > 0:
        what = f"carry out: shift right by 1, exponent {e1} -> {r.exp}"
    elif shift < 0:
        what = f"cancellation: shift left by {-shift}, exponent {e1} -> {r.exp}"
    else:
        what = "no shift needed"
    if r.sig < 1:
        what += f" (the sum is subnormal in {acc.name}: the exponent cannot go below {acc.emin})"
    tb.step(f"Normalise: {what}")
    tb.say(f"    {_fixed(r.sig, max(width + shift, acc.man_bits))}   x 2^{r.exp}")
    tb.step(f"Round to {acc.name}: keep {acc.man_bits} fraction bits | guard | round | sticky")
    _rounding_lines(tb, r, acc)
    value = _rounded_float(r, exact_sum < 0, acc)
    if r.exact:
        tb.say(f"exact: nothing dropped; the {acc.name} sum is {value!r}")
    elif r.overflow:
        tb.say(f"overflow: the {acc.name} sum is {value!r} (not exact)")
    else:
        tb.say(f"{_decision(r)}: the {acc.name} sum is {value!r} (not exact)")
    return value, r.exact


def _rounded_float(r: _Rounded, negative: bool, f: FloatFormat) -> float:
    mag = math.inf if r.magnitude is None else float(r.magnitude)
    return -mag if negative else mag


def _rounding_lines(tb: _Builder, r: _Rounded, f: FloatFormat) -> None:
    """Kept bits | G | R | rest, the RNE decision, carry and overflow."""
    m = f.man_bits
    rest_bits = _bits_after(r.sig, m + 2)
    rest = _frac_bits(r.sig * (1 << (m + 2)), min(rest_bits, _REST_LIMIT))
    rest += "..." if rest_bits > _REST_LIMIT else ""
    kept = format(math.floor(r.sig), "b").rjust(2) + "." + _frac_bits(r.sig, m)
    tb.say(f"    {kept} | {r.guard} | {r.round} | {rest or '0'}")
    lsb = r.kept & 1
    tb.say(f"guard {r.guard}, round {r.round}, sticky {r.sticky} (OR of the {rest_bits} bits after "
           f"the round bit), kept LSB {lsb}")
    if r.guard or r.round or r.sticky:
        tb.say(f"round to nearest even: up if G and (R or S or LSB) = {r.guard} and "
               f"({r.round} or {r.sticky} or {lsb}) -> {_decision(r)}")
    if r.carry:
        tb.say(f"the carry ripples out of the significand: 10.{'0' * m} -> 1.{'0' * m}, "
               f"exponent {r.exp} -> {r.exp + 1}")
    if r.overflow == "inf":
        tb.say(f"the rounded magnitude exceeds {f.name}'s largest finite value {f.max_finite!r}: "
               "overflow to inf")
    elif r.overflow == "saturate":
        tb.say(f"the rounded magnitude exceeds {f.name}'s largest finite value {f.max_finite!r}: "
               "saturates to it")


def _special_sum(tb: _Builder, a: float, b: float) -> tuple[float, bool]:
    """Sums with an infinite or NaN operand: IEEE rules, nothing to align."""
    s = a + b
    tb.step("Special operand (inf or NaN): no alignment or rounding")
    if math.isnan(a) or math.isnan(b):
        why = "a NaN operand gives NaN"
    elif math.isnan(s):
        why = "inf + (-inf) is invalid: NaN"
    else:
        why = "inf plus a finite value (or the same inf) is that inf"
    tb.say(f"{why}; the {tb.acc.name} sum is {s!r}")
    tb.info["normalisation_shift"] = None
    return s, True


def _store(tb: _Builder, v: float) -> tuple[float, _Rounded | None]:
    """Store the acc result v into fmt, with the guard/round/sticky trace."""
    fmt = tb.fmt
    tb.step(f"Store in {fmt.name}: keep {fmt.man_bits} fraction bits | guard | round | sticky")
    if not math.isfinite(v):
        out, _ = _round_value(v, fmt)
        note = "stays" if (math.isnan(v) or fmt.has_inf) else f"has no infinity in {fmt.name}: saturates to"
        tb.say(f"{v!r} {note} {out!r}")
        return out, None
    if v == 0:
        tb.say(f"zero is stored exactly: {v!r}")
        return v, None
    r = _round_nearest_even(abs(Fraction(v)), fmt)
    shown = max(_bits_after(r.sig, 0), tb.acc.man_bits, fmt.man_bits)
    sign = "negative" if v < 0 else "positive"
    tb.say(f"    {_fixed(r.sig, shown)}   x 2^{r.exp}   the {tb.acc.name} sum ({sign})"
           + (f", subnormal in {fmt.name}" if r.sig < 1 else ""))
    _rounding_lines(tb, r, fmt)
    out = _rounded_float(r, v < 0, fmt)
    if out == 0:
        out = math.copysign(0.0, v)
        tb.say(f"the value rounds to zero in {fmt.name}: underflow to {out!r}")
    elif r.magnitude is not None:
        n = r.magnitude / _p2(r.exp + r.carry)
        tb.say(f"    {_fixed(n, fmt.man_bits)}   x 2^{r.exp + r.carry} = {out!r}")
    return out, r


def _same(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))


def _finish(tb: _Builder, a_acc: float, b_acc: float, acc_result: float, acc_exact: bool,
            result: float, store: _Rounded | None) -> AddTrace:
    fmt, acc = tb.fmt, tb.acc
    exact_fr = (Fraction(tb.a) + Fraction(tb.b)
                if math.isfinite(tb.a) and math.isfinite(tb.b) else None)
    exact = _to_float(exact_fr) if exact_fr is not None else tb.a + tb.b
    if exact_fr is not None and math.isfinite(result):
        error = _to_float(Fraction(result) - exact_fr)
        error_ulps = _to_float((Fraction(result) - exact_fr) / _ulp_at(abs(exact_fr), fmt))
    elif exact_fr is not None:  # a finite sum stored as inf (or NaN)
        error = error_ulps = result
    else:  # an operand was inf or NaN: no exact value to compare with
        error = error_ulps = result - exact
    bits = "".join(_pattern(result, fmt))
    tb.step(f"Result in {fmt.name}: {result!r} = {_pattern_str(result, fmt)} (bits {bits})")
    tb.say(f"exact a + b = {exact!r}; error = stored - exact = {error!r} "
           f"({error_ulps:.3g} ulp of {fmt.name})")
    if not (_same(a_acc, tb.a) and _same(b_acc, tb.b)):
        tb.say(f"(the operands were rounded into {acc.name} first, so the {acc.name} sum is of "
               "the rounded operands)")
    guard, rnd, sticky = (store.guard, store.round, store.sticky) if store else (0, 0, 0)
    decision = _decision(store) if store else "exact (nothing dropped)"
    if store is None and not math.isfinite(acc_result):
        decision = f"special value: {acc_result!r} stored as {result!r} (no rounding)"
    return AddTrace(
        a=tb.a, b=tb.b, fmt=fmt.name, acc=acc.name, a_acc=a_acc, b_acc=b_acc,
        exact=exact, acc_result=acc_result, result=result, bits=bits, error=error,
        error_ulps=error_ulps, guard=guard, round=rnd, sticky=sticky, decision=decision,
        acc_exact=acc_exact, store_exact=store.exact if store else _same(result, acc_result),
        overflow=store.overflow if store else None,
        a_hex=tb.a.hex(), b_hex=tb.b.hex(),
        a_bits="".join(_pattern(a_acc, acc)), b_bits="".join(_pattern(b_acc, acc)),
        acc_bits="".join(_pattern(acc_result, acc)), result_hex=result.hex(),
        exponent_difference=tb.info["exponent_difference"],
        normalisation_shift=tb.info["normalisation_shift"],
        steps=list(tb.lines),
    )
