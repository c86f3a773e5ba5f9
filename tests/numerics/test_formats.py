"""FloatFormat properties against torch.finfo and hand-computed values; name parsing."""
import math

import pytest
import torch

from stableflash.numerics import FORMAT_NAMES, FloatFormat, get_format

TORCH_FORMATS = [
    ("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32),
    ("fp64", torch.float64), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2),
]


@pytest.mark.parametrize("name,dtype", TORCH_FORMATS)
def test_properties_match_torch_finfo(name, dtype):
    fmt = get_format(name)
    info = torch.finfo(dtype)
    assert fmt.bits == info.bits
    assert fmt.max_finite == info.max
    assert fmt.min_normal == info.tiny == info.smallest_normal
    assert fmt.eps == info.eps
    # torch.finfo has no smallest_subnormal in this version: it is tiny * eps
    assert fmt.min_subnormal == info.tiny * info.eps
    assert fmt.torch_dtype is dtype


@pytest.mark.parametrize("name,dtype", TORCH_FORMATS)
def test_min_subnormal_and_max_are_torch_values(name, dtype):
    """The smallest subnormal is nonzero in the dtype and half of it rounds to zero there;
    the largest finite value is a fixed point of the cast."""
    fmt = get_format(name)
    if dtype is torch.float64:
        assert math.ulp(0.0) == fmt.min_subnormal
        return
    x = torch.tensor([fmt.min_subnormal, fmt.min_subnormal / 2, fmt.max_finite], dtype=torch.float64)
    y = x.to(torch.float32).to(dtype).to(torch.float64) if dtype is not torch.float32 else x.float().double()
    assert y.tolist() == [fmt.min_subnormal, 0.0, fmt.max_finite]


@pytest.mark.parametrize("name,exp_bits,man_bits,bias,has_inf", [
    ("bf16", 8, 7, 127, True), ("fp16", 5, 10, 15, True), ("fp32", 8, 23, 127, True),
    ("fp64", 11, 52, 1023, True), ("fp8_e4m3", 4, 3, 7, False), ("fp8_e5m2", 5, 2, 15, True),
])
def test_layouts(name, exp_bits, man_bits, bias, has_inf):
    fmt = get_format(name)
    assert (fmt.name, fmt.exp_bits, fmt.man_bits, fmt.bias, fmt.has_inf) == (
        name, exp_bits, man_bits, bias, has_inf)
    assert fmt.overflow == ("inf" if has_inf else "saturate")


def test_fp8_e4m3_hand_values():
    fmt = get_format("fp8_e4m3")
    assert (fmt.emin, fmt.emax) == (-6, 8)
    assert fmt.max_finite == 448.0
    assert fmt.min_normal == 2.0 ** -6
    assert fmt.min_subnormal == 2.0 ** -9


@pytest.mark.parametrize("name,emin,emax,max_finite,min_subnormal", [
    # IEEE-like: max = 2**emax * (2 - 2**-M), emax = 2**E - 2 - bias
    ("e8m4", -126, 127, 2.0 ** 127 * (2 - 2.0 ** -4), 2.0 ** -130),
    ("e5m3", -14, 15, 2.0 ** 15 * 1.875, 2.0 ** -17),
    ("e3m2", -2, 3, 14.0, 2.0 ** -4),
    ("e2m0", 0, 1, 2.0, 1.0),
    ("e4m3", -6, 8, 448.0, 2.0 ** -9),  # "e4m3" is the name of fp8 e4m3fn, not IEEE e4m3
    # fn: emax = 2**E - 1 - bias, top mantissa 2**M - 2
    ("e3m2fn", -2, 4, 24.0, 2.0 ** -4),
    ("e5m2fn", -14, 16, 2.0 ** 16 * 1.5, 2.0 ** -16),
    ("e2m1fn", 0, 2, 4.0, 0.5),
    ("e11m51", -1022, 1023, 2.0 ** 1023 * (2 - 2.0 ** -51), 2.0 ** -1073),
])
def test_custom_formats_hand_values(name, emin, emax, max_finite, min_subnormal):
    fmt = get_format(name)
    assert (fmt.emin, fmt.emax) == (emin, emax)
    assert fmt.max_finite == max_finite
    assert fmt.min_subnormal == min_subnormal
    assert fmt.min_normal == 2.0 ** emin


