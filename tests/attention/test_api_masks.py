"""flash_attention's masks, window, alignment, dropout and log-sum-exp: results, dispatch, errors."""
import math

import pytest
import torch

import stableflash as sf
from stableflash.attention import api, reference
from stableflash.attention.masking import Alignment, Masking, Window
from tests.conftest import DEVICE, qkv, rel_err


def padding(gen, B, n_k, empty=True):
    lengths = torch.randint(1, n_k + 1, (B,), generator=gen)
    if empty:
        lengths[0] = 0
    return (torch.arange(n_k).view(1, n_k) < lengths.view(B, 1)).view(B, 1, 1, n_k)


@pytest.mark.parametrize("backend", ["reference", "emulated"])
def test_every_option_against_float64(gen, backend):
    q, k, v = qkv(gen, 2, 4, 13, 16, n_k=21)
    k, v = k[:, :2], v[:, :2]                                            # grouped-query attention
    am = padding(gen, 2, 21)
    kw = dict(causal=True, align="bottom-right", window=(6, None), attn_mask=am, softcap=5.0)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, lse = sf.flash_attention(*leaves, backend=backend, return_lse=True, **kw)
    masking = Masking(True, Alignment.BOTTOM_RIGHT, Window(6, None))
    k2, v2 = (t.repeat_interleave(2, 1) for t in (k, v))
    want, want_lse = reference.attention(q, k2, v2, masking=masking, attn_mask=am, softcap=5.0, return_lse=True)
    assert rel_err(o, want) <= 1e-5 and lse.dtype == torch.float32 and not lse.requires_grad
    assert torch.isneginf(lse[0]).all()
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-5, atol=1e-5)
    o.sum().backward()
    assert all(not torch.isnan(t.grad).any() for t in leaves) and torch.equal(leaves[0].grad[0], torch.zeros_like(q[0]))


@pytest.mark.parametrize("backend", ["reference", "emulated"])
def test_dropout_is_reproducible_from_the_seed_and_matches_the_definition(gen, backend):
    q, k, v = qkv(gen, 2, 2, 17, 16)
    torch.manual_seed(3)
    a = sf.flash_attention(q, k, v, causal=True, dropout_p=0.25, backend=backend)
    torch.manual_seed(3)
    seed = sf.attention.masking.draw_seed()
    want = reference.attention(q, k, v, causal=True, dropout_p=0.25, seed=seed)
    assert rel_err(a, want) <= 1e-5
    assert not torch.equal(a, sf.flash_attention(q, k, v, causal=True, dropout_p=0.25, backend=backend))


def test_sdpa_takes_the_masks_it_can_express(gen):
    q, k, v = qkv(gen, 2, 2, 9, 16, n_k=14)
    am = padding(gen, 2, 14)
    for kw in (dict(causal=True, align="bottom-right"), dict(window=(3, 2)), dict(attn_mask=am, causal=True),
               dict(attn_mask=torch.where(am, 0.5, -math.inf), causal=True, align="bottom-right")):
        got = sf.flash_attention(q, k, v, stabilize=False, backend="sdpa", **kw)
        want = sf.flash_attention(q, k, v, backend="reference", **kw)
        assert rel_err(got, want) <= 1e-5 and not torch.isnan(got).any(), kw
        assert torch.equal(sf.flash_attention(q, k, v, stabilize=False, **kw), got)     # auto picks it


