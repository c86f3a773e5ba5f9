"""round_to, ulp, encode and decode against torch's casts, brute force and exact arithmetic."""
import math
from fractions import Fraction

import pytest
import torch

from stableflash.numerics import ROUNDING_MODES, decode, encode, get_format, round_to, ulp
from stableflash.numerics.rounding import _round_exact

SEED = 20251004
TORCH_CASTS = [
    ("bf16", torch.bfloat16), ("fp16", torch.float16),
    ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2),
]
INF = math.inf
F32_MAX = torch.finfo(torch.float32).max


def exact(x, name, mode="rne", generator=None):
    """The general algorithm, bypassing round_to's fast paths for float32 (torch's cast, e8mY bits)."""
    return _round_exact(x, get_format(name), mode, generator)


# every check against torch's casts runs on round_to (fast paths) and on the exact algorithm
ROUNDERS = [pytest.param(round_to, id="round_to"), pytest.param(exact, id="exact")]


# ----------------------------------------------------------------------------- helpers

def torch_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's cast of x (float32 or float64), back to float32. float8_e4m3fn has no infinities and
    saturates on overflow (its definition, and the hand-written cases below); torch 2.11 casts
    overflow past 464 to NaN on both devices, later CPU casts saturate: a NaN from a non-NaN input
    is read as the saturated value, so the comparisons hold on every torch version."""
    y = x.to(dtype).to(torch.float32)
    if dtype is torch.float8_e4m3fn:
        y = torch.where(torch.isnan(y) & ~torch.isnan(x), torch.copysign(torch.tensor(448.0), x.float()), y)
    return y


def assert_same_bits(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """Bitwise equality of two float32 tensors, NaNs compared as NaN-ness."""
    nan = torch.isnan(ref)
    same = torch.where(nan, torch.isnan(got), got.view(torch.int32) == ref.view(torch.int32))
    bad = (~same).nonzero().flatten()
    if bad.numel():
        i = bad[:5]
        pytest.fail(f"{what}: {bad.numel()} of {x.numel()} differ; inputs {x[i].tolist()} "
                    f"(bits {x[i].view(torch.int32).tolist()}) gave {got[i].tolist()}, "
                    f"expected {ref[i].tolist()}")


def f32_next(v: float, direction: float) -> float:
    """The neighbouring float32 of float32 value v toward direction."""
    t = torch.tensor(v, dtype=torch.float32)
    return torch.nextafter(t, torch.tensor(direction, dtype=torch.float32)).item()


def grid(exp_bits: int, man_bits: int, has_inf: bool) -> list[float]:
    """Every nonnegative finite value of a small format, by the definition of the encoding,
    ascending; index i is the bit pattern i (so its parity is the mantissa LSB)."""
    bias = (1 << (exp_bits - 1)) - 1
    values = []
    for biased in range(1 << exp_bits):
        for man in range(1 << man_bits):
            if has_inf and biased == (1 << exp_bits) - 1:
                continue
            if not has_inf and biased == (1 << exp_bits) - 1 and man == (1 << man_bits) - 1:
                continue
            if biased == 0:
                values.append(math.ldexp(man, 1 - bias - man_bits))
            else:
                values.append(math.ldexp((1 << man_bits) + man, biased - bias - man_bits))
    return values


def ref_round(v: float, exp_bits: int, man_bits: int, has_inf: bool) -> float:
    """Correct round-to-nearest-even of the float64 v, by exact rational arithmetic."""
    if math.isnan(v) or math.isinf(v):
        return v
    bias = (1 << (exp_bits - 1)) - 1
    emin = 1 - bias
    a = abs(Fraction(v))
    e = emin
    if a >= Fraction(2) ** emin:
        e = math.floor(math.log2(a))
        while Fraction(2) ** e > a:
            e -= 1
        while Fraction(2) ** (e + 1) <= a:
            e += 1
    q = Fraction(2) ** (e - man_bits)
    y = a / q
    r = math.floor(y)
    if y - r > Fraction(1, 2) or (y - r == Fraction(1, 2) and r % 2 == 1):
        r += 1
    out = r * q
    emax = (1 << exp_bits) - (2 if has_inf else 1) - bias
    top = (1 << (man_bits + 1)) - (1 if has_inf else 2)
    max_finite = Fraction(top) * Fraction(2) ** (emax - man_bits)
    if out > max_finite:
        return math.copysign(INF if has_inf else float(max_finite), v)
    return math.copysign(float(out), v)


@pytest.fixture(scope="module")
def random_patterns() -> torch.Tensor:
    """4,194,304 uniformly random float32 bit patterns (NaNs, infs, subnormals, all exponents)."""
    g = torch.Generator().manual_seed(SEED)
    bits = torch.randint(-2**31, 2**31, (1 << 22,), generator=g, dtype=torch.int64)
    return bits.to(torch.int32).view(torch.float32)


# ----------------------------------------------------------------------------- bitwise vs torch

@pytest.mark.parametrize("fn", ROUNDERS)
@pytest.mark.parametrize("name,dtype", TORCH_CASTS)
def test_matches_torch_on_random_bit_patterns(fn, random_patterns, name, dtype):
    x = random_patterns
    assert_same_bits(fn(x, name), torch_cast(x, dtype), x, f"{name}, seed {SEED}")


SCALES = {
    "bf16": [1.0, 1e-3, 1e3, 1e-38, 1e-40, 1e38, 3e38, 1e20],
    "fp16": [1.0, 1e-3, 1e-5, 1e-7, 1e4, 6e4, 1e5, 3e-8],
    "fp8_e4m3": [1.0, 1e-2, 1e-3, 3e-3, 100.0, 440.0, 1e3, 10.0],
    "fp8_e5m2": [1.0, 1e-4, 1e-5, 2e-5, 1e4, 5e4, 7e4, 1e-6],
}


@pytest.mark.parametrize("fn", ROUNDERS)
@pytest.mark.parametrize("name,dtype", TORCH_CASTS)
def test_matches_torch_on_scaled_normals(fn, name, dtype):
    seed = SEED + 1
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(1 << 18, generator=g) * s for s in SCALES[name]]).float()
    assert_same_bits(fn(x, name), torch_cast(x, dtype), x, f"{name}, seed {seed}")


@pytest.mark.parametrize("fn", ROUNDERS)
@pytest.mark.parametrize("name,dtype", TORCH_CASTS)
def test_matches_torch_near_ties(fn, name, dtype):
    """Representable values of fmt plus half an ulp (the ties), plus or minus a few float32 ulps."""
    seed = SEED + 2
    g = torch.Generator().manual_seed(seed)
    fmt = get_format(name)
    patterns = torch.randint(0, 1 << fmt.bits, (1 << 18,), generator=g)
    base = decode(patterns, fmt)
    base = base[torch.isfinite(base)].float()
    tie = base + (torch.sign(base) + (base == 0)) * ulp(base, fmt).float() / 2
    parts = [base, tie]
    for direction in (INF, -INF):
        nxt = tie
        for _ in range(3):  # 1, 2 and 3 float32 ulps away from the tie
            nxt = torch.nextafter(nxt, torch.tensor(direction))
            parts.append(nxt)
    x = torch.cat(parts)
    x = x[torch.isfinite(x)]
    assert_same_bits(fn(x, name), torch_cast(x, dtype), x, f"{name}, seed {seed}")


def hard_cases(name: str) -> list[tuple[float, float]]:
    """(float32 input, expected result) pairs written from the format's definition."""
    fmt = get_format(name)
    eps, mx, tiny, sub = fmt.eps, fmt.max_finite, fmt.min_normal, fmt.min_subnormal
    ulp_max = math.ldexp(1.0, fmt.emax - fmt.man_bits)
    over = INF if fmt.overflow == "inf" else mx
    threshold = mx + ulp_max / 2  # halfway between max and the next binade step
    cases = [
        (0.0, 0.0), (-0.0, -0.0), (INF, INF if fmt.has_inf else mx),
        (-INF, -INF if fmt.has_inf else -mx),
        (1.0, 1.0), (1 + eps / 2, 1.0), (1 + 1.5 * eps, 1 + 2 * eps),  # ties: even LSB, odd LSB
        (-(1 + eps / 2), -1.0), (-(1 + 1.5 * eps), -(1 + 2 * eps)),
        (f32_next(1 + eps / 2, INF), 1 + eps), (f32_next(1 + eps / 2, 0), 1.0),
        (f32_next(1 + 1.5 * eps, 0), 1 + eps), (f32_next(1 + 1.5 * eps, INF), 1 + 2 * eps),
        (2 - eps / 2, 2.0),  # carry into the next binade
        (mx, mx), (-mx, -mx), (f32_next(threshold, 0), mx),
        (threshold, over), (-threshold, -over), (f32_next(threshold, INF), over),
        (min(2 * mx, F32_MAX), over), (F32_MAX, over), (-F32_MAX, -over),
        (tiny, tiny), (-tiny, -tiny), (tiny - sub / 2, tiny),  # tie, tiny is even
        (sub, sub), (sub / 2, 0.0), (-sub / 2, -0.0), (f32_next(sub / 2, INF), sub),
        (f32_next(sub / 2, 0), 0.0), (1.5 * sub, 2 * sub), (2.5 * sub, 2 * sub),
        (3.5 * sub, 4 * sub), (sub / 8, 0.0), (-sub / 8, -0.0),
    ]
    if name == "fp8_e4m3":
        cases += [(464.0, 448.0), (480.0, 448.0), (1e9, 448.0), (-500.0, -448.0)]
    if name == "fp8_e5m2":
        cases += [(61439.0, 57344.0), (61440.0, INF), (-61440.0, -INF)]
    if name == "fp16":
        cases += [(65519.0, 65504.0), (65520.0, INF), (2.0 ** -25, 0.0), (1.5 * 2.0 ** -24, 2.0 ** -23)]
    if name == "bf16":
        cases += [(1 + 2.0 ** -8, 1.0), (1 + 3 * 2.0 ** -8, 1 + 2.0 ** -6)]
    return cases


