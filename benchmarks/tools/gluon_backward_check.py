"""The Gluon Hopper attention backward: its sm_90a SASS without a GPU, and (on an H100/H200) its accuracy and speed.

    python benchmarks/tools/gluon_backward_check.py [--variants] [--tiles SPEC ...] [--json OUT.json]
    python benchmarks/tools/gluon_backward_check.py --time [--variants] [--tiles SPEC ...] [--non-causal] [--shapes 32,12,1024,64 ...] [--json OUT.json]

Without --time: compiles ``stableflash.attention.gluon``'s backward — the dK/dV kernel and the dQ
kernel, and the one kernel adding dQ up by TMA reduce-adds with the route's tiles
(``atomic_backward_tiles``, "fused") — for compute capability 9.0 (sm_90a) with the triton wheel's own ptxas, as a
launch at ``sass.LAUNCH_SHAPE`` compiles them (the code the training shapes run), for head_dim 64 and 128, causal and
not, and reads each cubin's SASS (``stableflash.attention.gluon.sass``):
HGMMA count; the warpgroup waits by how many products they leave in flight
(``WARPGROUP.DEPBAR.LE gsb0, N``: N ≥ 1 is an asynchronous product past the wait); the
exponentials placed while a product is in flight; TMA loads, stores and reduce-adds (UTMALDG,
UTMASTG, UTMAREDG); local-memory spills (STL, LDL); registers per thread (cuobjdump); dynamic
shared memory; USETMAXREG (the warp-specialised register split). Nothing runs. --variants adds
other tiles (``VARIANTS``).

With --time (a CUDA device of compute capability 9.0): first each provider's dQ, dK, dV against
float64 at (2, 4, 509, d) on fresh random inputs (‖x − x₆₄‖ / ‖x₆₄‖), then the backward's time
alone (triton.testing.do_bench, median ms; the forward runs once beforehand) and TFLOP/s counted
as 10·B·H·N²·d (the five products of the backward, 2.5× the forward's 4·B·H·N²·d), halved under
causal — for the Gluon backward (δ from the Triton δ kernel, then the dK/dV and dQ kernels), the
one adding dQ up by TMA reduce-adds with the route's tiles ("atomic dQ"; with --variants also other
tiles), the Triton backward (``triton.op._backward_impl`` for
``stabilize=True``, autotuned: the same δ and arithmetic) and SDPA's cuDNN and flash backends
(``torch.autograd.grad`` of their output with a fixed dO, the graph kept between calls). The
Gluon backward's dQ kernel recomputes S and dP, so it does 7 products where the count says 5 (the
"atomic dQ" variants do 5).
"""
from __future__ import annotations

import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gluon_check_cli  # noqa: E402  (this folder's shared command line)

VARIANTS = {64: [(128, 64, 2, 128, 64, 2), (128, 64, 3, 128, 128, 2), (128, 128, 2, 128, 128, 2),
                 (128, 64, 2, 128, 128, 2, True), (128, 64, 3, 128, 128, 2, True),
                 (64, 64, 3, 128, 128, 2, True, 128)],
            128: [(128, 64, 2, 128, 128, 2, True), (128, 32, 3, 128, 128, 2, True), (128, 32, 2, 128, 128, 2, True),
                  (128, 16, 4, 128, 128, 2, True), (64, 32, 2, 128, 128, 2, True, 128),
                  (64, 32, 3, 128, 128, 2, True, 128)]}


TILES_FORM = ("BLOCK_NxBLOCK_MxSTAGES with a for atomic dQ (its dQ fields unused; as for atomic dQ with "
              "skip_hidden) or BLOCK_NxBLOCK_MxSTAGES/DQ_BLOCK_MxDQ_BLOCK_NxDQ_STAGES, then rNNN for a register cap, "
              "e.g. 128x64x3a, 128x64x3as or 128x64x2/128x64x2")


def parse_tiles(text: str):
    """One --tiles value (``TILES_FORM``) as ``BackwardTiles``; ValueError naming what is accepted."""
    from stableflash.attention.gluon.hopper_backward import BackwardTiles
    body, sep, cap = text.partition("r")
    skip = body.endswith("as")
    body = body[:-1] if skip else body
    atomic = body.endswith("a")
    parts = [p.split("x") for p in body.rstrip("a").split("/")]
    dq = parts[1] if len(parts) == 2 and not atomic else ["128", "128", "2"] if len(parts) == 1 else []
    fields = parts[0] + dq
    if len(fields) != 6 or not all(f.isdigit() for f in fields) or (sep and not cap.isdigit()):
        raise ValueError(f"expected {TILES_FORM}")
    tiles = BackwardTiles(*(int(f) for f in fields), atomic_dq=atomic, max_registers=int(cap) if cap else None,
                          skip_hidden=skip)
    tiles.check()
    return tiles


def _valid_at(t, d: int) -> bool:
    try:
        t.check(d)
    except ValueError:
        return False
    return True


def _tiles(d: int, causal: bool, variants: bool, tiles: list = ()) -> list:
    """The two kernels' default tiles, the atomic-dQ kernel's (``atomic_backward_tiles``), with
    ``variants`` the other tiles of ``VARIANTS``, then those of ``tiles`` (--tiles) that head_dim d
    takes (an atomic-dQ query block of 16 or 32 rows, for one, has a schedule at 128 only)."""
    from stableflash.attention.gluon.hopper_backward import BackwardTiles, atomic_backward_tiles, backward_tiles_for
    base = [backward_tiles_for(d, causal), atomic_backward_tiles(d)]
    more = [BackwardTiles(*t) for t in VARIANTS[d]] if variants else []
    for t in more + [t for t in tiles if _valid_at(t, d)]:
        if t not in base:
            base.append(t)
    return base


