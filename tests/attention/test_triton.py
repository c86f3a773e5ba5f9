"""The fused Triton kernels: against float64, against the emulated backend policy by policy, through
torch.compile, and with clear errors. Without CUDA they run in Triton's CPU interpreter (set up in
conftest), so the shapes here are small; tests marked gpu add full shapes on a GPU."""
import warnings

import pytest
import torch

import stableflash as sf
from stableflash.attention import PrecisionPolicy, reference
from stableflash.numerics import get_format, round_to, ulp
from tests.conftest import DEVICE, rel_err

triton = pytest.importorskip("triton")
from stableflash.attention.triton import op as triton_op  # noqa: E402  (after TRITON_INTERPRET is set)
import triton.language as tl  # noqa: E402
from stableflash.attention.triton.common import E4M3, NO_FORMAT, p_bar_v, round_format, round_mantissa_stochastic  # noqa: E402
from stableflash.attention.triton.config import DeltaSource, Format, KernelConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")   # interpreter: numpy's inf − inf


@pytest.fixture(autouse=True)
def fixed_config(monkeypatch):
    """Correctness needs no autotuning (which would compile every config for every shape)."""
    monkeypatch.setattr(triton_op, "AUTOTUNE", False)

# bf16 keeps 8 significant bits (unit roundoff 2⁻⁸ ≈ 3.9e-3); fp16 keeps 11 (4.9e-4)
BOUNDS = {torch.bfloat16: {"O": 1e-2, "dQ": 2e-2, "dK": 2e-2, "dV": 2e-2},
          torch.float16: {"O": 2e-3, "dQ": 4e-3, "dK": 4e-3, "dV": 4e-3}}


def make(gen, b, h, n_q, d, n_k=None, h_kv=None, dtype=torch.bfloat16):
    n_k = n_q if n_k is None else n_k
    h_kv = h if h_kv is None else h_kv
    q = torch.randn(b, h, n_q, d, generator=gen)
    k = torch.randn(b, h_kv, n_k, d, generator=gen)
    v = torch.randn(b, h_kv, n_k, d, generator=gen)
    do = torch.randn(b, h, n_q, d, generator=gen)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, do)]


def run(q, k, v, do, **kw):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = sf.flash_attention(q, k, v, **kw)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def forward(q, k, v, **kw):
    """O alone, from the call ``run`` makes (inputs that require grad), without the backward that a
    check of O only would leave unread (the backward draws no stochastic-rounding seed)."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    return sf.flash_attention(q, k, v, **kw).detach()


def forward_outputs(q, k, v, monkeypatch, **kw):
    """What the forward op hands the backward — O, LSE and O32 (R, or the fp32 O) as
    ``triton_op._forward`` returns them — from the call ``run`` makes, without the backward. Where two
    forwards give all three bit for bit, the backward (the same kernels on the same tensors; the
    kernels and the interpreter are deterministic) gives the same gradients: a check that two
    forward paths agree in O and the gradients needs no backward run."""
    seen, real = [], triton_op._forward

    def recording(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]
    with monkeypatch.context() as m:
        m.setattr(triton_op, "_forward", recording)
        forward(q, k, v, **kw)
    (outputs,) = seen
    return outputs


def expanded_reference(q, k, v, do, causal):
    g = q.shape[1] // k.shape[1]
    want = reference.forward_backward(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), do, causal=causal)
    o, dq, dk, dv = want
    fold = lambda t: t.view(t.shape[0], k.shape[1], g, *t.shape[2:]).sum(2)  # noqa: E731
    return o, dq, fold(dk), fold(dv)


# Without a GPU the kernels run in the interpreter on tiles of 32 query rows by 16 keys
# (triton_op._INTERP): N = 40 rows are two query blocks, the last ragged, and three key blocks, the
# last ragged; causal, the diagonal crosses the first query block's two key blocks and the second's
# last, after two whole blocks. A GPU's tiles are 64 wide: there N = 70 spans two of them. B and H:
# where the arithmetic a test checks does not depend on which batch entry or head a program
# computes, one of each in the interpreter (a program per batch·head, its time in proportion). The
# tests of batch and head addressing keep theirs: CASES' two batch entries and grouped heads, the
# per-head fp32 policies, the fp8 product's V, the persistent grid.
N = 40 if DEVICE == "cpu" else 70
B = 1 if DEVICE == "cpu" else 2
H = 1 if DEVICE == "cpu" else 2

CASES = [  # (b, h, h_kv, n_q, n_k, d)
    (1, 2, 2, 1, 1, 32),
    (2, 2, 2, N, N, 32),
    (1, H, H, 33, 50, 16),
    (1, H, H, 50, 33, 64),
    (1, 4, 2, 40, 40, 32),       # grouped-query attention
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stabilize", [False, "paper", True, "all-shift"])
def test_forward_and_gradients_match_float64(gen, case, causal, stabilize):
    b, h, h_kv, n_q, n_k, d = case
    q, k, v, do = make(gen, b, h, n_q, d, n_k, h_kv)
    got = run(q, k, v, do, causal=causal, stabilize=stabilize, backend="triton")
    want = expanded_reference(q, k, v, do, causal)
    floor = 1.0 if n_k == 1 else 0.0
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert g.dtype == q.dtype and torch.isfinite(g).all(), name
        assert rel_err(g, w, floor) <= BOUNDS[q.dtype][name], (name, rel_err(g, w, floor))


@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_fp16_and_every_head_dim(gen, d):
    q, k, v, do = make(gen, 1, H, 37, d, dtype=torch.float16)
    got = run(q, k, v, do, causal=True, backend="triton")
    want = reference.forward_backward(q, k, v, do, causal=True)
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert rel_err(g, w) <= BOUNDS[torch.float16][name], (name, d, rel_err(g, w))


def agree(a: torch.Tensor, b: torch.Tensor, top_ulps: float, frac: float = 1.0) -> tuple[bool, str]:
    """Kernel vs emulation: at most ``top_ulps`` bf16 ulps of the largest value apart, and at most
    ``frac`` of the elements differing at all (fp32 additions in another order flip a rounding)."""
    diff = (a.double() - b.double()).abs()
    top = ulp(b.double().abs().max().reshape(1), "bf16").item()
    differing = (a != b).double().mean().item()
    return (diff.max().item() <= top_ulps * top and differing <= frac,
            f"max {diff.max().item() / top:.2f} ulp, {differing:.4f} differ")


O_FRAC = 0.01 if DEVICE == "cpu" else 0.05    # outputs: almost every element bit-identical


@pytest.mark.parametrize("policy", ["fa2", "paper"])
@pytest.mark.parametrize("stabilize", [False, "paper", True, "all-shift"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_agrees_with_the_emulated_policy(gen, policy, stabilize, causal):
    """Each precision switch of the kernel reproduces the emulated backend's policy."""
    q, k, v, do = make(gen, B, H, N, 32)
    kw = dict(causal=causal, stabilize=stabilize, policy=policy)
    fused = run(q, k, v, do, backend="triton", **kw)
    emulated = run(q, k, v, do, backend="emulated", block_q=32, block_k=triton_op.key_block(32), **kw)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        ok, msg = agree(a, b, 2.0, O_FRAC if name == "O" else 1.0)
        assert ok, (name, msg)


NARROW = [PrecisionPolicy.preset("paper").replace(acc=f, row_sum=f, out=f) for f in ("e8m5", "e8m4", "e8m2")]
NARROW += [PrecisionPolicy.preset("fa2").replace(out="e8m4")]
WIDE = [PrecisionPolicy.preset("paper").replace(acc="fp32", row_sum="fp32", out="fp32", delta="recompute_fp32"),
        PrecisionPolicy.preset("fa2").replace(out="fp32", delta="dP·P")]


@pytest.mark.parametrize("policy", NARROW, ids=lambda p: f"{p.name}-{p.out}")
@pytest.mark.parametrize("stabilize", [False, True])
def test_narrow_formats_agree_with_the_emulated_policy(gen, policy, stabilize):
    """The accelerated stand-ins (ℓ, Ō and O in e8mY): the kernel rounds where the emulation does,
    and the result really is narrower than bf16 (every O exactly representable in e8mY)."""
    q, k, v, do = make(gen, B, H, N, 32)
    kw = dict(causal=True, stabilize=stabilize, policy=policy)
    fused = run(q, k, v, do, backend="triton", **kw)
    emulated = run(q, k, v, do, backend="emulated", block_q=32, block_k=triton_op.key_block(32), **kw)
    fmt = policy.point("out")[0]
    assert torch.equal(fused[0].float(), round_to(fused[0].float(), fmt))
    assert not torch.equal(fused[0], forward(q, k, v, backend="triton", causal=True, stabilize=stabilize))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        ok, msg = agree(a, b, 2.0 * 2.0 ** (7 - fmt.man_bits), O_FRAC if name == "O" else 1.0)
        assert ok, (name, msg)


