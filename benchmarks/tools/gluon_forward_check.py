"""The Gluon Hopper attention forward: its sm_90a SASS without a GPU, and (on an H100/H200) its accuracy and speed.

    python benchmarks/tools/gluon_forward_check.py [--variants] [--tiles 64x128x3 ...] [--json OUT.json]
    python benchmarks/tools/gluon_forward_check.py --time [--non-causal] [--shapes 32,12,1024,64 ...]
        [--tiles 64x128x3 128x64x3p ...] [--json OUT.json]

Without --time: compiles ``stableflash.attention.gluon``'s forward for compute capability 9.0
(sm_90a) with the triton wheel's own ptxas, as a launch at ``sass.LAUNCH_SHAPE`` compiles it (the code
the training shapes run), for head_dim 64 and 128, causal and not, and reads
each cubin's SASS (``stableflash.attention.gluon.sass``): its instruction count ("SASS"); HGMMA
count; the warpgroup waits by how many products they leave in flight (``WARPGROUP.DEPBAR.LE gsb0,
N``: N ≥ 1 is an asynchronous product past the wait); the softmax exponentials placed while a
product is in flight; TMA loads and stores (UTMALDG, UTMASTG); local-memory spills (STL, LDL);
registers per thread (cuobjdump); dynamic shared memory; USETMAXREG (the warp-specialised register
split). Nothing runs.
--variants adds, per configuration, the kernel with one consumer partition instead of the
default's two ping-pong ones, that without warp specialisation, and the default without the
scheduling fence (the switches a GPU run compares). --tiles adds tiles of one's own choosing,
each BLOCK_MxBLOCK_NxSTAGES, then "p" for ping-pong or "n" for no warp specialisation (e.g.
64x128x3: one consumer warpgroup of 64 rows, 128 keys per block, three ring slots; 128x128x3p: the
head_dim-64 default), compiled beside the default or, with --time, timed as provider
"gluon-BMxBNxS[p|n]".

With --time (a CUDA device of compute capability 9.0): first each provider's O against float64 at
(2, 4, 509, d) on fresh random inputs (‖O − O₆₄‖ / ‖O₆₄‖), then the forward's time
(triton.testing.do_bench, median ms, and TFLOP/s with 4·B·H·N²·d flops, halved under causal) of
the Gluon forward (and its variants), the Triton forward for ``stabilize=True`` ("fa2", δ from
dO·(O+R): the same outputs) and SDPA's cuDNN and flash backends.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gluon_check_cli  # noqa: E402  (this folder's shared command line)

TILES_FORM = ("BLOCK_MxBLOCK_NxSTAGES, then p for ping-pong, P for persistent ping-pong (Pd: the first consumer's "
              "causal diagonal block over its 64 keys) or n for no warp specialisation (the consumers issue the "
              "loads), then rNNN for a register cap, e.g. 64x128x3, 128x128x3p, 128x128x3P, 128x128x2Pd, 64x128x2n, "
              "64x128x2r128")
TILES_PATTERN = re.compile(r"(\d+)x(\d+)x(\d+)(p|Pd?|n)?(?:r(\d+))?")


def parse_tiles(text: str):
    """One --tiles value (``TILES_FORM``) as a ``Tiles`` with the fence; ValueError naming what is
    accepted."""
    from stableflash.attention.gluon.hopper_forward import Tiles
    match = TILES_PATTERN.fullmatch(text)
    if not match:
        raise ValueError(f"expected {TILES_FORM}")
    block_m, block_n, stages, suffix, cap = match.groups()
    suffix = suffix or ""
    tiles = Tiles(int(block_m), int(block_n), int(stages), warp_specialize=suffix != "n",
                  pingpong=suffix[:1] in ("p", "P"), max_registers=int(cap) if cap else None,
                  persistent=suffix[:1] == "P", narrow_diagonal=suffix == "Pd")
    tiles.check()
    return tiles


def tiles_name(t) -> str:
    """The provider name of --tiles' ``t``: gluon-BMxBNxS, then p (ping-pong), P (persistent
    ping-pong; Pd: with the narrow diagonal) or n (no warp specialisation), then rNNN (a register
    cap)."""
    persistent = "Pd" if t.narrow_diagonal else "P"
    suffix = persistent if t.persistent else "p" if t.pingpong else "" if t.warp_specialize else "n"
    cap = f"r{t.max_registers}" if t.max_registers else ""
    return f"gluon-{t.block_m}x{t.block_n}x{t.stages}{suffix}{cap}"


def compile_rows(variants: bool, tiles: list = ()) -> list[dict]:
    from stableflash.attention.gluon import sass
    from stableflash.attention.gluon.hopper_forward import tiles_for
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            base = tiles_for(d, causal)
            chosen = [base]
            if variants:               # the default is ping-pong: one consumer partition, without warp
                single = base.per_block()._replace(pingpong=False)   # specialisation (one partition), without the fence
                chosen += [single, single._replace(warp_specialize=False), base._replace(sched_fence=False)]
            rows += [sass.check(d, causal, t) for t in [*chosen, *tiles]]
    return rows


def print_compile(rows: list[dict]) -> None:
    print(f"triton {triton.__version__}, target sm_90a (compiled, not run)")
    head = ("d", "causal", "tiles", "WS", "fence", "ping-pong", "SASS", "HGMMA", "waits (in flight ≤ N: count)",
            "EX2 in flight", "UTMALDG", "UTMASTG", "STL", "LDL", "regs", "smem B", "USETMAXREG")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        tiles = f"{r['block_m']}×{r['block_n']}×{r['stages']}" + (" narrow" if r["narrow_diagonal"] else "")
        cells = (r["head_dim"], r["causal"], tiles, r["warp_specialize"],
                 r["sched_fence"], r["pingpong"], r["instructions"], r["hgmma"],
                 gluon_check_cli.fmt_waits(r["wait_depths"]),
                 f"{r['ex2_in_flight']}/{r['ex2']}", r["tma_loads"], r["tma_stores"], r["stl"], r["ldl"],
                 r["registers"], r["shared_bytes"], r["setmaxnreg"])
        print("| " + " | ".join(str(c) for c in cells) + " |")


def providers(d: int, causal: bool, tiles: list = ()):
    """name → fn(q, k, v) giving O, for the timing (the Gluon variants, the Triton forward, SDPA)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stableflash.attention.gluon import flash_forward_hopper
    from stableflash.attention.gluon.hopper_forward import tiles_for
    from stableflash.attention.gluon.route import triton_only
    from stableflash.attention.triton.launch import stabilized_config
    from stableflash.attention.triton.op import _forward
    config = stabilized_config(torch.bfloat16)
    base = tiles_for(d, causal)

    def gluon(tiles, residual=True):
        return lambda q, k, v: flash_forward_hopper(q, k, v, causal, tiles=tiles, residual=residual)[0]

    def triton_forward(q, k, v):
        with triton_only():
            return _forward(q, k, v, causal, d ** -0.5, config)[0]

    def sdpa(backend):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return fn

    return {
        "gluon": gluon(base),
        "gluon-per-block": gluon(base.per_block()),
        "gluon-single": gluon(base.per_block()._replace(pingpong=False)),
        "gluon-no-ws": gluon(base.per_block()._replace(pingpong=False, warp_specialize=False)),
        "gluon-no-fence": gluon(base._replace(sched_fence=False)),
        "gluon-no-residual": gluon(base, residual=False),      # stabilize=False: O and L, no R stored
        **{tiles_name(t): gluon(t) for t in tiles},
        "triton-stabilized": triton_forward,
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }


def time_rows(shapes: list[tuple[int, ...]], causal: bool, tiles: list = ()) -> list[dict]:
    import torch
    from triton.testing import do_bench

    from stableflash.attention import reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for d in sorted({s[3] for s in shapes}):
        q, k, v = (torch.randn(2, 4, 509, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
        ref = reference.attention(q, k, v, causal=causal)
        for name, fn in providers(d, causal, tiles).items():
            err = ((fn(q, k, v).double() - ref).norm() / ref.norm()).item()
            rows.append({"kind": "accuracy", "provider": name, "head_dim": d, "causal": causal, "rel_err_O": err})
    for B, H, N, d in shapes:
        q, k, v = (torch.randn(B, H, N, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0)
        for name, fn in providers(d, causal, tiles).items():
            with torch.no_grad():
                ms = do_bench(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v))
            rows.append({"kind": "time", "provider": name, "shape": [B, H, N, d], "causal": causal, "ms": ms,
                         "tflops": flops / ms * 1e-9})
    return rows


def main(argv=None) -> int:
    return gluon_check_cli.main(
        argv, doc=__doc__, kernel="forward", compile_rows=compile_rows, print_compile=print_compile,
        variants_help="also compile with one consumer partition instead of ping-pong, that without warp "
                      "specialisation, and without the fence",
        time_rows=lambda shapes, causal, variants, tiles: time_rows(shapes, causal, tiles), time_label="time",
        width=22, tiles_type=parse_tiles,
        tiles_help=f"more tiles to compile or time: {TILES_FORM}")


if __name__ == "__main__":
    raise SystemExit(main())