@pytest.mark.parametrize("fn", ROUNDERS)
@pytest.mark.parametrize("name,dtype", TORCH_CASTS)
def test_hard_cases(fn, name, dtype):
    cases = hard_cases(name)
    x = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    assert x.double().tolist() == [c[0] for c in cases], "a hard case is not a float32 value"
    expected = torch.tensor([c[1] for c in cases], dtype=torch.float32)
    got = fn(x, name)
    assert_same_bits(got, expected, x, f"{name} vs hand-written expectations")
    assert_same_bits(torch_cast(x, dtype), expected, x, f"torch {dtype} vs hand-written expectations")


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,dtype", TORCH_CASTS)
def test_round_to_is_the_same_on_every_device(random_patterns, name, dtype, device):
    """round_to's fast path is torch's cast, whose float8_e4m3fn overflow differs between torch
    versions (NaN in 2.11 on CPU and CUDA, ±448 on later CPUs): on every device the result is the
    exact algorithm's, infinities, overflow, subnormals and NaN included."""
    x = torch.cat([random_patterns[: 1 << 18],
                   torch.tensor([INF, -INF, math.nan, F32_MAX, -F32_MAX, 1e-45, -0.0, 0.0])])
    got = round_to(x.to(device), name).cpu()
    assert_same_bits(got, exact(x, name), x, f"{name} on {device} vs exact")