# one row per seed: row i of Y is X rounded with seed first + i (Philox stream (first + i, offset j) for
# element j), for the n seeds first .. first + n − 1 in one launch; each program takes ROWS rows,
# the seed an element-wise tensor. The interpreter takes every row in one program (its time goes by
# the program, not by the elements), a GPU a few rows per program.
SR_ROWS = 512 if DEVICE == "cpu" else 16


@triton.jit
def _seed_rows(first, n, N: tl.constexpr, ROWS: tl.constexpr):
    """(seeds, offsets, row mask), each (ROWS, N): this program's rows of the seed × offset grid."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = tl.arange(0, N)[None, :] + rows * 0
    return first + rows + offs * 0, offs, (rows < n) & (offs < N)


@triton.jit
def _stochastic_e8m3(X, Y, first, n, N: tl.constexpr, ROWS: tl.constexpr):
    seed, offs, rows = _seed_rows(first, n, N, ROWS)
    y = round_mantissa_stochastic(tl.load(X + offs), 3, seed, offs)
    tl.store(Y + (seed - first) * N + offs, y, mask=rows)


@triton.jit
def _stochastic_small(X, Y, first, n, N: tl.constexpr, FMT: tl.constexpr, INTERP: tl.constexpr, ROWS: tl.constexpr):
    seed, offs, rows = _seed_rows(first, n, N, ROWS)
    y = round_format(tl.load(X + offs), FMT, INTERP, True, seed, offs)
    tl.store(Y + (seed - first) * N + offs, y, mask=rows)


@triton.jit
def _p_bar_v(P, V, Y, hp, PBAR32: tl.constexpr, HP: tl.constexpr, INTERP: tl.constexpr):
    i = tl.arange(0, 16)
    p = tl.load(P + i[:, None] * 16 + i[None, :])
    v = tl.load(V + i[:, None] * 16 + i[None, :])
    tl.store(Y + i[:, None] * 16 + i[None, :], p_bar_v(p, v, v, hp != 0, PBAR32, HP, INTERP, NO_FORMAT))


def test_p_bar_v_multiplies_p_bar_in_fp32_only_when_asked():
    """P̄ = 1 − 2⁻¹⁰ rounds to 1 in bf16: the tensor-core product sums 16 ones, the fp32 one
    16·(1 − 2⁻¹⁰) — for every head with PBAR32, and only for the fp32 heads with HP."""
    p = torch.full((16, 16), 1 - 2 ** -10, device=DEVICE)
    v = torch.ones(16, 16, device=DEVICE, dtype=torch.bfloat16)
    interp = DEVICE == "cpu"
    exact, rounded = 16 * (1 - 2 ** -10), 16.0
    for pbar32, hp_on, hp, want in ((False, False, 0, rounded), (True, False, 0, exact), (False, True, 0, rounded),
                                    (False, True, 1, exact)):
        y = torch.empty(16, 16, device=DEVICE)
        _p_bar_v[(1,)](p, v, y, hp, PBAR32=pbar32, HP=hp_on, INTERP=interp)
        assert torch.allclose(y, torch.full_like(y, want), rtol=0, atol=1e-6), (pbar32, hp_on, hp)


@triton.jit
def _round_format(X, Y, FMT: tl.constexpr, N: tl.constexpr, INTERP: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, round_format(tl.load(X + offs), FMT, INTERP))


@pytest.mark.parametrize("name", ["fp16", "fp8_e5m2", "fp8_e4m3", "e8m3", "bf16"])
def test_round_format_matches_the_numerics_module(name):
    """The kernels' rounding to fp16 and fp8 (normal, subnormal, ties, overflow to inf or to the
    largest finite value, NaN) gives exactly what ``numerics.round_to`` gives."""
    gen = torch.Generator().manual_seed(5)
    fmt = get_format(name)
    q = fmt.min_subnormal if fmt.min_subnormal > 0 else fmt.min_normal
    # the subnormal range: of fp16 and fp8 only (the e8 formats' is fp32's, which a GPU flushes to zero)
    small = fmt.exp_bits < 8
    x = torch.cat([torch.randn(400, generator=gen) * 4.0 ** torch.randint(-6, 6, (400,), generator=gen),
                   torch.randn(200 * small, generator=gen) * fmt.min_normal * 2,
                   torch.arange(-40, 41)[: 81 * small] * q * 0.5,                   # halfway cases below min normal
                   torch.tensor([fmt.max_finite, fmt.max_finite * 1.02, -fmt.max_finite * 1.2, 1e30, -1e30,
                                 float("inf"), float("-inf"), float("nan"), 0.0, -0.0])]).float()
    x = x[: 1024].contiguous()
    n = 1024
    x = torch.nn.functional.pad(x, (0, n - x.numel())).to(DEVICE)
    y = torch.empty_like(x)
    _round_format[(1,)](x, y, FMT=Format.named(name).value, N=n, INTERP=DEVICE == "cpu")
    want = round_to(x.cpu().double(), fmt).float()
    got = y.cpu()
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all(), (x.cpu()[~same][:5], got[~same][:5], want[~same][:5])


@triton.jit
def _fp8_cast(X, Y, n, FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    if FMT == E4M3:
        y = x.to(tl.float8e4nv).to(tl.float32)
    else:
        y = x.to(tl.float8e5).to(tl.float32)
    tl.store(Y + offs, y, mask=offs < n)


@pytest.mark.gpu                    # the GPU's own fp32 → fp8 conversion instruction
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_the_gpus_fp8_conversion_of_p_bar_rounds_as_round_to(name):
    """Every 61st fp32 value from 2⁻²⁴ to 1 (P̄'s range, the formats' subnormals included) through
    Triton's conversion to fp8: equal to round_to's nearest-even, which the fp8 product applies to
    P̄ in software before the same conversion. If it holds, that software rounding is redundant."""
    lo, hi = (torch.tensor([2.0 ** -24, 1.0]).view(torch.int32)).tolist()
    x = torch.arange(lo, hi + 1, 61, dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, torch.tensor([0.0, 1.0])]).to(DEVICE)
    y = torch.empty_like(x)
    _fp8_cast[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), FMT=Format.named(name).value, BLOCK=1024)
    want = round_to(x.cpu(), name)
    same = y.cpu() == want
    assert same.all(), (x.cpu()[~same][:5], y.cpu()[~same][:5], want[~same][:5])


def test_stochastic_rounding_helper_is_unbiased():
    """round_mantissa_stochastic: every result is one of the two e8m3 neighbours, and the mean of
    many roundings approaches the input (nearest-even's error does not shrink)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(120, generator=gen) * 3, torch.tensor([0.0, -0.0, 1.0, 1.0625, 1.0 + 2 ** -20,
                                                                      float("inf"), float("-inf"), float("nan")])])
    x = x.to(DEVICE)
    lo = round_to(x, "e8m3", mode="rtz")
    hi = torch.where(lo == x, lo, lo + torch.sign(x) * ulp(lo.abs(), "e8m3"))
    ys = torch.empty(400, x.numel(), device=DEVICE)
    _stochastic_e8m3[(triton.cdiv(len(ys), SR_ROWS),)](x, ys, 1, len(ys), N=x.numel(), ROWS=SR_ROWS)   # seeds 1-400
    finite = torch.isfinite(x)
    assert ((ys == lo) | (ys == hi))[:, finite].all()
    assert torch.equal(ys[:, ~finite].isnan(), x[~finite].isnan().expand(len(ys), -1))
    assert (ys[:, ~finite & ~x.isnan()] == x[~finite & ~x.isnan()]).all()
    quantum = (hi - lo).abs()[finite]
    err_sr = (ys[:, finite].mean(0) - x[finite]).abs()
    err_rne = (round_to(x, "e8m3")[finite] - x[finite]).abs()
    # 400 draws: the mean's error is ~quantum/2/sqrt(400) = quantum/40; allow quantum/8 per element
    assert (err_sr <= quantum / 8 + 1e-12).all()
    assert err_sr.mean() < 0.25 * err_rne.mean()


@pytest.mark.parametrize("name", ["fp16", "fp8_e5m2", "fp8_e4m3"])
def test_stochastic_rounding_to_fp16_and_fp8_is_unbiased_down_to_subnormals(name):
    """round_format with SR in fp16, e5m2 and e4m3: every result is one of x's two neighbours in
    the format (subnormals, the edge of the normal range and overflow included: e4m3 saturates at
    448, the others go to ±inf past their largest value), a representable x never moves, ±inf and
    NaN go as nearest-even takes them, and the mean of 400 roundings approaches x."""
    fmt = get_format(name)
    gen = torch.Generator().manual_seed(5)
    q, lo_n, top = fmt.min_subnormal, fmt.min_normal, fmt.max_finite
    x = torch.cat([torch.randn(80, generator=gen) * 3, torch.rand(36, generator=gen) * lo_n * torch.sign(torch.randn(36, generator=gen)),
                   torch.tensor([0.0, -0.0, q, 2.5 * q, -0.3 * q, lo_n * (1 - 2 ** -12), lo_n, top, 1.02 * top,
                                 float("inf"), float("-inf"), float("nan")])])
    x = x.float().to(DEVICE)                 # 128 values: a power of two, as tl.arange needs
    finite = torch.isfinite(x)
    lo = round_to(x, name, mode="rtz")
    hi = torch.where(lo == x, lo, lo + torch.sign(x) * ulp(lo.abs(), name))
    hi = torch.where(hi.abs() > top, torch.sign(x) * (top if fmt.overflow == "saturate" else float("inf")), hi)
    ys = torch.empty(400, x.numel(), device=DEVICE)
    _stochastic_small[(triton.cdiv(len(ys), SR_ROWS),)](x, ys, 1, len(ys), N=x.numel(),       # seeds 1-400
                                                        FMT=Format.named(name).value, INTERP=DEVICE == "cpu",
                                                        ROWS=SR_ROWS)
    assert ((ys == lo) | (ys == hi))[:, finite].all()
    exact = finite & (lo == x)
    assert (ys[:, exact] == x[exact]).all() and exact.sum() >= 5       # 0, −0, q, lo_n, top at least
    nearest = round_to(x[~finite], name)
    assert torch.equal(ys[:, ~finite].isnan(), nearest.isnan().expand(len(ys), -1))
    assert (ys[:, ~finite & ~x.isnan()] == nearest[~nearest.isnan()]).all()
    inside = finite & (x.abs() <= top)
    quantum = (hi - lo).abs()[inside]
    err = (ys[:, inside].mean(0) - x[inside]).abs()
    assert (err <= quantum / 8 + 1e-12).all()        # 400 draws: ~quantum/40 per element
    assert err.mean() < 0.25 * (round_to(x, name)[inside] - x[inside]).abs().mean()


SR_POLICIES = [PrecisionPolicy.preset("fa2").replace(out="e8m3:stochastic"),
               PrecisionPolicy.preset("fa2").replace(out="bf16:stochastic"),
               PrecisionPolicy.preset("paper").replace(acc="e8m5:stochastic", row_sum="e8m5:stochastic",
                                                     out="e8m5:stochastic"),
               PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", out="fp8_e4m3:stochastic"),
               PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e5m2", out="fp8_e5m2:stochastic"),
               PrecisionPolicy.preset("fa2").replace(out="fp16:stochastic")]


@pytest.mark.slow
@pytest.mark.parametrize("policy", SR_POLICIES, ids=lambda p: f"{p.name}-{p.out}")
def test_stochastic_rounding_in_the_kernel(gen, policy):
    """Stochastic narrowing: O stays in the format, a seed reproduces it, another seed changes it,
    the average of many calls approaches the unrounded O (nearest-even's error does not average
    away), and the gradients' error is no more than a stochastic rounding's larger variance explains
    (2× its variance: √2 in RMS, measured 1.2-1.4× at 1×2×96×32 over 4 inputs; bound 2×)."""
    q, k, v, do = make(gen, 1, H, N if DEVICE == "cpu" else 64, 32)
    kw = dict(causal=True, stabilize="tie-shift+consistent-delta", policy=policy, backend="triton")
    nearest = policy.replace(**{f: getattr(policy, f).split(":")[0] for f in ("acc", "row_sum", "out")})
    torch.manual_seed(0)
    a = run(q, k, v, do, **kw)
    torch.manual_seed(0)
    b = run(q, k, v, do, **kw)
    c = forward(q, k, v, **kw)
    fmt = policy.point("out")[0]
    assert torch.equal(a[0].float(), round_to(a[0].float(), fmt))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c)
    want = reference.forward_backward(q, k, v, do, causal=True)
    rne = run(q, k, v, do, causal=True, stabilize="tie-shift+consistent-delta", policy=nearest, backend="triton")
    for name, got, ref, base in zip(("dQ", "dK", "dV"), a[1:], want[1:], rne[1:]):
        assert rel_err(got, ref) <= 2.0 * rel_err(base, ref) + 1e-3, name
    # one rounding of O (fp32 ℓ, Ō) to a format coarser than the bf16 O is handed back in: the mean of
    # many calls tends to the fp32 O (as bf16), nearest-even's error stays
    if policy.out == "e8m3:stochastic":
        exact = forward(q, k, v, causal=True, stabilize="tie-shift+consistent-delta", backend="triton",
                        policy=policy.replace(out="fp32", delta="dP·P")).float()
        mean = torch.stack([forward(q, k, v, **kw).float() for _ in range(24)]).mean(0)
        assert (mean - exact).abs().mean() < 0.5 * (rne[0].float() - exact).abs().mean()


@pytest.mark.parametrize("policy", WIDE, ids=lambda p: f"{p.name}-{p.delta}")
def test_fp32_outputs_agree_with_the_emulated_policy(gen, policy):
    """The high-precision control: ℓ, Ō and O in fp32, rounded once to bf16 when stored (the emulated
    backend hands O back in the input dtype too), δ not from the stored O."""
    q, k, v, do = make(gen, B, H, N, 32)
    kw = dict(causal=True, stabilize=False, policy=policy)
    fused = run(q, k, v, do, backend="triton", **kw)
    emulated = run(q, k, v, do, backend="emulated", block_q=32, block_k=triton_op.key_block(32), **kw)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        ok, msg = agree(a, b, 2.0, O_FRAC if name == "O" else 1.0)
        assert ok, (name, msg)


KEEP = [PrecisionPolicy.preset("fa2").replace(out="fp32"),
        PrecisionPolicy.preset("paper").replace(acc="fp32", row_sum="fp32", out="fp32"),
        PrecisionPolicy.preset("paper").replace(acc="e8m5", row_sum="e8m5", out="fp32")]


@pytest.mark.parametrize("policy", KEEP, ids=lambda p: f"{p.name}-{p.acc}")
def test_fp32_o_kept_for_delta_agrees_with_the_emulated_policy(gen, policy):
    """out=fp32 with δ from dO·O: the forward keeps an fp32 O, which δ reads (the model still gets O
    in bf16, as from the emulated backend). Under "paper", ℓ and Ō may stay narrowed (e8m5) while O
    is not. The gradients must be nearer the emulation of this policy than of the same policy with
    O stored in bf16 (δ from the bf16 O): that is what tells an fp32 δ from a bf16 one."""
    q, k, v, do = make(gen, B, H, N, 32)
    kw = dict(causal=True, stabilize="tie-shift")
    emu = dict(backend="emulated", block_q=32, block_k=triton_op.key_block(32), **kw)
    fused = run(q, k, v, do, backend="triton", policy=policy, **kw)
    emulated = run(q, k, v, do, policy=policy, **emu)
    bf16_o = run(q, k, v, do, policy=policy.replace(out="bf16"), **emu)
    top = 2.0 * 2.0 ** (7 - min(policy.point("acc")[0].man_bits, 7))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        ok, msg = agree(a, b, top, O_FRAC if name == "O" else 1.0)
        assert ok, (name, msg)
    for name, a, b, c in zip(("dQ", "dK"), fused[1:3], emulated[1:3], bf16_o[1:3]):
        assert (a.double() - b.double()).norm() < 0.5 * (a.double() - c.double()).norm(), name


E8M5 = PrecisionPolicy.preset("paper").replace(acc="e8m5", row_sum="e8m5", out="e8m5")
LADDER = [E8M5.replace(hp_heads=(1,)), E8M5.replace(p_bar="fp32", acc="fp32"),
          PrecisionPolicy.preset("fa2").replace(hp_heads=(0,)), PrecisionPolicy.preset("fa2").replace(p_bar="fp32"),
          E8M5.replace(hp_heads=(0,), delta="dP·P"),
          PrecisionPolicy.preset("fa2").replace(p_bar="fp16", hp_heads=(1,)),
          PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", out="fp8_e4m3", hp_heads=(0,))]


@pytest.mark.parametrize("policy", LADDER, ids=lambda p: p.describe().replace(" ", ""))
def test_per_head_fp32_and_fp32_p_bar_agree_with_the_emulated_policy(gen, policy):
    """The isolation ladder's last rungs on the kernels: heads kept in fp32 (``hp_heads``: P̄, Ō, ℓ,
    O, and δ from that fp32 O), and P̄V with P̄ in fp32. Each agrees with the emulated policy, and
    the fp32 head really is wider: its O is not representable in the others' format."""
    # per-head fp32: two batch entries and two heads (the heads are heads, not batch·head indices)
    q, k, v, do = make(gen, 2, 2, N, 32) if policy.hp_heads else make(gen, B, H, N, 32)
    kw = dict(causal=True, stabilize="tie-shift")
    fused = run(q, k, v, do, backend="triton", policy=policy, **kw)
    emulated = run(q, k, v, do, backend="emulated", policy=policy, block_q=32,
                   block_k=triton_op.key_block(32), **kw)
    fmt = policy.point("row_sum")[0] if policy.name.startswith("paper") else policy.point("out")[0]
    top = 2.0 * 2.0 ** max(0, 7 - fmt.man_bits)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        ok, msg = agree(a, b, top, O_FRAC if name == "O" else 1.0)
        assert ok, (name, msg)
    if policy.hp_heads:           # the other heads run the policy as written, δ included: bit for bit
        h = policy.hp_heads[0]
        plain = run(q, k, v, do, backend="triton", policy=policy.replace(hp_heads=()), **kw)
        for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, plain):
            assert torch.equal(a[:, 1 - h], b[:, 1 - h]), name
        for name, a, b in zip(("O", "dQ"), fused, plain):     # the fp32 head's O and δ (hence dQ) change
            assert not torch.equal(a[:, h], b[:, h]), name
    if policy.hp_heads and fmt.man_bits < 7:
        h = policy.hp_heads[0]
        narrow_o = fused[0][:, 1 - h].float()
        assert torch.equal(narrow_o, round_to(narrow_o, fmt))
        assert not torch.equal(fused[0][:, h].float(), round_to(fused[0][:, h].float(), fmt))


