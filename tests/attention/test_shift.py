"""The row-maximum rules: exact in float64, and which tied-maximum cases each one leaves open."""
import math

import pytest
import torch

from stableflash import flash_attention
from stableflash.attention import reference
from stableflash.attention.emulated import emulated_forward
from stableflash.attention.policy import PrecisionPolicy
from stableflash.attention.shift import RULES, ShiftRule, next_shift, row_shift
from stableflash.numerics import round_to
from tests.conftest import rel_err


def tied_inputs(gen, rm: float, n: int = 97, ties=(5, 40, 41), d: int = 4, b: int = 2, h: int = 2,
                spread: float = 3.0):
    """q, k, v (float64) whose scores S_ij = a_j exactly for every row (scale 1), maximum ``rm``
    attained at the key positions ``ties``; the other keys lie 0.1 to ``spread`` below it."""
    a = rm - 0.1 - torch.rand(n, generator=gen, dtype=torch.float64) * spread
    a[list(ties)] = rm
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(b, h, n, d, dtype=torch.float64)
    k[..., 0] = a
    v = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("rm", [3.0, -3.0, 0.0, 1e-4, -1e-4, 40.0, -40.0])
@pytest.mark.parametrize("kind", RULES)
def test_every_rule_is_exact_in_float64(gen, rm, kind):
    """Stabilized ≡ standard to 1e-12 in float64, tiled (3 key blocks) and untiled."""
    q, k, v = tied_inputs(gen, rm)
    rule = ShiftRule(kind, beta=2.0)
    expected = reference.attention(q, k, v, scale=1.0)
    assert rel_err(reference.attention(q, k, v, scale=1.0, rule=rule), expected) <= 1e-12
    fp64 = PrecisionPolicy.preset("fp64")
    for block in (32, 97):
        out = emulated_forward(q, k, v, causal=False, scale=1.0, policy=fp64, rule=rule,
                               block_q=32, block_k=block).out
        assert rel_err(out, expected) <= 1e-12, (kind, rm, block)


@pytest.mark.parametrize("rm", [3.0, -3.0, 0.0, 1e-4, -1e-4, 0.5, 40.0, -40.0])
def test_our_rule_makes_tied_pbar_less_than_one(gen, rm):
    """In every row with repeated maxima, max P̄ < 1 under our rule, also after rounding to bf16."""
    q, k, v = tied_inputs(gen, rm)
    s = reference.scores(q, k, scale=1.0)
    m = row_shift(s, ShiftRule("tie-shift"))
    p_bar = torch.exp(s - m.unsqueeze(-1))
    assert p_bar.amax() < 1.0
    assert round_to(p_bar.float(), "bf16").amax() < 1.0
    assert torch.isfinite(m).all() and (p_bar.sum(-1) > 0).all()


@pytest.mark.parametrize("rm,why", [(0.0, "rm = 0 gets m = 0"), (1e-4, "exp(-1e-4) rounds to 1"),
                                    (-1e-4, "exp(-1e-4) rounds to 1")])
def test_paper_rule_leaves_small_maxima_open(gen, rm, why):
    q, k, v = tied_inputs(gen, rm)
    s = reference.scores(q, k, scale=1.0)
    m = row_shift(s, ShiftRule("paper", beta=2.0))
    p_bar_bf16 = round_to(torch.exp(s - m.unsqueeze(-1)).float(), "bf16")
    assert (p_bar_bf16 == 1.0).sum(-1).min() >= 2, why


@pytest.mark.filterwarnings("ignore:flash_attention\\(stabilize='paper'\\) returned non-finite:RuntimeWarning")
@pytest.mark.parametrize("rm,beta", [(120.0, 2.0), (-120.0, 2.0), (20.0, 8.0)])
def test_paper_rule_underflows_and_tie_shift_does_not(gen, rm, beta):
    """Large |rm|: the paper's shift drives ℓ to 0 in fp32 and O to NaN; ours stays exact."""
    q, k, v = (t.float() for t in tied_inputs(gen, rm))
    expected = reference.attention(q, k, v, scale=1.0)
    paper = flash_attention(q, k, v, scale=1.0, stabilize="paper", beta=beta, backend="emulated", policy="fp32")
    ours = flash_attention(q, k, v, scale=1.0, stabilize="tie-shift", beta=beta, backend="emulated", policy="fp32")
    assert torch.isnan(paper).any()
    assert rel_err(ours, expected) <= 1e-5