@pytest.mark.parametrize("name", ["e8m1", "e8m3", "e8m4", "e8m5", "e8m10", "e8m20"])
def test_e8_bit_trick_equals_the_exact_algorithm(random_patterns, name):
    """Formats with float32's exponent range round float32 by an integer trick on the bits: equal to
    the exact algorithm on 4M random patterns, on values near every tie, and on the hard cases."""
    x = random_patterns
    assert_same_bits(round_to(x, name), exact(x, name), x, f"{name} bit trick vs exact, seed {SEED}")
    fmt = get_format(name)
    g = torch.Generator().manual_seed(SEED + 5)
    base = torch.randn(1 << 16, generator=g) * torch.exp2(torch.randint(-140, 128, (1 << 16,), generator=g).float())
    base = exact(base[torch.isfinite(base)], name)
    tie = base + torch.sign(base) * ulp(base, fmt).float() / 2
    near = torch.cat([tie, torch.nextafter(tie, torch.tensor(INF)), torch.nextafter(tie, torch.tensor(-INF))])
    near = near[torch.isfinite(near)]
    assert_same_bits(round_to(near, name), exact(near, name), near, f"{name} near ties")
    cases = hard_cases(name)
    x = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    assert x.double().tolist() == [c[0] for c in cases], "a hard case is not a float32 value"
    expected = torch.tensor([c[1] for c in cases], dtype=torch.float32)
    assert_same_bits(round_to(x, name), expected, x, f"{name} vs hand-written expectations")