FORMATS = [PrecisionPolicy.preset("fa2").replace(p_bar=f, out=f) for f in ("fp8_e4m3", "fp8_e5m2", "fp16")]
FORMATS += [PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3"),
            PrecisionPolicy.preset("paper").replace(acc="fp16", row_sum="fp16", out="fp16"),
            PrecisionPolicy.preset("paper").replace(p_bar="fp8_e4m3", acc="fp8_e4m3", row_sum="fp8_e4m3",
                                                    out="fp8_e4m3")]


@pytest.mark.parametrize("policy", FORMATS, ids=lambda p: f"{p.name}-p_bar={p.p_bar}-out={p.out}")
def test_fp16_and_fp8_points_agree_with_the_emulated_policy(gen, policy):
    """P̄ and O (and ℓ, Ō under "paper") in fp16, fp8 e5m2 or e4m3 on the kernels: they round
    where the emulated backend rounds, to the same values; an fp8 O is representable in fp8."""
    q, k, v, do = make(gen, B, H, N, 32)
    kw = dict(causal=True, stabilize="tie-shift", policy=policy)
    fused = run(q, k, v, do, backend="triton", **kw)
    emulated = run(q, k, v, do, backend="emulated", block_q=32, block_k=triton_op.key_block(32), **kw)
    narrowest = min(policy.point(f)[0].man_bits for f in ("p_bar", "acc", "row_sum", "out"))
    top = 2.0 * 2.0 ** max(0, 7 - narrowest)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        ok, msg = agree(a, b, top, O_FRAC if name == "O" else 1.0)
        assert ok, (name, msg)
    out = policy.point("out")[0]
    if out.man_bits < 7:
        assert torch.equal(fused[0].float(), round_to(fused[0].float(), out))
    if policy.p_bar != "bf16":       # the rounding of P̄ shows: not what the bf16 policy computes
        plain = run(q, k, v, do, backend="triton", causal=True, stabilize="tie-shift",
                    policy=policy.replace(p_bar="bf16"))
        assert not torch.equal(fused[1], plain[1])


@pytest.mark.parametrize("rule", ["tie-shift", "all-shift"])
def test_our_shift_keeps_tied_rows_alive_in_fp8_on_the_kernels(gen, rule):
    """Rows whose maximum (10, far above e4m3's range for P̄ = e^−(β−1)·max) is tied: our rule caps
    its shift so that the tied entries' P̄ stays a normal e4m3 number, on the kernels as in the
    emulation. Uncapped, every P̄ of those rows rounded to 0 on the kernels and their O was 0."""
    n, d = 64, 32
    u = torch.randn(d, generator=gen)
    u = u / u.norm()
    q = u.expand(1, 2, n, d).clone()
    k = 0.1 * torch.randn(1, 2, n, d, generator=gen)
    k[:, :, :2] = u * 10.0 * d ** 0.5                       # scores: 10 on keys 0 and 1, tied
    v = torch.randn(1, 2, n, d, generator=gen)
    q, k, v = (t.to(torch.bfloat16).to(DEVICE) for t in (q, k, v))
    policy = PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", out="fp8_e4m3")
    fused = sf.flash_attention(q, k, v, causal=False, stabilize=rule, policy=policy, backend="triton")
    emulated = sf.flash_attention(q, k, v, causal=False, stabilize=rule, policy=policy, backend="emulated",
                                  block_q=32, block_k=triton_op.key_block(32))
    exact = reference.attention(q, k, v, causal=False)
    assert rel_err(fused, exact) <= 0.25, rel_err(fused, exact)   # e4m3 P̄ and O: 3 mantissa bits
    ok, msg = agree(fused, emulated, 2.0 * 2.0 ** 4, O_FRAC)
    assert ok, msg


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fa2", "paper"])
@pytest.mark.parametrize("causal", [True, False])
def test_soft_capped_scores_agree_with_the_emulation_and_float64(gen, policy, causal):
    """softcap·tanh(S/softcap): the kernels (forward, δ, dK/dV, dQ with the cap's slope) agree with
    the emulated backend, and both with float64 autograd through the capped scores; the cap
    changes the result (scores scaled up so that it bites)."""
    q, k, v, do = make(gen, B, H, N, 32)
    q = q * 3.0
    kw = dict(causal=causal, stabilize="tie-shift+consistent-delta", policy=policy, softcap=5.0)
    fused = run(q, k, v, do, backend="triton", **kw)
    emulated = run(q, k, v, do, backend="emulated", block_q=32, block_k=triton_op.key_block(32), **kw)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        ok, msg = agree(a, b, 2.0, O_FRAC if name == "O" else 1.0)
        assert ok, (name, msg)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = sf.attention.reference.attention(q64, k64, v64, causal=causal, softcap=5.0)
    grads = torch.autograd.grad(want, (q64, k64, v64), do.double())
    uncapped = run(q, k, v, do, backend="triton", causal=causal, stabilize="tie-shift+consistent-delta", policy=policy)
    for a, w, u in zip(fused, (want, *grads), uncapped):
        err = rel_err(a, w)
        assert err < 0.05, err                          # bf16 inputs; "paper" rounds S and ℓ, Ō too
        assert err < 0.5 * rel_err(u, w)                # the uncapped result is far off: the cap matters


def test_heads_above_the_kernels_mask_are_refused_by_name():
    from stableflash.attention.triton.launch import kernel_config
    with pytest.raises(ValueError, match=r"hp_heads=\(2, 31\) has a head above 30"):
        kernel_config(E8M5.replace(hp_heads=(2, 31)), sf.ShiftRule(), torch.bfloat16)
    assert kernel_config(E8M5.replace(hp_heads=(2, 30)), sf.ShiftRule(), torch.bfloat16).hp_heads == (2, 30)


@pytest.mark.parametrize("policy", [PrecisionPolicy.preset("fa2").replace(out="e8m4"),
                                    PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", out="fp8_e4m3"),
                                    PrecisionPolicy.preset("paper").replace(acc="e8m5", row_sum="e8m5", out="e8m5")],
                         ids=["fa2-e8m4", "fa2-fp8", "paper-e8m5"])
@pytest.mark.parametrize("backend", ["emulated", "triton"])
def test_delta_from_o_as_computed(gen, policy, backend):
    """δ from dO·O32 reads O before its store is rounded: the model still gets O in the policy's
    format, and the gradients are those of the same policy with O stored in fp32 (δ from that fp32
    O) — exactly, as nothing else in the backward depends on the stored O."""
    q, k, v, do = make(gen, 1, H, N, 32)
    kw = dict(causal=True, stabilize="tie-shift", backend=backend)
    if backend == "emulated":
        kw.update(block_q=32, block_k=triton_op.key_block(32))
    got = run(q, k, v, do, policy=policy.replace(delta="dO·O32"), **kw)
    stored = run(q, k, v, do, policy=policy, **kw)
    fp32_out = run(q, k, v, do, policy=policy.replace(out="fp32"), **kw)
    assert torch.equal(got[0], stored[0])                       # the model's O: the policy's format
    for name, a, b, c in zip(("dQ", "dK", "dV"), got[1:], fp32_out[1:], stored[1:]):
        assert torch.equal(a, b), name
        if name != "dV":                                        # dV = Pᵀ dO does not read δ
            assert not torch.equal(a, c), name                  # δ from the rounded O differs


