"""flash_attn_func, flash_attn_qkvpacked_func and flash_attn_varlen_func: FlashAttention's layouts and conventions."""
import ast
import inspect
import re

import pytest
import torch

import stableflash as sf
from stableflash.attention import reference
from stableflash.attention.masking import Alignment, Masking
from tests.conftest import DEVICE, rel_err


def bnhd(gen, B, N, H, d, dtype=torch.float32):
    return torch.randn(B, N, H, d, generator=gen).to(dtype)


@pytest.mark.parametrize("backend", ["emulated", "reference", "auto"])
def test_same_as_flash_attention_on_the_transposed_tensors(gen, backend):
    q, k, v = bnhd(gen, 2, 7, 4, 16, torch.bfloat16), bnhd(gen, 2, 11, 2, 16, torch.bfloat16), bnhd(gen, 2, 11, 2, 16, torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, lse = sf.flash_attn_func(*leaves, causal=True, window_size=(5, -1), softcap=0.0, return_lse=True,
                                backend=backend)
    assert o.shape == q.shape and o.transpose(1, 2).is_contiguous()      # a view, not a copy
    assert lse.shape == (2, 4, 7)
    twin = [t.clone().transpose(1, 2).requires_grad_(True) for t in (q, k, v)]
    want, want_lse = sf.flash_attention(*twin, causal=True, align="bottom-right", window=(5, None), return_lse=True,
                                        backend="emulated" if backend == "auto" else backend)
    assert torch.equal(o, want.transpose(1, 2)) and torch.equal(lse, want_lse)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    o.backward(do)
    want.backward(do.transpose(1, 2))
    for a, b in zip(leaves, twin):
        assert torch.equal(a.grad, b.grad.transpose(1, 2))


def test_the_layout_is_read_as_batch_seq_heads_dim(gen):
    """(B, N, H, d) with N != H: against float64 on the permuted tensors, bottom-right causal."""
    q, k, v = bnhd(gen, 1, 3, 2, 8), bnhd(gen, 1, 6, 2, 8), bnhd(gen, 1, 6, 2, 8)
    got = sf.flash_attn_func(q, k, v, causal=True, backend="reference")
    want = reference.attention(*(t.transpose(1, 2) for t in (q, k, v)), masking=Masking(True, Alignment.BOTTOM_RIGHT))
    assert rel_err(got, want.transpose(1, 2)) <= 1e-6
    assert got.transpose(1, 2).is_contiguous()            # a view of the backend's (B, H, N, d) result


def _packed_and_split(gen, backend, B=2, N=37, H=2, d=16, **kw):
    """flash_attn_qkvpacked_func on a (B, N, 3, H, d) tensor and flash_attn_func on its three slices:
    (O, gradient of qkv) of each, the latter's gradient the three slices' stacked."""
    qkv = torch.randn(B, N, 3, H, d, generator=gen).bfloat16().to(DEVICE)
    do = torch.randn(B, N, H, d, generator=gen).bfloat16().to(DEVICE)
    packed = qkv.clone().requires_grad_(True)
    torch.manual_seed(3)
    o = sf.flash_attn_qkvpacked_func(packed, backend=backend, **kw)
    (grad,) = torch.autograd.grad(o, packed, do)
    split = [t.clone().requires_grad_(True) for t in qkv.unbind(2)]
    torch.manual_seed(3)
    want = sf.flash_attn_func(*split, backend=backend, **kw)
    return (o, grad), (want, torch.stack(torch.autograd.grad(want, split, do), 2))


@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(causal=True, window_size=(9, -1), softcap=30.0),
                                dict(causal=True, dropout_p=0.25)], ids=["causal", "full", "window-softcap", "dropout"])