def test_nan_stays_nan_and_shape_dtype_kept():
    x = torch.tensor([[float("nan"), 1.0], [-0.0, 3.0]], dtype=torch.float16)
    for name in ("fp8_e4m3", "fp8_e5m2", "e3m2fn", "e4m2"):
        y = round_to(x, name)
        assert y.dtype is torch.float16 and y.shape == x.shape
        assert torch.isnan(y[0, 0]) and y[0, 1] == 1.0 and torch.signbit(y[1, 0])
    xb = torch.tensor([1.0078125, -2.5], dtype=torch.bfloat16)
    assert torch.equal(round_to(xb, "e8m4"), torch.tensor([1.0, -2.5], dtype=torch.bfloat16))


def test_negative_tiny_rounds_to_negative_zero():
    x = torch.tensor([-1e-30, 1e-30, -1e-45], dtype=torch.float32)
    for mode in ROUNDING_MODES:  # stochastic: rounds up with probability < 1e-22
        y = round_to(x, "fp16", mode, generator=torch.Generator().manual_seed(SEED))
        assert y.tolist() == [0.0, 0.0, 0.0]
        assert torch.signbit(y).tolist() == [True, False, True]


# ----------------------------------------------------------------------------- float64 inputs

def test_float64_is_correctly_rounded_unlike_torch():
    x = torch.tensor([1 + 2**-8 + 2**-40], dtype=torch.float64)
    assert round_to(x, "bf16").item() == 1 + 2**-7          # single, correct rounding
    assert x.to(torch.bfloat16).double().item() == 1.0       # torch rounds through float32 first
    two_step = round_to(round_to(x, "fp32"), "bf16")         # our double rounding, done explicitly
    assert two_step.item() == 1.0 == x.to(torch.bfloat16).double().item()


@pytest.mark.parametrize("name,dtype", TORCH_CASTS)
def test_float64_inputs_equal_torch_when_exact_in_float32(random_patterns, name, dtype):
    x32 = random_patterns[: 1 << 20]
    x64 = x32.double()
    got = round_to(x64, name)
    assert got.dtype is torch.float64
    ref = torch_cast(x64, dtype)          # torch casting the float64 values themselves
    assert_same_bits(got.float(), ref.float(), x32, f"{name} from float64, seed {SEED}")


