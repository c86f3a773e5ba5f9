"""δ computed inside the dQ kernel (``op.FUSED_DELTA``) against δ by its own kernel.

The fused path computes the same rowsum(dO ∘ O) (or with O + R) from the same tiles, then the dK/dV
kernel reads it: dQ, dK, dV agree with the unfused backward (bit for bit under the interpreter,
where a row's sum does not depend on the tile; on a GPU the row sums may be reduced in another
order, so the difference is bounded by the unfused backward's own error against float64). The
forward is untouched. Where a mask, window, varlen or dropout is on, or δ needs its own pass (dP·P),
the switch changes nothing.
"""
from __future__ import annotations

import pytest
import torch

from stableflash.attention.triton import op
from tests.attention.test_triton import expanded_reference, run
from tests.conftest import DEVICE, rel_err


def _run(q, k, v, do, fused, monkeypatch, **kw):
    monkeypatch.setattr(op, "FUSED_DELTA", fused)
    return run(q, k, v, do, backend="triton", **kw)


CASES = [  # (B, H, H_kv, n_q, n_k, d, causal, stabilize)
    (1, 2, 2, 40, 40, 16, True, True),             # δ from dO·(O+R), the default
    (2, 2, 1, 37, 53, 32, False, True),            # grouped-query heads, ragged lengths
    (1, 2, 2, 48, 48, 16, True, "none"),           # δ from the stored O
    (1, 2, 2, 48, 48, 16, True, "tie-shift+consistent-delta"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_fused_delta_gives_the_unfused_gradients(case, monkeypatch):
    B, H, Hk, n_q, n_k, d, causal, stabilize = case
    gen = torch.Generator().manual_seed(n_q * d + Hk)
    q = torch.randn(B, H, n_q, d, generator=gen).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(B, Hk, n_k, d, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    do = torch.randn(B, H, n_q, d, generator=gen).to(DEVICE, torch.bfloat16)
    kw = dict(causal=causal, stabilize=stabilize)
    fused, unfused = _run(q, k, v, do, True, monkeypatch, **kw), _run(q, k, v, do, False, monkeypatch, **kw)
    assert torch.equal(fused[0], unfused[0])                         # the forward is untouched
    if DEVICE == "cpu":
        for name, a, b in zip(("dQ", "dK", "dV"), fused[1:], unfused[1:]):
            assert torch.equal(a, b), name
        return
    ref = expanded_reference(q, k, v, do, causal)                   # dK, dV summed over each head group
    for name, a, b, r in zip(("dQ", "dK", "dV"), fused[1:], unfused[1:], ref[1:]):
        assert rel_err(a, r) <= 1.05 * rel_err(b, r) + 1e-4, name


def test_fused_delta_leaves_masked_calls_and_their_own_delta_pass_alone(monkeypatch):
    """A window (a masking switch) and δ from dP·P keep their kernels: the switch changes nothing."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(4))
    for kw in (dict(causal=True, window=(8, 0)), dict(causal=True, policy="fa2", stabilize="none")):
        if "policy" in kw:
            from stableflash.attention.policy import resolve_policy
            kw = dict(kw, policy=resolve_policy("fa2", torch.bfloat16).replace(delta="dP·P"))
        fused, unfused = _run(q, k, v, do, True, monkeypatch, **kw), _run(q, k, v, do, False, monkeypatch, **kw)
        for a, b in zip(fused, unfused):
            assert torch.equal(a, b)
