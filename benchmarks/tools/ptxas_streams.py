"""Which instruction streams ptxas makes from the route's Gluon kernels, and a triton cache holding each.

    python benchmarks/tools/ptxas_streams.py survey [--runs 8] [--no-aslr] [--json FILE]     # no GPU needed
    python benchmarks/tools/ptxas_streams.py draw --shape 32,12,1024,64 [--attempts 6] --out DIR   # H100/H200

``survey`` compiles each kernel the route launches (the Gluon forward and the backward that adds dQ up, head_dim
64 and 128, causal or not, and the head_dim-64 causal backward with its half diagonal block) once to PTX for
sm_90a, assembles that PTX ``--runs`` times with the ptxas its launches use and triton's flags, and hashes each
result's instruction lines (addresses left out): one hash per kernel is a deterministic assembly, more are
streams ptxas picks between from the same PTX. ``--no-aslr`` runs ptxas with address-space randomisation off
(``setarch -R``). Each stream is summarised by ``sass.cubin_summary``.

``draw`` makes what ``survey`` finds timeable: each attempt runs one causal forward and backward through
``flash_attention`` at ``--shape`` in a fresh process whose triton cache is ``DIR/attempt-N``, then hashes the
backward cubin triton kept there. Every stream drawn is listed with the attempts that hold it; timing a stream
is running a benchmark with ``TRITON_CACHE_DIR`` set to one of its attempts' folders (triton then loads that
cubin instead of assembling again), e.g.

    TRITON_CACHE_DIR=DIR/attempt-0 python benchmarks/tools/interleaved_bench.py --shape 32,12,1024,64 \\
        --providers sdpa-default stableflash --rounds 3

Both write JSON beside the printed table (``--json``; ``draw`` writes ``DIR/streams.json``).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SUMMARY_KEYS = ("instructions", "hgmma", "ex2", "ex2_in_flight", "stl", "ldl", "registers")
BACKWARD_CUBIN = "attn_bwd_hopper_kernel.cubin"
CHILD = "--one-call"                                   # the argument that makes a process one of draw's attempts


def instruction_hash(listing: str) -> str:
    """The first 10 hex digits of the SHA-1 of a SASS listing's instruction lines, their addresses left out."""
    lines = [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in listing.splitlines()
             if re.match(r"^\s*/\*[0-9a-f]+\*/\s+[^.\s]", line)]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


def _summary(cubin: bytes) -> dict:
    from stableflash.attention.gluon import sass
    summary = sass.cubin_summary(cubin)
    return {key: summary[key] for key in SUMMARY_KEYS}


def streams(cubins: list[bytes]) -> dict[str, dict]:
    """hash → {"count": how many of ``cubins`` are that stream, and its summary}, most frequent first."""
    from stableflash.attention.gluon import sass
    counted, first = collections.Counter(), {}
    for cubin in cubins:
        key = instruction_hash(sass.disassemble(cubin)[0])
        counted[key] += 1
        first.setdefault(key, cubin)
    return {key: {"count": n, **_summary(first[key])} for key, n in counted.most_common()}


def _assembler() -> tuple[str, str]:
    """The ptxas the Gluon launches use for sm_90 and its CUDA release."""
    from stableflash.attention.triton import assembler
    return assembler.ptxas_for(assembler.options())


def assemble(ptx: str, runs: int, no_aslr: bool = False) -> list[bytes]:
    """``ptx`` assembled ``runs`` times for sm_90a with triton's flags (``-lineinfo -v``)."""
    ptxas, _ = _assembler()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        src, obj = Path(tmp, "kernel.ptx"), Path(tmp, "kernel.cubin")
        src.write_text(ptx)
        prefix = ["setarch", os.uname().machine, "-R"] if no_aslr else []
        for _ in range(runs):
            subprocess.run([*prefix, ptxas, "-lineinfo", "-v", "--gpu-name=sm_90a", str(src), "-o", str(obj)],
                           check=True, capture_output=True)
            out.append(obj.read_bytes())
    return out


