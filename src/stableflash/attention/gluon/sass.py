"""Compile the Gluon Hopper forward for sm_90a without a GPU, and read its SASS.

``compile_forward`` builds the kernel for compute capability 9.0 as the launcher launches it at
``LAUNCH_SHAPE``: ``launch.launch_args`` bound for CPU tensors of that shape and compiled through
triton's runtime (``warmup``) with a stand-in for the CUDA driver (nothing runs), assembled by the
ptxas the launches use (``triton.assembler``). Triton specializes a launch on its integer arguments
(multiples of 16, the value 1), so the shape picks the code: at ``LAUNCH_SHAPE`` it is the PTX that
multi-head attention at the usual training shapes runs on the GPU. ``sass_summary`` disassembles the
cubin with the wheel's nvdisasm and counts what shows whether the sm90 features came through:

- ``instructions``: the kernel's SASS instructions (every partition's code, each counted once);
- ``hgmma``: warpgroup products (HGMMA), one per 16 of the reduction dimension per product site;
- ``wait_depths``: the ``WARPGROUP.DEPBAR.LE gsb0, N`` waits by N — a wait with N ≥ 1 leaves N
  product groups in flight (the product is asynchronous past it); ``arrives``: WARPGROUP.ARRIVE;
- ``ex2_in_flight``: MUFU.EX2 (the softmax's exponentials) placed between a wait that leaves a
  product in flight and the next wait, in program order: the softmax work that overlaps a product;
- ``tma_loads`` / ``tma_stores`` / ``tma_reduces``: UTMALDG / UTMASTG / UTMAREDG (TMA reduce-adds);
- ``stl`` / ``ldl``: local-memory stores and loads (register spills); ``stl_before_split``: the stores
  before the first ``USETMAXREG``, in the prologue every warpgroup runs before the register split;
- ``registers`` (the kernel's, cuobjdump), ``shared_bytes`` (dynamic), ``setmaxnreg``: the register
  counts USETMAXREG sets (the warp-specialised partitions' split, e.g. 240 for the consumers and 24
  for the producer; ``registers`` is then the count every warp starts with);
- ``bar_sync``: CTA or named barriers (BAR.SYNC), most of them inserted by the compiler;
- ``sleeps``: NANOSLEEP (a warp yielding the scheduler);
- ``turn_barriers``: the persistent forward's ping-pong turns, BAR.SYNC and BAR.ARV of named barriers 8
  and 9 for 256 threads ("sync_8", "arrive_8", "sync_9", "arrive_9"); ``named_barriers``: every
  barrier id BAR.SYNC / BAR.ARV use, with the thread counts they use it with (0: the whole CTA);
- ``half_swaps``: PRMT with selector 0x5432, which swaps a register's two 16-bit halves — what ptxas
  emits when bf16 pairs are packed in one order and read as a product's operand in the other.

``compile_through_runtime`` compiles the same path for the general case — grouped-query heads, a
strided query, sequence lengths that are not multiples of a block — and says what its grid and PTX
hold: the launch path up to the driver call.

``compile_backward`` / ``check_backward`` do the same for the backward's two kernels (dK/dV and
dQ) or, for tiles with ``atomic_dq``, its one kernel ("fused"), ``compile_backward_through_runtime``
for the general case, and
``offline_backward_checks`` runs them in fresh Python processes side by side.

``offline_checks`` runs these in a fresh Python process when this one runs Triton's interpreter
(TRITON_INTERPRET=1, as the CPU test suite does): after an interpreted kernel has run, Gluon's
frontend can fail in the same process (``'InterpreterBuilder' object has no attribute
'get_blocked_layout'``, with triton 3.9 and an empty triton cache).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from stableflash.attention.gluon.hopper_forward import Tiles, attn_fwd_hopper_kernel, tiles_for
from stableflash.attention.triton import assembler

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def tools_present() -> bool:
    """Whether this triton wheel ships the nvdisasm and cuobjdump the summary needs."""
    return (_BIN / "nvdisasm").exists() and (_BIN / "cuobjdump").exists()


# (B, H, N): the launch the compile checks build. Triton compiles a launch knowing which of its integer arguments
# are multiples of 16 and with an integer argument equal to 1 as that constant, so one kernel compiles to
# different code for different shapes. At this one — every query head its own key head (a group of 1), sequence
# lengths and head count multiples of 16 — the checks build what multi-head attention at the usual training
# shapes launches: the same PTX.
LAUNCH_SHAPE = (2, 16, 1024)


def _warmup(fn, launch: tuple, options: dict):
    """``fn`` compiled for sm_90a through triton's runtime for one launch (grid, arguments, compile-time
    arguments) without a GPU (the stand-in driver), assembled as that launch is (``assembler.for_options``)."""
    grid, args, meta = launch
    with _stand_in_driver(), assembler.for_options(options):
        return fn.warmup(*args, grid=grid, **meta)


def _bf16(*shape: int):
    import torch
    return torch.empty(*shape, dtype=torch.bfloat16)


def _forward_kernel(q, k, v, causal: bool, tiles: Tiles, residual: bool) -> tuple[tuple, object]:
    """(grid, compiled kernel) of the forward's launch (``launch.launch_args``) for CPU tensors, with O, L and
    (``residual``) R allocated as the launcher's caller allocates them."""
    import torch

    from stableflash.attention.gluon.launch import launch_args
    r = torch.empty(q.shape, dtype=q.dtype) if residual else _bf16(0)
    launch = launch_args(q, k, v, torch.empty_like(q), torch.empty(q.shape[:3]), r, causal, None, tiles)
    return launch[0], _warmup(attn_fwd_hopper_kernel, launch, tiles.options)


