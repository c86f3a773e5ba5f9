"""Which forwards and backwards of the Triton backend run on the Gluon Hopper kernels (``gluon.route``).

Without a GPU: ``why_not`` names each thing that keeps a call on the Triton kernels (the switch, the
interpreter, a configuration other than the bf16 default, the dtype, the head_dim, masks, TMA
alignment, the grid's limits, the device), and a call that has everything but a Hopper GPU is
refused for its device alone; ``beta``/``eps`` of the default (unused by its standard row maximum)
do not matter; ``triton_only`` switches the route off and back.

On an H100/H200 (compute capability 9.0): ``flash_attention`` as a user calls it, at head_dim 128,
runs the Gluon forward (counted) and the Triton backward on its outputs, and its O, dQ, dK, dV are
within 1.25× (+1e-4) the Triton kernels' error against float64 on fresh inputs and on tied maxima — causal and not, ragged
lengths, grouped-query heads, (B, N, H, d) buffers; through ``torch.compile`` the same kernels give
the same values bit for bit; head_dim 64 and a window stay on the Triton kernels.

The backward (``why_not_backward``): without a GPU each reason that keeps it on the Triton kernels
is named (head_dim, fewer keys than ``BACKWARD_MIN_KEYS`` of the head_dim, deterministic algorithms
at head_dim 64, or at 128 with fewer keys than ``DETERMINISTIC_MIN_KEYS``, the configuration,
masks, dO's alignment). On an H100/H200: a call from that many keys on runs the Gluon backward with
atomic dQ (counted), within 1.25× (+1e-4) the Triton backward's error against float64 — (B, N, H, d)
buffers, grouped-query heads, tied maxima, causal or not, and ``flash_attn_qkvpacked_func``'s one
gradient of qkv, eager and compiled; with ``torch.use_deterministic_algorithms`` at head_dim 64 the
Triton backward runs, bit for bit the portable path's, and at 128 from ``DETERMINISTIC_MIN_KEYS``
keys the two Gluon backward kernels, bit for bit repeatable. A forward or backward whose signature ran
before replays its kept plan (``launch_cache.Plan``): the same kernels and arguments, checked against
the launches the call builds; O, dK and dV bit for bit what the plans switched off give; a plan
recorded from ``flash_attention(x, x, x)`` is not run for distinct q, k, v. Without a GPU (the
launches stood in for): each replayed launch gets, place by place, what the call builds with the
plans off — the route's packed backward and forward, the Triton forward. On an H100/H200 the kernels that
the SASS checks compile without a GPU (``sass.compile_forward``, ``compile_backward`` at ``sass.LAUNCH_SHAPE``)
have the PTX of those a call of that shape launches.
"""
import contextlib

import pytest
import torch

from stableflash.attention import flash_attention
from stableflash.attention import gluon as sg
from stableflash.attention.gluon import route
from stableflash.attention.triton.launch import stabilized_config
from stableflash.attention.triton import op as triton_op
from stableflash.attention.triton.op import Masks
from tests.attention.test_gluon_hopper import on_hopper
from tests.attention.test_triton import expanded_reference

needs_gluon = pytest.mark.skipif(not sg.available(), reason=f"Gluon Hopper API missing: {sg.unavailable_reason()}")
CONFIG = stabilized_config(torch.bfloat16)


def _bf16(*shape, device="cpu"):
    return torch.zeros(*shape, dtype=torch.bfloat16, device=device)


def _qkv(d=128, device="cpu"):
    return _bf16(2, 4, 64, d, device=device), _bf16(2, 2, 64, d, device=device), _bf16(2, 2, 64, d, device=device)


def test_switch_and_interpreter_keep_calls_on_triton():
    q, k, v = _qkv()
    with route.triton_only():
        assert "switched off" in route.why_not(q, k, v, CONFIG, Masks())
    assert route.ENABLED
    assert "interpreter" in route.why_not(q, k, v, CONFIG, Masks(), interpreting=True)


@needs_gluon
def test_a_qualifying_call_is_refused_for_its_device_alone():
    q, k, v = _qkv()
    assert route.why_not(q, k, v, CONFIG, Masks()) == "the tensors are on cpu, not CUDA"
    from dataclasses import replace
    custom = replace(CONFIG, beta=3.0, eps=1e-2)         # unused by the standard row maximum
    assert route.why_not(q, k, v, custom, Masks()) == "the tensors are on cpu, not CUDA"
    unstabilized = _config_of(False)                       # δ from dO·O: the forward stores no R
    assert unstabilized.delta.name == "DO_O"
    assert route.why_not(q, k, v, unstabilized, Masks()) == "the tensors are on cpu, not CUDA"
    do, *qkv = _backward_call()
    assert route.why_not_backward(do, *qkv, unstabilized, Masks()) == "the tensors are on cpu, not CUDA"


@needs_gluon
def test_the_forward_at_head_dim_64_is_routed_from_its_key_counts():
    """At head_dim 64 the forward takes the route from ``FORWARD_MIN_KEYS`` keys on (causal or not), one
    key fewer is named; at head_dim 128 from one key on."""
    for causal in (False, True):
        least = route.FORWARD_MIN_KEYS[(64, causal)]
        q, k, v = (_bf16(1, 2, least, 64) for _ in range(3))
        assert route.why_not(q, k, v, CONFIG, Masks(), causal=causal) == "the tensors are on cpu, not CUDA"
        short = k[:, :, 1:]
        reason = route.why_not(q, short, short, CONFIG, Masks(), causal=causal)
        assert reason == (f"{least - 1} keys (the {'causal ' if causal else ''}forward at head_dim 64 is routed "
                          f"from {least} on)"), reason
    q, k, v = (_bf16(1, 2, 1, 128) for _ in range(3))
    assert route.why_not(q, k, v, CONFIG, Masks(), causal=True) == "the tensors are on cpu, not CUDA"


