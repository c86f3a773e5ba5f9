"""A stableflash CLI command (`bench train`, `bench attention`, ...), then the Triton tuners' picks and their
candidates' timings in that process; ``--add`` appends candidate tiles to a tuner's list first.

    python benchmarks/tools/train_tuner_picks.py bench train --attention sdpa --attention triton --out F.json
    python benchmarks/tools/train_tuner_picks.py --add dkdv=32x64x4x3r128 --add fwd=64x64x4x2r96 \
        bench attention --shape 16,12,1024,64 --modes fwd+bwd --timing graph --layout bnhd

Prints the command's output, then two lines: ``CHOICES`` (``op.tuned_choices()``: each tuner's pick per
key) and ``TIMINGS`` (``op.tuner_timings``: median, 20th and 80th percentile ms of every candidate at
the tuner's last tuning), each as JSON. Triton tunes anew in every process; under torch.compile the
forward and backward are tuned while the step is traced, so these are the tiles that process's step ran.

``--add KERNEL=BMxBNxWARPSxSTAGES[rREGS]`` (KERNEL one of fwd, dkdv, dq; ``rREGS`` caps the registers a
thread, triton's ``maxnreg``): a forward tile goes into both forward tuners' lists (pointer loads), so
the tuner picks it whether or not the call may read through tensor descriptors.
"""
import json
import re
import sys

from stableflash.cli import main as cli_main

TILE = re.compile(r"^(fwd|dkdv|dq)=(\d+)x(\d+)x(\d+)x(\d+)(?:r(\d+))?$")


def parse_add(text: str) -> tuple[str, dict]:
    """("fwd" | "dkdv" | "dq", the tile's fields) of an ``--add`` value; ValueError naming it otherwise."""
    m = TILE.match(text)
    if not m:
        raise ValueError(f"--add {text!r}: expected KERNEL=BMxBNxWARPSxSTAGES[rREGS] with KERNEL one of fwd, "
                         "dkdv, dq (e.g. dkdv=32x64x4x3r128)")
    kernel, bm, bn, warps, stages, regs = m.groups()
    return kernel, dict(bm=int(bm), bn=int(bn), warps=int(warps), stages=int(stages),
                        maxnreg=int(regs) if regs else None)


def add_candidates(specs: list[str]) -> None:
    from stableflash.attention.triton import op
    for kernel, t in map(parse_add, specs):
        args = (t["bm"], t["bn"], t["warps"], t["stages"], t["maxnreg"])
        if kernel == "fwd":
            op.TUNERS["fwd"].configs.append(op._cfg(*args))
            op.TUNERS["fwd_tma"].configs.append(op._cfg(*args, TMA=False))
        else:
            op.TUNERS[kernel].configs.append(op._cfg(*args))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    adds = []
    while argv[:1] == ["--add"]:
        if len(argv) < 2:
            raise SystemExit("--add needs a value: KERNEL=BMxBNxWARPSxSTAGES[rREGS]")
        adds.append(argv[1])
        argv = argv[2:]
    try:
        add_candidates(adds)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    rc = cli_main(argv)
    from stableflash.attention.triton import op
    print("CHOICES", json.dumps(op.tuned_choices()))
    print("TIMINGS", json.dumps(op.tuner_timings(["fwd", "fwd_tma", "dkdv", "dq"])))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
