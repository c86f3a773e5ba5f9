"""The kernels' launch cache: the same kernels, the same results, without Triton's per-call dispatch.

On a GPU: flash_attention's forward and backward with the cache give bit for bit what they give
with every launch through Triton (same compiled kernels, same arguments), over shapes that change
the autotuner's key, grouped-query heads and an input whose address is not 16-byte aligned (a
different specialization, which must not reuse an aligned kernel); and once a shape has run, a
second call launches without entering Triton's dispatch or its binder. On any machine: what the
autotuner's choice is keyed on, and what a call's shortcut is keyed on.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from stableflash.attention.triton import launch_cache, op
from tests.attention.test_triton import run

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@triton.jit
def _scale_kernel(x, y, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * factor, mask=offs < n)


def test_the_tuners_key_is_its_key_arguments_and_the_tensors_dtypes():
    tuner = triton.autotune([triton.Config({"BLOCK": 16})], key=["n"])(_scale_kernel)
    x = torch.zeros(4)
    base = launch_cache._tuner_key(tuner, (x, x, 100, 2.0), {})
    assert base == (id(tuner), (100,), (torch.float32, torch.float32))
    assert launch_cache._tuner_key(tuner, (x, x, 100, 3.0), {}) == base            # not a key argument
    assert launch_cache._tuner_key(tuner, (x, x), {"n": 100, "factor": 2.0}) == base
    assert launch_cache._tuner_key(tuner, (x, x, 101, 2.0), {}) != base
    assert launch_cache._tuner_key(tuner, (x.half(), x, 100, 2.0), {}) != base


@dataclasses.dataclass
class _Descriptor:                             # the shape of triton's host-side tensor descriptors
    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list
    layout: object = None


def test_a_calls_key_keeps_scalars_dtypes_alignment_and_descriptors_but_not_contents_or_addresses():
    buf = torch.zeros(256)
    x, y = buf[:64], buf[64:128]               # other addresses, both 16-byte aligned
    key = launch_cache.call_key((x, x, 100, 2.0), {"BLOCK": 16})
    assert key == launch_cache.call_key((y, torch.ones(64), 100, 2.0), {"BLOCK": 16})
    assert key != launch_cache.call_key((buf[1:65], x, 100, 2.0), {"BLOCK": 16})     # 4 bytes off
    assert key != launch_cache.call_key((x.double(), x, 100, 2.0), {"BLOCK": 16})
    assert key != launch_cache.call_key((x, x, 101, 2.0), {"BLOCK": 16})
    assert key != launch_cache.call_key((x, x, 100, 2.5), {"BLOCK": 16})
    assert key != launch_cache.call_key((x, x, 100, 2.0), {"BLOCK": 32})
    assert key != launch_cache.call_key((x, x, 100), {"factor": 2.0, "BLOCK": 16})     # by name, not position
    # values that compare equal across types (1 == 1.0 == True) key apart
    assert len({launch_cache.call_key((x, v), {}) for v in (1, 1.0, True)}) == 3
    d = _Descriptor(x.view(8, 8), [8, 8], [8, 1], [4, 8])
    dkey = launch_cache.call_key((d,), {})
    assert dkey == launch_cache.call_key((_Descriptor(y.view(8, 8), [8, 8], [8, 1], [4, 8]),), {})
    for other in (_Descriptor(x.view(8, 8), [8, 8], [8, 1], [8, 8]), _Descriptor(x.view(4, 16), [4, 16], [16, 1], [4, 8]),
                  _Descriptor(x.view(8, 8), [8, 8], [8, 1], [4, 8], layout="swizzled"),
                  _Descriptor(buf[2:66].view(8, 8), [8, 8], [8, 1], [4, 8])):
        assert launch_cache.call_key((other,), {}) != dkey
    assert launch_cache.call_key((x, [1, 2]), {}) is None                           # unhashable: no shortcut


def test_a_calls_key_reads_each_signature_once():
    """The classes and keyword names of a call are read into one plan per signature; calls of that
    signature share it, and each position keeps its role (a tensor's address, a scalar's value)."""
    launch_cache.clear()
    x, y = torch.zeros(64), torch.zeros(64)
    first = launch_cache.call_key((x, 100, 2.0), {"BLOCK": 16})
    assert first == launch_cache.call_key((y, 100, 2.0), {"BLOCK": 16})
    assert len(launch_cache._plans) == 1
    assert first != launch_cache.call_key((y, 100, 2.0), {"WIDTH": 16})      # another keyword: another plan
    assert first != launch_cache.call_key((y, 100, 2), {"BLOCK": 16})        # another class: another plan
    assert len(launch_cache._plans) == 3
    assert launch_cache.call_key((y, 7, 2.0), {"BLOCK": 16}) != first         # same plan, another value
    launch_cache.clear()
    assert launch_cache._plans == {}


@dataclasses.dataclass(frozen=True)
class _Layout:
    swizzle: int


def test_a_calls_key_names_a_frozen_layout_by_identity_and_keeps_it_alive():
    launch_cache.clear()
    layout = _Layout(128)
    key = launch_cache.call_key((1,), {"LAYOUT": layout})
    assert key == launch_cache.call_key((1,), {"LAYOUT": layout})
    assert key != launch_cache.call_key((1,), {"LAYOUT": _Layout(128)})   # equal, another object: another key
    assert launch_cache._pinned[id(layout)] is layout
    launch_cache.clear()
    assert launch_cache._pinned == {}


def test_a_recorded_calls_arguments_follow_the_kernels_parameters():
    call = launch_cache._Call(kernel=None, names=("x", "y", "n", "BLOCK"), tail=(("n", True, None), ("BLOCK", False, 16)))
    x = torch.zeros(4)
    assert call.arguments((x, x), {"n": 7}) == [x, x, 7, 16]


def test_a_shortcut_call_evaluates_its_grid_anew(monkeypatch):
    """A grid function may read what the arguments do not hold — the batch, which the strides of
    contiguous (B, H, N, d) tensors do not show — so a call that repeats another's arguments launches
    the recorded kernel on its own grid, evaluated with the arguments by name. Triton's binder and the
    device are stood in for, so that no GPU is needed."""
    import types
    launched = []

    class Kernel:                              # a compiled kernel: kernel[grid](*arguments)
        def __getitem__(self, grid):
            return lambda *args: launched.append((grid, args))

    kernel = Kernel()

    class Entry:                               # a jit function: entry[grid](*args, **kwargs) returns its kernel
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(("through Triton", grid)) or kernel

    def bind(raw, args, kwargs):
        return ("specialization",), {"x": args[0], "n": args[1], "BLOCK": kwargs["BLOCK"]}

    monkeypatch.setattr(launch_cache, "_bind", bind)
    monkeypatch.setattr(launch_cache, "driver", types.SimpleNamespace(
        active=types.SimpleNamespace(get_current_device=lambda: 0)))
    monkeypatch.setattr(launch_cache, "VERIFY", False)
    launch_cache.clear()
    entry, x = Entry(), torch.zeros(4)
    for batch in (2, 2, 2, 5):
        launch_cache.launch(entry, lambda meta, b=batch: (meta["n"] // meta["BLOCK"], b), x, 64, BLOCK=16)
    assert launched[0][0] == "through Triton"
    assert [grid for grid, _ in launched[1:]] == [(4, 2, 1), (4, 2, 1), (4, 5, 1)]
    assert all(args == (x, 64, 16) for _, args in launched[1:])
    assert len(launch_cache._calls) == 1       # the last two calls took the recorded call
    # a descriptor whose field cannot be hashed: no shortcut, the call binds (and launches) as before
    odd = _Descriptor(x.view(2, 2), [[2, 2]], [2, 1], [2, 2])
    launch_cache.launch(entry, (1,), odd, 64, BLOCK=16)
    assert launched[-1] == ((1, 1, 1), (odd, 64, 16)) and len(launch_cache._calls) == 1
    launch_cache.clear()


def _grads(q, k, v, do, causal):
    return run(q, k, v, do, causal=causal, backend="triton")


def _through_tritons_dispatch(q, k, v, do, causal):
    launch_cache.ENABLED = False
    try:
        return _grads(q, k, v, do, causal)
    finally:
        launch_cache.ENABLED = True


CASES = [  # (B, H, H_kv, n_q, n_k, d, causal)
    (2, 4, 4, 256, 256, 64, True),
    (2, 4, 4, 384, 384, 64, True),            # another tuner key
    (1, 8, 2, 200, 333, 128, False),          # grouped-query heads, ragged lengths
]


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "offset"])
def test_cached_launches_give_what_tritons_dispatch_gives_bit_for_bit(case, aligned):
    B, H, Hk, n_q, n_k, d, causal = case
    gen = torch.Generator(device="cuda").manual_seed(n_q + d)
    def make(h, n):
        t = torch.randn(B * h * n * d + 1, generator=gen, device="cuda").to(torch.bfloat16)
        start = 0 if aligned else 1           # 2 bytes past a 16-byte boundary: another specialization
        return t[start:start + B * h * n * d].view(B, h, n, d)
    q, k, v, do = make(H, n_q), make(Hk, n_k), make(Hk, n_k), make(H, n_q)
    launch_cache.clear()
    expected = _through_tritons_dispatch(q, k, v, do, causal)
    for _ in range(3):                         # the first call records, the later ones launch directly
        got = _grads(q, k, v, do, causal)
        for name, a, b in zip(("O", "dQ", "dK", "dV"), got, expected):
            assert torch.equal(a, b), f"{name} differs from Triton's dispatch"


@needs_cuda
def test_a_repeated_call_does_not_enter_tritons_dispatch(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 128, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4))
    _grads(q, k, v, do, True)                  # recorded
    entered = []
    for kernel in (op.attn_fwd_kernel, op.attn_bwd_dkdv_kernel, op.attn_bwd_dq_kernel, op.delta_dot_kernel):
        monkeypatch.setattr(kernel, "run", lambda *a, _k=kernel, **kw: entered.append(_k))
    got = _grads(q, k, v, do, True)
    assert entered == []
    monkeypatch.undo()
    expected = _through_tritons_dispatch(q, k, v, do, True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@needs_cuda
def test_a_repeated_call_does_not_bind_through_triton_and_the_record_stays_bounded(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, do = (torch.randn(1, 2, 128, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4))
    launch_cache.clear()
    expected = _grads(q, k, v, do, True)       # through Triton, then recorded on the second call
    _grads(q, k, v, do, True)
    monkeypatch.setattr(launch_cache, "VERIFY", False)
    bound = []
    real_bind = launch_cache._bind
    monkeypatch.setattr(launch_cache, "_bind", lambda *a: bound.append(a) or real_bind(*a))
    q2, k2, v2, do2 = (t.clone() for t in (q, k, v, do))      # new addresses, same alignment
    got = _grads(q2, k2, v2, do2, True)
    assert bound == []
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    q4, k4, v4, do4 = (torch.cat([t, t.flip(0)]) for t in (q2, k2, v2, do2))   # another batch, same strides
    got = _grads(q4, k4, v4, do4, True)
    assert all(torch.equal(a[:1], b) and torch.equal(a[1:], b) for a, b in zip(got, expected))
    monkeypatch.setattr(launch_cache, "MAX_CALLS", 2)
    for n in (96, 160, 224):
        x = torch.randn(1, 2, n, 64, device="cuda").to(torch.bfloat16)
        _grads(x, x, x, x, True)
        _grads(x, x, x, x, True)
        assert len(launch_cache._calls) <= 2
