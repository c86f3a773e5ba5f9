"""Rounding tensors to any :class:`~stableflash.numerics.formats.FloatFormat`, and bit patterns.

All work is done in float64 with exact operations (power-of-two scalings, integer rounding of
values below 2**53), so :func:`round_to` rounds *once*, correctly, from any input dtype. This is
where it differs from torch: torch's casts from float64 to a narrower format go through float32
and can round twice (``1 + 2**-8 + 2**-40`` in float64 casts to bfloat16 as 1.0, the correctly
rounded result is ``1 + 2**-7``). From float32, bfloat16 and float16 inputs the results agree with
torch's casts bit for bit.

Nearest-even rounding of float32 tensors takes a fast path where one exists (the emulated
attention rounds every tile, so this is its inner loop): torch's own cast for bf16, fp16 and the
two fp8 formats — proven equal to the exact algorithm from float32 — and an integer trick on the
bit pattern for custom formats with float32's exponent range (e8mY). Tests hold both fast paths
to the exact algorithm, ``_round_exact``, bit for bit.
"""
from __future__ import annotations

import torch

from stableflash.numerics.formats import BF16, FP8_E4M3, FP8_E5M2, FP16, FloatFormat, get_format

__all__ = ["ROUNDING_MODES", "round_to", "ulp", "encode", "decode"]

ROUNDING_MODES = ("rne", "rtz", "stochastic")

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_VALUE_DTYPES = _INPUT_DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)


# ----------------------------------------------------------------------------- helpers

def _pow2(n: torch.Tensor) -> torch.Tensor:
    """Exact 2**n in float64 for an int64 tensor n (subnormal powers included; n > 1023 gives
    inf, n < -1074 gives 0), built from the bit pattern."""
    normal = ((n.clamp(-1022, 1024) + 1023) << 52).view(torch.float64)
    sub = (torch.ones_like(n) << (n + 1074).clamp(0, 51)).view(torch.float64)
    zero = torch.zeros_like(normal)
    return torch.where(n >= -1022, normal, torch.where(n >= -1074, sub, zero))


def _exponent(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """For |x| values a (float64, finite), the exponent e of the binade holding a, clamped below
    at emin so that subnormals share emin's quantum. Zero gives emin."""
    _, e = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1); frexp(0) gives e = 0
    e = (e.to(torch.int64) - 1).clamp(min=fmt.emin)
    return torch.where(a == 0, torch.full_like(e, fmt.emin), e)


def _quantum(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Spacing of fmt at each finite magnitude a (float64): 2**(e - man_bits)."""
    return _pow2(_exponent(a, fmt) - fmt.man_bits)


def _check_tensor(arg: str, x: object, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        accepted = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{arg} has dtype {x.dtype}; accepted dtypes: {accepted}")
    return x


def _check_fits(fmt: FloatFormat, dtype: torch.dtype) -> None:
    """Every value of fmt must be a value of dtype, so that results can be returned in dtype."""
    host = get_format(dtype)
    fits = (fmt.man_bits <= host.man_bits and fmt.exp_bits <= host.exp_bits
            and fmt.max_finite <= host.max_finite and fmt.min_subnormal >= host.min_subnormal)
    if not fits:
        raise ValueError(
            f"fmt {fmt.name!r} (e{fmt.exp_bits}m{fmt.man_bits}, max {fmt.max_finite:g}) does not "
            f"fit inside x's dtype {dtype} ({host.name}): its values could not be returned in "
            "that dtype; cast x to torch.float32 or torch.float64 first")


# ----------------------------------------------------------------------------- round_to

def round_to(x: torch.Tensor, fmt: FloatFormat | torch.dtype | str, mode: str = "rne", *,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Round every element of ``x`` to the nearest value of ``fmt`` by ``mode``.

    Returns a tensor of x's dtype and shape whose values are exactly representable in fmt.
    The rounding is a single, correct rounding of x's exact value, whatever x's dtype (torch's own
    casts from float64 round twice, through float32; this does not). From float32 inputs the
    results equal torch's casts to bfloat16, float16, float8_e4m3fn and float8_e5m2 bit for bit,
    except that float8_e4m3fn overflow saturates here on every device and torch version (torch 2.11
    casts it to NaN on CPU and CUDA).

    Modes: ``"rne"`` round to nearest, ties to even; ``"rtz"`` toward zero; ``"stochastic"``
    rounds up with probability equal to the distance to the lower neighbour in units of the
    quantum (uniform draws from ``generator``), so it is unbiased.

    Overflow: in "rne" and "stochastic", a result above ``fmt.max_finite`` becomes +-inf for
    formats with ``overflow="inf"`` and +-max_finite for saturating ones. "rtz" never turns a
    finite input into inf; it clamps at +-max_finite. Infinite inputs stay infinite in formats
    with infinities and become +-max_finite in finite-only formats (as torch's float8_e4m3fn cast
    does). NaN stays NaN; signed zeros are kept (-tiny rounds to -0.0).

    Raises TypeError if x is not a float16/bfloat16/float32/float64 tensor, and ValueError for an
    unknown mode or a format that does not fit inside x's dtype.
    """
    _check_tensor("x", x, _INPUT_DTYPES)
    fmt = get_format(fmt)
    if mode not in ROUNDING_MODES:
        raise ValueError(f"mode must be one of {ROUNDING_MODES}, got {mode!r}")
    _check_fits(fmt, x.dtype)
    if mode == "rne" and x.dtype == torch.float32:
        if fmt in _TORCH_CASTS:
            y = x.to(_TORCH_CASTS[fmt]).to(torch.float32)
            if fmt.overflow == "saturate":       # torch 2.11's float8_e4m3fn cast: overflow → NaN
                y = torch.where(torch.isnan(y) & ~torch.isnan(x), torch.copysign(torch.tensor(
                    fmt.max_finite, device=x.device), x), y)
            return y
        if fmt.exp_bits == 8 and fmt.bias == 127 and fmt.has_inf and fmt.overflow == "inf" and fmt.man_bits < 23:
            return _rne_e8_fp32(x, fmt.man_bits)
    return _round_exact(x, fmt, mode, generator)


# float32 → these formats by torch's cast is the correctly rounded result (tests/numerics)
_TORCH_CASTS = {BF16: torch.bfloat16, FP16: torch.float16, FP8_E4M3: torch.float8_e4m3fn, FP8_E5M2: torch.float8_e5m2}


def _rne_e8_fp32(x: torch.Tensor, man_bits: int) -> torch.Tensor:
    """float32 x rounded to nearest-even with ``man_bits`` mantissa bits and float32's exponent
    range, on the bit pattern: add half a quantum minus one plus the kept last bit, clear the
    dropped bits. A carry out of the mantissa raises the exponent (to inf past the largest
    binade); subnormals round on the same bit positions, which is their quantum 2^(−126−m)."""
    drop = 23 - man_bits
    bits = x.contiguous().view(torch.int32)
    up = bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)
    out = (up & -(1 << drop)).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)


