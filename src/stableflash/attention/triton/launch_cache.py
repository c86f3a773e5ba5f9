"""Launching a Triton kernel again without Triton's per-call dispatch.

``kernel[grid](*args, **kwargs)`` costs the host tens of microseconds before the GPU sees
anything: the autotuner builds a dictionary of every argument to look up its choice, and the JIT
function binds the arguments, turns its compile options into a string to look up the compiled
kernel, and checks the kernel's globals (``benchmarks/tools/host_overhead.py`` measures it). An
attention forward and backward launch three or four kernels with some seventy arguments each, so at a training
step's small shapes that time is as long as the kernels'.

``launch`` keeps what those lookups found. Its key is what Triton's own lookup depends on: the
specialization that Triton's binder computes from the arguments (types, alignment, the integers
equal to 1 or divisible by 16, every constexpr's value), the compile options given, Triton's debug
switch and the device; in front of an autotuner also the exact values of the tuner's key
arguments and the argument dtypes, which decide its choice. The first call with a key goes
through Triton (tuning, compiling, launching as usual) and records the compiled kernel it
returns; later calls bind the arguments and launch that kernel directly
(``CompiledKernel[grid](*args)``, which calls Triton's launch hooks as its dispatch does). Under
the interpreter every call goes through Triton.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from triton import knobs
from triton.runtime.autotuner import Autotuner
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction

# off: every launch through Triton's dispatch (benchmarks compare both)
ENABLED = True

_configs: dict[tuple, dict[str, Any]] = {}      # (tuner, its key values, dtypes) -> the config's kwargs
_kernels: dict[tuple, Any] = {}                 # (kernel, device, specialization, options) -> CompiledKernel


def clear() -> None:
    """Forget every recorded choice and kernel (the next launch of each goes through Triton)."""
    _configs.clear()
    _kernels.clear()
    _positions.clear()


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


def launch(entry, grid: Callable | tuple, *args, **kwargs) -> None:
    """``entry[grid](*args, **kwargs)``, for ``entry`` a ``triton.jit`` function or a
    ``triton.autotune`` of one: the same kernel with the same arguments, launched directly once
    a call with the same key (module docstring) went through Triton."""
    if not ENABLED or isinstance(entry, InterpretedFunction):
        entry[grid](*args, **kwargs)
        return
    tuned = isinstance(entry, Autotuner)
    raw = entry.fn if tuned else entry
    if tuned:
        tkey = _tuner_key(entry, args, kwargs)
        config = _configs.get(tkey)
        if config is None:                          # Triton tunes (once per key) and launches
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
        _kernels[key] = raw[grid](*args, **kwargs)
        return
    kernel[_grid_tuple(grid, bound)](*bound.values())


def _bind(raw, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(the compiled-kernel key of these arguments, the arguments bound to the kernel's parameters)
    through Triton's own binder for the current device."""
    device = driver.active.get_current_device()
    bound, specialization, options = raw.device_caches[device][4](*args, **kwargs)
    return (id(raw), device, tuple(specialization), tuple(options.items()), knobs.runtime.debug), bound
