"""Which instruction streams ptxas makes from the route's Gluon kernels, and a triton cache holding each.

    python benchmarks/tools/ptxas_streams.py survey [--runs 8] [--no-aslr] [--json FILE]     # no GPU needed
    python benchmarks/tools/ptxas_streams.py draw --shape 32,12,1024,64 [--attempts 6] --out DIR   # H100/H200
    python benchmarks/tools/ptxas_streams.py split CACHE [--runs 8] --out DIR                      # no GPU needed

``survey`` compiles each kernel the route launches (the Gluon forward and the backward that adds dQ up, head_dim
64 and 128, causal or not, and the head_dim-64 causal backward with its half diagonal block) once to PTX for
sm_90a as a launch at ``sass.LAUNCH_SHAPE`` compiles it (the PTX of the kernels such a launch runs), assembles that PTX ``--runs`` times with the ptxas its launches use and triton's flags, and hashes each
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

``split`` gets every stream without relying on chance: it re-assembles the PTX that a triton cache (one of
``draw``'s attempts, or any cache a run on an H100/H200 filled) keeps beside each backward kernel's cubin,
``--runs`` times with the ptxas those launches use and triton's flags, and writes ``DIR/stream-K``: a copy of the
cache with each kernel's K-th stream in place of its cubin (``stream-0`` holds the streams triton drew; a kernel
with fewer streams than another keeps its last in the later copies). Triton loads a cached cubin as it is, so a
benchmark run with ``TRITON_CACHE_DIR=DIR/stream-K`` times stream K. It needs no GPU, only the cache.

    python benchmarks/tools/ptxas_streams.py split CACHE [--runs 8] [--jobs N] --out DIR

All three write JSON beside the printed table (``survey --json``; ``draw`` and ``split`` write
``DIR/streams.json``).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
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


def cubin_hash(cubin: bytes) -> str:
    """``instruction_hash`` of a cubin's SASS listing."""
    from stableflash.attention.gluon import sass
    return instruction_hash(sass.disassemble(cubin)[0])


def _grouped(cubins: list[bytes]) -> tuple[collections.Counter, dict[str, bytes]]:
    """How many of ``cubins`` each stream has, and each stream's first cubin."""
    counted, first = collections.Counter(), {}
    for cubin in cubins:
        key = cubin_hash(cubin)
        counted[key] += 1
        first.setdefault(key, cubin)
    return counted, first


def streams(cubins: list[bytes]) -> dict[str, dict]:
    """hash → {"count": how many of ``cubins`` are that stream, and its summary}, most frequent first."""
    counted, first = _grouped(cubins)
    return {key: {"count": n, **_summary(first[key])} for key, n in counted.most_common()}


def _assembler() -> tuple[str, str]:
    """The ptxas the Gluon launches use for sm_90 and its CUDA release."""
    from stableflash.attention.triton import assembler
    return assembler.ptxas_for(assembler.options())


def assemble(ptx: str, runs: int, no_aslr: bool = False, jobs: int = 1) -> list[bytes]:
    """``ptx`` assembled ``runs`` times for sm_90a with triton's flags (``-lineinfo -v``), ``jobs`` at a time."""
    ptxas, _ = _assembler()
    prefix = ["setarch", os.uname().machine, "-R"] if no_aslr else []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "kernel.ptx")
        src.write_text(ptx)

        def one(i: int) -> bytes:
            obj = Path(tmp, f"kernel-{i}.cubin")
            subprocess.run([*prefix, ptxas, "-lineinfo", "-v", "--gpu-name=sm_90a", str(src), "-o", str(obj)],
                           check=True, capture_output=True)
            return obj.read_bytes()

        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, range(runs)))


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
    drawn: dict[str, dict] = {}
    for i in range(attempts):
        cache = out / f"attempt-{i}"
        env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
        subprocess.run([sys.executable, __file__, CHILD, ",".join(map(str, shape))], env=env, check=True)
        cubins = sorted(cache.rglob(BACKWARD_CUBIN))
        if len(cubins) != 1:
            raise RuntimeError(f"attempt {i}: expected one {BACKWARD_CUBIN} in {cache}, found {len(cubins)}")
        cubin = cubins[0].read_bytes()
        key = cubin_hash(cubin)
        entry = drawn.setdefault(key, {"attempts": [], **_summary(cubin)})
        entry["attempts"].append(str(cache))
        print(f"attempt {i}: {key}", flush=True)
    return {"shape": list(shape), "streams": drawn}


def split(cache: Path, runs: int, jobs: int, out: Path) -> dict:
    """Every stream of each backward kernel in ``cache``, each in a copy of it (the module's docstring)."""
    folders = sorted(c.parent for c in cache.rglob(BACKWARD_CUBIN))
    if not folders:
        raise SystemExit(f"split: no {BACKWARD_CUBIN} in {cache}: run the kernels with TRITON_CACHE_DIR={cache} first")
    kernels = {}
    for folder in folders:
        ptx = folder / BACKWARD_CUBIN.replace(".cubin", ".ptx")
        if not ptx.is_file():
            raise SystemExit(f"split: {folder} holds no {ptx.name} beside its cubin, which re-assembling needs")
        drawn = (folder / BACKWARD_CUBIN).read_bytes()
        counted, first = _grouped(assemble(ptx.read_text(), runs, jobs=jobs))
        key = cubin_hash(drawn)
        first[key] = drawn                                    # the drawn stream first, as triton kept it
        order = [key] + [k for k, _ in counted.most_common() if k != key]
        kernels[folder] = [(k, counted[k], first[k]) for k in order]
    copies = max(len(found) for found in kernels.values())
    result = {"cache": str(cache), "runs": runs, "copies": [str(out / f"stream-{k}") for k in range(copies)],
              "kernels": {}}
    for k in range(copies):
        copy = out / f"stream-{k}"
        if copy.exists():
            shutil.rmtree(copy)
        shutil.copytree(cache, copy)
        for folder, found in kernels.items():
            (copy / folder.relative_to(cache) / BACKWARD_CUBIN).write_bytes(found[min(k, len(found) - 1)][2])
    for folder, found in kernels.items():
        name = str(folder.relative_to(cache))
        result["kernels"][name] = {key: {"runs": n, "drawn": i == 0,
                                         "copies": [k for k in range(copies) if min(k, len(found) - 1) == i],
                                         **_summary(cubin)}
                                   for i, (key, n, cubin) in enumerate(found)}
        print(f"{name}: " + "  ".join(f"{key} ×{n}{' (drawn)' if i == 0 else ''} in stream-"
                                      f"{result['kernels'][name][key]['copies']}" for i, (key, n, _) in
                                      enumerate(found)), flush=True)
    return result


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
    p = sub.add_parser("split", help="re-assemble each backward kernel of a triton cache; one copy per stream")
    p.add_argument("cache", type=Path, help="a triton cache holding the backward kernels (TRITON_CACHE_DIR of a run)")
    p.add_argument("--runs", type=_positive, default=8, help="assemblies per kernel (default 8)")
    p.add_argument("--jobs", type=_positive, default=os.cpu_count() or 1, help="assemblies at a time (default: cores)")
    p.add_argument("--out", type=Path, required=True, help="folder of the copies and streams.json")
    args = ap.parse_args(argv)
    if args.command == "split" and not args.cache.is_dir():
        ap.error(f"cache {str(args.cache)!r} is not a folder; accepted: a triton cache folder (TRITON_CACHE_DIR)")
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
    if args.command == "split":
        result = split(args.cache, args.runs, args.jobs, args.out)
    else:
        result = draw(args.shape, args.attempts, args.out)
    (args.out / "streams.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
