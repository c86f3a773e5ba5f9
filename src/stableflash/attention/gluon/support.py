"""Whether this machine's triton offers what the Gluon Hopper kernels are written with.

Imports nothing beyond the standard library at module level; ``unavailable_reason`` tries the
imports once and names the first thing missing (no triton, a triton without Gluon, a Gluon
without the Hopper module or one of the names the kernels call). ``device_capability``: a CUDA
device's compute capability, read once per device.
"""
from __future__ import annotations

import functools

# what hopper_forward.py calls, module by module (either TMA spelling is enough: 3.6 has the first pair,
# 3.7 and later the second)
_NEEDED = {
    "triton.experimental.gluon.language": ("warp_specialize", "allocate_shared_memory", "NVMMADistributedLayout",
                                           "NVMMASharedLayout", "DotOperandLayout", "inline_asm_elementwise", "reduce"),
    "triton.experimental.gluon.language.nvidia.hopper": ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared",
                                                         "mbarrier", "tma"),
    "triton.experimental.gluon.nvidia.hopper": ("TensorDescriptor",),
}
_TMA_SPELLINGS = (("async_load", "async_store"), ("async_copy_global_to_shared", "async_copy_shared_to_global"))


@functools.cache
def unavailable_reason() -> str | None:
    """None where the kernels can be compiled with this triton; else why not, in one sentence."""
    import importlib
    try:
        import triton
    except Exception as e:  # noqa: BLE001 (any import failure means: not available)
        return f"triton cannot be imported ({type(e).__name__}: {e})"
    version = getattr(triton, "__version__", "?")
    for module, names in _NEEDED.items():
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001
            return (f"triton {version} has no {module} ({type(e).__name__}: {e}); the Gluon Hopper kernels need "
                    "3.6 or later")
        missing = [n for n in names if not hasattr(mod, n)]
        if missing:
            return f"triton {version}: {module} lacks {', '.join(missing)}"
    tma = importlib.import_module("triton.experimental.gluon.language.nvidia.hopper").tma
    if not any(all(hasattr(tma, n) for n in pair) for pair in _TMA_SPELLINGS):
        return f"triton {version}: gluon's hopper.tma has neither async_load/async_store nor the 3.6 names"
    gl = importlib.import_module("triton.experimental.gluon.language")
    if not (hasattr(gl, "thread_barrier") or hasattr(gl, "barrier")):
        return f"triton {version}: gluon.language has neither thread_barrier nor barrier"
    return None


def available() -> bool:
    """True where this triton offers the Gluon Hopper API the kernels use (they can be compiled for
    sm_90a here, GPU or not; running them needs a CUDA device of compute capability 9.0)."""
    return unavailable_reason() is None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    import torch
    return torch.cuda.get_device_capability(index)


def device_capability(device) -> tuple[int, int]:
    """(major, minor) compute capability of the CUDA ``device`` (a ``torch.device``; without an index,
    the current device), asked of the driver once per device."""
    if device.index is not None:
        return _capability(device.index)
    import torch
    return _capability(torch.cuda.current_device())