@pytest.mark.parametrize("backend", ["triton", "emulated"])
def test_qkvpacked_gives_flash_attn_funcs_values_on_its_slices(gen, backend, kw):
    """The same kernels on the same numbers: O and the gradient bit for bit (the packed path only
    writes dQ, dK and dV into one tensor); dropout with the same seed drawn."""
    (o, grad), (want, want_grad) = _packed_and_split(gen, backend, **kw)
    assert torch.equal(o, want) and torch.equal(grad, want_grad)
    assert grad.is_contiguous()
    if backend == "triton":          # the kernels write O in q's order: (B, N, H, d) here
        assert o.is_contiguous()


def test_qkvpacked_with_the_lse_and_against_float64(gen):
    """Default options, causal: within bf16 rounding of float64 (relative error ≤ 2⁻⁷) for O and the
    three gradients; the log-sum-exp that flash_attn_func returns."""
    from tests.attention.test_triton import expanded_reference
    qkv = torch.randn(1, 45, 3, 2, 32, generator=gen).bfloat16().to(DEVICE).requires_grad_(True)
    do = torch.randn(1, 45, 2, 32, generator=gen).bfloat16().to(DEVICE)
    o, lse = sf.flash_attn_qkvpacked_func(qkv, causal=True, return_lse=True)
    o.backward(do)
    q, k, v = (t.detach().transpose(1, 2) for t in qkv.unbind(2))
    ref = expanded_reference(q, k, v, do.transpose(1, 2), True)
    got = (o.transpose(1, 2), *(g.transpose(1, 2) for g in qkv.grad.unbind(2)))
    for name, x, r in zip(("O", "dQ", "dK", "dV"), got, ref):
        assert ((x.double() - r).norm() / r.norm()).item() <= 2.0 ** -7, name
    _, want_lse = sf.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                     return_lse=True)
    assert torch.equal(lse, want_lse)


@pytest.mark.parametrize("bad,exc,match", [
    (lambda t: t[:, :, 0], ValueError, r"qkv must have 5 dimensions \(batch, seq, 3, heads, head_dim\); got shape \(1, 4, 2, 8\)"),
    (lambda t: t[:, :, :2], ValueError, r"qkv must hold q, k and v along dimension 2, of size 3; got shape \(1, 4, 2, 2, 8\)"),
    (lambda t: t.int(), TypeError, r"qkv has dtype torch.int32"),
    (lambda t: t.tolist(), TypeError, r"qkv must be a torch.Tensor; got list"),
])
def test_qkvpacked_refuses_bad_input_clearly(gen, bad, exc, match):
    qkv = torch.randn(1, 4, 3, 2, 8, generator=gen)
    with pytest.raises(exc, match=match):
        sf.flash_attn_qkvpacked_func(bad(qkv))


def test_varlen_matches_each_sequence_on_its_own(gen):
    H, Hk, d = 4, 2, 16
    cu_q = torch.tensor([0, 1, 9, 10, 16], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 12, 13, 16], dtype=torch.int32)
    q, k, v = torch.randn(16, H, d, generator=gen), torch.randn(16, Hk, d, generator=gen), torch.randn(16, Hk, d, generator=gen)
    for kw in (dict(causal=True), dict(causal=True, window_size=(3, -1), align="top-left"), dict(window_size=(1, 1))):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o, lse = sf.flash_attn_varlen_func(*leaves, cu_q, cu_k, 8, 8, return_lse=True, backend="emulated", **kw)
        assert o.shape == q.shape and lse.shape == (H, 16)
        o.sum().backward()
        for s in range(4):
            rows, cols = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            one = [t.clone().unsqueeze(0).requires_grad_(True) for t in (q[rows], k[cols], v[cols])]
            want, want_lse = sf.flash_attn_func(*one, return_lse=True, backend="emulated", **kw)
            assert rel_err(o[rows], want[0]) <= 1e-6, (kw, s)
            torch.testing.assert_close(lse[:, rows], want_lse[0])
            want.sum().backward()
            for a, b, sl in zip(leaves, one, (rows, cols, cols)):
                assert rel_err(a.grad[sl], b.grad[0]) <= 1e-5, (kw, s)