def test_float64_to_fp32_matches_torch():
    """torch's float64 -> float32 cast rounds once, so it must agree with round_to everywhere."""
    g = torch.Generator().manual_seed(SEED + 8)
    bits = torch.randint(-2**62, 2**62, (1 << 20,), generator=g) * 2  # all exponents and signs
    x = bits.view(torch.float64)
    x = torch.cat([x, x.float().double() * (1 + 2.0**-24), x.float().double() * (1 + 2.0**-25)])
    got = round_to(x, "fp32")
    ref = x.float().double()
    same = torch.where(torch.isnan(ref), torch.isnan(got), got.view(torch.int64) == ref.view(torch.int64))
    assert same.all(), f"seed {SEED + 8}: first differing input {x[~same][:3].tolist()}"


def test_empty_and_scalar_tensors():
    assert round_to(torch.empty(0), "bf16").shape == (0,)
    assert round_to(torch.tensor(1.0 + 2**-9), "bf16").item() == 1.0
    assert encode(torch.empty(0), "fp16").shape == (0,)
    assert decode(torch.empty(0, dtype=torch.int64), "fp16").shape == (0,)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(SEED)).t()  # not contiguous
    assert torch.equal(round_to(x, "bf16"), x.to(torch.bfloat16).float())


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "e8m4", "e3m2fn", "fp32"])
def test_float64_inputs_match_exact_rational_rounding(name):
    seed = SEED + 3
    g = torch.Generator().manual_seed(seed)
    fmt = get_format(name)
    lo, hi = fmt.emin - fmt.man_bits - 3, fmt.emax + 2
    exps = torch.randint(lo, hi, (1500,), generator=g)
    x = (torch.rand(1500, generator=g, dtype=torch.float64) + 1) * torch.pow(2.0, exps.double())
    x = x * torch.where(torch.rand(1500, generator=g) < 0.5, -1.0, 1.0).double()
    got = round_to(x, fmt).tolist()
    expected = [ref_round(v, fmt.exp_bits, fmt.man_bits, fmt.has_inf) for v in x.tolist()]
    bad = [(v, a, b) for v, a, b in zip(x.tolist(), got, expected) if a != b]
    assert not bad, f"{name}, seed {seed}: {len(bad)} differ, first (x, got, expected) {bad[:3]}"


# ----------------------------------------------------------------------------- custom formats

@pytest.mark.parametrize("name", ["e3m2", "e4m3ieee", "e3m2fn", "e2m1fn", "e5m3", "e2m0", "e4m2"])
def test_rne_matches_brute_force_nearest(name):
    """Against every value of the format: the nearest, ties to the even bit pattern."""
    seed = SEED + 4
    g = torch.Generator().manual_seed(seed)
    if name == "e4m3ieee":  # the name "e4m3" means fp8 e4m3fn; build the IEEE-like layout
        from stableflash.numerics import FloatFormat
        fmt = FloatFormat("e4m3ieee", 4, 3, 7, True, "inf")
    else:
        fmt = get_format(name)
    values = grid(fmt.exp_bits, fmt.man_bits, fmt.has_inf)
    assert values[-1] == fmt.max_finite and values[1] == fmt.min_subnormal
    step = 2.0 ** -40  # inputs are multiples of this, so every comparison below is exact
    table = torch.tensor(values, dtype=torch.float64)
    x = torch.cat([
        torch.randint(0, int(2.2 * fmt.max_finite / step), (20000,), generator=g).double() * step,
        torch.randint(0, int(4 * fmt.min_normal / step), (5000,), generator=g).double() * step,
        table, (table[1:] + table[:-1]) / 2,  # every value and every tie
    ])
    idx = torch.searchsorted(table, x, right=True).clamp(max=len(values) - 1)  # first > x
    below = table[(idx - 1).clamp(min=0)]
    above_max = x >= table[-1]
    upper = torch.where(above_max, torch.full_like(x, table[-1].item() + ulp(table[-1:], fmt).item()),
                        table[idx])
    lower = torch.where(above_max, table[-1].expand_as(x), below)
    lower_even = torch.where(above_max, torch.zeros_like(x, dtype=torch.bool),
                             ((idx - 1) % 2 == 0))
    d_lo, d_hi = x - lower, upper - x
    pick_up = (d_hi < d_lo) | ((d_hi == d_lo) & ~lower_even)
    expected = torch.where(pick_up, upper, lower)
    expected = torch.where(expected > fmt.max_finite,
                           torch.full_like(x, INF if fmt.overflow == "inf" else fmt.max_finite),
                           expected)
    got = round_to(x, fmt)
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, (f"{name}, seed {seed}: {bad.numel()} differ, first x "
                              f"{x[bad[:3]].tolist()} got {got[bad[:3]].tolist()} "
                              f"expected {expected[bad[:3]].tolist()}")
    assert torch.equal(round_to(-x, fmt), -expected)