def _round_exact(x: torch.Tensor, fmt: FloatFormat, mode: str,
                 generator: torch.Generator | None) -> torch.Tensor:
    """The general algorithm: float64, power-of-two scaling, one integer rounding."""
    x64 = x.to(torch.float64)
    a = x64.abs()
    finite = torch.isfinite(a)
    a_fin = torch.where(finite, a, torch.zeros_like(a))
    q = _quantum(a_fin, fmt)
    y = a_fin / q  # exact: y < 2**(man_bits + 1) <= 2**53, q is a power of two
    r = _round_integer(y, mode, generator)
    mag = r * q
    mag = _handle_overflow(mag, a, finite, fmt, mode)
    out = torch.copysign(mag, x64)
    out = torch.where(torch.isnan(x64), x64, out)
    return out.to(x.dtype)


def _round_integer(y: torch.Tensor, mode: str, generator: torch.Generator | None) -> torch.Tensor:
    """Round nonnegative float64 values y to integers by mode."""
    if mode == "rne":
        return torch.round(y)  # half to even
    if mode == "rtz":
        return torch.trunc(y)
    low = torch.floor(y)
    u = torch.rand(y.shape, generator=generator, dtype=torch.float64, device=y.device)
    return low + (u < (y - low)).to(torch.float64)


def _handle_overflow(mag: torch.Tensor, a: torch.Tensor, finite: torch.Tensor, fmt: FloatFormat,
                     mode: str) -> torch.Tensor:
    """Apply fmt's overflow rule to rounded magnitudes and put infinities back."""
    big = torch.tensor(fmt.max_finite, dtype=torch.float64, device=mag.device)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=mag.device)
    over = mag > big
    if mode == "rtz" or fmt.overflow == "saturate":
        mag = torch.where(over, big, mag)
    else:
        mag = torch.where(over, inf, mag)
    special = big if not fmt.has_inf else inf
    return torch.where(finite, mag, torch.where(torch.isinf(a), special, a))


# ----------------------------------------------------------------------------- ulp

def ulp(x: torch.Tensor, fmt: FloatFormat | torch.dtype | str) -> torch.Tensor:
    """The spacing of fmt at |x|, as float64: 2**(e - man_bits) for |x| in [2**e, 2**(e+1)) with
    e >= emin, ``fmt.min_subnormal`` below ``fmt.min_normal`` (0 included), NaN for inf and NaN.
    Magnitudes above fmt's range get the spacing the binade would have."""
    _check_tensor("x", x, _VALUE_DTYPES)
    fmt = get_format(fmt)
    a = x.to(torch.float64).abs()
    finite = torch.isfinite(a)
    q = _quantum(torch.where(finite, a, torch.zeros_like(a)), fmt)
    return torch.where(finite, q, torch.full_like(q, float("nan")))


# ----------------------------------------------------------------------------- encode / decode

