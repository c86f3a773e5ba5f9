"""The float64 reference and the emulated backend with the new masks, dropout and varlen batches,
against a dense float64 computation written here from ``masking.visible`` and ``dropout_keep``."""
import math

import pytest
import torch

from stableflash.attention import reference
from stableflash.attention.emulated import _key_steps, emulated_attention
from stableflash.attention.masking import Alignment, Masking, Window, dropout_keep, visible
from stableflash.attention.policy import PrecisionPolicy
from stableflash.attention.shift import ShiftRule
from tests.conftest import rel_err

TL, BR = Alignment.TOP_LEFT, Alignment.BOTTOM_RIGHT
FP64 = PrecisionPolicy.preset("fp64")


def dense(q, k, v, *, masking=Masking(), attn_mask=None, p=0.0, seed=0, first_batch=0, scale=None, softcap=None):
    """(O, lse) in float64 straight from the definitions (no tiling, no shift rule)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, n_q, d = q.shape
    n_k = k.shape[2]
    s = q @ k.transpose(-1, -2) * (d ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if attn_mask is not None:
        s = torch.where(attn_mask, s, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    s = torch.where(visible(n_q, n_k, masking), s, -math.inf)
    empty = torch.isinf(s).all(dim=-1, keepdim=True)
    w = torch.softmax(torch.where(empty, 0.0, s), dim=-1) * ~empty
    if p > 0:
        bh = (first_batch + torch.arange(B)).view(B, 1) * H + torch.arange(H).view(1, H)
        w = w * dropout_keep(seed, p, bh, n_q, n_k) / (1 - p)
    lse = torch.logsumexp(s, dim=-1)
    return w @ v, lse


def rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


# (n_q, n_k, masking): unequal lengths both ways and both alignments, windows at the edges
CASES = [
    (5, 9, Masking(True, TL)), (5, 9, Masking(True, BR)), (9, 5, Masking(True, TL)), (9, 5, Masking(True, BR)),
    (7, 7, Masking(False, TL, Window(0, 0))), (6, 11, Masking(False, BR, Window(2, 1))),
    (11, 6, Masking(True, BR, Window(1, None))), (8, 8, Masking(False, TL, Window(None, 2))),
    (4, 13, Masking(False, BR, Window(20, 20))), (13, 4, Masking(False, TL, Window(0, None))),
]


def key_padding(gen, B, H, n_q, n_k):
    """A boolean key-padding mask with one batch element whose every key is padded (empty rows)."""
    lengths = torch.randint(1, n_k + 1, (B,), generator=gen)
    lengths[0] = 0
    return (torch.arange(n_k).view(1, n_k) < lengths.view(B, 1)).view(B, 1, 1, n_k).expand(B, H, n_q, n_k)


@pytest.mark.parametrize("n_q,n_k,masking", CASES)
def test_reference_and_emulation_follow_the_definitions(gen, n_q, n_k, masking):
    B, H, d = 2, 2, 8
    q, k, v = rand(gen, B, H, n_q, d), rand(gen, B, H, n_k, d), rand(gen, B, H, n_k, d)
    am = key_padding(gen, B, H, n_q, n_k)
    for attn_mask in (None, am, torch.where(am, rand(gen, B, H, n_q, n_k), -math.inf)):
        for p in (0.0, 0.3):
            want_o, want_lse = dense(q, k, v, masking=masking, attn_mask=attn_mask, p=p, seed=11)
            o, lse = reference.attention(q, k, v, masking=masking, attn_mask=attn_mask, dropout_p=p, seed=11,
                                         return_lse=True)
            torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
            for rule in ("standard", "tie-shift"):
                o, lse = emulated_attention(q, k, v, causal=False, scale=d ** -0.5, policy=FP64, rule=ShiftRule(rule),
                                            block_k=3, masking=masking, attn_mask=attn_mask, dropout_p=p, seed=11,
                                            return_lse=True)
                torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(lse.double(), want_lse.float().double(), rtol=1e-6, atol=1e-6)


def test_reference_gradients_are_its_derivative_and_zero_on_empty_rows(gen):
    B, H, n_q, n_k, d = 2, 1, 4, 5, 3
    q, k, v = (rand(gen, B, H, n, d).requires_grad_(True) for n in (n_q, n_k, n_k))
    am = key_padding(gen, B, H, n_q, n_k)
    masking = Masking(True, BR, Window(2, None))

    def f(q, k, v):
        return reference.attention(q, k, v, masking=masking, attn_mask=am, dropout_p=0.25, seed=3, softcap=2.0)

    assert torch.autograd.gradcheck(f, (q, k, v))
    o = f(q, k, v)
    o.sum().backward()
    assert not torch.isnan(q.grad).any() and torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))
    assert torch.equal(o[0], torch.zeros_like(o[0]))


@pytest.mark.parametrize("delta", ["dO·O", "dO·O32", "dO·(O+R)", "dO·O16", "dP·P", "recompute_fp32"])
def test_emulated_gradients_with_masks_and_dropout_match_float64(gen, delta):
    """Every δ source reads the dropped, scaled P: in float64 they all give the exact gradients."""
    B, H, n_q, n_k, d = 2, 2, 9, 12, 8
    q, k, v, do = rand(gen, B, H, n_q, d), rand(gen, B, H, n_k, d), rand(gen, B, H, n_k, d), rand(gen, B, H, n_q, d)
    am = key_padding(gen, B, H, n_q, n_k)
    kw = dict(masking=Masking(True, BR, Window(4, None)), attn_mask=am, dropout_p=0.2, softcap=3.0)
    want = reference.forward_backward(q, k, v, do, seed=5, **kw)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = emulated_attention(*leaves, causal=False, scale=d ** -0.5, policy=FP64.replace(delta=delta),
                           rule=ShiftRule("standard"), block_k=4, seed=5, **kw)
    got = (o, *torch.autograd.grad(o, leaves, do))
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert not torch.isnan(g).any(), name
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=name)
    assert torch.equal(got[1][0], torch.zeros_like(got[1][0]))      # batch 0: every key padded


def test_varlen_packs_ragged_sequences_with_length_one(gen):
    H, d = 2, 8
    cu_q = torch.tensor([0, 1, 6, 13, 14, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 4, 15, 16, 18], dtype=torch.int32)    # the last sequence has no query
    q, k, v = rand(gen, 1, H, 14, d), rand(gen, 1, H, 18, d), rand(gen, 1, H, 18, d)
    do = rand(gen, 1, H, 14, d)
    for masking in (Masking(True, BR), Masking(True, TL, Window(2, None)), Masking()):
        outs, lses = [], []
        for s in range(5):
            rows, cols = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            o, lse = dense(q[:, :, rows], k[:, :, cols], v[:, :, cols], masking=masking, p=0.1, seed=9,
                           first_batch=s)
            outs.append(o)
            lses.append(lse)
        want = torch.cat(outs, 2)
        o, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, masking=masking, dropout_p=0.1, seed=9,
                                            return_lse=True)
        torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, torch.cat(lses, 2), rtol=1e-12, atol=1e-12)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = emulated_attention(*leaves, causal=False, scale=d ** -0.5, policy=FP64, rule=ShiftRule("tie-shift"),
                               block_k=2, masking=masking, dropout_p=0.1, seed=9, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
        ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref_o = reference.attention_varlen(*ref, cu_q, cu_k, masking=masking, dropout_p=0.1, seed=9)
        for g, w in zip(torch.autograd.grad(o, leaves, do), torch.autograd.grad(ref_o, ref, do)):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("preset", ["fa2", "paper"])
def test_bf16_policies_with_masks_stay_within_a_few_ulps(gen, preset):
    """The low-precision emulation with masks, a window and dropout: within a few bf16 ulps of
    float64, and no further from it than the same-precision reference (inputs and output rounded)."""
    B, H, n_q, n_k, d = 2, 2, 40, 56, 16
    q, k, v = (rand(gen, B, H, n, d).bfloat16() for n in (n_q, n_k, n_k))
    am = key_padding(gen, B, H, n_q, n_k)
    kw = dict(masking=Masking(True, BR, Window(24, None)), attn_mask=am, dropout_p=0.1)
    want = reference.attention(q, k, v, seed=7, **kw)
    same = want.bfloat16()
    for stab in ("standard", "tie-shift"):
        got = emulated_attention(q, k, v, causal=False, scale=d ** -0.5, policy=PrecisionPolicy.preset(preset),
                                 rule=ShiftRule(stab), block_k=16, seed=7, **kw)
        assert not torch.isnan(got).any() and torch.equal(got[0], torch.zeros_like(got[0]))
        err = (got.double() - want).abs().max().item()
        assert err <= 4 * 2 ** -8 * want.abs().max().item(), err
        assert err <= 8 * max((same.double() - want).abs().max().item(), 2 ** -9)


@pytest.mark.parametrize("n_q,n_k,masking", CASES)
def test_key_steps_visit_exactly_the_visible_blocks(n_q, n_k, masking):
    seen = visible(n_q, n_k, masking)
    for lo, hi in ((0, n_q), (1, max(2, n_q - 2)), (n_q - 1, n_q)):
        got = {}
        for first, stop, cols, needs_mask in _key_steps(lo, hi, n_q, n_k, 3, masking):
            block = seen[lo:hi, cols]
            rows = block.any(dim=1).nonzero().flatten() + lo
            assert (first, stop) == (rows.min().item(), rows.max().item() + 1)
            assert needs_mask == (not seen[first:stop, cols].all().item())
            got[cols.start] = True
        want = {j0 for j0 in range(0, n_k, 3) if seen[lo:hi, j0:j0 + 3].any()}
        assert set(got) == want


def test_emulated_keeps_the_reference_for_earlier_callers(gen):
    """``causal=`` still works in both, and the bf16 dense arithmetic is the same as with a
    Masking of the same meaning."""
    q, k, v = (rand(gen, 1, 2, 20, 8).bfloat16() for _ in range(3))
    pol = PrecisionPolicy.preset("fa2")
    a = emulated_attention(q, k, v, causal=True, scale=0.3, policy=pol, rule=ShiftRule(), block_k=8)
    b = emulated_attention(q, k, v, causal=False, scale=0.3, policy=pol, rule=ShiftRule(), block_k=8,
                           masking=Masking(True, BR))
    assert torch.equal(a, b)
    assert rel_err(reference.attention(q, k, v, causal=True),
                   reference.attention(q, k, v, masking=Masking(True))) == 0
