"""The tiled emulation (Algorithms 1-2) against the float64 reference, under each policy."""
import math

import pytest
import torch

from stableflash import flash_attention
from stableflash.attention import reference
from stableflash.attention.emulated import emulated_backward, emulated_forward
from stableflash.attention.policy import PrecisionPolicy
from stableflash.attention.shift import ShiftRule
from tests.conftest import qkv, rel_err

SHAPES = [(1, 1, 1, 16), (2, 3, 97, 32), (1, 2, 200, 64)]


def run(q, k, v, do, **kw):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = flash_attention(q, k, v, backend="emulated", **kw)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o, dq, dk, dv


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [16, 64, None])
@pytest.mark.parametrize("stabilize", [False, "paper", True])
def test_fp32_policy_matches_float64(gen, shape, causal, block, stabilize):
    """Forward and all three gradients within 1e-5 relative of float64."""
    b, h, n, d = shape
    q, k, v = qkv(gen, b, h, n, d)
    do = torch.randn(b, h, n, d, generator=gen)
    block = n if block is None else block
    got = run(q, k, v, do, causal=causal, policy="fp32", stabilize=stabilize, block_q=block, block_k=block)
    want = reference.forward_backward(q, k, v, do, causal=causal)
    floor = 1.0 if n == 1 else 0.0   # one token: dQ = dK = 0 exactly; measure against the unit input scale
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert rel_err(g, w, floor) <= 1e-5, (name, rel_err(g, w, floor))


@pytest.mark.slow
def test_long_sequence_fp32_matches_float64(gen):
    q, k, v = qkv(gen, 1, 1, 1000, 32)
    do = torch.randn(1, 1, 1000, 32, generator=gen)
    got = run(q, k, v, do, causal=True, policy="fp32", block_q=128, block_k=128)
    want = reference.forward_backward(q, k, v, do, causal=True)
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert rel_err(g, w) <= 1e-5, name


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k", [(33, 70), (70, 33)])
def test_different_query_and_key_lengths(gen, causal, n_q, n_k):
    q = torch.randn(2, 2, n_q, 16, generator=gen)
    _, k, v = qkv(gen, 2, 2, n_k, 16)
    do = torch.randn(2, 2, n_q, 16, generator=gen)
    got = run(q, k, v, do, causal=causal, policy="fp32", block_q=16, block_k=16)
    want = reference.forward_backward(q, k, v, do, causal=causal)
    torch.testing.assert_close(got[0].double(), torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=causal), rtol=1e-5, atol=1e-6)
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert rel_err(g, w) <= 1e-5, name


# Bounds for bf16 policies: bf16 keeps 8 significant bits (unit roundoff 2⁻⁸ ≈ 3.9e-3). "fa2" rounds
# the output once (plus bf16 P̄ and backward operands): a few unit roundoffs of the largest value.
# "paper" also rounds S, S − m, ℓ and the accumulator after every key block, which compounds.
BF16_BOUNDS = {"fa2": {"O": 8e-3, "dQ": 2e-2, "dK": 2e-2, "dV": 1e-2},
               "paper": {"O": 3e-2, "dQ": 6e-2, "dK": 6e-2, "dV": 3e-2}}


