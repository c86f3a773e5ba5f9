"""Which ptxas assembles the Gluon Hopper kernels.

Triton turns a kernel into PTX and hands it to an assembler (``ptxas``) shipped in its wheel. Up to
triton 3.8, sm_90 is assembled by the wheel's CUDA 12 ``ptxas``; from 3.9 by ``ptxas-blackwell``
(CUDA 13), with the CUDA 12 one still in the wheel beside it. Assembled by CUDA 13.4's, the Gluon
kernels at head_dim 64 run slower than assembled by 12.9's (the backward 5-7%, docs/kernels.md,
"The assembler under triton 3.9"), and none runs faster; the Triton kernels keep triton's default
(within 2% of each other under either, but one kernel at one shape 4% faster with CUDA 13.4's).
So where this triton would assemble sm_90 with a CUDA 13 ``ptxas-blackwell`` and its wheel also holds
a CUDA 12 ``ptxas``, the Gluon kernels are assembled by the CUDA 12 one:

- ``choice()`` names it (an ``Assembler``: path, CUDA release, the PTX ISA version that release
  accepts), or None where nothing is to change: an older triton (sm_90 is already assembled by the
  CUDA 12 ``ptxas``), a wheel without the CUDA 12 ``ptxas``, ``ENABLED`` off, or an assembler the user
  chose (``TRITON_PTXAS_PATH`` or ``TRITON_PTXAS_BLACKWELL_PATH`` set, or triton's knob assigned,
  before the first Gluon kernel's launch).
- ``options()``: the compile options that ask for it — ``ptx_version``, the PTX ISA that assembler
  accepts (triton would otherwise write the ISA of the CUDA 13 one). The option is part of triton's
  cache key, so a kernel assembled this way is never found under the key of one assembled the other
  way, in this process or in triton's cache on disk.
- ``for_options(options)``: where ``options`` ask for it, a context in which triton assembles with the
  chosen ``ptxas`` (triton's ``knobs.nvidia`` scoped: set for the block, restored after); otherwise a
  context that changes nothing. The launch cache enters it only where a launch may compile (a key's
  first launch); launches of compiled kernels do not pay for it. Triton's record of the default
  assembler's version, part of every kernel's cache key, is read before the knob is set, so other
  kernels keep their keys. The knob is process-wide while the block runs (it sets an environment
  variable): a kernel another thread compiles at that moment is assembled by the same ``ptxas``.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

# off: the Gluon kernels are assembled by what triton assembles sm_90 with (its default)
ENABLED = True
# sm_90: the architecture the Gluon kernels compile for
ARCH = 90


@dataclass(frozen=True)
class Assembler:
    """A ``ptxas``: its path, its CUDA release ("12.9") and the PTX ISA version it accepts, as triton's
    ``ptx_version`` option writes it (88 for 8.8)."""
    path: str
    release: str
    ptx_version: int


def _legacy() -> Assembler | None:
    """The wheel's CUDA 12 ``ptxas``, where this triton assembles sm_90 with another one."""
    try:
        from triton import knobs
        from triton.backends.nvidia import compiler
    except Exception:  # noqa: BLE001 (no triton or no NVIDIA backend: nothing to choose)
        return None
    if not all(hasattr(compiler, n) for n in ("get_ptxas", "ptx_get_version")) or \
            not all(hasattr(knobs.nvidia, n) for n in ("ptxas", "ptxas_blackwell", "scope")):
        return None
    try:
        default = compiler.get_ptxas(ARCH)
        blackwell = knobs.nvidia.ptxas_blackwell
        legacy = knobs.nvidia.ptxas
    except RuntimeError:                            # a wheel without one of its assemblers
        return None
    if default.path != blackwell.path or legacy.path == blackwell.path:
        return None                                 # sm_90 is assembled by the CUDA 12 ptxas already
    if not legacy.version.startswith("12.") or not blackwell.version.startswith("13."):
        return None
    return Assembler(legacy.path, legacy.version, compiler.ptx_get_version(legacy.version))


def _user_chose() -> bool:
    """Whether the user named an assembler (environment or triton's knob)."""
    if os.environ.get("TRITON_PTXAS_PATH") or os.environ.get("TRITON_PTXAS_BLACKWELL_PATH"):
        return True
    try:
        from triton import knobs
    except Exception:  # noqa: BLE001
        return False
    assigned = getattr(knobs.nvidia, "__dict__", {})
    return "ptxas" in assigned or "ptxas_blackwell" in assigned


def choice() -> Assembler | None:
    """The ``ptxas`` the Gluon kernels are assembled with where it is not triton's default; None where
    they are assembled by triton's default (the module docstring says when). The environment and
    triton's knobs are read at the first call (``_chosen.cache_clear()`` reads them again)."""
    return _chosen() if ENABLED else None


@functools.cache
def _chosen() -> Assembler | None:
    return None if _user_chose() else _legacy()


def options() -> dict:
    """The compile options that ask for ``choice()``: ``{"ptx_version": ...}``, or nothing."""
    chosen = choice()
    return {} if chosen is None else {"ptx_version": chosen.ptx_version}


def _asked_by(options: dict) -> Assembler | None:
    """``choice()`` where ``options`` ask for it (its ``ptx_version``), else None: triton's default."""
    chosen = choice()
    return chosen if chosen is not None and options.get("ptx_version") == chosen.ptx_version else None


def for_options(options: dict) -> contextlib.AbstractContextManager:
    """A context in which triton assembles what ``options`` ask for: the chosen ``ptxas`` where their
    ``ptx_version`` is ``choice()``'s, else triton's default (a context that changes nothing)."""
    chosen = _asked_by(options)
    return contextlib.nullcontext() if chosen is None else _assembling(chosen)


def ptxas_for(options: dict) -> tuple[str, str]:
    """The path and CUDA release ("12.9") of the ``ptxas`` that assembles sm_90 for a kernel compiled
    with ``options``; ("", "") where triton or its NVIDIA backend is missing."""
    chosen = _asked_by(options)
    if chosen is not None:
        return chosen.path, chosen.release
    try:
        from triton.backends.nvidia import compiler
        default = compiler.get_ptxas(ARCH)
        return default.path, default.version
    except Exception:  # noqa: BLE001
        return "", ""


def release_for(options: dict) -> str:
    """The CUDA release of ``ptxas_for(options)``; "" where triton or its NVIDIA backend is missing."""
    return ptxas_for(options)[1]


@contextlib.contextmanager
def _assembling(chosen: Assembler):
    from triton import knobs
    from triton.backends.nvidia import compiler
    if hasattr(compiler, "get_ptxas_version"):
        compiler.get_ptxas_version(ARCH)            # the default's version, recorded before the knob moves
    with knobs.nvidia.scope():
        knobs.nvidia.ptxas_blackwell = chosen.path
        yield