@pytest.mark.parametrize("p_bar", ["fp8_e4m3", "e8m3"])
@pytest.mark.parametrize("backend", ["emulated", "triton"])
def test_delta_from_the_16_bit_product(gen, p_bar, backend):
    """δ from dO·O16 reads the O that P̄V with P̄ in bf16 gives, computed beside the narrow product:
    the model gets the narrow P̄'s O, and the gradients are exactly those of the bf16-P̄ policy with
    δ from O as computed (the backward recomputes P itself; only δ reads the forward's O)."""
    q, k, v, do = make(gen, 1, H, N, 32)
    policy = PrecisionPolicy.preset("fa2").replace(p_bar=p_bar)
    kw = dict(causal=True, stabilize="tie-shift", backend=backend)
    if backend == "emulated":
        kw.update(block_q=32, block_k=triton_op.key_block(32))
    got = run(q, k, v, do, policy=policy.replace(delta="dO·O16"), **kw)
    narrow = run(q, k, v, do, policy=policy, **kw)
    wide = run(q, k, v, do, policy=policy.replace(p_bar="bf16", delta="dO·O32"), **kw)
    assert torch.equal(got[0], narrow[0])                        # the model's O: the narrow P̄'s
    assert not torch.equal(got[0], wide[0])
    for name, a, b, c in zip(("dQ", "dK", "dV"), got[1:], wide[1:], narrow[1:]):
        assert torch.equal(a, b), name
        if name != "dV":                                         # dV = Pᵀ dO does not read δ
            assert not torch.equal(a, c), name


@pytest.mark.parametrize("out", ["fp8_e4m3", "bf16"])
@pytest.mark.parametrize("backend", ["emulated", "triton"])
def test_delta_from_the_16_bit_product_as_a_residual(gen, out, backend):
    """δ from dO·(O16+R): the forward keeps the 16-bit product's O as the residual of the O store, in
    bf16, and δ reads O + R. The model's O is the narrow P̄'s; dQ and dK come out far nearer those of
    δ from dO·O16 (O16 in fp32) than those of δ from the stored O. Measured, as for dO·(O+R), by the
    share of bf16 gradient entries that differ from dO·O16's."""
    q, k, v, do = make(gen, 1, 2, 50, 32)
    policy = PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", out=out)
    kw = dict(causal=True, stabilize=False, backend=backend)
    if backend == "emulated":
        kw.update(block_q=32, block_k=triton_op.key_block(32))
    got = run(q, k, v, do, policy=policy.replace(delta="dO·(O16+R)"), **kw)
    o16 = run(q, k, v, do, policy=policy.replace(delta="dO·O16"), **kw)
    stored = run(q, k, v, do, policy=policy, **kw)
    assert torch.equal(got[0], stored[0])                            # the model's O: the policy's
    assert torch.equal(got[3], o16[3])                               # dV = Pᵀ dO does not read δ
    for name, a, b, c in zip(("dQ", "dK"), got[1:3], o16[1:3], stored[1:3]):
        near, far = (a != b).float().mean().item(), (c != b).float().mean().item()
        assert far >= 0.1 and near <= far / 20, (name, near, far)


def test_the_16_bit_residual_agrees_between_the_backends(gen):
    """The kernel and the emulated backend keep the same O16 residual: their gradients under
    dO·(O16+R) agree as closely as under dO·O16 (fp32 summation orders differ between them)."""
    q, k, v, do = make(gen, 1, H, N, 32)
    policy = PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e4m3", out="fp8_e4m3")
    emu = dict(backend="emulated", block_q=32, block_k=triton_op.key_block(32))
    for delta in ("dO·(O16+R)", "dO·O16"):
        kw = dict(causal=True, stabilize=False, policy=policy.replace(delta=delta))
        got, want = run(q, k, v, do, backend="triton", **kw), run(q, k, v, do, **emu, **kw)
        for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want):
            assert rel_err(a, b) <= BOUNDS[torch.bfloat16][name] / 4, (delta, name, rel_err(a, b))


def test_the_16_bit_product_for_delta_is_refused_under_the_paper_emulation():
    from stableflash.attention.triton.launch import check_policy, kernel_config
    with pytest.raises(ValueError, match=r"delta='dO·O16' with policy=.*only under 'fa2' arithmetic"):
        check_policy(E8M5.replace(delta="dO·O16"), torch.bfloat16)
    with pytest.raises(ValueError, match=r"delta='dO·\(O16\+R\)' with policy=.*only under 'fa2' arithmetic"):
        check_policy(E8M5.replace(delta="dO*(O16+R)"), torch.bfloat16)
    fa2, rule = PrecisionPolicy.preset("fa2"), sf.ShiftRule()
    assert kernel_config(fa2.replace(delta="dO*O16"), rule, torch.bfloat16).delta is DeltaSource.DO_O16
    assert kernel_config(fa2.replace(delta="do_o16_r"), rule, torch.bfloat16).delta is DeltaSource.DO_O16_R


def assert_fp8_product_agrees(fused, emulated, truth, where=()):
    """The fp8 P̄V product's O against the emulated backend's (the same rounded P̄ and V, the same
    policy): as far from the float64 truth as the emulation is (FlashAttention's criterion: at most
    2× the same-precision reference's error, plus a few bf16 rounding steps), and, under the
    interpreter, within 2 bf16 ulps of it with almost every element identical (bf16 products summed
    in fp32 in another order may flip an O's last bit). A GPU's fp8 products accumulate with fewer
    bits: there O agrees to well under one fp8 step."""
    err = (fused.double() - truth).abs().max().item()
    ref_err = (emulated.double() - truth).abs().max().item()
    assert err <= 2.0 * ref_err + 4 * 2.0 ** -8 * truth.abs().max().item(), (*where, err, ref_err)
    if DEVICE == "cpu":
        ok, msg = agree(fused, emulated, 2.0, O_FRAC)
        assert ok, (*where, msg)
    else:
        assert rel_err(fused, emulated) < 1e-2, (*where, rel_err(fused, emulated))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_p_bar_v_on_the_fp8_tensor_cores_agrees_with_the_emulation(gen, fmt):
    """p_bar = v_bar = an fp8 format: P̄ and V rounded to it and multiplied as fp8 (FP8 attention). The
    interpreter multiplies the same rounded values in bf16: O as the emulated backend's (to its last bit or so), the
    gradients (which read V as input, not rounded) as every policy's do; a GPU's fp8 products
    accumulate with fewer bits, so there O agrees to well under one fp8 step. Rounding V shows: the
    result differs from P̄ alone in fp8."""
    q, k, v, do = make(gen, B, H, N, 32)
    policy = PrecisionPolicy.preset("fa2").replace(p_bar=fmt, v_bar=fmt)
    kw = dict(causal=True, stabilize="tie-shift+consistent-delta", policy=policy)
    fused = run(q, k, v, do, backend="triton", **kw)
    emulated = run(q, k, v, do, backend="emulated", block_q=32, block_k=triton_op.key_block(32), **kw)
    assert_fp8_product_agrees(fused[0], emulated[0], reference.attention(q, k, v, causal=True))
    for name, a, b in zip(("dQ", "dK", "dV"), fused[1:], emulated[1:]):
        ok, msg = agree(a, b, 2.0)
        assert ok, (name, msg)
    p_only = forward(q, k, v, backend="triton", causal=True, stabilize="tie-shift+consistent-delta",
                     policy=policy.replace(v_bar="fp32"))
    assert not torch.equal(fused[0], p_only)