def test_auto_dispatch(gen, monkeypatch):
    q, k, v = qkv(gen, 1, 2, 8, 16)
    monkeypatch.setattr(api, "_warned", set())
    with pytest.warns(UserWarning, match=r"chose 'emulated'.*return_lse=True"):
        o, lse = sf.flash_attention(q, k, v, stabilize=False, return_lse=True)
    assert torch.equal(o, sf.flash_attention(q, k, v, stabilize=False, backend="emulated"))
    calls = []

    class Kernels:
        def check_inputs(self, q, k, **kw):
            calls.append(("check", kw))

        def triton_attention(self, q, k, v, **kw):
            calls.append(("run", kw))
            return q.clone(), q.new_zeros(q.shape[:3])

    def reason(q, k, policy, masking, attn_mask, varlen, dropout_p):
        """``_triton_reason`` on a CUDA machine whose kernels take the call: their input check, passed."""
        Kernels().check_inputs(q, k, masking=masking, attn_mask=attn_mask, varlen=varlen, dropout_p=dropout_p)
        return None

    monkeypatch.setattr(api, "_triton_module", lambda: Kernels())
    monkeypatch.setattr(api, "_triton_reason", reason)
    am = torch.ones(8, 8, dtype=torch.bool)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    masking = Masking(False, Alignment.TOP_LEFT, Window(2, 0))
    for backend in ("auto", "triton"):          # auto checks once, while choosing; triton when it runs
        calls.clear()
        sf.flash_attention(q, k, v, window=(2, 0), attn_mask=am, dropout_p=0.1, backend=backend)   # bf16: stabilized
        (_, check), (_, run) = calls
        assert check == dict(masking=masking, attn_mask=run["attn_mask"], varlen=False, dropout_p=0.1)
        assert run["attn_mask"].shape == (1, 2, 8, 8) and run["attn_mask"].stride()[1] == 0    # expanded, not copied
        assert run["masking"] == masking and run["dropout_p"] == 0.1 and run["cu_seqlens_q"] is None


def test_the_triton_backend_takes_every_mask_through_the_public_call(gen):
    """The kernels (interpreter) against float64 through flash_attention: window, bottom-right causal
    with n_q < n_k, a boolean mask; within bf16's bound on O and on the LSE."""
    q, k, v = (t.to(DEVICE, torch.bfloat16) for t in qkv(gen, 1, 2, 8, 16, n_k=12))
    for kw in (dict(window=(2, 2)), dict(causal=True, align="bottom-right"),
               dict(attn_mask=(torch.rand(8, 12, generator=gen) > 0.3).to(DEVICE))):
        o, lse = sf.flash_attention(q, k, v, backend="triton", return_lse=True, **kw)
        want, want_lse = sf.flash_attention(q.double(), k.double(), v.double(), backend="reference",
                                            return_lse=True, **kw)
        assert (o.double() - want).abs().max() <= 1e-2 * want.abs().max(), kw
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert (lse.double()[finite] - want_lse[finite]).abs().max() <= 1e-2, kw


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(attn_mask=torch.ones(8, 12, dtype=torch.int64)), TypeError, r"attn_mask has dtype torch.int64; accepted: torch.bool"),
    (dict(attn_mask=torch.ones(3, 8, 12, dtype=torch.bool)), ValueError, r"attn_mask has shape \(3, 8, 12\), which does not broadcast to \(batch, heads, seq_q, seq_k\) = \(1, 2, 8, 12\)"),
    (dict(attn_mask=[[True]]), TypeError, "attn_mask must be None or a torch.Tensor; got list"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p=1.0 is invalid; accepted: a number with 0 <= dropout_p < 1"),
    (dict(dropout_p=-0.1), ValueError, r"dropout_p=-0.1 is invalid"),
    (dict(dropout_p=True), ValueError, r"dropout_p=True is invalid"),
    (dict(dropout_p=torch.tensor(0.1)), ValueError, r"dropout_p=tensor\(0.1000\) is a tensor"),
    (dict(window=(-1, 2)), ValueError, r"window=\(-1, 2\) is invalid; accepted: None, or a pair \(left, right\) of ints ≥ 0 or None"),
    (dict(window=3), ValueError, r"window=3 is invalid"),
    (dict(window=(1.5, 2)), ValueError, r"window=\(1.5, 2\) is invalid"),
    (dict(align="bottom"), ValueError, r"align='bottom' is invalid; accepted: 'top-left', 'bottom-right'"),
    (dict(return_lse="yes"), TypeError, r"return_lse='yes' must be a bool"),
    (dict(return_lse=True, backend="sdpa", stabilize=False), ValueError, r"backend='sdpa' cannot return the log-sum-exp"),
])
def test_bad_new_arguments_raise_clear_errors(gen, kwargs, exc, match):
    q, k, v = qkv(gen, 1, 2, 8, 16, n_k=12)
    with pytest.raises(exc, match=match):
        sf.flash_attention(q, k, v, **kwargs)