def encode(x: torch.Tensor, fmt: FloatFormat | torch.dtype | str) -> torch.Tensor:
    """Bit patterns (int64) of the values of x in fmt; x must already be representable in fmt.

    Patterns are sign | biased exponent | mantissa, as nonnegative integers below 2**fmt.bits
    (for 64-bit formats, the pattern read as a signed int64, like ``x.view(torch.int64)``).
    NaN encodes as the canonical NaN: for IEEE-like formats the all-ones exponent with the top
    mantissa bit set, for fn formats all ones (sign bit from x).

    Raises ValueError naming how many elements are not representable, and the first of them.
    """
    _check_tensor("x", x, _VALUE_DTYPES)
    fmt = get_format(fmt)
    x64 = x.to(torch.float64)
    _check_representable(x64, fmt)

    a = x64.abs()
    finite = torch.isfinite(a)
    a_fin = torch.where(finite, a, torch.zeros_like(a))
    e = _exponent(a_fin, fmt)
    y = (a_fin / _pow2(e - fmt.man_bits)).to(torch.int64)  # significand with hidden bit
    hidden = 1 << fmt.man_bits
    normal = y >= hidden
    biased = torch.where(normal, e + fmt.bias, torch.zeros_like(e))
    man = torch.where(normal, y - hidden, y)

    top = (1 << fmt.exp_bits) - 1
    nan_man = (1 << fmt.man_bits) - 1 if not fmt.has_inf else (1 << max(fmt.man_bits - 1, 0))
    is_inf = torch.isinf(a)
    is_nan = torch.isnan(a)
    biased = torch.where(is_inf | is_nan, torch.full_like(biased, top), biased)
    man = torch.where(is_inf, torch.zeros_like(man), man)
    man = torch.where(is_nan, torch.full_like(man, nan_man), man)

    sign = torch.signbit(x64).to(torch.int64)
    return (sign << (fmt.exp_bits + fmt.man_bits)) | (biased << fmt.man_bits) | man


def _check_representable(x64: torch.Tensor, fmt: FloatFormat) -> None:
    """Raise ValueError unless every element of x64 is a value of fmt."""
    nan = torch.isnan(x64)
    inf = torch.isinf(x64)
    a = torch.where(nan | inf, torch.zeros_like(x64), x64.abs())
    y = a / _quantum(a, fmt)  # exact; an integer iff a has at most man_bits fraction bits
    ok = (a <= fmt.max_finite) & (y == torch.floor(y))
    ok = torch.where(inf, torch.full_like(ok, fmt.has_inf), ok)
    if fmt.man_bits > 0 or not fmt.has_inf:
        ok |= nan
    bad = ~ok
    count = int(bad.sum())
    if count:
        first = x64.reshape(-1)[bad.reshape(-1)][0].item()
        raise ValueError(
            f"x: {count} of {x64.numel()} elements are not representable in {fmt.name}, the first "
            f"is {first!r}; round them first with round_to(x, {fmt.name!r})")


def decode(bits: torch.Tensor, fmt: FloatFormat | torch.dtype | str) -> torch.Tensor:
    """Values (float64) of the bit patterns ``bits`` (an integer tensor) in fmt; the inverse of
    :func:`encode`. Patterns must lie in [0, 2**fmt.bits) (any int64 for 64-bit formats)."""
    if not isinstance(bits, torch.Tensor):
        raise TypeError(f"bits must be a torch.Tensor, got {type(bits).__name__}")
    if bits.dtype.is_floating_point or bits.dtype.is_complex or bits.dtype == torch.bool:
        raise TypeError(f"bits must be an integer tensor, got dtype {bits.dtype}")
    fmt = get_format(fmt)
    b = bits.to(torch.int64)
    if fmt.bits < 64 and b.numel() and (int(b.min()) < 0 or int(b.max()) >= 1 << fmt.bits):
        raise ValueError(
            f"bits must lie in [0, 2**{fmt.bits}) for {fmt.name}, got values from {int(b.min())} "
            f"to {int(b.max())}")

    man_mask = (1 << fmt.man_bits) - 1
    top = (1 << fmt.exp_bits) - 1
    sign = (b >> (fmt.exp_bits + fmt.man_bits)) & 1
    biased = (b >> fmt.man_bits) & top
    man = b & man_mask

    sub = biased == 0
    significand = torch.where(sub, man, man + (1 << fmt.man_bits)).to(torch.float64)
    exp = torch.where(sub, torch.full_like(biased, fmt.emin), biased - fmt.bias)
    value = significand * _pow2(exp - fmt.man_bits)
    value = _decode_specials(value, biased, man, fmt)
    return torch.where(sign == 1, -value, value)


def _decode_specials(value: torch.Tensor, biased: torch.Tensor, man: torch.Tensor,
                     fmt: FloatFormat) -> torch.Tensor:
    top = (1 << fmt.exp_bits) - 1
    nan = torch.full_like(value, float("nan"))
    if fmt.has_inf:
        value = torch.where((biased == top) & (man == 0), torch.full_like(value, float("inf")), value)
        return torch.where((biased == top) & (man != 0), nan, value)
    return torch.where((biased == top) & (man == (1 << fmt.man_bits) - 1), nan, value)
