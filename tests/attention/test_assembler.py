"""Which ptxas assembles the Gluon kernels (``attention/triton/assembler.py``): under a triton that assembles
sm_90 with a CUDA 13 ``ptxas-blackwell`` and ships a CUDA 12 ``ptxas`` beside it (3.9), the chosen one is
the CUDA 12 one and a compile asking for it is assembled by it; under older releases nothing changes; a
user's own choice stands. Compiles for sm_90a without a GPU (no kernel runs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
compiler = pytest.importorskip("triton.backends.nvidia.compiler")

from stableflash.attention.triton import assembler  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"

# compile a small Triton kernel for sm_90a with the options ``assembler.options()`` gives, inside
# ``assembler.for_options``, and report what came out: the PTX ISA written, the CUDA release in the cubin's
# tool note (CUDA 13's ptxas writes one, CUDA 12's none), the kernel's cache key, and triton's knob and
# environment after the block
PROGRAM = r"""
import json, os, re, sys
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from stableflash.attention.triton import assembler
assembler.ENABLED = sys.argv[1] == "1"

@triton.jit
def doubled(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

options = {"num_warps": 4, **assembler.options()}
src = triton.compiler.ASTSource(doubled, signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                                constexprs={"BLOCK": 128})
with assembler.for_options(options):
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
note = re.search(rb"Cuda compilation tools, release (\d+\.\d+)", kernel.asm["cubin"])
chosen = assembler.choice()
print(json.dumps({"ptx_isa": re.search(r"^\.version (\d+\.\d+)", kernel.asm["ptx"], re.M).group(1),
                  "note": note.group(1).decode() if note else None, "hash": kernel.hash,
                  "knob_after": knobs.nvidia.ptxas_blackwell.path,
                  "env_after": os.environ.get("TRITON_PTXAS_BLACKWELL_PATH"),
                  "release": assembler.release_for(options), "options": options,
                  "chosen": None if chosen is None else chosen.path}))
"""


def _compile(enabled: bool, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p),
               TRITON_CACHE_DIR=str(tmp_path / f"cache-{int(enabled)}"), TRITON_DEFAULT_FP_FUSION="1")
    program = tmp_path / "assemble.py"            # triton reads a jit function's source from its file
    program.write_text(PROGRAM)
    out = subprocess.run([sys.executable, str(program), "1" if enabled else "0"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _two_assemblers() -> bool:
    """Whether this triton assembles sm_90 with a CUDA 13 ptxas-blackwell and ships a CUDA 12 ptxas."""
    from triton import knobs
    default, legacy = compiler.get_ptxas(90), knobs.nvidia.ptxas
    return default.path != legacy.path and default.version.startswith("13.") and legacy.version.startswith("12.")


@pytest.fixture
def fresh_choice():
    """The choice read again from the environment and triton's knobs, before and after the test."""
    assembler._chosen.cache_clear()
    yield
    assembler._chosen.cache_clear()


def test_the_choice_follows_the_wheel(fresh_choice, monkeypatch):
    """Under a triton with both assemblers the choice is its CUDA 12 ptxas with that release's PTX ISA
    (12.9: 8.8, written 88); under one that assembles sm_90 with a CUDA 12 ptxas already, none."""
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    from triton import knobs
    chosen = assembler.choice()
    if _two_assemblers():
        legacy = knobs.nvidia.ptxas
        assert chosen == assembler.Assembler(legacy.path, legacy.version, compiler.ptx_get_version(legacy.version))
        major, minor = map(int, legacy.version.split("."))
        assert chosen.ptx_version == 80 + minor - (1 if minor >= 6 else 0) and major == 12
        assert assembler.options() == {"ptx_version": chosen.ptx_version}
    else:
        assert chosen is None and assembler.options() == {}


def test_a_user_choice_or_the_switch_off_leaves_triton_s_default(fresh_choice, monkeypatch):
    """An assembler the user named (``TRITON_PTXAS_BLACKWELL_PATH``) or ``ENABLED`` off: no choice, no
    options, contexts that change nothing."""
    from triton import knobs
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", knobs.nvidia.ptxas_blackwell.path)
    assert assembler.choice() is None and assembler.options() == {}
    assembler._chosen.cache_clear()
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH")
    monkeypatch.setattr(assembler, "ENABLED", False)
    assert assembler.choice() is None and assembler.options() == {}
    before = knobs.nvidia.ptxas_blackwell.path
    with assembler.for_options({"ptx_version": 88}):
        assert knobs.nvidia.ptxas_blackwell.path == before


def test_a_compile_asking_for_the_choice_is_assembled_by_it(tmp_path):
    """The same kernel compiled with the choice's options inside ``for_options`` and with the switch off:
    under a triton with both assemblers, the first is written in the CUDA 12 ptxas's PTX ISA, carries no
    CUDA 13 tool note and has a cache key of its own, the second carries CUDA 13's note; triton's knob and
    environment are as before after either. Under older releases both compile alike."""
    on, off = _compile(True, tmp_path), _compile(False, tmp_path)
    for r in (on, off):
        assert r["env_after"] is None and r["knob_after"] != r["chosen"], r
    if _two_assemblers():
        legacy_isa = f"{on['options']['ptx_version'] // 10}.{on['options']['ptx_version'] % 10}"
        assert on["ptx_isa"] == legacy_isa and on["note"] is None and on["release"].startswith("12."), on
        assert off["note"] == off["release"] and off["release"].startswith("13.") and off["options"] == {"num_warps": 4}
        assert on["hash"] != off["hash"]
    else:
        assert on["chosen"] is None and on["options"] == off["options"] == {"num_warps": 4}, on
        assert (on["ptx_isa"], on["note"], on["hash"]) == (off["ptx_isa"], off["note"], off["hash"])


def test_launch_contexts_only_where_the_options_ask(fresh_choice, monkeypatch):
    """``for_options`` moves triton's knob only for options carrying the choice's PTX version, and puts it
    back after the block (the launch cache enters it around every launch that may compile)."""
    from triton import knobs
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
    before = knobs.nvidia.ptxas_blackwell.path
    with assembler.for_options({"num_warps": 4}):
        assert knobs.nvidia.ptxas_blackwell.path == before
    chosen = assembler.choice()
    if chosen is None:
        pytest.skip("this triton assembles sm_90 with its CUDA 12 ptxas already: nothing to move")
    with assembler.for_options(assembler.options()):
        assert knobs.nvidia.ptxas_blackwell.path == chosen.path
        assert os.environ["TRITON_PTXAS_BLACKWELL_PATH"] == chosen.path
    assert knobs.nvidia.ptxas_blackwell.path == before and "TRITON_PTXAS_BLACKWELL_PATH" not in os.environ
    assert "ptxas_blackwell" not in vars(knobs.nvidia)
