"""Does this triton's Gluon express a Hopper warpgroup product, compiled for sm_90a without a GPU?

    python benchmarks/tools/gluon_hopper_probe.py [--json OUT.json]

Compiles one tile of C = A·B (64 × 64 × 64, bf16 operands staged in shared memory in the NVMMA
layout, fp32 accumulator in the warpgroup-MMA layout) written in Gluon (`triton.experimental.gluon`,
`nvidia.hopper.warpgroup_mma`) for compute capability 9.0 with the ptxas that ships in the triton
wheel, disassembles the cubin with its nvdisasm and counts the HGMMA instructions. The kernel is
compiled, never run. It is the smallest check that a Gluon Hopper path (wgmma, later TMA,
mbarriers and warp specialisation) can be built and inspected on a machine without a GPU, on each
triton the project meets (the GPU machines' and the newest). The attention forward built on it
(``stableflash.attention.gluon``) is checked the same way by gluon_forward_check.py.

In a process that runs Triton's interpreter (TRITON_INTERPRET=1, as the CPU test suite does)
``probe`` compiles in a fresh process without it: once an interpreted kernel has run, Gluon's
frontend can fail in the same process ("'InterpreterBuilder' object has no attribute
'get_blocked_layout'", triton 3.9 with an empty triton cache).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from stableflash.attention.gluon import sass


@gluon.jit
def one_tile(a_ptr, b_ptr, c_ptr, M: gl.constexpr):
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, M, layout=gl.SliceLayout(0, blocked))
    offs = rows[:, None] * M + cols[None, :]
    smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, M], gl.bfloat16)
    a = gl.allocate_shared_memory(gl.bfloat16, [M, M], smem, gl.load(a_ptr + offs))
    b = gl.allocate_shared_memory(gl.bfloat16, [M, M], smem, gl.load(b_ptr + offs))
    fence_async_shared()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M, 16])
    acc = warpgroup_mma(a, b, gl.zeros([M, M], gl.float32, layout=mma))
    gl.store(c_ptr + offs, gl.convert_layout(acc, blocked))


def probe(m: int = 64) -> dict:
    """Compile ``one_tile`` for sm_90a; its cubin size and HGMMA count, with the triton version."""
    if sass.interpreting():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "probe.json"
            subprocess.run([sys.executable, __file__, "--m", str(m), "--json", str(out)], env=env, check=True,
                           capture_output=True)
            return json.loads(out.read_text())
    src = gluon._runtime.GluonASTSource(one_tile, signature={"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32",
                                                             "M": "constexpr"}, constexprs={"M": m})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    listing = sass.listing(kernel.asm["cubin"])
    return {"triton": triton.__version__, "target": "sm_90a", "cubin_bytes": len(kernel.asm["cubin"]),
            "hgmma": len(re.findall(r"\bHGMMA\b", listing)), "ptx_has_wgmma": "wgmma.mma_async" in kernel.asm["ptx"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--m", type=int, default=64, help="the tile's size (M = N = K)")
    args = ap.parse_args(argv)
    result = probe(args.m)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"triton {result['triton']}: {result['target']} cubin {result['cubin_bytes']} bytes, "
          f"{result['hgmma']} HGMMA instructions, wgmma in the PTX: {result['ptx_has_wgmma']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