@pytest.mark.parametrize("name", ["e8m4", "e5m3", "e3m2fn", "e6m9", "e4m3fn"])
@pytest.mark.parametrize("mode", ROUNDING_MODES)
def test_results_are_representable(name, mode):
    seed = SEED + 5
    g = torch.Generator().manual_seed(seed)
    fmt = get_format(name)
    x = torch.randn(100000, generator=g) * torch.exp(torch.randn(100000, generator=g) * 8)
    y = round_to(x, fmt, mode, generator=g)
    finite = torch.isfinite(y)
    assert finite.all() or fmt.has_inf
    y = y[finite]
    assert y.abs().max() <= fmt.max_finite
    # at most man_bits fraction bits: y / ulp(y) is an integer
    quot = y.double() / ulp(y, fmt)
    assert torch.equal(quot, torch.round(quot)), f"{name} {mode}, seed {seed}"
    assert torch.equal(decode(encode(y, fmt), fmt), y.double())


# ----------------------------------------------------------------------------- rtz

@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "e5m3", "e3m2fn"])
def test_rtz_properties(random_patterns, name):
    fmt = get_format(name)
    x = random_patterns[: 1 << 20]
    x = x[torch.isfinite(x)]
    y = round_to(x, fmt, "rtz")
    assert torch.isfinite(y).all(), "rtz must not overflow to inf from a finite input"
    a, b = x.double().abs(), y.double().abs()
    assert (b <= a).all() and (torch.signbit(y) == torch.signbit(x)).all()
    assert torch.equal(round_to(y, fmt, "rne"), y), "rtz results must be representable"
    inside = a <= fmt.max_finite
    # no representable value strictly between the result and x: the next one up is above |x|
    assert ((b + ulp(y, fmt))[inside] > a[inside]).all()
    assert (b[~inside] == fmt.max_finite).all()


def test_rtz_bf16_is_bit_truncation(random_patterns):
    x = random_patterns[torch.isfinite(random_patterns)]
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert_same_bits(round_to(x, "bf16", "rtz"), truncated, x, f"rtz bf16, seed {SEED}")


def test_rtz_infinities():
    x = torch.tensor([INF, -INF, 1e30, -1e30])
    assert round_to(x, "fp16", "rtz").tolist() == [INF, -INF, 65504.0, -65504.0]
    assert round_to(x, "fp8_e4m3", "rtz").tolist() == [448.0, -448.0, 448.0, -448.0]


# ----------------------------------------------------------------------------- stochastic

def test_stochastic_is_reproducible():
    x = torch.randn(10000, generator=torch.Generator().manual_seed(SEED))
    a = round_to(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(7))
    b = round_to(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(7))
    c = round_to(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert (a != c).sum() > 1000


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "e3m2fn"])
def test_stochastic_picks_a_neighbour(name):
    seed = SEED + 6
    g = torch.Generator().manual_seed(seed)
    fmt = get_format(name)
    x = (torch.randn(200000, generator=g) * torch.exp(torch.randn(200000, generator=g) * 4)).double()
    x = x[x.abs() < fmt.max_finite]
    y = round_to(x, fmt, "stochastic", generator=g)
    down = round_to(x, fmt, "rtz")
    up = torch.copysign(down.abs() + ulp(down, fmt), x)
    assert ((y == down) | (y == up)).all(), f"{name}, seed {seed}"
    exact = round_to(x, fmt, "rne") == x
    assert torch.equal(y[exact], x[exact])
    assert (y == up).any() and (y == down).any()


