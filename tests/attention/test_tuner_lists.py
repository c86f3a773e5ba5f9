"""The Triton tuners' candidate lists: a register-capped tile compiles for sm_90 within its cap (no GPU needed:
triton compiles with the ptxas its wheel ships, and cuobjdump reads the cubin's register count). The compile
runs in a process of its own: the test suite's processes run Triton's interpreter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from stableflash.attention.triton import op  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

# compiles the dK/dV kernel (head_dim 64, causal, bf16) for sm_90 at each (BLOCK_M, BLOCK_N, warps, stages,
# maxnreg) of argv[1] and prints the registers a thread takes, as JSON
REGISTERS = r"""
import importlib.util, json, re, subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
spec = importlib.util.spec_from_file_location("compile_check", sys.argv[2])
cc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cc)
from stableflash.attention.triton.backward import attn_bwd_dkdv_kernel
out = []
for bm, bn, warps, stages, cap in json.loads(sys.argv[1]):
    options = dict(num_warps=warps, num_stages=stages, **({"maxnreg": cap} if cap else {}))
    compiled = triton.compile(cc.source(attn_bwd_dkdv_kernel, dict(cc.BWD, BLOCK_M=bm, BLOCK_N=bn)),
                              target=GPUTarget("cuda", 90, 128), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([sys.argv[3], "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    out.append(int(re.search(r"REG:(\d+)", usage).group(1)))
print(json.dumps(out))
"""


def _registers(configs) -> list[int]:
    tiles = [[c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.maxnreg] for c in configs]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", REGISTERS, json.dumps(tiles),
                          str(ROOT / "benchmarks" / "tools" / "compile_check.py"), str(BIN / "cuobjdump")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not (BIN / "cuobjdump").exists(), reason="this triton wheel ships no cuobjdump")
def test_the_capped_dkdv_tile_compiles_within_its_cap_and_the_cap_binds():
    capped = [c for c in op.DKDV_CONFIGS if c.maxnreg is not None]
    assert capped, "the dK/dV list holds a register-capped tile"
    twins = []
    for cfg in capped:
        plain = [c for c in op.DKDV_CONFIGS if c.maxnreg is None and c.kwargs == cfg.kwargs
                 and (c.num_warps, c.num_stages) == (cfg.num_warps, cfg.num_stages)]
        assert plain, f"{cfg} has no uncapped twin in the list"
        twins.append(plain[0])
    regs = _registers(capped + twins)
    for cfg, got, free in zip(capped, regs, regs[len(capped):]):
        assert got <= cfg.maxnreg, (got, cfg)
        assert free > cfg.maxnreg, f"the cap {cfg.maxnreg} does not bind: the tile takes {free} registers without it"


def test_a_tile_carries_its_register_cap():
    assert op._cfg(32, 64, 4, 3, maxnreg=128).maxnreg == 128
    assert op._cfg(32, 64, 4, 3).maxnreg is None
    assert op._cfg(64, 64, 4, 3, TMA=True).kwargs == {"BLOCK_M": 64, "BLOCK_N": 64, "TMA": True}