@needs_gluon
def test_traced_sizes_are_answered_as_concrete_ones():
    """Under ``torch.compile(dynamic=True)`` the ops' fake implementations ask the route with symbolic
    sizes (unhashable): each answer is the one the same concrete sizes get — the forward's and the
    backward's key counts by head_dim (a traced count named by its symbol), and past them the device."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
    for n, d in ((128, 64), (4096, 64), (600, 128)):
        concrete = [_bf16(2, 3, n, d) for _ in range(4)]
        traced = [mode.from_tensor(t, symbolic_context=dynamic) for t in concrete]
        assert all(isinstance(s, torch.SymInt) for s in traced[0].shape[2:])
        do, q, k, v = traced
        for got, want in ((route.why_not(q, k, v, CONFIG, Masks(), pointers=False),
                           route.why_not(*concrete[1:], CONFIG, Masks(), pointers=False)),
                          (route.why_not_backward(do, q, k, v, CONFIG, Masks(), pointers=False),
                           route.why_not_backward(*concrete, CONFIG, Masks(), pointers=False))):
            assert want is not None and got is not None
            if want.startswith(f"{n} keys"):               # a traced key count is named by its symbol
                got, want = got.split(" ", 1)[1], want.split(" ", 1)[1]
            assert got == want, (n, d)
        assert route.forward_routed(d, True, n) == bool(route.forward_routed(q.shape[-1], True, k.shape[2]))


def _config_of(stabilize):
    """The kernels' configuration of ``flash_attention(q, k, v, stabilize=...)`` for bf16 inputs."""
    from stableflash.attention.policy import resolve_policy
    from stableflash.attention.stabilization import parse_stabilize
    from stableflash.attention.triton.launch import kernel_config
    stab = parse_stabilize(stabilize)
    return kernel_config(stab.policy_for(resolve_policy(None, torch.bfloat16)), stab.rule, torch.bfloat16)


@needs_gluon
@pytest.mark.parametrize("change, words", [
    (dict(config=stabilized_config(torch.float16)), "not flash_attention's default for bf16"),
    (dict(config="tie-shift"), "not flash_attention's default for bf16"),
    (dict(dtype=torch.float16), "dtype torch.float16"),
    (dict(d=64), "the causal forward at head_dim 64 is routed from"),
    (dict(masks=Masks(dropout_p=0.1)), "window, attn_mask, varlen batch or dropout"),
    (dict(masks=Masks(band=(8, 0, False))), "window, attn_mask, varlen batch or dropout"),
    (dict(offset=True), "is not TMA-aligned"),
    (dict(heads=70000), "exceeds the kernels' grid"),
], ids=["fp16-config", "stabilize-tie-shift", "fp16", "d64", "dropout", "window", "misaligned", "grid"])
def test_each_unsupported_feature_is_named(change, words):
    d = change.get("d", 128)
    q, k, v = _qkv(d)
    if "dtype" in change:
        q, k, v = (t.to(change["dtype"]) for t in (q, k, v))
    if change.get("offset"):
        q = _bf16(2 * 4 * 64 * d + 1)[1:].view(2, 4, 64, d)          # base 2 bytes past alignment
    if "heads" in change:
        q = torch.empty_strided((1, change["heads"], 1, d), (change["heads"] * d, d, d, 1), dtype=torch.bfloat16)
    config = change.get("config", CONFIG)
    if config == "tie-shift":
        config = _config_of("tie-shift")
    reason = route.why_not(q, k, v, config, change.get("masks", Masks()))
    assert reason is not None and words in reason, reason


def _backward_call(d=64, n=None, device="cpu"):
    n = route.BACKWARD_MIN_KEYS[d] if n is None else n
    q, k, v = _bf16(1, 2, n, d, device=device), _bf16(1, 2, n, d, device=device), _bf16(1, 2, n, d, device=device)
    return _bf16(1, 2, n, d, device=device), q, k, v


