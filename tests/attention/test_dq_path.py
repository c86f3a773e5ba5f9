"""dQ inside the dK/dV kernel (``op.DQ_PATH``: ATOMIC, TMA_REDUCE) against dQ by its own kernel (KERNEL).

The dK/dV kernel already has dS for each (key block, query block) tile; with ATOMIC or TMA_REDUCE it
also multiplies dS by K and adds the product into an fp32 accumulator, which is then scaled and
rounded into dQ as the dQ kernel stores it. The forward is untouched. dK and dV come from the same
operations (bit for bit under the interpreter, whose tile is fixed; on a GPU the accumulating
kernel has its own tuner, so its tile may differ). dQ's additions happen in another grouping and,
on a GPU, in a varying order, so its error against float64 is bounded by the dQ kernel's own error.
Where a mask, window, varlen or dropout is on, or torch's deterministic mode is, the switch changes
nothing. Under the interpreter TMA_REDUCE would run the element-wise atomics (its TMA reduce needs
sm_90): its cases run on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from stableflash.attention.triton import op
from tests.attention.test_triton import expanded_reference, make, run
from tests.conftest import DEVICE, rel_err

# under the interpreter TMA_REDUCE runs ATOMIC's element-wise atomics: its own cases on a GPU alone
PATHS = [op.DQPath.ATOMIC] + ([op.DQPath.TMA_REDUCE] if DEVICE == "cuda" else [])

CASES = [  # (B, H, H_kv, n_q, n_k, d, causal, keyword arguments)
    (1, 2, 2, 40, 40, 16, True, dict(stabilize=True)),              # δ from dO·(O+R), the default
    (2, 2, 1, 37, 53, 32, False, dict(stabilize=True)),             # grouped-query heads, ragged lengths
    (1, 2, 2, 33, 50, 16, True, dict(stabilize="none")),            # δ from the stored O, n_q < n_k
    (1, 2, 2, 48, 48, 16, True, dict(stabilize="tie-shift+consistent-delta")),
    (1, 2, 2, 40, 40, 16, True, dict(policy="paper", stabilize="none")),   # S recomputed in bf16 units
    (1, 2, 2, 40, 40, 16, False, dict(softcap=5.0)),
]


def _run(q, k, v, do, path, monkeypatch, **kw):
    monkeypatch.setattr(op, "DQ_PATH", path)
    return run(q, k, v, do, backend="triton", **kw)


def _launched(monkeypatch) -> list:
    """The tuners (or kernels) ``op._launch`` is called with from now on."""
    seen = []
    launch = op._launch

    def spy(tuned, *args, **kwargs):
        seen.append(tuned)
        return launch(tuned, *args, **kwargs)

    monkeypatch.setattr(op, "_launch", spy)
    return seen


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, [*c[:7], *c[7].values()])))
def test_dq_inside_the_dkdv_kernel_is_as_accurate_as_its_own_kernel(case, path, monkeypatch):
    B, H, Hk, n_q, n_k, d, causal, kw = case
    q, k, v, do = make(torch.Generator().manual_seed(n_q * d + Hk), B, H, n_q, d, n_k, Hk)
    seen = _launched(monkeypatch)
    got = _run(q, k, v, do, path, monkeypatch, causal=causal, **kw)
    assert op._dkdv_atomic_tuned in seen and op._dq_tuned not in seen      # one kernel did dK, dV and dQ
    base = _run(q, k, v, do, op.DQPath.KERNEL, monkeypatch, causal=causal, **kw)
    assert torch.equal(got[0], base[0])                                     # the forward is untouched
    ref = expanded_reference(q, k, v, do, causal)                           # dK, dV summed over each head group
    if "softcap" in kw or "policy" in kw:                                   # not what the reference computes:
        ref = base                                                          # then the dQ kernel's own result
    for name, a, b, r in zip(("dQ", "dK", "dV"), got[1:], base[1:], ref[1:]):
        assert torch.isfinite(a).all(), name
        if DEVICE == "cpu" and name != "dQ":
            assert torch.equal(a, b), name
        elif r is b:
            assert rel_err(a, b) <= 2.0 ** -7, name                         # within bf16 rounding of it
        else:
            assert rel_err(a, r) <= 1.05 * rel_err(b, r) + 1e-4, name


def test_keys_past_the_last_block_add_no_nan_to_dq(monkeypatch):
    """Scores of −144 make L ≈ −144: a padded key (loaded as zero, score 0) would give P = exp(144)
    = inf in fp32, and inf · 0 = NaN in dS·K. The padded keys' dS is zeroed before the product."""
    gen = torch.Generator().manual_seed(3)
    q = torch.full((1, 1, 8, 16), 6.0).to(DEVICE, torch.bfloat16)
    k = (torch.rand(1, 1, 20, 16, generator=gen) - 6.0).to(DEVICE, torch.bfloat16)
    v, do = torch.randn(1, 1, 20, 16, generator=gen), torch.randn(1, 1, 8, 16, generator=gen)
    v, do = v.to(DEVICE, torch.bfloat16), do.to(DEVICE, torch.bfloat16)
    got = _run(q, k, v, do, op.DQPath.ATOMIC, monkeypatch, scale=0.25)
    base = _run(q, k, v, do, op.DQPath.KERNEL, monkeypatch, scale=0.25)
    ref = expanded_reference(q, k, v, do, False)
    assert torch.isfinite(got[1]).all()
    assert rel_err(got[1], ref[1]) <= 1.05 * rel_err(base[1], ref[1]) + 1e-4


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.value)
def test_masked_calls_and_deterministic_mode_keep_the_dq_kernel(path, monkeypatch):
    """A window (a masking switch), and any call while torch's deterministic mode is on, run the dQ
    kernel: the same values bit for bit as with the switch off."""
    q, k, v, do = make(torch.Generator().manual_seed(5), 1, 2, 40, 16)
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        for deterministic, kw in ((False, dict(causal=True, window=(8, 0))), (True, dict(causal=True))):
            torch.use_deterministic_algorithms(deterministic, warn_only=True)
            seen = _launched(monkeypatch)
            got = _run(q, k, v, do, path, monkeypatch, **kw)
            assert op._dq_tuned in seen and op._dkdv_atomic_tuned not in seen
            base = _run(q, k, v, do, op.DQPath.KERNEL, monkeypatch, **kw)
            for a, b in zip(got, base):
                assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