@pytest.mark.slow
@pytest.mark.parametrize("delta", ["dO·O", "dO·(O16+R)"])
def test_the_fp8_product_reads_v_converted_once_for_every_head_group(gen, delta):
    """The launcher converts V to fp8 once per call, laid out (B, H_kv, d, N); each program finds
    its head's V there — grouped-query heads, keys fewer or more than the queries, a ragged last
    key block, V handed in as a (B, N, H, d) buffer — and the 16-bit product beside it (the guard's
    δ for fp8) still reads V itself: O as accurate as the emulated backend's and within a bf16 ulp or
    two of it (well under one fp8 step on a GPU), and bit for bit the same with V given contiguous."""
    short = 20 if DEVICE == "cpu" else 40           # the interpreter's key blocks: 16 and a ragged 4
    # two batch entries in the square shape (V's batch offset there); the others, keys fewer or more
    # than the queries, also read V at head offsets (two K/V heads)
    for b, n_q, n_k, causal in ((B, short, N, False), (B, N, short, False), (2, N, N, True)):
        q, k, v, do = make(gen, b, 4, n_q, 32, n_k=n_k, h_kv=2)
        v_bnhd = v.transpose(1, 2).contiguous().transpose(1, 2)          # (B, N, H, d) memory
        policy = PrecisionPolicy.preset("fa2").replace(p_bar="fp8_e5m2", v_bar="fp8_e5m2", delta=delta)
        kw = dict(causal=causal, policy=policy)
        fused = run(q, k, v_bnhd, do, backend="triton", **kw)
        emulated = run(q, k, v, do, backend="emulated", block_q=32, block_k=triton_op.key_block(32), **kw)
        truth = reference.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=causal)
        assert_fp8_product_agrees(fused[0], emulated[0], truth, (n_q, n_k))
        with torch.no_grad():                                  # V contiguous: the forward alone
            assert torch.equal(sf.flash_attention(q, k, v, backend="triton", **kw), fused[0])
        for name, a, b in zip(("dQ", "dK", "dV"), fused[1:], emulated[1:]):
            ok, msg = agree(a, b, 2.0)
            assert ok, (n_q, n_k, name, msg)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_v_converted_for_the_fp8_product_rounds_as_round_to(fmt):
    """The launcher's one conversion of V for the fp8 product: nearest-even, e4m3 saturating at ±448
    beyond its range (464, 1e9, ±inf included; torch 2.11's own cast gives NaN there), e5m2 to ±inf,
    subnormals and NaN kept — round_to's values, in the (B, H, d, N) layout."""
    from stableflash.attention.triton.op import _v_for_fp8_product
    from stableflash.numerics import round_to
    g = torch.Generator().manual_seed(3)
    v = torch.randn(2, 3, 16, 8, generator=g) * 40
    v.view(-1)[:10] = torch.tensor([464.0, 500.0, 1e9, -1e9, float("inf"), float("-inf"), float("nan"),
                                    1e-3, -2e-6, 61440.0])
    v = v.to(torch.bfloat16).to(DEVICE)
    got = _v_for_fp8_product(v, Format.named(fmt)).float()
    want = round_to(v.float().cpu(), fmt).transpose(-1, -2).to(DEVICE)
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_v_bar_narrows_only_and_only_as_an_fp8_product_on_the_kernels():
    from stableflash.attention.triton.launch import check_policy, kernel_config
    fa2, rule = PrecisionPolicy.preset("fa2"), sf.ShiftRule()
    assert not fa2.narrows_v and not fa2.replace(v_bar="bf16").narrows_v and fa2.replace(v_bar="e8m3").narrows_v
    assert kernel_config(fa2.replace(v_bar="bf16"), rule, torch.bfloat16) == kernel_config(fa2, rule, torch.bfloat16)
    for changes in ({"v_bar": "fp8_e4m3"}, {"p_bar": "fp8_e5m2", "v_bar": "fp8_e4m3"}, {"v_bar": "e8m3"}):
        with pytest.raises(ValueError, match=r"is not implemented by backend='triton'; accepted: .*v_bar equal to an fp8"):
            check_policy(fa2.replace(**changes), torch.bfloat16)


@pytest.mark.parametrize("source", ["dP·P", "recompute_fp32"])
@pytest.mark.parametrize("policy", ["fa2", "paper"])
def test_delta_sources_agree_with_the_emulation(gen, source, policy):
    q, k, v, do = make(gen, 1, H, N, 32)
    pol = PrecisionPolicy.preset(policy).replace(delta=source)
    fused = run(q, k, v, do, backend="triton", causal=True, policy=pol)
    emulated = run(q, k, v, do, backend="emulated", causal=True, policy=pol, block_q=32,
                   block_k=triton_op.key_block(32))
    for name, a, b in zip(("dQ", "dK", "dV"), fused[1:], emulated[1:]):
        ok, msg = agree(a, b, 2.0)
        assert ok, (name, msg)


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("stabilize", [False, True])
def test_a_chosen_key_block_agrees_with_the_emulation(gen, block, stabilize):
    """Under "paper" the key block is part of the arithmetic (ℓ and Ō are rounded after each): the
    kernel walks the keys in the block it is given — 128 covers the whole sequence, the ladder's
    "tiling off" — and computes what the emulation computes with that block, bit for bit here."""
    q, k, v, do = make(gen, 1, H, N, 32)
    pol = PrecisionPolicy.preset("paper").replace(acc="e8m4", row_sum="e8m4", out="e8m4")
    kw = dict(causal=True, stabilize=stabilize, policy=pol)
    fused = run(q, k, v, do, backend="triton", block_k=block, **kw)
    emulated = run(q, k, v, do, backend="emulated", block_q=32, block_k=block, **kw)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        ok, msg = agree(a, b, 2.0 * 2.0 ** 3, O_FRAC if name == "O" else 1.0)
        assert ok, (name, msg)
    own = forward(q, k, v, backend="triton", **kw)              # the kernel's own block (16 here): it differs
    assert not torch.equal(fused[0], own)


@pytest.mark.parametrize("kw,match", [
    (dict(policy="fa2", block_k=32), r"block_k=32 with policy=fa2\(.*takes a key block only under the 'paper'"),
    (dict(policy="paper", block_k=96), r"block_k=96 is not a key block the kernels take; accepted: one of \(16, 32"),
    (dict(policy="paper", block_k=1024), r"block_k=1024 is not a key block"),
    (dict(policy="paper", block_k=512, d=128), r"block_k=512 with head_dim=128 is not a key block .* ≤ 32768"),
])
def test_key_blocks_the_kernels_cannot_take_are_refused_by_name(gen, kw, match):
    q, k, v, _ = make(gen, 1, 2, 8, kw.pop("d", 32))
    with pytest.raises(ValueError, match=match):
        sf.flash_attention(q, k, v, backend="triton", **kw)


@pytest.mark.parametrize("rm", [3.0, -3.0, 0.0, 40.0])
def test_repeated_maxima(gen, rm):
    """Rows whose maximum is attained several times, at positive, negative, zero and large maxima:
    for every rule the output matches float64, and the gradients are as accurate as the emulated
    backend's under the same policy (at rm = 40, bf16's δ = rowsum(dO∘O) makes dQ inaccurate in
    both: that is the paper's subject, not a kernel fault)."""
    n, d = 48, 16
    a = rm - 0.1 - torch.rand(n, generator=gen) * 3
    a[[3, 20, 21]] = rm
    q = torch.randn(1, 2, n, d, generator=gen)
    q[..., 0] = 1.0
    k = torch.zeros(1, 2, n, d)
    k[..., 0] = a
    v = torch.randn(1, 2, n, d, generator=gen)
    do = torch.randn(1, 2, n, d, generator=gen)
    q, k, v, do = (t.bfloat16().to(DEVICE) for t in (q, k, v, do))
    want = reference.forward_backward(q, k, v, do, scale=1.0)
    for stabilize in (False, "paper", True, "all-shift"):
        fused = run(q, k, v, do, scale=1.0, stabilize=stabilize, backend="triton")
        emulated = run(q, k, v, do, scale=1.0, stabilize=stabilize, backend="emulated", block_q=32,
                       block_k=triton_op.key_block(16))
        assert rel_err(fused[0], want[0]) <= BOUNDS[torch.bfloat16]["O"], (stabilize, rel_err(fused[0], want[0]))
        assert agree(fused[0], emulated[0], 1.0, O_FRAC)[0], stabilize
        for name, f, e, w in zip(("dQ", "dK", "dV"), fused[1:], emulated[1:], want[1:]):
            assert rel_err(f, w) <= 1.5 * rel_err(e, w) + 2 ** -8, (stabilize, name, rel_err(f, w), rel_err(e, w))


def test_non_contiguous_inputs_are_copied(gen):
    q, k, v, do = make(gen, 1, 2, 40, 32)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)          # (B, N, H, D) memory, (B, H, N, D) view
    wide = torch.cat([k, k], dim=-1)[..., ::2]                   # last dim strided: must be copied
    assert not qt.is_contiguous() and wide.stride(-1) == 2
    o = sf.flash_attention(qt, wide, v, backend="triton")
    assert rel_err(o, reference.attention(q, wide, v)) <= 1e-2


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3], CASES[4]])
@pytest.mark.parametrize("stabilize", [False, True])
def test_tensor_descriptor_loops_give_the_same_results(gen, case, stabilize, monkeypatch):
    """The forward's TMA path (tensor descriptors for K and V; rows past n_k read as zeros) is
    bit-identical to the pointer path: O and what the backward takes from the forward (LSE, O32),
    hence the gradients (``forward_outputs``), ragged tails and grouped-query attention included."""
    b, h, h_kv, n_q, n_k, d = case
    q, k, v, _ = make(gen, b, h, n_q, d, n_k, h_kv)
    monkeypatch.setattr(triton_op, "TMA", False)
    pointers = forward_outputs(q, k, v, monkeypatch, causal=True, stabilize=stabilize, backend="triton")
    monkeypatch.setattr(triton_op, "_use_tma", lambda *ts: True)
    descriptors = forward_outputs(q, k, v, monkeypatch, causal=True, stabilize=stabilize, backend="triton")
    for name, a, t in zip(("O", "LSE", "O32"), pointers, descriptors):
        assert torch.equal(a, t), name


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fa2", "paper"])
def test_persistent_grid_gives_the_same_results(gen, policy, monkeypatch):
    """A persistent forward (a few programs walking every (query block, head) tile, longest first)
    computes each tile as the one-program-per-tile grid does: bit for bit in O and what the backward
    takes from the forward (LSE, O32), hence in the gradients (``forward_outputs``), ragged and
    grouped too (40 rows: two query blocks of the interpreter's 32, the last ragged, so the tiles
    differ in length), with one program per SM and with three (the one-program-per-tile result
    computed once for both)."""
    q, k, v, _ = make(gen, B, 4, 40, 32, h_kv=2)
    kw = dict(causal=True, stabilize="tie-shift+consistent-delta", policy=policy, backend="triton")
    want = forward_outputs(q, k, v, monkeypatch, **kw)
    for programs_per_sm in (1, 3):
        monkeypatch.setattr(triton_op, "PERSISTENT", programs_per_sm)
        got = forward_outputs(q, k, v, monkeypatch, **kw)
        for name, a, b in zip(("O", "LSE", "O32"), got, want):
            assert torch.equal(a, b), (programs_per_sm, name)


