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


@pytest.mark.parametrize("kwargs,match", [({"attn_mask": torch.ones(20, 20, dtype=torch.bool)}, "attn_mask"),
                                          ({"dropout_p": 0.1}, "dropout_p=0.1")])
def test_unsupported_arguments_are_refused(gen, kwargs, match):
    q, k, v = qkv(gen, 1, 2, 20, 16)
    with pytest.raises(ValueError, match=match):
        scaled_dot_product_attention(q, k, v, **kwargs)


def test_module_validates_options_at_construction():
    with pytest.raises(ValueError, match="beta=0.5"):
        StableAttention(beta=0.5)
    with pytest.raises(ValueError, match="backend='fast'"):
        StableAttention(backend="fast")
    assert "stabilize=True" in repr(StableAttention())
