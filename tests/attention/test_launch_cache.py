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


def _stand_in_binder(monkeypatch, bind) -> None:
    """Triton's binder (``bind(raw, args, kwargs)`` → (key, bound arguments)) and the device stood in for,
    the launch cache emptied: ``launch`` runs without a GPU."""
    import types
    monkeypatch.setattr(launch_cache, "_bind", bind)
    monkeypatch.setattr(launch_cache, "driver", types.SimpleNamespace(
        active=types.SimpleNamespace(get_current_device=lambda: 0)))
    monkeypatch.setattr(launch_cache, "VERIFY", False)
    launch_cache.clear()


def test_a_shortcut_call_evaluates_its_grid_anew(monkeypatch):
    """A grid function may read what the arguments do not hold — the batch, which the strides of
    contiguous (B, H, N, d) tensors do not show — so a call that repeats another's arguments launches
    the recorded kernel on its own grid, evaluated with the arguments by name. Triton's binder and the
    device are stood in for, so that no GPU is needed."""
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

    _stand_in_binder(monkeypatch, bind)
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


def test_a_compiled_launch_asks_for_fp_contraction_and_an_interpreted_one_is_left_as_called(monkeypatch):
    """Every launch of a compiled kernel — through Triton, bound by ``launch``, or with the cache off — is
    given ``enable_fp_fusion=True`` unless its caller gives a value (triton 3.9 warns about a kernel left
    to the default, which it announces will turn off); the interpreter's kernels are called with the
    caller's keyword arguments alone and compute what they compute. Triton's binder and the device are
    stood in for, so that no GPU is needed."""
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args: None

    class Entry:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(("through Triton", kwargs)) or Kernel()

    def bind(raw, args, kwargs):
        seen.append(("bound", kwargs))
        return ("specialization", tuple(sorted(kwargs.items()))), {"x": args[0], "n": args[1], "BLOCK": kwargs["BLOCK"]}

    _stand_in_binder(monkeypatch, bind)
    entry, x = Entry(), torch.zeros(4)
    assert launch_cache.COMPILE_OPTIONS == {"enable_fp_fusion": True}
    for _ in range(2):
        launch_cache.launch(entry, (1,), x, 64, BLOCK=16)
    asked = {"enable_fp_fusion": True, "BLOCK": 16}
    assert seen == [("bound", asked), ("through Triton", asked), ("bound", asked)]
    seen.clear()
    launch_cache.launch(entry, (1,), x, 64, BLOCK=16, enable_fp_fusion=False)      # the caller's value stands
    assert seen == [("bound", {"enable_fp_fusion": False, "BLOCK": 16}),
                    ("through Triton", {"enable_fp_fusion": False, "BLOCK": 16})]
    seen.clear()
    monkeypatch.setattr(launch_cache, "ENABLED", False)
    launch_cache.launch(entry, (1,), x, 64, BLOCK=16)
    assert seen == [("through Triton", {"enable_fp_fusion": True, "BLOCK": 16})]
    launch_cache.clear()
    monkeypatch.setattr(launch_cache, "ENABLED", True)
    src, dst = torch.arange(20, dtype=torch.float32), torch.zeros(20)
    launch_cache.launch(launch_cache.InterpretedFunction(_scale_kernel.fn), (2,), src, dst, 20, 3.0, BLOCK=16)
    torch.testing.assert_close(dst, src * 3.0, rtol=0, atol=0)


def _replay_world(monkeypatch, hooks=False):
    """A recorded call of a stand-in kernel (``_scale_kernel``'s parameters with a descriptor) and what
    its launches receive, without a GPU: Triton's binder and the device stood in for."""
    import types
    launched = []

    class Kernel:                              # a compiled kernel: run(...) as Triton's runner calls it, or [grid]
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            launched.append(("run", args))

        def __getitem__(self, grid):
            return lambda *args: launched.append(("getitem", grid, args))

    kernel = Kernel()

    class Entry:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: kernel

    def bind(raw, args, kwargs):
        return ("specialization",), dict(zip(("desc", "y", "n", "factor", "BLOCK"), (*args, kwargs["BLOCK"])))

    monkeypatch.setattr(launch_cache, "_bind", bind)
    monkeypatch.setattr(launch_cache, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 1234)))
    monkeypatch.setattr(launch_cache.knobs.runtime, "launch_enter_hook", (lambda *a: None) if hooks else None)
    monkeypatch.setattr(launch_cache.knobs.runtime, "launch_exit_hook", None)
    monkeypatch.setattr(launch_cache, "VERIFY", False)
    launch_cache.clear()
    return Entry(), kernel, launched