def test_tma_allocator_is_set_on_every_thread_and_a_users_is_kept(monkeypatch):
    """Triton's allocator is per thread (a context variable) and autograd runs the backward on its
    own thread: a TMA launch on a thread with no allocator must install one; one the user set stays."""
    import threading

    from triton.runtime import _allocation
    monkeypatch.setattr(triton_op, "interpreting", lambda: False)
    seen = {}

    def fresh_thread():
        seen["before"] = _allocation._allocator.get()
        triton_op._ensure_allocator()
        seen["after"] = _allocation._allocator.get()
        users = lambda size, align, stream: None  # noqa: E731
        triton.set_allocator(users)
        triton_op._ensure_allocator()
        seen["kept"] = _allocation._allocator.get() is users

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    assert isinstance(seen["before"], _allocation.NullAllocator)
    assert seen["after"] is triton_op._torch_scratch and seen["kept"]


@pytest.mark.slow
def test_torch_compile_traces_through_without_graph_break(gen):
    q, k, v, do = make(gen, 1, H, 40, 32)

    def f(q, k, v):
        return sf.flash_attention(q, k, v, causal=True, backend="triton") * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = run(q, k, v, do, causal=True, backend="triton")
    q_, k_, v_ = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = compiled(q_, k_, v_)
    grads = torch.autograd.grad(o, (q_, k_, v_), do)
    assert torch.equal(o, got[0] * 2.0)
    for a, b in zip(grads, got[1:]):
        torch.testing.assert_close(a, b * 2.0, rtol=0, atol=0)


def test_outputs_and_gradients_are_laid_out_like_the_inputs(gen):
    """q, k, v as a model makes them — (B, H, N, d) views of one (B, N, 3·H·d) projection — give O
    and dQ, dK, dV in (B, N, H, d) memory, so the model's transpose back and the join of the
    gradients are cheap; the numbers equal those from contiguous inputs bit for bit."""
    B, N, H, d = 1, 40, 2, 32
    x = torch.randn(B, N, 3 * H * d, generator=gen).to(torch.bfloat16).to(DEVICE)
    q, k, v = (t.view(B, N, H, d).transpose(1, 2) for t in x.split(H * d, dim=2))
    do = torch.randn(B, H, N, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    got = run(q, k, v, do, causal=True, backend="triton")
    want = run(q.contiguous(), k.contiguous(), v.contiguous(), do, causal=True, backend="triton")
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want):
        assert torch.equal(a, b), name
        assert a.stride() == (N * H * d, d, H * d, 1), (name, a.stride())
        assert b.is_contiguous(), name                   # contiguous inputs: contiguous outputs
    lse = torch.zeros(B, H, N, device=DEVICE)
    for residual, delta in ((do.new_empty(0), DeltaSource.DO_O),
                            (torch.zeros(B, H, N, d, dtype=do.dtype, device=DEVICE), DeltaSource.DO_O_R)):
        config = KernelConfig(narrow=Format.BF16, narrow_out=True, delta=delta)
        args = (do, q, k, v, got[0], residual, lse, True, 0.25, config.op_key)
        torch.library.opcheck(triton_op.attn_bwd, args, test_utils=("test_schema", "test_faketensor"))


def test_custom_ops_pass_the_opcheck(gen):
    from stableflash.attention.triton.launch import kernel_config
    q, k, v, _ = make(gen, 1, 2, 20, 16)
    fa2, rule = PrecisionPolicy.preset("fa2"), sf.ShiftRule("tie-shift")
    policies = (fa2, fa2.replace(out="fp32"), fa2.replace(hp_heads=(1,)), fa2.replace(delta="dO·O16"),
                fa2.replace(delta="dO·(O+R)"), fa2.replace(delta="dO·(O16+R)"),
                fa2.replace(p_bar="fp8_e4m3", v_bar="fp8_e4m3", out="e8m3:stochastic"))
    for policy in policies:
        args = (q, k, v, True, 0.25, kernel_config(policy, rule, q.dtype).op_key)
        torch.library.opcheck(triton_op.attn_fwd, args, test_utils=("test_schema", "test_faketensor"))
    args = (q, k, v, True, 0.25, kernel_config(E8M5, rule, q.dtype, 5.0, 32).op_key)
    torch.library.opcheck(triton_op.attn_fwd, args, test_utils=("test_schema", "test_faketensor"))
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))   # (B, N, H, d) memory
    args = (qt, kt, vt, True, 0.25, kernel_config(fa2, rule, q.dtype).op_key)
    torch.library.opcheck(triton_op.attn_fwd, args, test_utils=("test_schema", "test_faketensor"))


BAD = [
    (dict(dtype=torch.float32), TypeError, r"backend='triton' takes float16 or bfloat16; got dtype torch.float32"),
    (dict(d=48), ValueError, r"supports head_dim in \(16, 32, 64, 128, 256\); got head_dim=48"),
    (dict(policy="fp32"), ValueError, r"not implemented by backend='triton'"),
    (dict(policy="paper", dtype=torch.float16), ValueError, r"not implemented by backend='triton'"),
    (dict(policy=PrecisionPolicy.preset("fa2").replace(p_bar="e8m5:stochastic")), ValueError, r"not implemented"),
    (dict(policy=PrecisionPolicy.preset("paper").replace(out="e8m4")), ValueError, r"in one shared format bf16, e8m1-e8m6"),
    (dict(policy=PrecisionPolicy.preset("fa2").replace(out="e8m4:rtz")), ValueError, r"not implemented"),
    (dict(policy=PrecisionPolicy.preset("paper").replace(acc="e8m5:stochastic", row_sum="e8m5", out="e8m5")),
     ValueError, r"\(each nearest-even, or ':stochastic'\)"),
    (dict(policy=PrecisionPolicy.preset("fa2").replace(out="bf16:stochastic"), dtype=torch.float16), ValueError,
     r"not implemented"),
    (dict(policy=PrecisionPolicy.preset("fa2").replace(out="fp8_e5m2:rtz")), ValueError,
     r"fp16, fp8_e5m2 or fp8_e4m3 \(each nearest-even, or ':stochastic'\)"),
    (dict(policy=PrecisionPolicy.preset("fa2", "fp16").replace(out="fp8_e4m3"), dtype=torch.float16), ValueError,
     r"not implemented"),
    (dict(policy=PrecisionPolicy.preset("paper").replace(acc="e8m5", row_sum="e8m4", out="fp32")), ValueError,
     r"each in fp32 or in one shared format"),
]


@pytest.mark.parametrize("kw,exc,match", BAD)
def test_bad_inputs_raise_clear_errors(gen, kw, exc, match):
    d = kw.pop("d", 32)
    dtype = kw.pop("dtype", torch.bfloat16)
    q, k, v, _ = make(gen, 1, 2, 8, d, dtype=dtype)
    with pytest.raises(exc, match=match):
        sf.flash_attention(q, k, v, backend="triton", **kw)


def test_cpu_tensors_without_the_interpreter_are_refused(gen, monkeypatch):
    from stableflash.attention.triton import launch
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    q, k, v, _ = make(gen, 1, 2, 8, 32)
    with pytest.raises(ValueError, match=r"needs CUDA tensors; got device cpu"):
        sf.flash_attention(q.cpu(), k.cpu(), v.cpu(), backend="triton")


