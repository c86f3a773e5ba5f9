"""Launching a Triton kernel again without Triton's per-call dispatch.

``kernel[grid](*args, **kwargs)`` costs the host tens of microseconds before the GPU sees
anything: the autotuner builds a dictionary of every argument to look up its choice, and the JIT
function binds the arguments, turns its compile options into a string to look up the compiled
kernel, and checks the kernel's globals (``benchmarks/tools/host_overhead.py`` measures it). An
attention forward and backward launch three or four kernels with some seventy arguments each, so at a training
step's small shapes that time is as long as the kernels'.

``launch`` keeps what those lookups found, at two levels:

- The kernel: keyed on what Triton's own lookup depends on — the specialization that Triton's
  binder computes from the arguments (types, alignment, the integers equal to 1 or divisible by
  16, every constexpr's value), the compile options given, Triton's debug switch and the device;
  in front of an autotuner also the exact values of the tuner's key arguments and the argument
  dtypes, which decide its choice. The first call with a key goes through Triton (tuning,
  compiling, launching as usual) and records the compiled kernel it returns; later calls bind the
  arguments and launch that kernel directly (``CompiledKernel[grid](*args)``, which calls
  Triton's launch hooks as its dispatch does).
- The call: once a call has launched a recorded kernel, a call whose arguments agree with it in
  everything but the tensors' contents and addresses (``call_key``: every scalar's type and value,
  every tensor's dtype and its address modulo 16, a tensor descriptor's base by the same two and
  its other fields by value, a frozen dataclass such as a Gluon layout by identity) launches the same
  kernel without binding its arguments through Triton or asking the tuner: the kernel's key is a
  function of these, so it cannot differ. The grid is not: a grid function may read what the
  arguments do not hold (the batch, whose stride a contiguous tensor's strides do not show), so it is
  evaluated on every call, with the arguments by name as Triton evaluates it.
  A training step's calls repeat their shapes, and binding costs a launch tens of microseconds.
  ``VERIFY`` (the tests set it) binds through Triton as well on every such call and checks that
  the kernel, grid and arguments are the ones the shortcut used. Triton's own settings (its
  ``knobs``, except the debug switch, which the key holds) are read when a call binds, not by the
  shortcut: call ``clear()`` after changing them.

Under the interpreter every call goes through Triton.

Above both, a ``Plan`` keeps the launches of one call signature of the attention ops (their tensors'
shapes, strides, dtypes and alignment, the options), launching them with a later call's tensors in
the recorded places; on a CUDA device a call repeating an earlier call's addresses replays them as one
CUDA graph (``GRAPHS``), which costs the host one graph launch instead of one launch through Triton's
launcher per kernel.

Every compiled launch asks for ``COMPILE_OPTIONS`` (a caller's own value of one stands): floating-point
contraction, which triton 3.6-3.9 apply by default, asked for explicitly — triton 3.9 warns about every
kernel that leaves it to the default, which it announces will turn off, and the Gluon kernels ask for
it too, so that both paths compile the same arithmetic. A launch that may compile (every one that goes
through Triton) runs inside ``assembler.for_options`` of its options: the Gluon kernels' options may ask
for another ``ptxas`` than triton's default (``assembler``); launches of recorded kernels do not (with
``ENABLED`` off every launch goes through Triton, and a Gluon launch then enters it each time).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from typing import Any, Callable

import torch
from triton import knobs
from triton.runtime.autotuner import Autotuner
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction

from stableflash.attention.triton import assembler

try:        # the caching allocator's entry that torch.compile's generated code allocates through
    from torch._C._dynamo.guards import _empty_strided_cuda
except ImportError:                              # a torch without it: torch.empty_strided alone
    _empty_strided_cuda = None

# off: every launch through Triton's dispatch (benchmarks compare both)
ENABLED = True
# the compile options every compiled launch asks for, unless its caller gives its own (module docstring)
COMPILE_OPTIONS = {"enable_fp_fusion": True}
# on: every call found in ``_calls`` is also bound through Triton and checked against it (the tests)
VERIFY = False

_configs: dict[tuple, dict[str, Any]] = {}      # (tuner, its key values, dtypes) -> the config's kwargs
_kernels: dict[tuple, Any] = {}                 # (kernel, device, specialization, options) -> CompiledKernel
# (entry, device, debug, call_key) -> _Call; emptied when it or the pinned objects reach MAX_CALLS
# (arguments that change on every call, such as a seed, would otherwise grow it without end)
_calls: dict[tuple, "_Call"] = {}
MAX_CALLS = 4096
# how many times ``clear`` ran: a ``Replay`` made before the last one is stale
_generation = 0


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ of host integers, for grids: ``triton.cdiv`` is a Triton function, whose call costs the
    host microseconds."""
    return -(-a // b)


def clear() -> None:
    """Forget every recorded choice, kernel and call (the next launch of each goes through Triton);
    every ``Replay`` made before turns stale (``Replay.current``)."""
    global _generation
    _generation += 1
    _configs.clear()
    _kernels.clear()
    _positions.clear()
    _calls.clear()
    _pinned.clear()
    _plans.clear()


@dataclasses.dataclass(frozen=True)
class _Call:
    """A recorded call: the compiled kernel, the kernel's parameters' names, and those after the call's
    positional arguments as (name, taken from the call's keyword arguments, else this value) — the
    defaults and the tuner's choice."""

    kernel: Any
    names: tuple[str, ...]
    tail: tuple[tuple[str, bool, Any], ...]

    def arguments(self, args: tuple, kwargs: dict) -> list:
        """The kernel's arguments in its parameters' order, as Triton's binder lists them."""
        return [*args, *[kwargs[name] if given else value for name, given, value in self.tail]]


_SCALARS = frozenset({int, float, bool, str, type(None)})
# how ``call_key`` keys an argument of a class: _BY_VALUE, _BY_IDENTITY (a frozen dataclass, such as a
# Gluon layout, whose own hash costs microseconds), or a tensor descriptor's fields but ``base``
_BY_VALUE, _BY_IDENTITY = "value", "identity"
_kinds: dict[type, object] = {}
# the objects keyed by identity, kept alive so that no other object takes their id while a recorded call
# names it; emptied with ``_calls``
_pinned: dict[int, Any] = {}


def _kind(cls: type, a) -> object:
    """How ``call_key`` keys an argument of class ``cls`` (``a`` one of them), read once per class."""
    kind = _kinds.get(cls)
    if kind is None:
        if _is_descriptor(a):
            kind = tuple(f.name for f in dataclasses.fields(a) if f.name != "base")
        elif dataclasses.is_dataclass(a) and a.__dataclass_params__.frozen:
            kind = _BY_IDENTITY
        else:
            kind = _BY_VALUE
        _kinds[cls] = kind
    return kind


def _pin(a) -> int:
    _pinned[id(a)] = a
    return id(a)


def _field(value):
    cls = value.__class__
    if cls in _SCALARS:
        return value
    if cls is list:
        return tuple(value)
    return (cls, _pin(value)) if _kind(cls, value) is _BY_IDENTITY else value


class _KeyPlan:
    """How ``call_key`` reads the arguments of one signature — the keyword names and every argument's
    class, in order: which positions are scalars (taken by value, together, by one ``itemgetter``),
    tensors, tensor descriptors (with their field names), frozen dataclasses (by identity) and other
    objects taken by value (hashed on each call). The plan is part of the key: it holds the
    signature, so two calls whose classes differ (1, 1.0 and True compare equal) never share one."""

    __slots__ = ("scalars", "tensors", "descriptors", "identities", "hashed", "unhashable")

    def __init__(self, classes: tuple, sample: tuple) -> None:
        scalars, tensors, descriptors, identities, hashed = [], [], [], [], []
        for i, (cls, a) in enumerate(zip(classes, sample)):
            if cls in _SCALARS:
                scalars.append(i)
            elif isinstance(a, torch.Tensor):
                tensors.append(i)
            else:
                kind = _kind(cls, a)
                if kind is _BY_IDENTITY:
                    identities.append(i)
                elif kind is _BY_VALUE:
                    hashed.append(i)
                else:
                    descriptors.append((i, kind))
        self.unhashable = list in classes or dict in classes or set in classes
        self.scalars = (lambda vals: ()) if not scalars else \
            (lambda vals, i=scalars[0]: (vals[i],)) if len(scalars) == 1 else operator.itemgetter(*scalars)
        self.tensors, self.descriptors = tuple(tensors), tuple(descriptors)
        self.identities, self.hashed = tuple(identities), tuple(hashed)


# (keyword names, every argument's class) -> its _KeyPlan; emptied with ``_calls``
_plans: dict[tuple, _KeyPlan] = {}


def call_key(args: tuple, kwargs: dict) -> tuple | None:
    """What a launch's kernel can depend on in its arguments (the module docstring): scalars
    by type and value, tensors by dtype and address modulo 16, tensor descriptors (dataclasses with
    a ``base`` tensor) by class, base dtype and address modulo 16 and every other field, frozen
    dataclasses (a layout) by identity, anything else hashable by type and value; None if an
    argument is none of these (such a call binds through Triton every time). The classes and
    keyword names are read once per signature (``_KeyPlan``)."""
    vals = (*args, *kwargs.values()) if kwargs else args
    signature = (tuple(kwargs), tuple(map(type, vals)))
    plan = _plans.get(signature)
    if plan is None:
        plan = _plans[signature] = _KeyPlan(signature[1], vals)
    if plan.unhashable:
        return None
    out = [plan, plan.scalars(vals)]
    add = out.append
    for i in plan.tensors:
        t = vals[i]
        add(t.dtype)
        add(t.data_ptr() & 15)
    for i in plan.hashed:
        a = vals[i]
        try:
            hash(a)
        except TypeError:
            return None
        add(a)
    for i in plan.identities:
        add(_pin(vals[i]))
    for i, fields in plan.descriptors:
        a = vals[i]
        base = a.base
        add(base.dtype)
        add(base.data_ptr() & 15)
        for name in fields:
            add(_field(getattr(a, name)))
    return tuple(out)


_positions: dict[int, tuple[tuple[str, int], ...]] = {}   # tuner -> (key name, its position) pairs


def _tuner_key(tuner: Autotuner, args: tuple, kwargs: dict) -> tuple:
    """What the autotuner's choice depends on: its key arguments' values and the tensors' dtypes."""
    positions = _positions.get(id(tuner))
    if positions is None:
        positions = _positions[id(tuner)] = tuple((name, tuner.arg_names.index(name)) for name in tuner.keys)
    n = len(args)
    values = tuple(kwargs[name] if name in kwargs else args[i] if i < n else None for name, i in positions)
    dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
    return (id(tuner), values, dtypes)


def recorded_choice(tuner: Autotuner, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The config (all its keyword arguments) ``launch`` recorded for the tuner at these arguments'
    key; None if it has none (never launched there, or the cache was off)."""
    return _configs.get(_tuner_key(tuner, args, kwargs))


def _grid_tuple(grid, bound: dict) -> tuple[int, int, int]:
    g = grid(bound) if callable(grid) else grid
    return (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)


def _asked(kwargs: dict) -> dict:
    """A compiled launch's keyword arguments with ``COMPILE_OPTIONS`` where they leave them out: what
    ``launch`` records a call under, and what ``replay_of`` and the checks key it by."""
    return {**COMPILE_OPTIONS, **kwargs}


def launch(entry, grid: Callable | tuple, *args, **kwargs) -> None:
    """``entry[grid](*args, **kwargs)``, for ``entry`` a ``triton.jit`` function or a
    ``triton.autotune`` of one: the same kernel with the same arguments, launched directly once
    a call with the same key (module docstring) went through Triton. A compiled kernel is asked for
    ``COMPILE_OPTIONS`` where ``kwargs`` leave them out."""
    if isinstance(entry, InterpretedFunction):
        entry[grid](*args, **kwargs)
        return
    kwargs = _asked(kwargs)
    if not ENABLED:
        with assembler.for_options(kwargs):
            entry[grid](*args, **kwargs)
        return
    ckey = call_key(args, kwargs)
    if ckey is not None:
        ckey = (id(entry), driver.active.get_current_device(), knobs.runtime.debug, ckey)
        try:
            call = _calls.get(ckey)
        except TypeError:                           # a descriptor field that cannot be hashed
            ckey = call = None
        if call is not None:
            values = call.arguments(args, kwargs)
            grid3 = _grid_tuple(grid, dict(zip(call.names, values)) if callable(grid) else None)
            if VERIFY:
                _verify(entry, call, values, grid, grid3, args, kwargs)
            call.kernel[grid3](*values)
            return
    given = kwargs
    tuned = isinstance(entry, Autotuner)
    raw = entry.fn if tuned else entry
    if tuned:
        tkey = _tuner_key(entry, args, kwargs)
        config = _configs.get(tkey)
        if config is None:                          # Triton tunes (once per key) and launches
            with assembler.for_options(kwargs):
                kernel = entry[grid](*args, **kwargs)
            best = entry.best_config
            if best.pre_hook is None and kernel is not None:
                config = best.all_kwargs()
                _configs[tkey] = config
                _kernels[_bind(raw, args, {**kwargs, **config})[0]] = kernel
            return
        kwargs = {**kwargs, **config}
    key, bound = _bind(raw, args, kwargs)
    kernel = _kernels.get(key)
    if kernel is None:                              # Triton compiles (or finds) and launches
        with assembler.for_options(kwargs):
            _kernels[key] = raw[grid](*args, **kwargs)
        return
    grid3 = _grid_tuple(grid, bound)
    kernel[grid3](*bound.values())
    if ckey is not None:
        if len(_calls) >= MAX_CALLS or len(_pinned) >= MAX_CALLS or len(_plans) >= MAX_CALLS:
            _calls.clear()
            _pinned.clear()
            _plans.clear()
        _calls[ckey] = _Call(kernel, tuple(bound), tuple((name, name in given, None if name in given else bound[name])
                                                  for name in list(bound)[len(args):]))


def _through_binder(entry, args: tuple, kwargs: dict, what: str) -> tuple[str, Any, dict]:
    """(the kernel's name, the compiled kernel recorded for these arguments' key or None, the arguments
    bound to its parameters) as a launch through Triton would find them: a tuner's recorded choice
    merged in, then Triton's binder. The checks' common part (``_verify``, ``Replay.check``); ``what``
    names the checked thing in the assertion for a tuner without a recorded choice."""
    raw = entry.fn if isinstance(entry, Autotuner) else entry
    name = getattr(raw, "__name__", type(raw).__name__)
    kwargs = _asked(kwargs)
    if isinstance(entry, Autotuner):
        config = _configs.get(_tuner_key(entry, args, kwargs))
        assert config is not None, f"{name}: {what} of a tuner without its recorded choice"
        kwargs = {**kwargs, **config}
    key, bound = _bind(raw, args, kwargs)
    return name, _kernels.get(key), bound


def _verify(entry, call: _Call, values: list, grid, grid3: tuple, args: tuple, kwargs: dict) -> None:
    """Check a recorded call against what binding through Triton gives (``VERIFY``)."""
    name, kernel, bound = _through_binder(entry, args, kwargs, "a recorded call")
    assert kernel is call.kernel, f"{name}: the recorded call's kernel is not its arguments' kernel"
    assert _grid_tuple(grid, bound) == grid3, f"{name}: the recorded call's grid is not its binder's"
    expected = list(bound.values())
    assert len(values) == len(expected) and all(a is b or (a.__class__ in _SCALARS and a == b) for a, b in zip(values, expected)), \
        f"{name}: the recorded call's arguments are not its binder's"


def _bind(raw, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(the compiled-kernel key of these arguments, the arguments bound to the kernel's parameters)
    through Triton's own binder for the current device."""
    device = driver.active.get_current_device()
    bound, specialization, options = raw.device_caches[device][4](*args, **kwargs)
    return (id(raw), device, tuple(specialization), tuple(options.items()), knobs.runtime.debug), bound


class Replay:
    """A recorded call launched again with other tensors in the places of its tensors: no key, no
    binding, no lookup. ``replay_of`` makes one from a call that ``launch`` has recorded; calling it
    with ``tensors`` (one per place, in the arguments' order) launches the recorded kernel with the
    recorded values everywhere else — a tensor descriptor's place gets the recorded descriptor
    with the given tensor as its base.

    The caller vouches for what ``call_key`` would have checked: every other argument the same, and
    each given tensor of the recorded one's dtype, address modulo 16 and (for a descriptor's base)
    the shape and strides the descriptor records; the launcher reads a tensor's address alone, so a
    tensor that starts where the recorded view starts may stand for it. ``VERIFY`` does not reach
    a replay by itself: under it, the replay's user builds the launch as well and checks the replay
    against it (``check``)."""

    __slots__ = ("kernel", "template", "places", "recorded", "generation", "grid")

    def __init__(self, kernel, values: list, generation: int, grid: tuple[int, int, int] | None = None) -> None:
        self.kernel = kernel
        self.grid = grid                       # the recorded call's grid, where ``replay_of`` was given it
        # (position, the recorded descriptor without its base, or None for a tensor); the template holds
        # no tensor, so that a replay keeps none of the recorded call's memory alive
        places, recorded = [], []
        for i, a in enumerate(values):
            if isinstance(a, torch.Tensor):
                places.append((i, None))
                recorded.append((a.data_ptr(), a.dtype))
            elif _is_descriptor(a):
                places.append((i, _rebased(a, None)))
                recorded.append((a.base.data_ptr(), a.base.dtype))
        self.places = tuple(places)
        # each place's tensor in the recorded call, by (address, dtype): how a user tells which of its
        # tensors goes where
        self.recorded = tuple(recorded)
        taken = {i for i, _ in places}
        self.template = [None if i in taken else a for i, a in enumerate(values)]
        self.generation = generation

    @property
    def current(self) -> bool:
        """False once ``clear`` ran after it was made (Triton's settings may have changed)."""
        return self.generation == _generation

    def values(self, tensors) -> list:
        """The kernel's arguments with ``tensors`` in the recorded tensors' places."""
        values = self.template.copy()
        for (i, desc), t in zip(self.places, tensors):
            values[i] = t if desc is None else _rebased(desc, t)
        return values

    def __call__(self, grid: tuple[int, int, int], tensors, stream=None) -> None:
        """Launch on ``stream`` (a CUDA stream handle; None: the current device's current stream)."""
        kernel = self.kernel
        values = self.values(tensors)
        if _unhooked():
            # what ``kernel[grid](*values)`` does when no hook is set, without its closure
            if stream is None:
                stream = current_stream()
            kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *values)
        else:
            kernel[grid](*values)

    def check(self, entry, grid, args: tuple, kwargs: dict, tensors) -> None:
        """Assert that ``launch(entry, grid, *args, **kwargs)`` would launch this kernel with these
        ``tensors``' values: the same compiled kernel through Triton's binder, the same grid (where the
        replay holds one), every argument equal, tensors by address and dtype, descriptors by every
        field."""
        name, kernel, bound = _through_binder(entry, args, kwargs, "a replay")
        assert kernel is self.kernel, f"{name}: the replay's kernel is not its arguments' kernel"
        assert self.grid is None or _grid_tuple(grid, bound) == self.grid, \
            f"{name}: the replay's grid {self.grid} is not the call's {_grid_tuple(grid, bound)}"
        expected, got = list(bound.values()), self.values(tensors)
        assert len(got) == len(expected) and all(map(_same_argument, got, expected)), \
            f"{name}: the replay's arguments are not its binder's"


def current_stream():
    """The current device's current stream, as Triton's launch reads it."""
    return driver.active.get_current_stream(driver.active.get_current_device())


def _unhooked() -> bool:
    """Whether neither launch hook of Triton's knobs calls anything: each None, or a chain of no hooks
    (the form newer releases keep)."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook     # no generator: read on every launch
    return (enter is None or getattr(enter, "calls", None) == []) \
        and (leave is None or getattr(leave, "calls", None) == [])


def _rebased(desc, base):
    """A copy of the tensor descriptor ``desc`` over ``base``, its other fields shared (not checked again)."""
    copy = object.__new__(desc.__class__)
    copy.__dict__ = {**desc.__dict__, "base": base}
    return copy


def _is_descriptor(a) -> bool:
    return dataclasses.is_dataclass(a) and isinstance(getattr(a, "base", None), torch.Tensor)


def _same_argument(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
                and a.dtype == b.dtype)
    if _is_descriptor(a) or _is_descriptor(b):
        return (a.__class__ is b.__class__ and _same_argument(a.base, b.base)
                and {k: v for k, v in a.__dict__.items() if k != "base"}
                == {k: v for k, v in b.__dict__.items() if k != "base"})
    return a is b or (a.__class__ is b.__class__ and a == b)


def replay_of(entry, args: tuple, kwargs: dict, grid=None) -> Replay | None:
    """A ``Replay`` of the call ``launch(entry, grid, *args, **kwargs)`` has recorded (the same key),
    or None: none recorded yet (a key's first call goes through Triton, the next records it), the
    cache off, the interpreter, or arguments ``call_key`` cannot key. ``grid``: the call's grid, kept
    evaluated as ``launch`` evaluates it (a grid function gets the arguments by name, the tuner's choice
    among them)."""
    if not ENABLED or isinstance(entry, InterpretedFunction):
        return None
    kwargs = _asked(kwargs)                         # as ``launch`` recorded the call
    ckey = call_key(args, kwargs)
    if ckey is None:
        return None
    try:
        call = _calls.get((id(entry), driver.active.get_current_device(), knobs.runtime.debug, ckey))
    except TypeError:
        return None
    if call is None:
        return None
    values = call.arguments(args, kwargs)
    grid3 = None if grid is None else _grid_tuple(grid, dict(zip(call.names, values)) if callable(grid) else None)
    return Replay(call.kernel, values, _generation, grid3)


# off: every call whose launches a plan keeps builds them again (what the plans are tested against)
PLANS = True
MAX_PLANS = 256
# on: a plan's call whose tensors sit at the addresses of an earlier call of the same plan launches its
# kernels as one CUDA graph, captured at the first repeat (``Plan``); off: through Triton's launcher each
GRAPHS = True
# the graphs, and the address sets seen once, that one plan keeps (each store emptied when it is full)
MAX_GRAPHS = 64


def empty(shape: tuple, strides: tuple, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """``torch.empty_strided(shape, strides, dtype=dtype, device=like.device)``. Where ``_direct(like)``,
    through the allocator's entry that torch.compile's generated code uses, which costs the host about
    half as much (the ops allocate their outputs and buffers on every call); it takes tuples alone."""
    if _direct(like):
        return _empty_strided_cuda(shape if type(shape) is tuple else tuple(shape),
                                   strides if type(strides) is tuple else tuple(strides), dtype)
    return torch.empty_strided(shape, strides, dtype=dtype, device=like.device)


def elsewhere(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor (not traced) on another device than the current one. Triton launches
    on the current device, so a call on such tensors runs under ``torch.cuda.device(t.device)``: without
    it the launch would hand the current device addresses it cannot reach (a model split over GPUs, as
    transformers' ``device_map="auto"`` does, calls each layer on its own GPU)."""
    return type(t) is torch.Tensor and t.is_cuda and t.get_device() != torch.cuda.current_device()


def _direct(like: torch.Tensor) -> bool:
    """Whether ``empty`` may allocate through the allocator's entry: a plain tensor ``like`` on the current
    CUDA device, with no dispatch mode active (nothing traced or faked that the allocation would bypass)."""
    return _empty_strided_cuda is not None and type(like) is torch.Tensor and like.is_cuda \
        and torch._C._len_torch_dispatch_stack() == 0 and like.get_device() == torch.cuda.current_device()


def empty_contiguous(shape, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=like.device)``: for a plain tensor ``like`` (whose sizes are
    ints) through ``empty``; for a traced one (sizes that may be symbolic) through ``torch.empty``."""
    if type(like) is torch.Tensor:
        shape = tuple(shape)
        return empty(shape, contiguous_strides(shape), dtype, like)
    return torch.empty(shape, dtype=dtype, device=like.device)


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def plan_key(tensors: tuple, *extra, fresh: tuple = ()) -> tuple:
    """What a call's launches can read of ``tensors`` beyond their addresses — every tensor's shape,
    strides, dtype and address modulo 16, and which of them share an address and dtype (a plan maps
    each place to one tensor by address: recorded from ``f(x, x, x)`` it would hand a later call's
    last tensor to all three places) — with ``extra`` (the call's other arguments), the current device
    and Triton's debug switch: the key of the call's ``Plan``. ``fresh``: tensors the call allocated
    itself (its outputs), whose shapes, strides and dtypes follow from ``tensors`` and ``extra`` and
    which share no address with them: only their addresses modulo 16 are keyed."""
    key = [*extra, driver.active.get_current_device(), knobs.runtime.debug]
    first: dict = {}
    for i, t in enumerate(tensors):
        ptr = t.data_ptr()
        key += (t.shape, t.stride(), t.dtype, ptr & 15, first.setdefault((ptr, t.dtype), i))
    if fresh:
        bits = 0
        for t in fresh:
            bits |= t.data_ptr()
        key.append(bits & 15)
    return tuple(key)


class Plan:
    """The launches of one call signature (``plan_key``), kept: each a ``Replay`` with its grid and,
    for each of its tensor places, which tensor of the call goes there — by position among the
    call's tensors and then the buffers the plan allocates (their shapes and dtypes recorded). A call
    repeating the signature allocates the buffers and launches: no arguments built, no key, no
    binding. ``clear`` retires it (``current``). Its user keeps it by key and, under ``VERIFY``,
    builds the launches anyway and runs them through ``checking``.

    On a CUDA device (``GRAPHS`` on) a call whose tensors, buffers included, sit at the addresses of
    an earlier call replays the launches as one CUDA graph, captured at the first such repeat: a
    training step allocates in the same order every step, so its calls repeat their addresses, and one
    graph launch costs the host a fraction of the kernels' launches through Triton's launcher, each of
    which builds the kernel's TMA descriptors anew. Everything else a launch reads is fixed by the
    signature, so a graph is keyed by the addresses alone. Not while the stream is being captured (the
    launches then join the capture) nor with Triton's launch hooks set (they run at each launch)."""

    __slots__ = ("device", "buffers", "steps", "graphs", "seen", "generation")

    def __init__(self, device, buffers: tuple, steps: tuple) -> None:
        self.device, self.buffers, self.steps = device, buffers, steps
        # the oldest of its replays' generations: the plan is current while that one is
        self.generation = min((replay.generation for replay, _ in steps), default=_generation)
        # addresses of the call's tensors -> its graph; addresses seen once (a graph at the next sighting)
        self.graphs: dict[tuple, Any] | None = {} if device.type == "cuda" else None
        self.seen: set[tuple] = set()

    @classmethod
    def record(cls, tensors: tuple, buffers: tuple, launches: list) -> "Plan | None":
        """The plan of a call that launched ``launches`` ((kernel, grid, arguments, keyword arguments)
        each, through ``launch``) with ``tensors`` and its own ``buffers``; None while ``launch`` has not
        recorded every one of them (a signature's first calls) or where a tensor place holds none of
        these tensors (a copy the call made)."""
        where = {(t.data_ptr(), t.dtype): i for i, t in enumerate((*tensors, *buffers))}
        steps = []
        for kernel, grid, args, kwargs in launches:
            replay = replay_of(kernel, args, kwargs, grid)
            if replay is None:
                return None
            order = tuple(where.get(place) for place in replay.recorded)
            if None in order:
                return None
            steps.append((replay, order))
        device = tensors[0].device
        return cls(device, tuple((tuple(b.shape), b.dtype) for b in buffers), tuple(steps))

    @property
    def current(self) -> bool:
        """False once ``clear`` ran after any of its replays was made."""
        return self.generation == _generation

    def allocate(self, like: torch.Tensor) -> tuple:
        """New buffers of the recorded shapes and dtypes (uninitialised), contiguous; ``like``: a tensor of
        the call, on the plan's device (``empty_contiguous``)."""
        return tuple([empty_contiguous(shape, dtype, like) for shape, dtype in self.buffers])

    def __call__(self, tensors: tuple) -> None:
        ts = (*tensors, *self.allocate(tensors[0])) if self.buffers else tensors
        if self.graphs is not None and GRAPHS and self._graphed(ts):
            return
        self.launch(ts, current_stream())          # one stream lookup for the plan's launches

    def launch(self, ts: tuple, stream) -> None:
        """The plan's launches on ``ts`` (the call's tensors, then its buffers) on ``stream``."""
        for replay, order in self.steps:
            replay(replay.grid, [ts[i] for i in order], stream)

    def _graphed(self, ts: tuple) -> bool:
        """Whether the launches on ``ts`` ran as the graph of their addresses (captured now if these
        addresses were seen once before); False where they are to be launched one by one."""
        if not _unhooked() or _capturing():
            return False
        addresses = tuple([t.data_ptr() for t in ts])
        graph = self.graphs.get(addresses)
        if graph is None:
            if addresses not in self.seen:
                if len(self.seen) >= MAX_GRAPHS:
                    self.seen.clear()
                self.seen.add(addresses)
                return False
            try:
                graph = capture(self, ts)
            except RuntimeError as e:       # the capture refused: this plan launches one by one from now on
                warnings.warn(f"stableflash: a CUDA graph of the attention kernels' launches could not be captured "
                              f"({e}); they are launched one by one", RuntimeWarning, stacklevel=2)
                self.graphs = None
                return False
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.clear()
            self.graphs[addresses] = graph
        graph.replay()
        return True

    def checking(self, tensors: tuple, buffers: tuple):
        """A ``launch(index, kernel, grid, arguments, keyword arguments)`` for a call building its
        launches under ``VERIFY``: launch ``index``'s replay checked against the launch built
        (``Replay.check``: kernel, grid, arguments) and run with these tensors and buffers."""
        ts = (*tensors, *buffers)

        def launch(index: int, kernel, grid, args: tuple, kwargs: dict) -> None:
            replay, order = self.steps[index]
            mine = [ts[i] for i in order]
            replay.check(kernel, grid, args, kwargs, mine)
            replay(replay.grid, mine)
        return launch


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (a user's, or torch.compile's)."""
    return torch.cuda.is_current_stream_capturing()


_capture_streams: dict = {}          # device -> the side stream graphs are captured on


def capture(plan: Plan, ts: tuple):
    """A ``torch.cuda.CUDAGraph`` of ``plan``'s launches on ``ts``, captured (not run) on a stream of its
    own; the side stream is ordered after the current stream's work and before its later work, so that
    what the capture's start runs there (torch's random-number state) stays in order with it."""
    side = _capture_streams.get(plan.device)
    if side is None:
        side = _capture_streams[plan.device] = torch.cuda.Stream(plan.device)
    here = torch.cuda.current_stream(plan.device)
    side.wait_stream(here)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            plan.launch(ts, side.cuda_stream)
        finally:
            graph.capture_end()
    here.wait_stream(side)
    return graph


def keep_plan(plans: dict, key: tuple, plan: "Plan | None") -> None:
    """``plans[key] = plan`` for a recorded plan, the store emptied first when it holds MAX_PLANS."""
    if plan is None:
        return
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan
