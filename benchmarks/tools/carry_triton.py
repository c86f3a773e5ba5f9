"""A triton release the GPU machine does not have, carried to it in parts, to time the kernels under it.

    python benchmarks/tools/carry_triton.py pack [--version 3.9.0] [--python 3.12] [--part-mb 45] [--out DIR]
    python benchmarks/tools/carry_triton.py keep DIR        # on the GPU machine, in each call that carries a part
    python benchmarks/tools/carry_triton.py unpack          # on the GPU machine, once every part is kept

The GPU machine's torch pins its triton, reaches no registry, and takes at most 64 MiB of carried files a
call, while a triton wheel is about 290 MB. ``pack`` (here, with a registry) downloads the release's wheel
for the GPU machine's Python, keeps what compiling and launching the kernels for NVIDIA GPUs needs —
without the AMD backend, the CUPTI libraries, the proton profiler's library and the symbol tables of
``libtriton.so`` (``strip --strip-unneeded``, where ``strip`` exists) — and writes it as one xz-compressed
tar cut into parts of at most ``--part-mb`` MB, with ``parts.json`` (the release, each part's name and the
archive's SHA-256) in the first part's folder: DIR/1/part-00, DIR/1/parts.json, DIR/2/part-01, ... Carry
DIR/N in call N of one warm lease (a machine released between calls loses what was kept) and run
``keep DIR/N`` there; ``unpack`` checks the whole archive against its SHA-256, unpacks it under
/tmp/carried-triton/<release> and prints the environment that runs it (``TRITON_BACKENDS_IN_TREE=1``,
the folder first on ``PYTHONPATH``, its own cache folder), which the same call's commands then use, e.g.

    eval "$(python benchmarks/tools/carry_triton.py unpack)" && python -c "import triton; print(triton.__version__)"

Both ptxas binaries of the wheel are kept (3.9 assembles sm_90 with ``ptxas-blackwell``, CUDA 13.4's; the
other, which ``TRITON_PTXAS_BLACKWELL_PATH`` can name, is CUDA 12.9's): 68.4 MB in all for 3.9.0, two parts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

KEPT = Path("/tmp/carried-triton")
# what the kernels never use, relative to the wheel's root
DROPPED = ("triton/backends/amd", "triton/backends/nvidia/lib/cupti", "triton/backends/nvidia/lib/cupti-blackwell",
           "triton/_C/libproton.so")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tools_executable(root: Path) -> None:
    """Mark the NVIDIA tools (ptxas, nvdisasm, cuobjdump) under ``root`` executable: neither a wheel's zip
    nor tar's "data" filter keeps them so for certain."""
    tools = root / "triton/backends/nvidia/bin"
    if tools.is_dir():
        for tool in tools.iterdir():
            tool.chmod(0o755)


def strip_tree(root: Path) -> list[str]:
    """Remove ``DROPPED`` under ``root`` (a wheel's unpacked files), mark the NVIDIA tools executable
    (a zip keeps no modes) and strip ``libtriton.so``'s symbols where ``strip`` exists. Returns what
    was removed."""
    removed = []
    for rel in DROPPED:
        path = root / rel
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(rel)
        elif path.exists():
            path.unlink()
            removed.append(rel)
    _tools_executable(root)
    lib = root / "triton/_C/libtriton.so"
    if lib.exists() and shutil.which("strip"):
        subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)
    return removed


def write_parts(root: Path, out: Path, release: str, part_bytes: int, preset: int = 6) -> dict:
    """``root``'s files as one xz tar (``preset``: xz's level) cut into parts of at most ``part_bytes``:
    part i in ``out``/(i + 1)/, ``parts.json`` beside the first. Returns what ``parts.json`` holds."""
    if part_bytes < 1:
        raise ValueError(f"part size {part_bytes} bytes is invalid; accepted: at least 1")
    out.mkdir(parents=True, exist_ok=True)
    archive = out / "archive.tar.xz"
    with lzma.open(archive, "wb", preset=preset) as raw, \
            tarfile.open(fileobj=raw, mode="w") as tar:
        for path in sorted(root.iterdir()):
            tar.add(path, arcname=path.name)
    names = []
    with archive.open("rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            folder = out / str(i + 1)
            folder.mkdir(exist_ok=True)
            (folder / f"part-{i:02d}").write_bytes(block)
            names.append(f"part-{i:02d}")
    meta = {"release": release, "parts": names, "sha256": _sha256(archive), "bytes": archive.stat().st_size}
    (out / "1" / "parts.json").write_text(json.dumps(meta, indent=1))
    archive.unlink()
    return meta


def pack(version: str, python: str, part_mb: float, out: Path) -> dict:
    """Download triton ``version``'s manylinux x86_64 wheel for CPython ``python``, strip it
    (``strip_tree``) and write its parts (``write_parts``) under ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}     # a machine's pip cap does not apply here
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", python, "--platform", "manylinux_2_27_x86_64",
                        "--platform", "manylinux_2_28_x86_64", f"triton=={version}", "-d", str(tmp / "wheel")],
                       check=True, env=env)
        wheel, = (tmp / "wheel").glob("triton-*.whl")
        root = tmp / "root"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
        strip_tree(root)
        return write_parts(root, out, version, int(part_mb * 1e6))


def keep(folder: Path, kept: Path = KEPT) -> list[str]:
    """Copy the parts (and ``parts.json``) in ``folder`` to ``kept``/parts. Returns what is kept there."""
    (kept / "parts").mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.name.startswith("part-") or path.name == "parts.json":
            shutil.copy(path, kept / "parts" / path.name)
    return sorted(p.name for p in (kept / "parts").iterdir())


def unpack(kept: Path = KEPT) -> tuple[Path, dict]:
    """Join the kept parts, check the SHA-256 and unpack under ``kept``/<release>. Returns (that folder,
    the environment that runs it). ValueError naming what is missing or does not match."""
    meta_path = kept / "parts" / "parts.json"
    if not meta_path.exists():
        raise ValueError(f"{meta_path} is missing; accepted: the first part's folder kept with `keep`")
    meta = json.loads(meta_path.read_text())
    missing = [name for name in meta["parts"] if not (kept / "parts" / name).exists()]
    if missing:
        raise ValueError(f"parts {missing} of triton {meta['release']} are not kept; keep each part's folder "
                         "in one warm lease")
    site = kept / meta["release"]
    archive = kept / "archive.tar.xz"
    with archive.open("wb") as f:
        for name in meta["parts"]:
            f.write((kept / "parts" / name).read_bytes())
    if _sha256(archive) != meta["sha256"]:
        raise ValueError(f"the joined parts of triton {meta['release']} do not match their SHA-256 "
                         f"{meta['sha256']}; accepted: the parts `pack` wrote, unchanged")
    shutil.rmtree(site, ignore_errors=True)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(site, filter="data")
    archive.unlink()
    _tools_executable(site)
    env = {"TRITON_BACKENDS_IN_TREE": "1", "TRITON_CACHE_DIR": str(kept / f"cache-{meta['release']}"),
           "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")}
    return site, env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="download, strip and cut a triton wheel into parts (needs a registry)")
    p.add_argument("--version", default="3.9.0", help="the triton release (default 3.9.0)")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python, major.minor (default 3.12)")
    p.add_argument("--part-mb", type=float, default=45.0,
                   help="MB per part at most (default 45: with the tracked tree, about 12 MB, under the 64 MiB a call carries)")
    p.add_argument("--out", type=Path, default=Path("scratch/carried-triton"), help="the parts' folder")
    k = sub.add_parser("keep", help="keep the parts in a carried folder under /tmp (on the GPU machine)")
    k.add_argument("folder", type=Path)
    sub.add_parser("unpack", help="join, check and unpack the kept parts; print the environment that runs them")
    args = ap.parse_args(argv)
    if args.command == "pack":
        if args.part_mb <= 0:
            ap.error(f"--part-mb {args.part_mb} is invalid; accepted: a positive number of MB")
        meta = pack(args.version, args.python, args.part_mb, args.out)
        print(f"triton {meta['release']}: {meta['bytes'] / 1e6:.1f} MB in {len(meta['parts'])} parts under {args.out}")
        return 0
    try:
        if args.command == "keep":
            if not args.folder.is_dir():
                ap.error(f"{args.folder} is not a folder; accepted: a carried folder of parts (DIR/N)")
            print("kept:", " ".join(keep(args.folder)), file=sys.stderr)
            return 0
        site, env = unpack()
    except ValueError as e:
        print(f"carry_triton: {e}", file=sys.stderr)
        return 2
    print(f"# triton unpacked in {site}", file=sys.stderr)
    print(" ".join(f"export {key}={value}" for key, value in env.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