@pytest.mark.parametrize("name,value", [
    ("bf16", 1 + 0.3 * 2**-7), ("bf16", -3.7), ("fp16", 0.1), ("fp16", 3e-6),  # 3e-6: subnormal
    ("fp8_e4m3", 0.3), ("fp8_e5m2", -1000.0),
])
def test_stochastic_is_unbiased(name, value):
    """The mean of n stochastic roundings equals x within 5 standard errors, where one rounding
    has standard deviation ulp * sqrt(p (1 - p)) with p the distance to the lower neighbour."""
    n, seed = 200000, SEED + 7
    fmt = get_format(name)
    x = torch.full((n,), value, dtype=torch.float64)
    y = round_to(x, fmt, "stochastic", generator=torch.Generator().manual_seed(seed))
    down = round_to(x[:1], fmt, "rtz").item()
    q = ulp(x[:1], fmt).item()
    p = abs(value - down) / q
    assert 0 < p < 1
    se = q * math.sqrt(p * (1 - p) / n)
    assert abs(y.mean().item() - value) < 5 * se, f"{name} {value}, seed {seed}"
    assert abs(round_to(x[:1], fmt).item() - value) > 5 * se  # rne alone would be biased


def test_stochastic_overflow():
    x = torch.tensor([65519.0] * 1000 + [1e9])
    y = round_to(x, "fp16", "stochastic", generator=torch.Generator().manual_seed(SEED))
    assert set(y.tolist()) <= {65504.0, INF} and y[-1] == INF
    y8 = round_to(torch.tensor([460.0] * 100), "fp8_e4m3", "stochastic",
                  generator=torch.Generator().manual_seed(SEED))
    assert set(y8.tolist()) == {448.0}


# ----------------------------------------------------------------------------- ulp

def test_ulp_values():
    x = torch.tensor([1.0, 1.5, 2.0, -3.0, 0.0, 1e-40, INF, float("nan")])
    u = ulp(x, "bf16")
    assert u.dtype is torch.float64
    assert u[:6].tolist() == [2.0**-7, 2.0**-7, 2.0**-6, 2.0**-6, 2.0**-133, 2.0**-133]
    assert torch.isnan(u[6:]).all()
    assert ulp(torch.tensor([448.0, 1.0, 0.0]), "fp8_e4m3").tolist() == [32.0, 0.125, 2.0**-9]


def test_ulp_is_the_float32_spacing(random_patterns):
    x = random_patterns.abs()
    x = x[torch.isfinite(x) & (x < torch.finfo(torch.float32).max)]
    spacing = torch.nextafter(x, torch.tensor(INF)).double() - x.double()
    assert torch.equal(ulp(x, "fp32"), spacing)


# ----------------------------------------------------------------------------- encode / decode

VIEWS = [("bf16", torch.bfloat16, torch.int16), ("fp16", torch.float16, torch.int16),
         ("fp32", torch.float32, torch.int32),
         ("fp8_e4m3", torch.float8_e4m3fn, torch.uint8), ("fp8_e5m2", torch.float8_e5m2, torch.uint8)]


@pytest.mark.parametrize("name,dtype,view", VIEWS)
def test_encode_matches_torch_bit_view(random_patterns, name, dtype, view):
    x = random_patterns[: 1 << 20].to(dtype)
    x = x[~torch.isnan(x)]
    bits = encode(x, name)
    mask = (1 << get_format(name).bits) - 1
    assert bits.dtype is torch.int64
    assert torch.equal(bits, x.view(view).to(torch.int64) & mask)
    assert torch.equal(decode(bits, name), x.double())