def test_a_replay_puts_new_tensors_in_the_recorded_places_and_keeps_none_of_the_old(monkeypatch):
    """``launch_cache.Replay``: the recorded call's values with the given tensors in its tensors'
    places (a descriptor's place: the recorded descriptor rebased on the tensor), launched through
    the compiled kernel's ``run`` as Triton's runner does (the current stream, the kernel's function
    and metadata, no launch metadata or hooks) — or through ``kernel[grid]`` when a launch hook is
    set; the replay holds no tensor of the recorded call, and ``clear`` retires it."""
    entry, kernel, launched = _replay_world(monkeypatch)
    x, y = torch.zeros(64), torch.zeros(64)
    rows = x.view(8, 8)
    desc = _Descriptor(rows, [8, 8], [8, 1], [4, 8])
    args, kwargs = (desc, y, 64, 2.0), {"BLOCK": 16}
    assert launch_cache.replay_of(entry, args, kwargs) is None          # nothing recorded yet
    launch_cache.launch(entry, (4,), *args, **kwargs)                     # through Triton
    launch_cache.launch(entry, (4,), *args, **kwargs)                     # binds, records the call
    replay = launch_cache.replay_of(entry, args, kwargs)
    assert replay is not None and replay.current
    assert replay.recorded == ((x.data_ptr(), torch.float32), (y.data_ptr(), torch.float32))
    assert not any(isinstance(a, torch.Tensor) for a in replay.template)
    assert all(d is None or d.base is None for _, d in replay.places)
    x2, y2 = torch.ones(64), torch.ones(64)
    launched.clear()
    replay((4, 1, 1), [x2, y2])
    (how, sent), = launched
    assert how == "run" and sent[:9] == (4, 1, 1, 1234, "function", "metadata", None, None, None)
    new_desc, *rest = sent[9:]
    assert rest[0] is y2 and rest[1:] == [64, 2.0, 16]
    assert new_desc.base is x2 and (new_desc.shape, new_desc.strides, new_desc.block_shape) == ([8, 8], [8, 1], [4, 8])
    assert desc.base is rows                                               # the caller's descriptor untouched
    launch_cache.clear()
    assert not replay.current


def test_a_replay_goes_through_the_kernels_runner_when_a_launch_hook_is_set(monkeypatch):
    entry, kernel, launched = _replay_world(monkeypatch, hooks=True)
    y = torch.zeros(64)
    args, kwargs = (_Descriptor(y.view(8, 8), [8, 8], [8, 1], [4, 8]), y, 64, 2.0), {"BLOCK": 16}
    for _ in range(2):
        launch_cache.launch(entry, (4,), *args, **kwargs)
    launched.clear()
    launch_cache.replay_of(entry, args, kwargs)((2, 3, 1), [y, y])
    (how, grid, sent), = launched
    assert how == "getitem" and grid == (2, 3, 1) and sent[1] is y and list(sent[2:]) == [64, 2.0, 16]