def test_varlen_dropout_follows_the_definition(gen):
    cu = torch.tensor([0, 1, 6, 13], dtype=torch.int32)
    q, k, v = (torch.randn(13, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(1)
    got = sf.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, dropout_p=0.3, causal=True, backend="emulated")
    torch.manual_seed(1)
    seed = sf.attention.masking.draw_seed()
    want = reference.attention_varlen(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu, cu, dropout_p=0.3,
                                      seed=seed, masking=Masking(True, Alignment.BOTTOM_RIGHT))
    assert rel_err(got, want.transpose(0, 1)) <= 1e-12


def args():
    q = torch.randn(6, 2, 8)
    return dict(q=q, k=q.clone(), v=q.clone(), cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 2, 6], dtype=torch.int32), max_seqlen_q=4, max_seqlen_k=4)


@pytest.mark.parametrize("change,exc,match", [
    (dict(cu_seqlens_q=torch.tensor([0, 2, 6])), ValueError, r"cu_seqlens_q has dtype torch.int64 and shape \(3,\); accepted: int32, 1-D"),
    (dict(cu_seqlens_k=torch.tensor([[0, 6]], dtype=torch.int32)), ValueError, r"cu_seqlens_k has dtype torch.int32 and shape \(1, 2\)"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 2, 6], dtype=torch.int32)), ValueError, r"cu_seqlens_q=\[0, 4, 2, 6\] is invalid; accepted: non-decreasing offsets from 0 to 6"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 5], dtype=torch.int32)), ValueError, r"cu_seqlens_k=\[0, 2, 5\] is invalid; accepted: non-decreasing offsets from 0 to 6"),
    (dict(cu_seqlens_k=torch.tensor([0, 6], dtype=torch.int32)), ValueError, r"cu_seqlens_q has 3 entries and cu_seqlens_k 2"),
    (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q=3 is below the longest sequence's length 4"),
    (dict(max_seqlen_k=True), ValueError, r"max_seqlen_k=True is invalid; accepted: an int >= 0"),
    (dict(q=torch.randn(1, 6, 2, 8)), ValueError, r"q must have 3 dimensions \(total_tokens, heads, head_dim\)"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size=\(-2, 0\) is invalid; accepted: None, or a pair \(left, right\) of ints ≥ 0 or -1"),
    (dict(softcap=-1.0), ValueError, r"softcap=-1.0 is invalid"),
    (dict(backend="sdpa", stabilize=False), ValueError, r"backend='sdpa' cannot take a varlen batch"),
])
def test_varlen_refuses_bad_input_clearly(change, exc, match):
    with pytest.raises(exc, match=match):
        sf.flash_attn_varlen_func(**{**args(), **change})


def test_flash_attn_func_refuses_the_sdpa_layout_mistakes_clearly(gen):
    q = bnhd(gen, 1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions \(batch, seq, heads, head_dim\); got shape \(4, 2, 8\)"):
        sf.flash_attn_func(q[0], q, q)
    with pytest.raises(ValueError, match=r"align='left' is invalid"):
        sf.flash_attn_func(q, q, q, align="left")


@pytest.mark.parametrize("fn", [sf.flash_attn_func, sf.flash_attn_qkvpacked_func, sf.flash_attn_varlen_func])
def test_the_docstrings_state_the_semantics_then_every_argument(fn):
    doc = fn.__doc__
    for topic in ("Masks.", "Dropout.", "Log-sum-exp.", "bottom-right    top-left"):
        assert doc.index(topic) < doc.index("Arguments:"), topic
    args = doc[doc.index("Arguments:"):doc.index("Returns:")]
    for name, p in inspect.signature(fn).parameters.items():
        assert f"\n        {name}: " in args, name
        if p.default is not inspect.Parameter.empty:
            entry = re.split(r"\n {8}(?=\S)", args[args.index(f"\n        {name}: "):])[1]
            stated = re.search(r"default\s+(\(.*?\)|\S+?)[.,]?(?:\s|$)", entry)
            assert stated and ast.literal_eval(stated.group(1)) == p.default, (name, entry[:90])
    assert fn is getattr(sf.attention, fn.__name__)
