"""conftest's ``_interpreter_without_repeated_setup`` changes how fast Triton's CPU interpreter runs,
not what it computes: the stabilized attention's forward and backward (the Triton kernels, their
@triton.jit helpers nested in each other, bf16 casts through numpy) give bit for bit what the
interpreter gives with Triton's own functions put back — checked on the triton installed, so a
release whose interpreter no longer works as the patch assumes fails here instead of elsewhere."""
import pytest
import torch

from stableflash.attention import flash_attention
from tests.conftest import _interpreter_without_repeated_setup


def _run(q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = flash_attention(q, k, v, causal=True, backend="triton")
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def test_the_patched_interpreter_computes_what_triton_computes(monkeypatch):
    originals = getattr(_interpreter_without_repeated_setup, "originals", None)
    if originals is None:
        pytest.skip("the patch is not applied here (a GPU, or an interpreter without the functions it replaces)")
    gen = torch.Generator().manual_seed(29)
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=gen).to(torch.bfloat16) for _ in range(4))
    k = k[:, :, torch.arange(40) % 8]                     # tied row maxima: the stabilized path's branches
    patched = _run(q, k, v, do)
    for (owner, name), original in originals.items():
        monkeypatch.setattr(owner, name, original)
    plain = _run(q, k, v, do)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), patched, plain):
        assert torch.isfinite(a).all() and torch.equal(a, b), name