def test_encode_fp64_matches_view():
    x = torch.randn(10000, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED))
    x = torch.cat([x, torch.tensor([0.0, -0.0, INF, -INF, 5e-324, 1.7976931348623157e308])])
    assert torch.equal(encode(x, "fp64"), x.view(torch.int64))
    assert torch.equal(decode(encode(x, "fp64"), "fp64"), x)


@pytest.mark.parametrize("name,dtype,view", [v for v in VIEWS if v[0] != "fp32"])
def test_decode_every_pattern(name, dtype, view):
    """All 2**bits patterns of the 8- and 16-bit formats decode to torch's values."""
    fmt = get_format(name)
    n = 1 << fmt.bits
    patterns = torch.arange(n, dtype=torch.int64)
    ref = patterns.to(torch.int32 if view is torch.int16 else torch.uint8)
    ref = (ref.to(torch.int16) if view is torch.int16 else ref).view(dtype).double()
    got = decode(patterns, fmt)
    same = torch.where(torch.isnan(ref), torch.isnan(got), got == ref)
    assert same.all()
    assert torch.equal(torch.signbit(got[~torch.isnan(got)]), torch.signbit(ref[~torch.isnan(ref)]))
    finite = torch.isfinite(got)
    assert torch.equal(encode(got[finite], fmt), patterns[finite])


def test_canonical_nan_patterns():
    nan = torch.tensor([float("nan")])
    assert encode(nan, "bf16").item() == 0x7FC0
    assert encode(nan, "fp16").item() == 0x7E00
    assert encode(nan, "fp8_e4m3").item() == 0x7F
    assert encode(nan, "fp8_e5m2").item() == 0x7E
    assert encode(nan, "e3m2fn").item() == 0b011111
    assert torch.isnan(decode(torch.tensor([0x7F, 0xFF]), "fp8_e4m3")).all()
    assert decode(torch.tensor([0x7E]), "fp8_e4m3").item() == 448.0


def test_encode_rejects_unrepresentable_values():
    x = torch.tensor([1.0, 1.0 + 2**-10, 3.0, 1e-30, 1e6])
    with pytest.raises(ValueError) as info:
        encode(x, "fp8_e4m3")
    msg = str(info.value)
    assert "3 of 5" in msg and "1.0009765625" in msg and "fp8_e4m3" in msg
    with pytest.raises(ValueError, match="1 of 1"):
        encode(torch.tensor([INF]), "fp8_e4m3")  # no infinity in an fn format


def test_decode_rejects_bad_patterns():
    with pytest.raises(ValueError, match="256"):
        decode(torch.tensor([256]), "fp8_e5m2")
    with pytest.raises(TypeError, match="bits"):
        decode(torch.tensor([1.0]), "fp8_e5m2")


# ----------------------------------------------------------------------------- argument checks

def test_round_to_argument_errors():
    with pytest.raises(TypeError, match="torch.int32"):
        round_to(torch.tensor([1], dtype=torch.int32), "bf16")
    with pytest.raises(TypeError, match="list"):
        round_to([1.0], "bf16")
    with pytest.raises(ValueError) as info:
        round_to(torch.tensor([1.0]), "bf16", "nearest")
    assert "'nearest'" in str(info.value) and "rne" in str(info.value) and "stochastic" in str(info.value)
    with pytest.raises(ValueError, match="float32"):
        round_to(torch.tensor([1.0], dtype=torch.float16), "bf16")
    with pytest.raises(ValueError, match="float32"):
        round_to(torch.tensor([1.0], dtype=torch.bfloat16), "fp16")
    with pytest.raises(ValueError, match="float32"):
        round_to(torch.tensor([1.0], dtype=torch.float16), "e5m2fn")  # max 98304 > 65504
    with pytest.raises(ValueError, match="bf17"):
        round_to(torch.tensor([1.0]), "bf17")


def test_large_tensor_is_fast():
    import time
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(SEED))
    start = time.perf_counter()
    round_to(x, "bf16")
    assert time.perf_counter() - start < 5.0