def route_kernels():
    """(name, compiled kernel) for each kernel the route launches on sm_90 (``sass`` compiles, no GPU)."""
    from stableflash.attention.gluon import sass
    from stableflash.attention.gluon.hopper_backward import atomic_backward_tiles
    for d in (64, 128):
        for causal in (True, False):
            mask = "causal" if causal else "full"
            yield f"forward d{d} {mask}", sass.compile_forward(d, causal)
            tiles = atomic_backward_tiles(d)
            yield f"backward d{d} {mask}", sass.compile_backward(d, causal, tiles)["fused"]
            if d == 64 and causal:
                half = tiles._replace(skip_hidden=True)
                yield "backward d64 causal, half block", sass.compile_backward(d, causal, half)["fused"]


def survey(runs: int, no_aslr: bool) -> dict:
    import triton
    _, release = _assembler()
    kernels = {}
    for name, kernel in route_kernels():
        kernels[name] = streams(assemble(kernel.asm["ptx"], runs, no_aslr))
        print(f"{name:32s} " + "  ".join(f"{h} ×{s['count']} (exp in flight {s['ex2_in_flight']}/{s['ex2']}, "
                                         f"spills {s['stl']}/{s['ldl']})" for h, s in kernels[name].items()),
              flush=True)
    return {"triton": triton.__version__, "ptxas": release, "runs": runs, "aslr_off": no_aslr, "kernels": kernels}


def _call(shape: tuple[int, ...]) -> None:
    """One causal forward and backward through ``flash_attention`` (what ``draw`` runs in each attempt)."""
    import torch

    import stableflash as sf
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sf.flash_attention(q, k, v, causal=True).backward(torch.randn(*shape, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()


def draw(shape: tuple[int, ...], attempts: int, out: Path) -> dict:
    from stableflash.attention.gluon import sass
    drawn: dict[str, dict] = {}
    for i in range(attempts):
        cache = out / f"attempt-{i}"
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
        subprocess.run([sys.executable, __file__, CHILD, ",".join(map(str, shape))], env=env, check=True)
        cubins = sorted(cache.rglob(BACKWARD_CUBIN))
        if len(cubins) != 1:
            raise RuntimeError(f"attempt {i}: expected one {BACKWARD_CUBIN} in {cache}, found {len(cubins)}")
        cubin = cubins[0].read_bytes()
        key = instruction_hash(sass.disassemble(cubin)[0])
        entry = drawn.setdefault(key, {"attempts": [], **_summary(cubin)})
        entry["attempts"].append(str(cache))
        print(f"attempt {i}: {key}", flush=True)
    return {"shape": list(shape), "streams": drawn}


def _shape(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[3]) not in (64, 128):
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected B,H,N,d (positive integers, d 64 or 128)")
    return tuple(int(p) for p in parts)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer ≥ 1")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD]:                           # one of draw's attempts
        _call(_shape(argv[1]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("survey", help="assemble each route kernel's PTX --runs times and count the streams")
    s.add_argument("--runs", type=_positive, default=8, help="assemblies per kernel (default 8)")
    s.add_argument("--no-aslr", action="store_true", help="run ptxas with address-space randomisation off")
    s.add_argument("--json", type=Path, help="also write the result here")
    d = sub.add_parser("draw", help="on an H100/H200: a fresh triton cache per attempt, the backward's stream in each")
    d.add_argument("--shape", type=_shape, required=True, help="B,H,N,d of the causal call")
    d.add_argument("--attempts", type=_positive, default=6, help="fresh caches to draw (default 6)")
    d.add_argument("--out", type=Path, required=True, help="folder of the attempts' caches and streams.json")
    args = ap.parse_args(argv)
    if args.command == "draw":
        import torch
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            ap.error("draw runs the kernels: it needs a CUDA device of compute capability 9.0 (H100/H200)")
    from stableflash.attention.gluon import sass
    if not sass.tools_present():
        ap.error("this triton wheel ships no nvdisasm / cuobjdump, which reading the streams needs")
    if args.command == "survey":
        if args.no_aslr and not shutil.which("setarch"):
            ap.error("--no-aslr needs setarch (util-linux), which this machine lacks")
        result = survey(args.runs, args.no_aslr)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    result = draw(args.shape, args.attempts, args.out)
    (args.out / "streams.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