def test_custom_formats_flags():
    ieee, fn = get_format("e8m4"), get_format("E3M2FN")
    assert (ieee.name, ieee.has_inf, ieee.overflow, ieee.bias, ieee.bits) == ("e8m4", True, "inf", 127, 13)
    assert (fn.name, fn.has_inf, fn.overflow, fn.bias, fn.bits) == ("e3m2fn", False, "saturate", 3, 6)
    assert ieee.torch_dtype is None and fn.torch_dtype is None


@pytest.mark.parametrize("alias,canonical", [
    ("bf16", "bf16"), ("BFloat16", "bf16"), ("e8m7", "bf16"),
    ("fp16", "fp16"), ("float16", "fp16"), ("HALF", "fp16"), ("e5m10", "fp16"),
    ("fp32", "fp32"), ("float32", "fp32"), ("single", "fp32"), ("e8m23", "fp32"),
    ("fp64", "fp64"), ("float64", "fp64"), ("double", "fp64"), ("e11m52", "fp64"),
    ("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3fn", "fp8_e4m3"), ("e4m3", "fp8_e4m3"),
    ("e4m3fn", "fp8_e4m3"), ("E4M3FN", "fp8_e4m3"),
    ("fp8_e5m2", "fp8_e5m2"), ("e5m2", "fp8_e5m2"), (" fp8_E5M2 ", "fp8_e5m2"),
])
def test_aliases_give_canonical_format(alias, canonical):
    fmt = get_format(alias)
    assert fmt.name == canonical
    assert fmt is get_format(canonical)


def test_names_round_trip():
    assert FORMAT_NAMES == ("bf16", "fp16", "fp32", "fp64", "fp8_e4m3", "fp8_e5m2")
    for name in FORMAT_NAMES:
        fmt = get_format(name)
        assert get_format(fmt.name) is fmt
        assert get_format(fmt) is fmt
        if fmt.torch_dtype is not None:
            assert get_format(fmt.torch_dtype) is fmt
        suffix = "" if fmt.has_inf else "fn"
        assert get_format(f"e{fmt.exp_bits}m{fmt.man_bits}{suffix}") is fmt
    for name in ("e8m4", "e5m3", "e3m2fn", "e6m9fn"):
        assert get_format(name).name == name
        assert get_format(get_format(name).name) == get_format(name)


def test_str_is_short_and_names_the_format():
    text = str(get_format("bf16"))
    assert "bf16" in text and "e8m7" in text and len(text) < 80
    assert "fn" in str(get_format("fp8_e4m3"))


@pytest.mark.parametrize("bad", ["bf17", "fp8", "e4", "e1m3", "e12m3", "e5m53", "e4m0fn",
                                 "e11m52fn", "float", ""])
def test_bad_names_raise_value_error_naming_the_value(bad):
    with pytest.raises(ValueError) as info:
        get_format(bad)
    assert repr(bad) in str(info.value)


def test_unknown_name_lists_accepted_names():
    with pytest.raises(ValueError) as info:
        get_format("fp7")
    msg = str(info.value)
    assert "'fp7'" in msg and "bf16" in msg and "fp8_e4m3" in msg and "eXmY" in msg and "eXmYfn" in msg


def test_bad_types():
    with pytest.raises(TypeError, match="fmt"):
        get_format(16)
    with pytest.raises(ValueError, match="torch.int32"):
        get_format(torch.int32)


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="overflow"):
        FloatFormat("x", 5, 2, 15, True, "wrap")
    with pytest.raises(ValueError, match="has_inf=False"):
        FloatFormat("x", 4, 3, 7, False, "inf")
    with pytest.raises(ValueError, match="exp_bits"):
        FloatFormat("x", 12, 3, 2047)
    with pytest.raises(ValueError, match="float64"):
        FloatFormat("x", 8, 3, -1000)
    fmt = FloatFormat("mine", 5, 2, 15, True, "saturate")
    assert fmt.max_finite == 57344.0 and fmt.torch_dtype is None
    with pytest.raises(Exception):
        fmt.man_bits = 3  # frozen
