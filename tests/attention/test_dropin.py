"""The SDPA-compatible function and module."""
import pytest
import torch
import torch.nn.functional as F

from stableflash.attention import reference
from stableflash.attention.dropin import StableAttention, scaled_dot_product_attention
from tests.conftest import qkv, rel_err


@pytest.mark.parametrize("causal", [False, True])
def test_same_call_as_sdpa(gen, causal):
    q, k, v = qkv(gen, 2, 3, 33, 16)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    got = scaled_dot_product_attention(q, k, v, is_causal=causal, backend="emulated")
    assert rel_err(got, want) <= 1e-5
    got = StableAttention(backend="emulated")(q, k, v, is_causal=causal)
    assert rel_err(got, want) <= 1e-5


def test_grouped_query_attention_needs_enable_gqa(gen):
    q = torch.randn(1, 4, 20, 16, generator=gen)
    _, k, v = qkv(gen, 1, 2, 20, 16)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        scaled_dot_product_attention(q, k, v, backend="emulated")
    got = scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True, backend="emulated")
    want = reference.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"attn_mask": torch.ones(20, 20, dtype=torch.int32)}, TypeError, "attn_mask has dtype torch.int32"),
    ({"attn_mask": torch.ones(3, 20, 20, dtype=torch.bool)}, ValueError, r"attn_mask has shape \(3, 20, 20\)"),
    ({"dropout_p": 1.5}, ValueError, r"dropout_p=1.5 is invalid; accepted: a number with 0 <= dropout_p < 1")])
def test_unsupported_arguments_are_refused(gen, kwargs, exc, match):
    q, k, v = qkv(gen, 1, 2, 20, 16)
    with pytest.raises(exc, match=match):
        scaled_dot_product_attention(q, k, v, **kwargs)


def test_masks_as_sdpa_takes_them(gen):
    """Boolean and additive masks broadcast as SDPA's, with fully masked rows (0, as SDPA's)."""
    q, k, v = qkv(gen, 2, 3, 12, 16, n_k=15)
    pad = torch.arange(15).view(1, 1, 1, 15) < torch.tensor([0, 9]).view(2, 1, 1, 1)
    for mask in (pad, torch.where(pad, 0.0, float("-inf")), torch.randn(12, 15, generator=gen)):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for backend in ("emulated", "auto"):
            got = scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
            assert rel_err(got, want) <= 1e-5 and not torch.isnan(got).any()
        got = StableAttention(backend="emulated")(q, k, v, attn_mask=mask)
        assert rel_err(got, want) <= 1e-5


def test_dropout_applies_whenever_asked_and_in_the_module_only_in_training(gen):
    q, k, v = (t.bfloat16() for t in qkv(gen, 1, 2, 10, 16))
    torch.manual_seed(0)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="emulated")
    torch.manual_seed(0)
    want = reference.attention(q, k, v, dropout_p=0.5, seed=sf_seed())
    assert rel_err(a, want) <= 2e-2
    module = StableAttention(backend="emulated", dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(module(q, k, v), a)
    module.eval()
    assert torch.equal(module(q, k, v), scaled_dot_product_attention(q, k, v, backend="emulated"))
    assert "dropout_p=0.5" in repr(module)
    with pytest.raises(ValueError, match="dropout_p=1 is invalid"):
        StableAttention(dropout_p=1)


def sf_seed():
    from stableflash.attention.masking import draw_seed
    return draw_seed()


def test_module_validates_options_at_construction():
    with pytest.raises(ValueError, match="beta=0.5"):
        StableAttention(beta=0.5)
    with pytest.raises(ValueError, match="backend='fast'"):
        StableAttention(backend="fast")
    assert "stabilize=True" in repr(StableAttention())