def compile_forward(head_dim: int, causal: bool, tiles: Tiles | None = None, residual: bool = True,
                    shape: tuple[int, int, int] = LAUNCH_SHAPE):
    """The forward's kernel compiled for sm_90a as ``launch.launch_args`` launches it at ``shape`` (B, H, N)
    with CPU tensors (a triton ``CompiledKernel``; never launched); ``residual`` False: the kernel that
    stores no R (``stabilize=False``)."""
    t = tiles or tiles_for(head_dim, causal)
    t.check()
    q, k, v = (_bf16(*shape, head_dim) for _ in range(3))
    return _forward_kernel(q, k, v, causal, t, residual)[1]


def _run_on_cubin(cubin: bytes, *commands: list[str]) -> list[str]:
    """The standard output of each of the wheel's tools (``[tool, *options]``) run on the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return [subprocess.run([str(_BIN / tool), *options, f.name], capture_output=True, text=True,
                               check=True).stdout for tool, *options in commands]


def listing(cubin: bytes) -> str:
    """A cubin's SASS listing, by the wheel's nvdisasm."""
    return _run_on_cubin(cubin, ["nvdisasm"])[0]


def disassemble(cubin: bytes) -> tuple[str, str]:
    """(SASS listing, cuobjdump's resource usage) of a cubin, by the wheel's own tools."""
    sass, usage = _run_on_cubin(cubin, ["nvdisasm"], ["cuobjdump", "--dump-resource-usage"])
    return sass, usage


def _ex2_in_flight(sass: str) -> int:
    """MUFU.EX2 between a WARPGROUP.DEPBAR.LE that leaves a product in flight and the next DEPBAR."""
    count, open_ = 0, False
    for line in sass.splitlines():
        wait = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", line)
        if wait:
            open_ = int(wait.group(1), 16) > 0
        elif open_ and "MUFU.EX2" in line:
            count += 1
    return count


def _stores_before_split(sass: str) -> int:
    """STL (local-memory stores) before the first USETMAXREG of the kernel's code: values the compiler
    keeps in local memory from the prologue, which every warpgroup runs before the partitions set their
    register counts, rather than spills of a partition's own loop."""
    text = sass[max(sass.find(".text."), 0):]
    split = text.find("USETMAXREG")
    return len(re.findall(r"\bSTL(\.|\s)", text if split < 0 else text[:split]))


def _named_barriers(sass: str) -> dict:
    """{barrier id: the thread counts BAR.SYNC / BAR.ARV use it with, sorted (0: the whole CTA)}."""
    found: dict[int, set] = {}
    for n, count in re.findall(r"\bBAR\.(?:SYNC|ARV)\S*\s+0x([0-9a-f]+)(?:,\s*0x([0-9a-f]+))?", sass):
        found.setdefault(int(n, 16), set()).add(int(count, 16) if count else 0)
    return {n: sorted(c) for n, c in sorted(found.items())}


def sass_summary(kernel) -> dict:
    """What the compiled kernel's SASS holds (the module docstring lists the keys)."""
    return {**cubin_summary(kernel.asm["cubin"]), "shared_bytes": kernel.metadata.shared}


def cubin_summary(cubin: bytes) -> dict:
    """``sass_summary`` of a cubin alone: every key but the shared memory, which the launch metadata holds."""
    sass, usage = disassemble(cubin)
    regs = re.search(r"REG:(\d+)", usage)
    ops = lambda pattern: len(re.findall(pattern, sass))
    waits = Counter(int(n, 16) for n in re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", sass))
    return {"instructions": len(re.findall(r"^\s*/\*[0-9a-f]+\*/\s+[^.\s][^\n]*;\s*$", sass, re.M)),
            "hgmma": ops(r"\bHGMMA\."), "wait_depths": dict(sorted(waits.items())),
            "arrives": ops(r"WARPGROUP\.ARRIVE"), "ex2_in_flight": _ex2_in_flight(sass),
            "ex2": ops(r"MUFU\.EX2"), "tma_loads": ops(r"\bUTMALDG\b"), "tma_stores": ops(r"\bUTMASTG\b"),
            "tma_reduces": ops(r"\bUTMAREDG\b"),
            "stl": ops(r"\bSTL(\.|\s)"), "ldl": ops(r"\bLDL(\.|\s)"), "stl_before_split": _stores_before_split(sass),
            "bar_sync": ops(r"\bBAR\.SYNC"),
            "half_swaps": ops(r"\bPRMT\s+R\d+,\s*R\d+,\s*0x5432,"), "sleeps": ops(r"\bNANOSLEEP\b"),
            "turn_barriers": {f"{kind}_{n}": ops(rf"\bBAR\.{op}\S*\s+0x{n},\s*0x100\b")
                              for n in (8, 9) for kind, op in (("sync", "SYNC"), ("arrive", "ARV"))},
            "named_barriers": _named_barriers(sass),
            "setmaxnreg": sorted({int(n, 16) for n in re.findall(r"USETMAXREG\.\S+\s+(?:UP\d+,\s*)?0x([0-9a-f]+)",
                                                                 sass)}),
            "registers": int(regs.group(1)) if regs else None}


def release(summary: dict) -> tuple[int, int]:
    """(major, minor) of the triton release that compiled a ``check`` or ``check_backward`` row (its
    "triton" entry): what the SASS bounds, which differ between releases, are chosen by."""
    return _major_minor(summary["triton"])


def assembled_by(summary: dict) -> tuple[int, int]:
    """(major, minor) CUDA release of the ``ptxas`` that assembled a ``check`` or ``check_backward`` row (its
    "ptxas" entry, ``triton.assembler``): with the triton release, what the SASS bounds are chosen by."""
    return _major_minor(summary["ptxas"])


def _major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version "3.9.0+git1a2b" or "12.9"."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def check(head_dim: int, causal: bool, tiles: Tiles | None = None, residual: bool = True) -> dict:
    """Compile one configuration and summarise it, with the triton version, the tiles and whether the
    kernel stores R (``residual``)."""
    t = tiles or tiles_for(head_dim, causal)
    summary = sass_summary(compile_forward(head_dim, causal, t, residual))
    return {"triton": triton.__version__, "ptxas": assembler.release_for(t.options), "target": "sm_90a",
            "head_dim": head_dim, "causal": causal, "residual": residual, **t._asdict(), **summary}


class _StandInDriver:
    """What triton's runtime asks of the active driver to compile a launch — device 0, its stream,
    an sm_90a target — answered without CUDA; anything else from an uninitialised CudaDriver."""

    def __init__(self):
        from triton.backends.nvidia.driver import CudaDriver
        self._real = CudaDriver.__new__(CudaDriver)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def __getattr__(self, name):
        return getattr(self._real, name)


@contextlib.contextmanager
def _stand_in_driver():
    """Triton's active driver is the stand-in inside the block; the one active before comes back
    after it (a GPU launch later in the process needs the real one)."""
    from triton.runtime import driver
    previous = driver._active                 # None until first asked for: then created on demand again
    driver.set_active(_StandInDriver())
    try:
        yield
    finally:
        driver._active = previous


def _isolated_env() -> dict:
    """This process's environment for a fresh Python process that compiles: without TRITON_INTERPRET
    (the module docstring says why), with the folder holding this stableflash package first on
    PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    return env


def compile_through_runtime(head_dim: int = 64, causal: bool = True, tiles: Tiles | None = None) -> dict:
    """Bind ``launch.launch_args`` for CPU tensors — q a (2, 200, 4, d) buffer seen as (B, H, N, d),
    k and v (2, 2, 150, d) (grouped-query heads, N not a multiple of the block) — to the kernel and
    compile them through triton's runtime (``warmup``) for sm_90a with a stand-in driver; the grid
    and what the PTX holds. Triton's active driver is the stand-in during the compile alone: the
    one active before comes back afterwards (a GPU launch later in the process needs the real one)."""
    t = tiles or tiles_for(head_dim, causal)
    q = _bf16(2, 200, 4, head_dim).transpose(1, 2)
    k, v = _bf16(2, 2, 150, head_dim), _bf16(2, 2, 150, head_dim)
    grid, kernel = _forward_kernel(q, k, v, causal, t, residual=True)
    ptx = kernel.asm["ptx"]
    return {"grid": list(grid), "wgmma": "wgmma.mma_async" in ptx, "tma": "cp.async.bulk.tensor.4d" in ptx,
            "num_warps": kernel.metadata.num_warps, "shared_bytes": kernel.metadata.shared}


def interpreting() -> bool:
    """Whether this process runs Triton's interpreter (TRITON_INTERPRET set to a true value)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _checks_here(configs: list, runtime: bool) -> dict:
    rows = [check(d, causal, Tiles(*t) if t is not None else None, *rest) for d, causal, t, *rest in configs]
    return {"rows": rows, "runtime": compile_through_runtime() if runtime else None}


def offline_checks(configs: list, runtime: bool = False, isolate: bool | None = None) -> dict:
    """{"rows": ``check`` of each (head_dim, causal, tiles or None[, residual]), "runtime": ``compile_through_runtime()``
    if asked}. ``isolate`` (default: when this process runs Triton's interpreter): in a fresh Python
    process without TRITON_INTERPRET (the module docstring says why)."""
    configs = [(d, causal, None if t is None else list(t), *rest) for d, causal, t, *rest in configs]
    if isolate is None:
        isolate = interpreting()
    if not isolate:
        return _checks_here(configs, runtime)
    env = _isolated_env()
    code = ("import json, sys; from stableflash.attention.gluon import sass; "
            "print('\\n' + json.dumps(sass._checks_here(json.loads(sys.argv[1]), sys.argv[2] == '1')))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(configs), "1" if runtime else "0"], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the sm_90a compile check failed in its own process:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for row in result["rows"]:
        row["wait_depths"] = {int(n): c for n, c in row["wait_depths"].items()}
    return result


# --- the backward ---------------------------------------------------------------------------------

def _backward_kernels(do, q, k, v, lse, delta, causal: bool, tiles) -> tuple[dict, dict]:
    """({name: grid}, {name: compiled kernel}) of the backward's launches (``launch_backward.launch_args_backward``)
    for CPU tensors: "dkdv" and "dq", or "fused" for tiles with ``atomic_dq``."""
    import torch

    from stableflash.attention.gluon.hopper_backward import (attn_bwd_dkdv_hopper_kernel, attn_bwd_dq_hopper_kernel,
                                                             attn_bwd_hopper_kernel)
    from stableflash.attention.gluon.launch_backward import dq_buffer, launch_args_backward
    functions = {"dkdv": attn_bwd_dkdv_hopper_kernel, "dq": attn_bwd_dq_hopper_kernel, "fused": attn_bwd_hopper_kernel}
    d = q.shape[-1]
    dq = dq_buffer(q, tiles.dq_transposed(d)) if tiles.atomic_dq else torch.empty_like(q)
    launches = launch_args_backward(do, q, k, v, dq, torch.empty_like(k), torch.empty_like(v), lse, delta, causal,
                                    None, tiles)
    return ({name: launch[0] for name, launch in launches.items()},
            {name: _warmup(functions[name], launch, tiles.options) for name, launch in launches.items()})


def compile_backward(head_dim: int, causal: bool, tiles=None, shape: tuple[int, int, int] = LAUNCH_SHAPE) -> dict:
    """The backward's kernels compiled for sm_90a as the launcher launches them at ``shape`` (B, H, N) with CPU
    tensors, {"dkdv": ..., "dq": ...}, or {"fused": ...} for tiles with ``atomic_dq`` (triton
    ``CompiledKernel``s; never launched)."""
    import torch

    from stableflash.attention.gluon.hopper_backward import backward_tiles_for
    t = tiles or backward_tiles_for(head_dim, causal)
    t.check(head_dim)
    B, H, N = shape
    q, k, v, do = (_bf16(B, H, N, head_dim) for _ in range(4))
    return _backward_kernels(do, q, k, v, torch.empty(B, H, N), torch.empty(B, H, N), causal, t)[1]


def check_backward(head_dim: int, causal: bool, tiles=None) -> list[dict]:
    """Compile the backward's kernels for one configuration and summarise each (``sass_summary``),
    with the triton version, the kernel's name and the tiles."""
    from stableflash.attention.gluon.hopper_backward import backward_tiles_for
    t = tiles or backward_tiles_for(head_dim, causal)
    kernels = compile_backward(head_dim, causal, t)
    ptxas = assembler.release_for(t.options)
    return [{"triton": triton.__version__, "ptxas": ptxas, "target": "sm_90a", "kernel": name, "head_dim": head_dim,
             "causal": causal, **t._asdict(), **sass_summary(kernel)} for name, kernel in kernels.items()]


def compile_backward_through_runtime(head_dim: int = 64, causal: bool = True, tiles=None) -> dict:
    """``compile_through_runtime`` for the backward: ``launch_backward.launch_args_backward`` bound for
    CPU tensors — q and do (2, 200, 4, d) buffers seen as (B, H, N, d), k and v (2, 2, 150, d)
    (grouped-query heads, N not a multiple of a block), L and δ (2, 4, 200) — and both kernels
    compiled through triton's runtime (``warmup``) for sm_90a with the stand-in driver, the one
    active before given back afterwards. {kernel: its grid and what its PTX holds}."""
    import torch

    from stableflash.attention.gluon.hopper_backward import backward_tiles_for
    t = tiles or backward_tiles_for(head_dim, causal)
    q, do = (_bf16(2, 200, 4, head_dim).transpose(1, 2) for _ in range(2))
    k, v = _bf16(2, 2, 150, head_dim), _bf16(2, 2, 150, head_dim)
    grids, kernels = _backward_kernels(do, q, k, v, torch.zeros(2, 4, 200), torch.zeros(2, 4, 200), causal, t)
    return {name: {"grid": list(grids[name]), "wgmma": "wgmma.mma_async" in k.asm["ptx"],
                   "tma": "cp.async.bulk.tensor.4d" in k.asm["ptx"], "num_warps": k.metadata.num_warps,
                   "shared_bytes": k.metadata.shared}
            for name, k in kernels.items()}


def _backward_checks_here(configs: list, runtime: bool) -> dict:
    from stableflash.attention.gluon.hopper_backward import BackwardTiles, atomic_backward_tiles
    rows = [row for d, causal, t in configs
            for row in check_backward(d, causal, BackwardTiles(*t) if t is not None else None)]
    both = {**compile_backward_through_runtime(),
            **compile_backward_through_runtime(tiles=atomic_backward_tiles(64))} if runtime else None
    return {"rows": rows, "runtime": both}


def offline_backward_checks(configs: list, runtime: bool = False, jobs: int = 2) -> dict:
    """{"rows": ``check_backward``'s rows of each (head_dim, causal, tiles or None), "runtime":
    ``compile_backward_through_runtime`` of the default tiles and of ``atomic_backward_tiles(64)``
    (its kernels by name: "dkdv", "dq", "fused") if asked}, computed in ``jobs`` fresh Python processes
    without TRITON_INTERPRET running side by side (the configurations dealt out in turn, the
    runtime compile in the last process; ``offline_checks`` says why a fresh process), or here
    with jobs=0."""
    configs = [(d, causal, None if t is None else list(t)) for d, causal, t in configs]
    if jobs == 0:
        return _backward_checks_here(configs, runtime)
    env = _isolated_env()
    code = ("import json, sys; from stableflash.attention.gluon import sass; "
            "print('\\n' + json.dumps(sass._backward_checks_here(json.loads(sys.argv[1]), sys.argv[2] == '1')))")
    shares = [configs[i::jobs] for i in range(jobs)]
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(share),
                               "1" if runtime and i == jobs - 1 else "0"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, share in enumerate(shares)]
    results = [(p, *p.communicate()) for p in procs]
    rows, runtime_result = [], None
    for p, out, err in results:
        if p.returncode:
            raise RuntimeError(f"the sm_90a backward compile check failed in its own process:\n{err[-4000:]}")
        part = json.loads(out.strip().splitlines()[-1])
        rows += part["rows"]
        runtime_result = part["runtime"] or runtime_result
    for row in rows:
        row["wait_depths"] = {int(n): c for n, c in row["wait_depths"].items()}
    order = {(d, causal): i for i, (d, causal, _) in enumerate(configs)}
    rows.sort(key=lambda r: (order[(r["head_dim"], r["causal"])], r["kernel"]))
    return {"rows": rows, "runtime": runtime_result}