@contextlib.contextmanager
def deterministic(on: bool = True):
    """``torch.use_deterministic_algorithms(on)`` within the block, the earlier setting restored after."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def test_backward_switch_and_interpreter_keep_calls_on_triton():
    do, q, k, v = _backward_call()
    with route.triton_only():
        assert "switched off" in route.why_not_backward(do, q, k, v, CONFIG, Masks())
    assert "interpreter" in route.why_not_backward(do, q, k, v, CONFIG, Masks(), interpreting=True)


@needs_gluon
@pytest.mark.parametrize("d", [64, 128])
def test_a_qualifying_backward_is_refused_for_its_device_alone(d):
    """At head_dim 128 also with torch.use_deterministic_algorithms on, from DETERMINISTIC_MIN_KEYS
    keys: its two kernels sum in a fixed order."""
    do, q, k, v = _backward_call(d)
    assert route.why_not_backward(do, q, k, v, CONFIG, Masks()) == "the tensors are on cpu, not CUDA"
    if d == 128:
        do, q, k, v = _backward_call(d, route.DETERMINISTIC_MIN_KEYS[d])
        with deterministic():
            assert route.why_not_backward(do, q, k, v, CONFIG, Masks()) == "the tensors are on cpu, not CUDA"


@needs_gluon
@pytest.mark.parametrize("change, words", [
    (dict(d=32, n=4096), "head_dim 32 (routed backward: (64, 128))"),
    (dict(n=route.BACKWARD_MIN_KEYS[64] - 1), f"the backward at head_dim 64 is routed from {route.BACKWARD_MIN_KEYS[64]} on"),
    (dict(d=128, n=route.BACKWARD_MIN_KEYS[128] - 1),
     f"the backward at head_dim 128 is routed from {route.BACKWARD_MIN_KEYS[128]} on"),
    (dict(deterministic=True), "use_deterministic_algorithms is on"),
    (dict(d=128, n=route.DETERMINISTIC_MIN_KEYS[128] - 1, deterministic=True),
     f"under torch.use_deterministic_algorithms (the deterministic backward at head_dim 128 is routed from "
     f"{route.DETERMINISTIC_MIN_KEYS[128]} on)"),
    (dict(config=stabilized_config(torch.float16)), "not flash_attention's default for bf16"),
    (dict(masks=Masks(band=(8, 0, False))), "window, attn_mask, varlen batch or dropout"),
    (dict(offset=True), "do with strides"),
], ids=["d32", "short", "short-d128", "deterministic", "deterministic-short-d128", "fp16-config", "window",
        "misaligned-do"])
def test_each_backward_it_does_not_take_is_named(change, words):
    do, q, k, v = _backward_call(change.get("d", 64), change.get("n"))
    if change.get("offset"):
        do = _bf16(do.numel() + 1)[1:].view(do.shape)                # base 2 bytes past alignment
    with deterministic(change.get("deterministic", torch.are_deterministic_algorithms_enabled())):
        reason = route.why_not_backward(do, q, k, v, change.get("config", CONFIG), change.get("masks", Masks()))
    assert reason is not None and words in reason, reason


def _plan_world(monkeypatch) -> tuple[list, list]:
    """The route taken on this CPU — its device checks, Triton's device and the launches stood in for —
    with plans on: ([each launch built: its arguments], [each launch replayed: its arguments])."""
    import types

    from stableflash.attention.gluon import launch_backward
    from stableflash.attention.triton import launch_cache
    built, replayed = [], []

    class Kernel:                              # a compiled kernel as Triton's runner calls it
        function = packed_metadata = None

        def run(self, *args):
            replayed.append(list(args[9:]))    # after the grid, stream, function, metadata and hooks

    monkeypatch.setattr(launch_cache, "launch", lambda entry, grid, *args, **kwargs: built.append([*args, *kwargs.values()]))
    monkeypatch.setattr(launch_cache, "replay_of", lambda entry, args, kwargs, grid=None: launch_cache.Replay(
        Kernel(), [*args, *kwargs.values()], launch_cache._generation, (1, 1, 1)))
    monkeypatch.setattr(launch_cache, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 0)))
    monkeypatch.setattr(launch_cache.knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(launch_cache.knobs.runtime, "launch_exit_hook", None)
    monkeypatch.setattr(launch_cache, "VERIFY", False)
    monkeypatch.setattr(launch_cache, "PLANS", True)
    monkeypatch.setattr(triton_op, "interpreting", lambda: False)
    monkeypatch.setattr(triton_op, "_INTERPRETING", False)
    monkeypatch.setattr(triton_op, "_forward_plans", {})
    monkeypatch.setattr(launch_backward, "_plans", {})
    monkeypatch.setattr(route, "_common_reason", lambda *args, **kwargs: None)
    return built, replayed


def _named_launches(launches: list, names: dict) -> list:
    """Each launch's arguments with every tensor named: ``names[(address, dtype)]``, else the call's
    n-th other tensor (its buffers, in order of appearance) with its dtype and, where it is not a
    descriptor's base (whose address alone reaches the launch), its shape and strides."""
    import dataclasses

    from stableflash.attention.triton import launch_cache
    buffers: dict = {}

    def named(a, base=False):
        if isinstance(a, torch.Tensor):
            at = (a.data_ptr(), a.dtype)
            if at in names:
                return names[at]
            index = buffers.setdefault(at, len(buffers))
            return ("buffer", index, a.dtype) if base else ("buffer", index, a.dtype, a.shape, a.stride())
        if launch_cache._is_descriptor(a):
            return ("descriptor", named(a.base, True),
                    *(getattr(a, f.name) for f in dataclasses.fields(a) if f.name != "base"))
        return a
    return [[named(a) for a in launch] for launch in launches]