@pytest.mark.gpu
def test_auto_picks_triton_on_cuda(gen):
    q, k, v, _ = make(gen, 1, 2, 64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = sf.flash_attention(q, k, v, causal=True)
    assert torch.equal(o, sf.flash_attention(q, k, v, causal=True, backend="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 12, 1024, 64), (1, 16, 4096, 64), (1, 8, 2048, 128), (2, 4, 1000, 256)])
@pytest.mark.parametrize("stabilize", [False, True, "paper", "all-shift"])
def test_full_shapes_against_references(gen, shape, stabilize):
    """At full shapes on the GPU, error against float64 compared with two references at the same
    precision: the emulated backend under the same stabilization (the same algorithm in PyTorch) and
    SDPA. Every stabilization: at most 1.25× the emulated backend's error (+ 2⁻⁹ slack). None, the
    default and the paper's rule, which leave the largest P̄ of a row at exactly 1: also at most 1.25×
    SDPA's. "all-shift" rounds the largest P̄ of every row, an accuracy cost of the rule itself, not
    of the kernel: 0.9-3.4× SDPA's dQ and dK error on this shape list, with the kernel's error equal to the
    emulated backend's (docs/kernels.md, benchmarks/results/all-shift-error-H100-2026-11-24.txt)."""
    b, h, n, d = shape
    q, k, v, do = make(gen, b, h, n, d)
    want = reference.forward_backward(q, k, v, do, causal=True)
    ours = run(q, k, v, do, causal=True, stabilize=stabilize, backend="triton")
    references = {"emulated": run(q, k, v, do, causal=True, stabilize=stabilize, backend="emulated")}
    if stabilize != "all-shift":
        references["sdpa"] = run(q, k, v, do, causal=True, stabilize=False, backend="sdpa")
    for ref_name, theirs in references.items():
        for name, a, s, w in zip(("O", "dQ", "dK", "dV"), ours, theirs, want):
            e_ours, e_ref = rel_err(a, w), rel_err(s, w)
            assert e_ours <= 1.25 * e_ref + 2 ** -9, (ref_name, name, e_ours, e_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block,d", [(512, 64), (256, 128), (128, 256), (16, 64)])
def test_chosen_key_blocks_at_full_shapes(gen, block, d):
    """The tiles of ``key_block_config`` on the GPU (512 keys at once: the ladder's "tiling off" at
    context 512): against the emulation with the same block."""
    q, k, v, do = make(gen, 2, 6, 512, d)
    pol = PrecisionPolicy.preset("paper").replace(acc="e8m5", row_sum="e8m5", out="e8m5")
    kw = dict(causal=True, stabilize="tie-shift+consistent-delta", policy=pol, block_k=block)
    fused = run(q, k, v, do, backend="triton", **kw)
    emulated = run(q, k, v, do, backend="emulated", block_q=64, **kw)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        ok, msg = agree(a, b, 2.0 * 2.0 ** 2, O_FRAC if name == "O" else 1.0)
        assert ok, (name, block, d, msg)


@pytest.mark.parametrize("stabilize", ["tie-shift+consistent-delta", "all-shift"])
def test_bounded_rules_stay_finite_at_huge_bf16_logits(stabilize):
    """The "paper" emulation rounds the shift up into bf16; at logits of 16 512 that would underflow
    every P̄ of the row (a NaN seen in training). The kernel falls back as the emulation does."""
    from tests.attention.test_emulated import huge_tied_logits
    q, k, v = (t.to(DEVICE) for t in huge_tied_logits())
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q)
    kw = dict(scale=1.0, stabilize=stabilize, policy="paper")
    fused = run(q, k, v, do, backend="triton", **kw)
    emulated = run(q, k, v, do, backend="emulated", block_q=32, block_k=triton_op.key_block(16), **kw)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), fused, emulated):
        assert torch.isfinite(a).all(), name
        ok, msg = agree(a, b, 2.0, O_FRAC if name == "O" else 1.0)
        assert ok, (name, msg)


def test_stabilize_true_reads_delta_from_o_plus_its_residual(gen):
    """The drop-in's default on the kernels: the standard kernel's O, bit for bit, and δ from the
    stored O plus its bf16 residual (policy.consistent_delta_source for a bf16 kernel); "tie-shift+consistent-delta" adds our
    rule to the same δ."""
    q, k, v, do = make(gen, 1, H, N, 32)
    fa2 = PrecisionPolicy.preset("fa2")
    got = run(q, k, v, do, causal=True, stabilize=True, backend="triton")
    want = run(q, k, v, do, causal=True, stabilize=False, backend="triton", policy=fa2.replace(delta="dO·(O+R)"))
    standard = run(q, k, v, do, causal=True, stabilize=False, backend="triton")
    assert torch.equal(got[0], standard[0])
    for name, a, b, c in zip(("dQ", "dK", "dV"), got[1:], want[1:], standard[1:]):
        assert torch.equal(a, b), name
        if name != "dV":
            assert not torch.equal(a, c), name
    ref = reference.forward_backward(q, k, v, do, causal=True)
    for name, a, r in zip(("O", "dQ", "dK", "dV"), got, ref):
        assert rel_err(a, r) <= BOUNDS[torch.bfloat16][name], name
    both = run(q, k, v, do, causal=True, stabilize="tie-shift+consistent-delta", backend="triton")
    rule = run(q, k, v, do, causal=True, stabilize="tie-shift", backend="triton", policy=fa2.replace(delta="dO·(O+R)"))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), both, rule):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("policy", [PrecisionPolicy.preset("fa2"), PrecisionPolicy.preset("fa2").replace(out="e8m4")],
                         ids=["fa2-bf16", "fa2-e8m4"])
@pytest.mark.parametrize("backend", ["emulated", "triton"])
def test_delta_from_o_plus_its_residual(gen, policy, backend):
    """δ from dO·(O+R): the forward keeps the O store's residual in bf16 instead of an fp32 O. The
    model's O is the policy's; δ, hence dQ and dK, come out far nearer those of δ from O as computed
    (dO·O32) than those of δ from the stored O — bf16 + bf16 holds O to about 16 bits. Measured by
    the share of bf16 gradient entries that differ from dO·O32's (a norm would only see the
    gradients' own bf16 rounding)."""
    q, k, v, do = make(gen, 1, 2, 50, 32)
    kw = dict(causal=True, stabilize="tie-shift", backend=backend)
    if backend == "emulated":
        kw.update(block_q=32, block_k=triton_op.key_block(32))
    got = run(q, k, v, do, policy=policy.replace(delta="dO·(O+R)"), **kw)
    exact = run(q, k, v, do, policy=policy.replace(delta="dO·O32"), **kw)
    stored = run(q, k, v, do, policy=policy, **kw)
    assert torch.equal(got[0], stored[0])
    assert torch.equal(got[3], exact[3])                             # dV = Pᵀ dO does not read δ
    for name, a, b, c in zip(("dQ", "dK"), got[1:3], exact[1:3], stored[1:3]):
        near, far = (a != b).float().mean().item(), (c != b).float().mean().item()
        assert far >= 0.1 and near <= far / 20, (name, near, far)


def test_the_delta_kernel_adds_the_residual_itself(gen):
    """The δ kernel reads O and R and sums dO ∘ (O + R) in fp32, with no fp32 O + R in memory: its
    gradients equal, bit for bit, those of the same backward handed O + R already summed in fp32 —
    also for an O with the model's (B, T, H, d) strides, while R is contiguous (B, H, T, d)."""
    q, k, v, do = make(gen, 2, 3, 45, 32)
    o = torch.randn(2, 45, 3, 32, generator=gen).to(q.device, torch.bfloat16).transpose(1, 2)   # the model's layout
    r = (torch.randn(2, 3, 45, 32, generator=gen) * 2.0 ** -9).to(q.device, torch.bfloat16)
    config = KernelConfig(narrow=Format.BF16, narrow_out=True)
    _, lse, _ = triton_op._forward(q, k, v, True, 32 ** -0.5, config)
    args = (lse, True, 32 ** -0.5, KernelConfig(narrow=Format.BF16, narrow_out=True, delta=DeltaSource.DO_O_R))
    got = triton_op._backward_impl(do, q, k, v, o, r, *args)
    summed = triton_op._backward_impl(do, q, k, v, o.float() + r.float(), r.new_empty(0), *args)
    stored = triton_op._backward_impl(do, q, k, v, o, r.new_empty(0), *args)
    for name, a, b, c in zip(("dQ", "dK", "dV"), got, summed, stored):
        assert torch.equal(a, b), name
        if name != "dV":                          # R moves δ, so dQ and dK: the residual was read
            assert not torch.equal(a, c), name


def test_the_o_residual_halves_what_the_backward_keeps(gen):
    """Bytes saved for the backward (beside the output, which the caller holds anyway): an fp32 O
    for dO·O32, a bf16 residual for dO·(O+R)."""
    q, k, v, _ = make(gen, 1, 2, 64, 32)
    fa2 = PrecisionPolicy.preset("fa2")

    def extra_bytes(policy):
        from stableflash.bench.attention import saved_for_backward
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o, kept = saved_for_backward(lambda q, k, v: sf.flash_attention(
            q, k, v, causal=True, stabilize="tie-shift", backend="triton", policy=policy), *leaves)
        return kept - 4 * o.shape[2] * o.shape[1] * o.shape[0]            # less the fp32 LSE
    n = q.numel()
    assert extra_bytes(fa2.replace(delta="dO·O32")) == 4 * n
    assert extra_bytes(fa2.replace(delta="dO·(O+R)")) == 2 * n
    assert extra_bytes(fa2) == 0
    fp8 = fa2.replace(p_bar="fp8_e4m3", out="fp8_e4m3")
    assert extra_bytes(fp8.replace(delta="dO·O16")) == 4 * n
    assert extra_bytes(fp8.replace(delta="dO·(O16+R)")) == 2 * n