def test_a_replays_check_refuses_arguments_its_binder_would_not_give(monkeypatch):
    """``Replay.check`` (the plans' form under ``launch_cache.VERIFY``): the recorded kernel, the grid
    (a grid function evaluated on the arguments by name, as ``launch`` does) and the binder's
    arguments, tensors by address and dtype, descriptors by every field."""
    entry, kernel, launched = _replay_world(monkeypatch)
    x = torch.zeros(64)
    desc = _Descriptor(x.view(8, 8), [8, 8], [8, 1], [4, 8])
    args, kwargs = (desc, x, 64, 2.0), {"BLOCK": 16}
    grid = lambda meta: (meta["n"] // meta["BLOCK"], 2)  # noqa: E731
    for _ in range(2):
        launch_cache.launch(entry, grid, *args, **kwargs)
    replay = launch_cache.replay_of(entry, args, kwargs, grid)
    assert replay.grid == (4, 2, 1)
    replay.check(entry, grid, args, kwargs, [x, x])
    with pytest.raises(AssertionError, match="grid"):
        replay.check(entry, (4, 3), args, kwargs, [x, x])
    with pytest.raises(AssertionError, match="arguments"):
        replay.check(entry, grid, args, kwargs, [x, torch.zeros(64)])        # another address
    with pytest.raises(AssertionError, match="arguments"):
        replay.check(entry, grid, (desc, x, 64, 3.0), kwargs, [x, x])        # another scalar
    with pytest.raises(AssertionError, match="arguments"):
        other = _Descriptor(x.view(8, 8), [8, 8], [8, 1], [8, 8])
        replay.check(entry, grid, (other, x, 64, 2.0), kwargs, [x, x])       # another block
    launch_cache.clear()


def test_no_replay_under_the_interpreter_or_with_the_cache_off(monkeypatch):
    entry, kernel, launched = _replay_world(monkeypatch)
    x = torch.zeros(64)
    args, kwargs = (x, x, 64, 2.0), {"BLOCK": 16}
    for _ in range(2):
        launch_cache.launch(entry, (4,), *args, **kwargs)
    assert launch_cache.replay_of(entry, args, kwargs) is not None
    monkeypatch.setattr(launch_cache, "ENABLED", False)
    assert launch_cache.replay_of(entry, args, kwargs) is None
    monkeypatch.setattr(launch_cache, "ENABLED", True)
    interpreted = object.__new__(launch_cache.InterpretedFunction)
    assert launch_cache.replay_of(interpreted, args, kwargs) is None
    launch_cache.clear()


def test_a_plan_sends_each_of_the_calls_tensors_and_new_buffers_to_their_places(monkeypatch):
    """``launch_cache.Plan``: recorded from a call's launches (each place matched to one of the call's
    tensors or buffers by address and dtype), it launches every replay with a later call's tensors in
    the same places and buffers of the recorded shapes and dtypes; a place holding none of them (a
    copy the call made) gives no plan; ``plan_key`` tells signatures apart by shape, strides, dtype,
    alignment and which tensors share an address, not by the addresses themselves."""
    entry, kernel, launched = _replay_world(monkeypatch)
    a, b, buf = torch.zeros(64), torch.zeros(64), torch.zeros(8, 8)
    launches = [(entry, (4,), (_Descriptor(buf, [8, 8], [8, 1], [4, 8]), a, 64, 2.0), {"BLOCK": 16}),
                (entry, (2, 3), (_Descriptor(b.view(8, 8), [8, 8], [8, 1], [4, 8]), buf, 64, 2.0), {"BLOCK": 16})]
    assert launch_cache.Plan.record((a, b), (buf,), launches) is None            # nothing recorded yet
    for _ in range(2):
        for kern, grid, args, kwargs in launches:
            launch_cache.launch(kern, grid, *args, **kwargs)
    plan = launch_cache.Plan.record((a, b), (buf,), launches)
    assert plan is not None and plan.current and plan.buffers == (((8, 8), torch.float32),)
    assert [order for _, order in plan.steps] == [(2, 0), (1, 2)]
    assert [replay.grid for replay, _ in plan.steps] == [(4, 1, 1), (2, 3, 1)]
    a2, b2 = torch.ones(64), torch.ones(64)
    launched.clear()
    plan((a2, b2))
    (_, first), (_, second) = launched
    assert first[9].base is second[10] and first[9].base.shape == (8, 8) and first[9].base is not buf
    assert first[10] is a2 and second[9].base is b2
    copy = b.clone()
    other = [launches[0], (entry, (2, 3), (_Descriptor(copy.view(8, 8), [8, 8], [8, 1], [4, 8]), buf, 64, 2.0),
                                             {"BLOCK": 16})]
    assert launch_cache.Plan.record((a, b), (buf,), other) is None
    key = launch_cache.plan_key((a, buf), True, 0.5)
    assert key == launch_cache.plan_key((b, torch.ones(8, 8)), True, 0.5)
    assert key != launch_cache.plan_key((b, torch.ones(8, 8)), False, 0.5)
    assert key != launch_cache.plan_key((b, torch.ones(8, 8).t()), True, 0.5)
    assert key != launch_cache.plan_key((torch.zeros(65)[1:], buf), True, 0.5)
    assert key != launch_cache.plan_key((b.double(), buf), True, 0.5)
    # a call's own outputs (``fresh``): only their alignment is keyed
    fresh = launch_cache.plan_key((a,), True, 0.5, fresh=(buf, torch.zeros(3)))
    assert fresh == launch_cache.plan_key((b,), True, 0.5, fresh=(torch.ones(8, 8), torch.ones(5).double()))
    assert fresh != launch_cache.plan_key((b,), True, 0.5, fresh=(torch.zeros(65)[1:], torch.zeros(3)))
    assert fresh != launch_cache.plan_key((b,), True, 0.5)
    # tensors sharing an address: a plan recorded from (a, a) sends one tensor to both places, so a call
    # of distinct tensors must not find it (it would get b2 where a2 belongs)
    same = [launches[0], (entry, (2, 3), (_Descriptor(a.view(8, 8), [8, 8], [8, 1], [4, 8]), buf, 64, 2.0),
                                            {"BLOCK": 16})]
    for _ in range(2):
        launch_cache.launch(*same[1][:2], *same[1][2], **same[1][3])
    aliased = launch_cache.Plan.record((a, a), (buf,), same)
    assert [order for _, order in aliased.steps] == [(2, 1), (1, 2)]
    assert launch_cache.plan_key((a, a, buf), True) != launch_cache.plan_key((a2, b2, buf), True)
    assert launch_cache.plan_key((a, a, buf), True) == launch_cache.plan_key((b2, b2, torch.ones(8, 8)), True)
    assert launch_cache.plan_key((a, b, a), True) != launch_cache.plan_key((a, b, b), True)
    plans = {}
    monkeypatch.setattr(launch_cache, "MAX_PLANS", 2)
    for i in range(3):
        launch_cache.keep_plan(plans, (i,), plan)
    launch_cache.keep_plan(plans, (9,), None)
    assert list(plans) == [(2,)]
    launch_cache.clear()
    assert not plan.current


def test_a_plan_replays_a_call_repeating_its_addresses_as_one_captured_graph(monkeypatch):
    """``Plan`` on a CUDA device (its graph store present; the capture and the capture check stood in
    for): a call's first addresses launch one by one, their first repeat captures the launches (on the
    capture's stream) and replays the graph, later repeats replay it alone; other addresses launch; so
    does every call while the stream is being captured, with a launch hook set or with ``GRAPHS`` off;
    each store stays bounded; a refused capture leaves the plan launching, with a warning; a plan of
    CPU tensors keeps no store."""
    entry, kernel, launched = _replay_world(monkeypatch)
    a, b, buf = torch.zeros(64), torch.zeros(64), torch.zeros(8, 8)
    launches = [(entry, (4,), (_Descriptor(buf, [8, 8], [8, 1], [4, 8]), a, 64, 2.0), {"BLOCK": 16}),
                (entry, (2, 3), (_Descriptor(b.view(8, 8), [8, 8], [8, 1], [4, 8]), buf, 64, 2.0), {"BLOCK": 16})]
    for _ in range(2):
        for kern, grid, args, kwargs in launches:
            launch_cache.launch(kern, grid, *args, **kwargs)
    plan = launch_cache.Plan.record((a, b), (buf,), launches)
    assert plan.graphs is None                                     # CPU tensors: no graphs
    buffers = (torch.zeros(8, 8),)
    capturing = []
    monkeypatch.setattr(launch_cache, "_capturing", lambda: bool(capturing))

    class Graph:
        def __init__(self, ts):
            self.ts = ts

        def replay(self):
            launched.append(("replay", self.ts))

    def capture(p, ts):
        p.launch(ts, "capture stream")
        return Graph(ts)
    monkeypatch.setattr(launch_cache, "capture", capture)

    class Fixed(launch_cache.Plan):                                # a plan whose buffers keep one address
        __slots__ = ()

        def allocate(self, like):
            return buffers
    fixed = Fixed(torch.device("cpu"), plan.buffers, plan.steps)
    fixed.graphs = {}                                              # as a plan of CUDA tensors has
    streams = lambda: [sent[3] for how, *rest in launched if how == "run" for sent in rest]  # noqa: E731
    a2, b2 = torch.ones(64), torch.ones(64)
    launched.clear()
    fixed((a2, b2))                                                # first sighting: launched one by one
    assert streams() == [1234, 1234] and not fixed.graphs
    launched.clear()
    fixed((a2, b2))                                                # first repeat: captured, then replayed
    assert streams() == ["capture stream", "capture stream"] and launched[-1][0] == "replay"
    assert list(fixed.graphs) == [(a2.data_ptr(), b2.data_ptr(), buffers[0].data_ptr())]
    launched.clear()
    fixed((a2, b2))                                                # later repeats: the graph alone
    assert [how for how, *_ in launched] == ["replay"]
    a3 = torch.ones(64)
    launched.clear()
    fixed((a3, b2))                                                # other addresses: launched
    assert streams() == [1234, 1234]
    for switch in ("capturing", "hook", "off"):
        with monkeypatch.context() as m:
            if switch == "capturing":
                capturing.append(True)
            elif switch == "hook":
                m.setattr(launch_cache.knobs.runtime, "launch_enter_hook", lambda *args: None)
            else:
                m.setattr(launch_cache, "GRAPHS", False)
            launched.clear()
            fixed((a2, b2))
            assert [how for how, *_ in launched] == (["getitem"] * 2 if switch == "hook" else ["run"] * 2), switch
            capturing.clear()
    monkeypatch.setattr(launch_cache, "MAX_GRAPHS", 1)
    for t in (a3, torch.ones(64), torch.ones(64)):
        for _ in range(2):
            fixed((t, b2))
    assert list(fixed.graphs) == [(t.data_ptr(), b2.data_ptr(), buffers[0].data_ptr())] and len(fixed.seen) == 1

    def refuse(p, ts):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(launch_cache, "capture", refuse)
    a4 = torch.ones(64)
    fixed((a4, b2))
    launched.clear()
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        fixed((a4, b2))
    assert streams() == [1234, 1234] and fixed.graphs is None
    launched.clear()
    fixed((a4, b2))
    assert streams() == [1234, 1234]
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


class _CountingGraph:
    """A captured graph whose replays are counted."""

    def __init__(self, graph):
        self.graph, self.replays = graph, 0

    def replay(self):
        self.replays += 1
        self.graph.replay()


def _counted_captures(monkeypatch) -> list:
    """Every graph ``launch_cache.capture`` makes from now on, wrapped in ``_CountingGraph``."""
    graphs = []
    real = launch_cache.capture

    def counting(plan, ts):
        graphs.append(_CountingGraph(real(plan, ts)))
        return graphs[-1]
    monkeypatch.setattr(launch_cache, "capture", counting)
    return graphs


def _until_replays_alone(call, graphs: list, plans: int, most: int = 12) -> None:
    """Call ``call()`` until one call replays ``plans`` graphs and captures none (its first calls go
    through Triton, record the launches and their plans, then see each set of addresses once); fails
    after ``most`` calls."""
    for _ in range(most):
        captured, replays = len(graphs), sum(g.replays for g in graphs)
        call()
        if len(graphs) == captured and sum(g.replays for g in graphs) == replays + plans:
            return
    raise AssertionError(f"no call of {most} replayed {plans} graphs alone: {len(graphs)} captured, "
                         f"{[g.replays for g in graphs]} replays")


@needs_cuda
def test_a_graph_replay_computes_the_current_contents_of_the_repeated_addresses(monkeypatch):
    """Forward calls on the same q, k, v buffers, their outputs freed before the next call (so that the
    call's addresses repeat, as a training step's do): the first repeat captures the forward's launches,
    later calls replay the graph; after new values are written into the buffers, a replay gives what
    the kernels launched one by one give on them, bit for bit."""
    import stableflash as sf
    monkeypatch.setattr(launch_cache, "GRAPHS", True)
    monkeypatch.setattr(launch_cache, "VERIFY", False)       # the suite's check builds every planned call instead
    graphs = _counted_captures(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 3, 256, 64, generator=gen, device="cuda").bfloat16() for _ in range(3))

    def forward():
        with torch.no_grad():
            return sf.flash_attention(q, k, v, causal=True).clone()
    new = [torch.randn(t.shape, generator=gen, device="cuda").bfloat16() for t in (q, k, v)]   # before: no allocation
    _until_replays_alone(forward, graphs, 1)                                                    # between the calls
    captured, before = len(graphs), sum(g.replays for g in graphs)
    for t, values in zip((q, k, v), new):
        t.copy_(values)
    got = forward()
    assert len(graphs) == captured and sum(g.replays for g in graphs) == before + 1
    monkeypatch.setattr(launch_cache, "GRAPHS", False)
    assert torch.equal(got, forward())