def compile_rows(variants: bool, tiles: list = ()) -> list[dict]:
    from stableflash.attention.gluon import sass
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for t in _tiles(d, causal, variants, tiles):
                rows += sass.check_backward(d, causal, t)
    return rows


def _fmt_tiles(r: dict) -> str:
    if r.get("atomic_dq"):
        return f"dkdv {r['block_n']}×{r['block_m']}×{r['stages']}, dq atomic"
    return (f"dkdv {r['block_n']}×{r['block_m']}×{r['stages']}, dq {r['dq_block_m']}×{r['dq_block_n']}×"
            f"{r['dq_stages']}")


def print_compile(rows: list[dict]) -> None:
    print(f"triton {triton.__version__}, target sm_90a (compiled, not run)")
    head = ("kernel", "d", "causal", "tiles", "HGMMA", "waits (in flight ≤ N: count)", "EX2 in flight", "UTMALDG",
            "UTMASTG", "UTMAREDG", "STL", "LDL", "regs", "smem B", "USETMAXREG")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = (r["kernel"], r["head_dim"], r["causal"], _fmt_tiles(r), r["hgmma"], gluon_check_cli.fmt_waits(r["wait_depths"]),
                 f"{r['ex2_in_flight']}/{r['ex2']}", r["tma_loads"], r["tma_stores"], r["tma_reduces"], r["stl"],
                 r["ldl"], r["registers"], r["shared_bytes"], r["setmaxnreg"])
        print("| " + " | ".join(str(c) for c in cells) + " |")


def _providers(d: int, causal: bool, variants: bool, extra: list = ()):
    """name → setup(q, k, v, do) giving a closure that runs the backward alone and returns (dQ, dK, dV)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stableflash.attention.gluon import flash_backward_hopper, flash_forward_hopper
    from stableflash.attention.gluon.route import triton_only
    from stableflash.attention.triton.launch import stabilized_config
    from stableflash.attention.triton.op import _backward_impl, _forward
    config = stabilized_config(torch.bfloat16)

    def gluon(tiles):
        def setup(q, k, v, do):
            o, lse, r = flash_forward_hopper(q, k, v, causal)
            return lambda: flash_backward_hopper(do, q, k, v, o, r, lse, causal, tiles=tiles)
        return setup

    def triton_setup(q, k, v, do):
        with triton_only():
            o, lse, r = _forward(q, k, v, causal, d ** -0.5, config)

        def backward():
            with triton_only():
                return _backward_impl(do, q, k, v, o, r, lse, causal, d ** -0.5, config)
        return backward

    def sdpa(backend):
        def setup(q, k, v, do):
            qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)

            def run():
                with sdpa_kernel(backend):
                    return torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
            return run
        return setup

    tiles = _tiles(d, causal, variants, extra)
    out = {"gluon": gluon(tiles[0])}
    for t in tiles[1:]:
        cap = f" r{t.max_registers}" if t.max_registers else ""
        skip = " skip-hidden" if t.skip_hidden else ""
        name = (f"gluon {t.block_n}×{t.block_m}×{t.stages}{cap} atomic dQ{skip}" if t.atomic_dq else
                f"gluon {t.block_n}×{t.block_m}×{t.stages}/{t.dq_block_m}×{t.dq_block_n}×{t.dq_stages}")
        out[name] = gluon(t)
    out.update({"triton-stabilized": triton_setup, "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION)})
    return out


def time_rows(shapes: list[tuple[int, ...]], causal: bool, variants: bool, tiles: list = ()) -> list[dict]:
    import torch
    from triton.testing import do_bench

    from stableflash.attention import reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for d in sorted({s[3] for s in shapes}):
        q, k, v, do = (torch.randn(2, 4, 509, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4))
        _, *refs = reference.forward_backward(q, k, v, do, causal=causal)
        for name, setup in _providers(d, causal, variants, tiles).items():
            got = setup(q, k, v, do)()
            errs = {f"rel_err_{n}": ((x.double() - ref).norm() / ref.norm()).item()
                    for n, x, ref in zip(("dQ", "dK", "dV"), got, refs)}
            rows.append({"kind": "accuracy", "provider": name, "head_dim": d, "causal": causal, **errs})
    for B, H, N, d in shapes:
        q, k, v, do = (torch.randn(B, H, N, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4))
        flops = 10 * B * H * N * N * d * (0.5 if causal else 1.0)
        for name, setup in _providers(d, causal, variants, tiles).items():
            run = setup(q, k, v, do)
            run()                                     # compile, autotune
            ms = do_bench(run)
            rows.append({"kind": "time", "provider": name, "shape": [B, H, N, d], "causal": causal, "ms": ms,
                         "tflops": flops / ms * 1e-9})
            del run
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    return gluon_check_cli.main(argv, doc=__doc__, kernel="backward", compile_rows=compile_rows,
                                print_compile=print_compile, variants_help="also compile (or time) other tiles",
                                time_rows=time_rows, time_label="backward", width=34, tiles_type=parse_tiles,
                                tiles_help=f"more tiles to compile or time: {TILES_FORM}")


if __name__ == "__main__":
    raise SystemExit(main())