def test_paper_rule_loses_precision_in_subnormals_and_ours_does_not(gen):
    """rm = 100, β = 2: exp(−100) ≈ 3.7e-44 is an fp32 subnormal, so ℓ and Ō keep only a few bits."""
    q, k, v = (t.float() for t in tied_inputs(gen, 100.0, spread=0.5))
    expected = reference.attention(q, k, v, scale=1.0)
    paper = flash_attention(q, k, v, scale=1.0, stabilize="paper", backend="emulated", policy="fp32")
    ours = flash_attention(q, k, v, scale=1.0, stabilize="tie-shift", backend="emulated", policy="fp32")
    assert rel_err(paper, expected) > 1e-2
    assert rel_err(ours, expected) <= 1e-5


def test_ties_split_across_key_blocks(gen):
    """Maxima in different key blocks: the paper's per-block count misses them, ours does not."""
    q, k, v = (t.float() for t in tied_inputs(gen, 2.0, n=96, ties=(3, 50)))
    bf16 = PrecisionPolicy.preset("fa2")
    counts = {kind: emulated_forward(q, k, v, causal=False, scale=1.0, policy=bf16, rule=ShiftRule(kind),
                                     block_q=32, block_k=32).pbar_ones for kind in RULES}
    assert (counts["standard"] == 2).all()
    assert (counts["paper"] == 2).all()          # each block sees one maximum: rs = 1, no shift
    assert (counts["tie-shift"] == 0).all()
    within = emulated_forward(q, k, v, causal=False, scale=1.0, policy=bf16, rule=ShiftRule("paper"),
                              block_q=32, block_k=96).pbar_ones
    assert (within == 0).all()                   # one block: the paper's rule catches them


def test_next_shift_is_monotone_and_bounds_the_block(gen):
    s = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64) * 4
    s[..., 3] = s[..., 7] = s.amax(-1) + 0.0
    s[0, 0] = -math.inf                          # a row fully masked in this block (causal tiles)
    m_prev = torch.randn(3, 5, generator=gen, dtype=torch.float64) - 20
    for kind in RULES:
        m, r = next_shift(s, m_prev, m_prev.clone(), ShiftRule(kind))
        assert (m >= m_prev).all() and (m >= s.amax(-1)).all()
        assert torch.equal(r, torch.maximum(m_prev, s.amax(-1)))
        assert m[0, 0] == m_prev[0, 0], kind      # a masked row keeps its shift


def test_paper_rule_matches_algorithm_3_by_hand():
    s = torch.tensor([[2.0, 2.0, 1.0], [-1.0, -1.0005, -3.0], [1.5, 0.0, -2.0], [0.0, 0.0, -1.0]],
                     dtype=torch.float64)
    m = row_shift(s, ShiftRule("paper", beta=3.0, eps=1e-3))
    assert m.tolist() == [6.0, 0.0, 1.5, 0.0]
    ours = row_shift(s, ShiftRule("tie-shift", beta=3.0, eps=1e-3))
    assert ours[0].item() == 6.0                  # = β·rm between the clamps
    assert ours[1].item() == pytest.approx(-1.0 + 2.0)
    assert ours[2].item() == 1.5                  # unique maximum: unchanged
    assert ours[3].item() == pytest.approx(math.log(8 / 7))


@pytest.mark.parametrize("kwargs,match", [({"beta": 1.0}, "beta=1.0"), ({"beta": 0.5}, "beta=0.5"),
                                          ({"beta": float("nan")}, "beta=nan"), ({"eps": -1e-3}, "eps=-0.001"),
                                          ({"kind": "fancy"}, "'fancy'")])
def test_rule_rejects_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShiftRule(**kwargs)


def test_capped_rule_keeps_pbar_normal_in_fp8():
    rule = ShiftRule("tie-shift").capped_for(2.0 ** -6)   # fp8 e4m3's smallest normal
    assert math.exp(-rule.max_shift) >= 2.0 ** -6
    assert rule.max_shift < ShiftRule("tie-shift").max_shift


def test_shift_rule_takes_any_real_number_type():
    """NumPy scalars and ints are numbers as floats are: stored as plain floats (so equal rules hash
    alike), bools and non-finite values refused by name."""
    np = pytest.importorskip("numpy")
    rule = ShiftRule("tie-shift", beta=np.float32(4.0), eps=np.float64(1e-3), min_shift=np.float32(0.25), max_shift=8)
    assert rule == ShiftRule("tie-shift", beta=4.0, eps=1e-3, min_shift=0.25, max_shift=8.0)
    assert all(type(getattr(rule, f)) is float for f in ("beta", "eps", "min_shift", "max_shift"))
    assert hash(rule) == hash(ShiftRule("tie-shift", beta=4.0, eps=1e-3, min_shift=0.25, max_shift=8.0))
    with pytest.raises(ValueError, match="beta=True is invalid"):
        ShiftRule("tie-shift", beta=True)
    with pytest.raises(ValueError, match=r"eps=\S*nan\S* is invalid"):
        ShiftRule("tie-shift", eps=np.float32("nan"))