@needs_cuda
def test_calls_inside_a_users_graph_capture_join_it(monkeypatch):
    """A forward captured by the user (``torch.cuda.graph``) after its plan has a graph of its own: the
    launches join the user's capture (no capture inside a capture), and the user's replays compute
    the buffers' current values, bit for bit what launches give."""
    import stableflash as sf
    monkeypatch.setattr(launch_cache, "GRAPHS", True)
    monkeypatch.setattr(launch_cache, "VERIFY", False)       # the suite's check builds every planned call instead
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(1, 2, 384, 64, generator=gen, device="cuda").bfloat16() for _ in range(3))

    def forward():
        with torch.no_grad():
            return sf.flash_attention(q, k, v, causal=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):              # warm-up on a side stream, as torch.cuda.graph asks
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = forward()
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(launch_cache, "GRAPHS", False)
    assert torch.equal(o, forward())


@pytest.mark.parametrize("shape", [(2, 3, 4), (0,), (4, 0, 3), (5,), (2, 1024, 3, 12, 64)])
def test_contiguous_strides_are_torchs(shape):
    assert launch_cache.contiguous_strides(shape) == torch.empty(shape).stride()


def _allocations_on(device: str) -> list:
    """launch_cache.empty beside torch.empty_strided: as is, under a fake mode, under a dispatch mode."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    like = torch.zeros(3, device=device)
    shape, strides = (2, 12, 5), (60, 1, 12)
    got = launch_cache.empty(shape, strides, torch.bfloat16, like)
    assert type(got) is torch.Tensor
    assert (got.shape, got.stride(), got.dtype, got.device) == (shape, strides, torch.bfloat16, like.device)
    with FakeTensorMode() as mode:                 # traced: a fake tensor, no memory
        fake = launch_cache.empty(shape, strides, torch.float32, mode.from_tensor(like))
    assert isinstance(fake, FakeTensor) and (fake.shape, fake.stride(), fake.device) == (shape, strides, like.device)
    with Seen() as seen:                           # a dispatch mode sees the allocation
        launch_cache.empty(shape, strides, torch.float32, like)
    return seen.ops


def test_empty_allocates_as_torch_empty_strided_and_stays_visible_to_modes():
    assert torch.ops.aten.empty_strided.default in _allocations_on("cpu")


@needs_cuda
def test_empty_on_the_gpu_allocates_on_the_tensors_device_as_torch_empty_strided():
    assert torch.ops.aten.empty_strided.default in _allocations_on("cuda")
    # through the allocator's direct entry: the current stream's pool, freed and reused as torch's
    like = torch.zeros(1, device="cuda")
    a = launch_cache.empty((1024,), (1,), torch.float32, like)
    address = a.data_ptr()
    del a
    assert launch_cache.empty((1024,), (1,), torch.float32, like).data_ptr() == address


@pytest.mark.parametrize("enter, leave, unhooked", [
    (None, None, True), ("no hooks", None, True), (None, "no hooks", True), ("no hooks", "no hooks", True),
    (print, None, False), (None, print, False), ("a hook", None, False), ("no hooks", "a hook", False)])
def test_unhooked_reads_both_launch_hooks_in_either_form(enter, leave, unhooked, monkeypatch):
    """A launch hook is None, a callable, or (newer Triton) a chain whose ``calls`` lists its hooks."""
    class Chain:
        def __init__(self, calls):
            self.calls = calls

        def __call__(self, *args):
            for f in self.calls:
                f(*args)
    form = {"no hooks": Chain([]), "a hook": Chain([print])}
    monkeypatch.setattr(launch_cache.knobs.runtime, "launch_enter_hook", form.get(enter, enter))
    monkeypatch.setattr(launch_cache.knobs.runtime, "launch_exit_hook", form.get(leave, leave))
    assert launch_cache._unhooked() is unhooked