@pytest.mark.parametrize("policy", ["fa2", "paper"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stabilize", [False, True])
def test_bf16_policies_within_bf16_bounds(gen, policy, causal, stabilize):
    q, k, v = qkv(gen, 2, 2, 97, 64, dtype=torch.bfloat16)
    do = torch.randn(2, 2, 97, 64, generator=gen).bfloat16()
    got = run(q, k, v, do, causal=causal, policy=policy, stabilize=stabilize, block_q=32, block_k=32)
    want = reference.forward_backward(q, k, v, do, causal=causal)
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, w) <= BF16_BOUNDS[policy][name], (name, rel_err(g, w))


def test_fa2_policy_no_worse_than_torch_bf16_sdpa(gen):
    """Our fa2 emulation's output error is within 1.5× of torch SDPA's own bf16 error."""
    q, k, v = qkv(gen, 4, 4, 128, 64, dtype=torch.bfloat16)
    want = reference.attention(q, k, v)
    ours = flash_attention(q, k, v, backend="emulated", policy="fa2", stabilize=False)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    e_ours = (ours.double() - want).abs().mean().item()
    e_sdpa = (theirs.double() - want).abs().mean().item()
    assert e_ours <= 1.5 * e_sdpa, (e_ours, e_sdpa)


@pytest.mark.parametrize("policy", ["fa2", "paper"])
def test_query_blocking_changes_nothing(gen, policy):
    """Each row's arithmetic depends only on the key blocks: outputs identical bit for bit."""
    q, k, v = qkv(gen, 1, 2, 80, 32, dtype=torch.bfloat16)
    pol = PrecisionPolicy.preset(policy)
    outs = [emulated_forward(q, k, v, causal=True, scale=0.2, policy=pol, rule=ShiftRule("tie-shift"),
                             block_q=bq, block_k=16) for bq in (7, 16, 80)]
    for o in outs[1:]:
        assert torch.equal(o.out, outs[0].out) and torch.equal(o.lse, outs[0].lse)


def test_key_block_size_matters_for_paper_policy(gen):
    """The bf16 accumulator is rounded after each key block, so block_k changes the result."""
    q, k, v = qkv(gen, 1, 2, 128, 32, dtype=torch.bfloat16)
    a = flash_attention(q, k, v, backend="emulated", policy="paper", block_k=16, stabilize=False)
    b = flash_attention(q, k, v, backend="emulated", policy="paper", block_k=128, stabilize=False)
    assert not torch.equal(a, b)


def test_hp_heads_compute_o_in_fp32_for_those_heads_only(gen):
    q, k, v = qkv(gen, 2, 4, 64, 32, dtype=torch.bfloat16)
    paper = PrecisionPolicy.preset("paper")
    hp = paper.replace(hp_heads=(1, 3))
    all_fp32 = paper.replace(p_bar="fp32", acc="fp32", row_sum="fp32", out="fp32")
    kw = dict(causal=True, scale=0.25, rule=ShiftRule("standard"), block_q=16, block_k=16)
    got = emulated_forward(q, k, v, policy=hp, **kw).out
    low = emulated_forward(q, k, v, policy=paper, **kw).out
    high = emulated_forward(q, k, v, policy=all_fp32, **kw).out
    assert torch.equal(got[:, [0, 2]], low[:, [0, 2]])
    assert torch.equal(got[:, [1, 3]], high[:, [1, 3]])
    assert not torch.equal(low[:, [1, 3]], high[:, [1, 3]])


@pytest.mark.parametrize("source", ["dP·P", "recompute_fp32"])
def test_delta_sources_are_exact_in_fp32(gen, source):
    q, k, v = qkv(gen, 1, 2, 50, 16)
    do = torch.randn(1, 2, 50, 16, generator=gen)
    pol = PrecisionPolicy.preset("fp32").replace(delta=source)
    got = run(q, k, v, do, causal=True, policy=pol, block_q=16, block_k=16)
    want = reference.forward_backward(q, k, v, do, causal=True)
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert rel_err(g, w) <= 1e-5, name


def test_delta_from_dp_p_avoids_the_rounded_output(gen):
    """Under bf16, δ from dO·O carries O's rounding; dP·P and the fp32 recompute do not, so
    their dQ is closer to float64."""
    q, k, v = qkv(gen, 2, 2, 96, 64, dtype=torch.bfloat16)
    do = torch.randn(2, 2, 96, 64, generator=gen).bfloat16()
    want = reference.forward_backward(q, k, v, do)[1]
    pol = PrecisionPolicy.preset("paper").replace(bwd="fp32")
    err = {}
    for source in ("dO·O", "dP·P", "recompute_fp32"):
        q_ = q.float().requires_grad_(True)
        o = flash_attention(q_, k.float(), v.float(), backend="emulated", policy=pol.replace(delta=source),
                            stabilize=False, block_k=32)
        (dq,) = torch.autograd.grad(o, (q_,), do.float())
        err[source] = rel_err(dq, want)
    assert err["dP·P"] < err["dO·O"] and err["recompute_fp32"] < err["dO·O"], err


def test_backward_functions_agree_with_autograd_wrapper(gen):
    q, k, v = qkv(gen, 1, 2, 40, 16)
    do = torch.randn(1, 2, 40, 16, generator=gen)
    pol = PrecisionPolicy.preset("fa2")
    res = emulated_forward(q, k, v, causal=True, scale=0.25, policy=pol, rule=ShiftRule("tie-shift"),
                           block_q=16, block_k=16)
    direct = emulated_backward(q, k, v, res.out, res.lse, do, causal=True, scale=0.25, policy=pol,
                               block_q=16, block_k=16)
    via = run(q, k, v, do, causal=True, scale=0.25, policy=pol, stabilize="tie-shift", block_q=16, block_k=16)[1:]
    for a, b in zip(direct, via):
        assert torch.equal(a, b)


def test_autocast_does_not_leak_into_the_emulation(gen):
    q, k, v = qkv(gen, 1, 2, 64, 32)
    want = reference.attention(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = flash_attention(q, k, v, backend="emulated", policy="fp32")
    assert got.dtype == torch.float32 and rel_err(got, want) <= 1e-5


def test_stochastic_rounding_point_is_seeded_and_unbiased(gen):
    q, k, v = qkv(gen, 2, 2, 64, 32)
    pol = PrecisionPolicy.preset("fa2").replace(out="bf16:stochastic", inputs="fp32")
    want = reference.attention(q, k, v)
    torch.manual_seed(1)
    a = flash_attention(q, k, v, backend="emulated", policy=pol)
    torch.manual_seed(1)
    b = flash_attention(q, k, v, backend="emulated", policy=pol)
    torch.manual_seed(2)
    c = flash_attention(q, k, v, backend="emulated", policy=pol)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert rel_err(a, want) <= 8e-3
    # averaging independent stochastic roundings converges to the fp32 result
    mean = torch.stack([flash_attention(q, k, v, backend="emulated", policy=pol) for _ in range(64)]).mean(0)
    assert rel_err(mean, want) <= 2e-3


def huge_tied_logits(dtype=torch.bfloat16, n=40, d=16):
    """Every row's scores are 128·x_j for bf16 x_j: two keys tie at the top, 16 512 (where a bf16 step
    is 128), the rest lower. Seen in a training run whose attention logits had grown that large."""
    q = torch.zeros(1, 1, n, d)
    q[..., 0] = 128.0
    k = torch.zeros(1, 1, n, d)
    k[..., 0] = torch.linspace(100.0, 127.0, n)
    k[..., 5, 0] = k[..., 17, 0] = 129.0
    v = torch.randn(1, 1, n, d, generator=torch.Generator().manual_seed(3))
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("stabilize", [True, "all-shift"])
def test_bounded_rules_stay_finite_when_bf16_scores_cannot_hold_the_shift(stabilize):
    """With bf16 scores the shift is rounded up into bf16; at 16 512 the next bf16 value is 128 higher
    and every P̄ would underflow (ℓ = 0, O = NaN). The bounded rules fall back to the standard shift
    there, so O stays finite and as accurate as bf16 allows."""
    q, k, v = huge_tied_logits()
    want = reference.attention(q.double(), k.double(), v.double(), causal=False, scale=1.0)
    for block in (8, 64):
        got = flash_attention(q, k, v, scale=1.0, stabilize=stabilize, backend="emulated", policy="paper",
                              block_k=block)
        assert torch.isfinite(got).all(), block
        assert rel_err(got, want) <= 1e-2, (block, rel_err(got, want))


def test_bound_rounded_shift_only_touches_the_bounded_rules():
    from stableflash.attention.shift import bound_rounded_shift
    m, prev, r = torch.tensor([16640.0, 10.5]), torch.tensor([16000.0, 9.0]), torch.tensor([16512.0, 10.0])
    bf16_limit = 126 * math.log(2.0)                 # exp(−limit) is bf16's smallest normal number
    for kind in ("tie-shift", "all-shift"):
        assert bound_rounded_shift(m, prev, r, ShiftRule(kind), bf16_limit).tolist() == [16512.0, 10.5]
        assert bound_rounded_shift(m, prev, r, ShiftRule(kind), 0.25).tolist() == [16512.0, 10.0]
    for kind in ("paper", "standard"):
        assert bound_rounded_shift(m, prev, r, ShiftRule(kind), bf16_limit).tolist() == [16640.0, 10.5]