@needs_gluon
@pytest.mark.parametrize("direct", [False, True], ids=["torch allocation", "direct allocation"])
@pytest.mark.parametrize("case", ["packed backward", "gluon forward", "triton forward"])
def test_a_repeated_call_replays_each_launch_with_its_own_tensors(case, direct, monkeypatch):
    """The ops as torch.compile's code calls them, with the launches stood in for (no GPU): a first call
    records its plan; a call with new tensors of the same signature replays it, building nothing, and
    each replayed launch gets, place by place, what the same call builds with the plans off — its own
    inputs, outputs and views of them, new buffers of the same shapes, strides and dtypes — and every
    other argument equal. The route's packed backward (head_dim 128), its forward (128) and the Triton
    forward below the route's key count (64). ``direct``: the outputs and buffers allocated through the
    allocator's entry (``launch_cache.empty``; stood in for here by one that takes exact tuples alone, as
    torch's does)."""
    from stableflash.attention.triton import launch_cache
    built, replayed = _plan_world(monkeypatch)
    allocated = []
    if direct:
        def strict(shape, strides, dtype):
            assert type(shape) is tuple and type(strides) is tuple, (type(shape), type(strides))
            allocated.append(shape)
            return torch.empty_strided(shape, strides, dtype=dtype)
        monkeypatch.setattr(launch_cache, "_empty_strided_cuda", strict)
        monkeypatch.setattr(launch_cache, "_direct", lambda like: True)
    monkeypatch.setattr(triton_op, "TMA", False)   # the Triton forward's pointer path (TMA asks the device)
    gen = torch.Generator().manual_seed(3)
    d = 64 if case == "triton forward" else 128
    B, H, n = 1, 2, route.BACKWARD_MIN_KEYS[128]
    assert (d == 128) == route.forward_routed(d, True, n)
    seed = torch.empty(0, dtype=torch.int64)

    def bf16(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    def inputs():
        if case == "packed backward":
            return (bf16(B, n, H, d).transpose(1, 2), bf16(B, n, 3, H, d), bf16(B, n, H, d).transpose(1, 2),
                    bf16(B, H, n, d), torch.randn(B, H, n, generator=gen))
        return tuple(bf16(B, n, H, d).transpose(1, 2) for _ in range(3))

    def call(tensors, plans: bool) -> list:
        monkeypatch.setattr(launch_cache, "PLANS", plans)
        if case == "packed backward":
            do, qkv, o, r, lse = tensors
            grad = torch.ops.stableflash.attn_bwd_packed.default(do, qkv, o, r, lse, True, d ** -0.5, CONFIG.op_key,
                                                                 *Masks().op_args(), seed)
            names = (("dO", do), ("O", o), ("R", r), ("L", lse), *zip("qkv", triton_op.unpack_qkv(qkv)),
                     *zip(("dq", "dk", "dv"), triton_op.unpack_qkv(grad)))
        else:
            o, lse, r, _ = torch.ops.stableflash.attn_fwd.default(*tensors, True, d ** -0.5, CONFIG.op_key,
                                                                  *Masks().op_args())
            names = (*zip("qkv", tensors), ("O", o), ("L", lse), ("R", r))
        return _named_launches(replayed if plans else built, {(t.data_ptr(), t.dtype): name for name, t in names})
    call(inputs(), True)                           # recorded
    steps = len(built)
    assert steps == (3 if case == "packed backward" else 1) and not replayed
    later = inputs()
    built.clear()
    got = call(later, True)
    assert len(replayed) == steps and not built    # replayed, nothing built
    want = call(later, False)
    assert len(built) == steps and got == want
    places = {x if isinstance(x, str) else x[1] for launch in got for x in launch
              if isinstance(x, str) or (isinstance(x, tuple) and x[:1] == ("descriptor",))}
    assert set("qkv") | {"O", "L"} <= places, places
    assert bool(allocated) == direct


@needs_gluon
def test_a_plan_recorded_from_one_tensor_in_several_places_is_not_replayed_for_distinct_ones(monkeypatch):
    """The forward op called as ``(x, x, x)`` records a plan whose three places take one tensor; a call
    of distinct q, k, v of the same shapes builds its launch instead of replaying that plan (the GPU
    test below checks the outputs)."""
    built, replayed = _plan_world(monkeypatch)
    x, k, v = (torch.randn(1, 600, 2, 128).to(torch.bfloat16).transpose(1, 2) for _ in range(3))

    def call(*tensors):
        torch.ops.stableflash.attn_fwd.default(*tensors, True, 0.125, CONFIG.op_key, *Masks().op_args())
    call(x, x, x)
    call(x, x, x)
    assert len(built) == 1 and len(replayed) == 1          # recorded, then replayed
    call(x, k, v)
    assert len(built) == 2 and len(replayed) == 1


# --- on a Hopper GPU -----------------------------------------------------------------------------

@pytest.fixture
def counted(monkeypatch):
    """{"forward": n, "backward": n}: the Gluon forwards and backwards launched through the route."""
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(route, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(route, name, counting)
    return calls


def _run(q, k, v, do, **kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = flash_attention(q, k, v, **kw)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def _inputs(B, H, Hk, n, d, tied, gen, layout="bhnd"):
    def make(h):
        if layout == "bnhd":
            return torch.randn(B, n, h, d, generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)
        return torch.randn(B, h, n, d, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v, do = make(H), make(Hk), make(Hk), make(H)
    if tied:                                   # keys repeating every 16 positions: tied row maxima
        k = k[:, :, :16].repeat(1, 1, (n + 15) // 16, 1)[:, :, :n]
    return q, k, v, do


ROUTE_CASES = [  # (B, H, H_kv, N, layout, tied)
    (2, 4, 4, 509, "bhnd", False),
    (1, 8, 2, 300, "bhnd", True),              # grouped-query heads, tied maxima
    (2, 4, 4, 256, "bnhd", False),             # (B, N, H, d) buffers, as a model hands them over
]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", ROUTE_CASES, ids=["-".join(map(str, c)) for c in ROUTE_CASES])
def test_flash_attention_runs_the_hopper_kernels_at_head_dim_128(case, causal, counted):
    B, H, Hk, n, layout, tied = case
    gen = torch.Generator(device="cuda").manual_seed(n + causal)
    q, k, v, do = _inputs(B, H, Hk, n, 128, tied, gen, layout)
    got = _run(q, k, v, do, causal=causal)
    assert counted == {"forward": 1, "backward": 0}
    with route.triton_only():
        portable = _run(q, k, v, do, causal=causal)
    assert counted == {"forward": 1, "backward": 0}
    _within_portable_error(got, portable, expanded_reference(q, k, v, do, causal), (q, q, k, v))


@pytest.mark.gpu
@on_hopper
def test_compiled_calls_take_the_same_kernels(counted, monkeypatch):
    """The forward through the opaque op (the route), the backward inline; fixed tiles (AUTOTUNE
    off) on both sides, so that inductor's tuning and eager's cannot pick different ones."""
    monkeypatch.setattr(triton_op, "AUTOTUNE", False)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = _inputs(2, 4, 4, 384, 128, False, gen, "bnhd")
    eager = _run(q, k, v, do, causal=True)
    compiled = torch.compile(lambda a, b, c: flash_attention(a, b, c, causal=True), fullgraph=True)
    qc, kc, vc = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = compiled(qc, kc, vc)
    got = (o, *torch.autograd.grad(o, (qc, kc, vc), do))
    assert counted == {"forward": 2, "backward": 0}
    for a, b in zip(eager, got):
        assert torch.equal(a, b)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("kw", [dict(d=64), dict(d=128, window=(32, 0))], ids=["d64", "window"])
def test_unsupported_calls_stay_on_the_triton_kernels(kw, counted):
    d = kw.pop("d")
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v, do = _inputs(1, 2, 2, 200, d, False, gen)
    got = _run(q, k, v, do, causal=True, **kw)
    with route.triton_only():
        portable = _run(q, k, v, do, causal=True, **kw)
    assert counted == {"forward": 0, "backward": 0}
    for a, b in zip(got, portable):
        assert torch.equal(a, b)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_stabilize_false_runs_the_hopper_kernels_without_the_residual(d, counted):
    """``flash_attention(..., stabilize=False, backend="triton")`` (δ from dO·O as stored; "auto" hands
    it to SDPA) takes the route as the default does — at head_dim 128 the Gluon forward, storing no R, and from ``BACKWARD_MIN_KEYS`` keys the
    Gluon backward, whose δ kernel then reads O alone — (B, N, H, d) buffers, grouped-query heads,
    tied maxima, causal: within 1.25× (+1e-4) the switched-off route's error against float64."""
    n = route.BACKWARD_MIN_KEYS[d] + 37
    gen = torch.Generator(device="cuda").manual_seed(7 + d)
    q, k, v, do = _inputs(1, 4, 2, n, d, True, gen, "bnhd")
    got = _run(q, k, v, do, causal=True, stabilize=False, backend="triton")
    assert counted == {"forward": int(route.forward_routed(d, True, n)), "backward": 1}
    with route.triton_only():
        portable = _run(q, k, v, do, causal=True, stabilize=False, backend="triton")
    _within_portable_error(got, portable, expanded_reference(q, k, v, do, True), (q, q, k, v))


def _routed_within_portable_error(q, k, v, do, causal, counted, launches):
    """``flash_attention`` fwd+bwd through the route, its Gluon launches counted as ``launches``, within
    ``_within_portable_error`` of the switched-off route's against float64; returns the latter's."""
    got = _run(q, k, v, do, causal=causal)
    assert counted == launches
    with route.triton_only():
        portable = _run(q, k, v, do, causal=causal)
    _within_portable_error(got, portable, expanded_reference(q, k, v, do, causal), (q, q, k, v))
    return portable


def _within_portable_error(got, portable, ref, likes):
    for name, x, x_t, r, like in zip(("O", "dQ", "dK", "dV"), got, portable, ref, likes):
        assert x.shape == like.shape and x.dtype == torch.bfloat16 and torch.isfinite(x).all(), name
        err, err_t = (((y.double() - r).norm() / r.norm()).item() for y in (x, x_t))
        assert err <= 1.25 * err_t + 1e-4, (name, err, err_t)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_head_dim_64_backwards_run_the_hopper_backward(causal, counted, monkeypatch):
    """head_dim 64 from BACKWARD_MIN_KEYS keys on, as a user calls it — (B, N, H, d) buffers,
    grouped-query heads, keys repeating every 16 positions (tied maxima), N not a multiple of a
    block: the Triton forward (the forward's route held back to isolate the backward's), the Gluon
    backward with atomic dQ, within 1.25× (+1e-4) the Triton backward's error against float64; with
    torch.use_deterministic_algorithms the Triton backward, bit for bit what the switched-off route
    gives."""
    monkeypatch.setattr(route, "FORWARD_MIN_KEYS", {key: 2**31 for key in route.FORWARD_MIN_KEYS})
    n = route.BACKWARD_MIN_KEYS[64] + 37
    gen = torch.Generator(device="cuda").manual_seed(64 + causal)
    q, k, v, do = _inputs(1, 4, 2, n, 64, True, gen, "bnhd")
    portable = _routed_within_portable_error(q, k, v, do, causal, counted, {"forward": 0, "backward": 1})
    with deterministic():
        repeatable = _run(q, k, v, do, causal=causal)
    assert counted == {"forward": 0, "backward": 1}
    for a, b in zip(repeatable, portable):
        assert torch.equal(a, b)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_head_dim_64_forwards_run_the_hopper_forward(causal, counted):
    """head_dim 64 from FORWARD_MIN_KEYS keys on (fewer causal ones: the Triton forward), as a user calls
    it — (B, N, H, d) buffers, grouped-query heads, tied maxima, N not a multiple of a block: the Gluon
    forward and backward within 1.25× (+1e-4) the Triton kernels' error against float64."""
    n = route.FORWARD_MIN_KEYS[(64, causal)] + 37
    assert route.forward_routed(64, causal, n) and not route.forward_routed(64, causal, n - 38)
    gen = torch.Generator(device="cuda").manual_seed(640 + causal)
    q, k, v, do = _inputs(1, 4, 2, n, 64, True, gen, "bnhd")
    _routed_within_portable_error(q, k, v, do, causal, counted, {"forward": 1, "backward": 1})


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_head_dim_128_backwards_run_the_hopper_backward(causal, counted):
    """head_dim 128 from BACKWARD_MIN_KEYS[128] keys on, as a user calls it — (B, N, H, d) buffers,
    grouped-query heads, tied maxima, N not a multiple of a block: the Gluon forward and the Gluon
    backward with atomic dQ, within 1.25× (+1e-4) the Triton kernels' error against float64; with
    torch.use_deterministic_algorithms from DETERMINISTIC_MIN_KEYS[128] keys still a Gluon backward
    (the two kernels, their sums in one fixed order), bit for bit the same in two runs."""
    n = route.BACKWARD_MIN_KEYS[128] + 37
    gen = torch.Generator(device="cuda").manual_seed(128 + causal)
    q, k, v, do = _inputs(1, 2, 1, n, 128, True, gen, "bnhd")
    _routed_within_portable_error(q, k, v, do, causal, counted, {"forward": 1, "backward": 1})
    q, k, v, do = _inputs(1, 2, 1, route.DETERMINISTIC_MIN_KEYS[128] + 37, 128, True, gen, "bnhd")
    with deterministic():
        first, again = _run(q, k, v, do, causal=causal), _run(q, k, v, do, causal=causal)
    assert counted == {"forward": 3, "backward": 3}
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
@on_hopper
def test_packed_qkv_backward_on_the_hopper_route_eager_and_compiled(counted, monkeypatch):
    """``flash_attn_qkvpacked_func`` (the GPT model's call): the gradient of qkv, dQ, dK and dV written
    by the Gluon backward into one tensor laid out as qkv, in eager mode and through torch.compile
    (the inline backward op hands the call to the opaque one), each within 1.25× (+1e-4) the
    Triton backward's error against float64."""
    from stableflash.attention import flash_attn_qkvpacked_func
    monkeypatch.setattr(triton_op, "AUTOTUNE", False)
    gen = torch.Generator(device="cuda").manual_seed(7)
    B, n, H, d = 1, route.BACKWARD_MIN_KEYS[64], 2, 64
    qkv = torch.randn(B, n, 3, H, d, generator=gen, device="cuda").to(torch.bfloat16)
    do = torch.randn(B, n, H, d, generator=gen, device="cuda").to(torch.bfloat16)

    def run(fn):
        x = qkv.detach().clone().requires_grad_(True)
        o = fn(x)
        return o, torch.autograd.grad(o, x, do)[0]
    call = lambda x: flash_attn_qkvpacked_func(x, causal=True)  # noqa: E731
    eager = run(call)
    compiled = run(torch.compile(call, fullgraph=True))
    routed = n >= route.FORWARD_MIN_KEYS[(64, True)]          # the forward too, from its threshold on
    assert counted == {"forward": 2 if routed else 0, "backward": 2}
    with route.triton_only():
        portable = run(call)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    o, dq, dk, dv = expanded_reference(q, k, v, do.transpose(1, 2), True)
    ref = (o.transpose(1, 2), torch.stack([t.transpose(1, 2) for t in (dq, dk, dv)], 2))
    for got in (eager, compiled):
        assert got[1].shape == qkv.shape and got[1].stride() == qkv.stride()
        for name, x, x_t, r in zip(("O", "dqkv"), got, portable, ref):
            err, err_t = (((y.double() - r).norm() / r.norm()).item() for y in (x, x_t))
            assert err <= 1.25 * err_t + 1e-4, (name, err, err_t)


def test_a_devices_capability_is_asked_once_per_device_and_the_current_one_stands_for_no_index(monkeypatch):
    """``support.device_capability``: what the route, the Gluon launcher and the Triton op's TMA switch
    read; the driver stood in for, so that no GPU is needed."""
    from stableflash.attention.gluon import support
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (9, index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    support._capability.cache_clear()
    try:
        assert support.device_capability(torch.device("cuda", 0)) == (9, 0)
        assert support.device_capability(torch.device("cuda")) == (9, 1)
        assert support.device_capability(torch.device("cuda", 1)) == (9, 1)
        assert support.device_capability(torch.device("cuda", 0)) == (9, 0)
        assert asked == [0, 1]
    finally:
        support._capability.cache_clear()


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_a_repeated_backward_runs_its_plan(d, counted, monkeypatch):
    """``flash_attn_qkvpacked_func`` (the GPT model's call) at a routed length, eager, as a training loop
    repeats it: the first calls build the route backward's launches, later ones run the kept plan —
    with ``launch_cache.VERIFY`` on, each replay checked against the launches the call builds (the
    same kernel, grid and arguments) before it runs; with it off, as users run it. dK and dV bit for
    bit what the plans switched off give (dQ is added up in no fixed order), and every result within
    1.25× (+1e-4) the Triton backward's error against float64. ``launch_cache.clear`` retires the plan:
    the next call builds its launches again."""
    from stableflash.attention import flash_attn_qkvpacked_func
    from stableflash.attention.triton import launch_cache
    monkeypatch.setattr(route, "FORWARD_MIN_KEYS", {key: 2**31 for key in route.FORWARD_MIN_KEYS})
    ran = _count_plans(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(d)
    B, n, H = 2, route.BACKWARD_MIN_KEYS[d] + 64, 4
    qkv = torch.randn(B, n, 3, H, d, generator=gen, device="cuda").to(torch.bfloat16)
    do = torch.randn(B, n, H, d, generator=gen, device="cuda").to(torch.bfloat16)

    def run():
        x = qkv.detach().clone().requires_grad_(True)
        o = flash_attn_qkvpacked_func(x, causal=True)
        return o, torch.autograd.grad(o, x, do)[0]
    unplanned, results = _planned_runs(run, monkeypatch)
    assert ran["checked"] >= 1 and ran["plan"] >= 2, ran
    launch_cache.clear()
    before = dict(ran)
    results.append(run())                      # a retired plan: the launches built again (and a plan recorded)
    assert ran == before
    with route.triton_only():
        portable = run()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    ref_o, dq, dk, dv = expanded_reference(q, k, v, do.transpose(1, 2), True)
    ref = (ref_o.transpose(1, 2), torch.stack([t.transpose(1, 2) for t in (dq, dk, dv)], 2))
    for got in results:
        assert torch.equal(got[0], unplanned[0]) and torch.equal(got[1][:, :, 1:], unplanned[1][:, :, 1:])
        for name, x, x_t, r in zip(("O", "dqkv"), got, portable, ref):
            err, err_t = (((y.double() - r).norm() / r.norm()).item() for y in (x, x_t))
            assert err <= 1.25 * err_t + 1e-4, (name, err, err_t)
    assert counted["backward"] == 1 + len(results) - 2     # two replays skipped the route's call
    monkeypatch.setattr(route, "BACKWARD_MIN_KEYS", {64: 2**31, 128: 2**31})
    held_back = run()                          # the route's settings are in the key: the Triton backward runs
    assert counted["backward"] == len(results) - 1 and ran == before
    for name, x, x_t, r in zip(("O", "dqkv"), held_back, portable, ref):
        assert torch.equal(x, x_t), name        # the switched-off route's kernels, bit for bit


def _planned_runs(run, monkeypatch) -> tuple:
    """``run()`` with the plans off after ``launch_cache.clear``, then four times with them on: recorded,
    checked under ``VERIFY``, twice as users run it. (the unplanned result, [the four results])."""
    from stableflash.attention.triton import launch_cache
    launch_cache.clear()
    with monkeypatch.context() as m:
        m.setattr(launch_cache, "PLANS", False)
        unplanned = run()
    results = []
    for verify in (False, True, False, False):
        monkeypatch.setattr(launch_cache, "VERIFY", verify)
        results.append(run())
    return unplanned, results


def _count_plans(monkeypatch) -> dict:
    """{"plan": n, "checked": n}: ``launch_cache.Plan`` calls (replays as users run them) and checks (under VERIFY)."""
    from stableflash.attention.triton import launch_cache
    ran = {"plan": 0, "checked": 0}
    for name, key in (("__call__", "plan"), ("checking", "checked")):
        real = getattr(launch_cache.Plan, name)

        def counting(self, *args, _real=real, _key=key):
            ran[_key] += 1
            return _real(self, *args)
        monkeypatch.setattr(launch_cache.Plan, name, counting)
    return ran


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("d, stabilize", [(128, True), (128, False), (64, True)], ids=["gluon", "gluon-no-r", "triton"])
def test_a_repeated_forward_runs_its_plan(d, stabilize, counted, monkeypatch):
    """The forward as a loop repeats it — on the Gluon kernel (head_dim 128, with and without R: ``stabilize=False``, whose "auto" would be SDPA) and on
    the Triton kernel (head_dim 64 below the route's key count: its tuner's choice and grid function) —
    recorded, checked under ``launch_cache.VERIFY`` against the launch the call builds (kernel, grid,
    arguments), run as users run it (the Gluon route's checks skipped with the launch), retired by
    ``launch_cache.clear``; O bit for bit what the plans switched off give."""
    from stableflash.attention.triton import launch_cache
    ran = _count_plans(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(11 + stabilize + d)
    q, k, v, _ = _inputs(2, 4, 2, 700, d, True, gen, "bnhd")
    routed = d == 128

    def run():
        with torch.no_grad():
            return flash_attention(q, k, v, causal=True, stabilize=stabilize, backend="triton")
    unplanned, results = _planned_runs(run, monkeypatch)
    assert ran == {"checked": 1, "plan": 2}, ran
    launch_cache.clear()
    results.append(run())                          # a retired plan: the launch built again
    assert ran == {"checked": 1, "plan": 2}
    assert counted["forward"] == (4 if routed else 0)   # the replays skip the route's call
    for got in results:
        assert torch.equal(got, unplanned)


@pytest.mark.gpu
@on_hopper
def test_a_plan_recorded_with_one_tensor_in_several_places_is_not_run_for_distinct_ones(monkeypatch):
    """``flash_attention(x, x, x)`` repeated records plans (forward and backward) in which one tensor fills
    q's, k's and v's places; a later call with distinct q, k, v of the same shapes does not run them
    (``launch_cache.plan_key`` keeps which tensors share an address): O, dK and dV bit for bit what the
    plans switched off give, dQ (added up in no fixed order) within 1.25× (+1e-4) of their error against
    float64."""
    from stableflash.attention.triton import launch_cache
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = _inputs(1, 2, 2, route.BACKWARD_MIN_KEYS[128] + 88, 128, False, gen)

    def step(*tensors):
        leaves = {id(t): t.detach().clone().requires_grad_(True) for t in tensors}
        o = flash_attention(*(leaves[id(t)] for t in tensors), causal=True)
        return (o, *torch.autograd.grad(o, list(leaves.values()), do))
    launch_cache.clear()
    for _ in range(3):
        step(q, q, q)
    got = step(q, k, v)
    with monkeypatch.context() as m:
        m.setattr(launch_cache, "PLANS", False)
        want = step(q, k, v)
    ref = expanded_reference(q, k, v, do, True)
    for name, i in (("O", 0), ("dK", 2), ("dV", 3)):
        assert torch.equal(got[i], want[i]), name
    err, err_w = (((x[1].double() - ref[1]).norm() / ref[1].norm()).item() for x in (got, want))
    assert err <= 1.25 * err_w + 1e-4, (err, err_w)


def test_the_routes_settings_name_every_threshold_by_value(monkeypatch):
    """``route.settings()``, which the op's plans key on (a plan skips the route's checks): it changes
    with the switch, each head-dim list and key count and the grid's limit, and not otherwise."""
    base = route.settings()
    assert route.settings() == base
    for name, value in (("ENABLED", False), ("HEAD_DIMS", (128,)), ("FORWARD_MIN_KEYS", {**route.FORWARD_MIN_KEYS, (64, True): 1}),
                        ("BACKWARD_HEAD_DIMS", (128,)), ("BACKWARD_MIN_KEYS", {64: 2**31, 128: 512}),
                        ("DETERMINISTIC_MIN_KEYS", {}), ("MAX_HEAD_PROGRAMS", 1)):
        with monkeypatch.context() as m:
            m.setattr(route, name, value)
            assert route.settings() != base, name
    assert route.settings() == base


def _code(ptx: str) -> str:
    """PTX without its debug lines (``.loc``, ``.file``, comments), which name source files and lines."""
    return "\n".join(line for line in ptx.splitlines()
                     if not line.lstrip().startswith((".loc", ".file", "//")))


@on_hopper
@pytest.mark.parametrize("d, causal", [(64, True), (64, False), (128, True), (128, False)])
def test_the_compile_checks_build_what_the_route_launches(d, causal):
    """``sass.compile_forward`` and ``compile_backward`` (what the SASS checks count, compiled without a GPU) at
    ``sass.LAUNCH_SHAPE`` build the PTX, debug lines aside, of the kernels that a ``flash_attention`` call of
    that shape launches on the GPU — the forward with its default tiles, the backward with the route's."""
    from stableflash.attention.gluon import sass
    from stableflash.attention.gluon.hopper_backward import route_backward_tiles
    from stableflash.attention.triton import launch_cache
    B, H, N = sass.LAUNCH_SHAPE
    launch_cache.clear()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    flash_attention(q, k, v, causal=causal).sum().backward()
    launched = {kernel.name: _code(kernel.asm["ptx"]) for kernel in launch_cache._kernels.values()}
    assert launched["attn_fwd_hopper_kernel"] == _code(sass.compile_forward(d, causal).asm["ptx"])
    backward = sass.compile_backward(d, causal, route_backward_tiles(d, N))["fused"]
    assert launched["attn_bwd_hopper_kernel"] == _code(backward.asm["ptx"])


@pytest.mark.gpu
@on_hopper
def test_graph_replays_of_the_packed_route_compute_the_buffers_current_values(monkeypatch):
    """``flash_attn_qkvpacked_func`` forward and backward on the Gluon route (head_dim 64, causal, from
    both thresholds), repeated on the same qkv and dO buffers: the plans' first repeats capture graphs
    (the forward's and the backward's), later calls replay them. After new values are written into
    the buffers, a replayed call's O and dK, dV equal the launched call's bit for bit, and its dQ
    (summed by atomics, in no fixed order) is within 1.25× (+1e-4) of the launched dQ's error
    against float64."""
    from stableflash.attention import flash_attn_qkvpacked_func
    from stableflash.attention.triton import launch_cache
    from tests.attention.test_launch_cache import _counted_captures, _until_replays_alone
    monkeypatch.setattr(launch_cache, "GRAPHS", True)
    monkeypatch.setattr(launch_cache, "VERIFY", False)       # the suite's check builds every planned call instead
    graphs = _counted_captures(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(13)
    B, n, H, d = 2, max(route.BACKWARD_MIN_KEYS[64], route.FORWARD_MIN_KEYS[(64, True)]), 2, 64
    qkv = torch.randn(B, n, 3, H, d, generator=gen, device="cuda").bfloat16()
    do = torch.randn(B, n, H, d, generator=gen, device="cuda").bfloat16()

    def step():
        x = qkv.detach().requires_grad_(True)
        o = flash_attn_qkvpacked_func(x, causal=True)
        g = torch.autograd.grad(o, x, do)[0]
        return [o.detach().clone(), *(g[:, :, i].clone() for i in range(3))]
    new = [torch.randn(t.shape, generator=gen, device="cuda").bfloat16() for t in (qkv, do)]  # allocated before
    _until_replays_alone(step, graphs, 2)                  # the forward's graph and the backward's
    captured, before = len(graphs), sum(g.replays for g in graphs)
    qkv.copy_(new[0])
    do.copy_(new[1])
    got = step()
    assert len(graphs) == captured and sum(g.replays for g in graphs) == before + 2
    monkeypatch.setattr(launch_cache, "GRAPHS", False)
    launched = step()
    for name, a, b in zip(("O", "dK", "dV"), (got[0], *got[2:]), (launched[0], *launched[2:])):
        assert torch.equal(a, b), name
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    ref = expanded_reference(q, k, v, do.transpose(1, 2), True)[1].transpose(1, 2)
    err, err_t = (((y.double() - ref).norm() / ref.norm()).item() for y in (got[1], launched[1]))
    assert err <= 1.25 * err_t + 1e-4, (err, err_t)
