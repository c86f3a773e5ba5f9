"""The Gluon Hopper backward (``stableflash.attention.gluon.flash_backward_hopper``).

Without a GPU: the launcher's argument errors; both kernels (dK/dV and dQ) compile for sm_90a with
the triton wheel's ptxas at head_dim 64 and 128, causal and not, and their SASS holds the expected
number of asynchronous warpgroup products, waits that leave a product in flight (with the
exponentials of Pᵀ placed while dPᵀ computes in the dK/dV kernel), TMA loads and stores, the
warp-specialised register split and no spills; the launcher's arguments (host TMA descriptors)
compile through triton's runtime. The compiles run in two
fresh processes side by side (``sass.offline_backward_checks``).

On an H100/H200 (compute capability 9.0; skipped elsewhere): dQ, dK, dV against float64 on fresh
random inputs and on inputs whose keys repeat every 16 positions (tied row maxima), at head_dim 64
and 128, causal and not, sequence lengths that are not multiples of the blocks, grouped-query
heads, fewer and more keys than queries. O, L and R come from the Gluon forward; the Triton
backward (``triton.op._backward_impl`` for ``stabilize=True``: δ from dO·(O + R)) gets the same.
Tolerance: each gradient's error ‖x − x₆₄‖ / ‖x₆₄‖ is at most 1.25× the Triton backward's (the same
arithmetic summed in another order; the bound the forward's tests use) plus 1e-4: a tenth of the
error that rounding a gradient to bf16 alone leaves (≈ 2⁻⁹/√3 ≈ 1.1e-3), which both carry, so that
the bound never asks for more than the last bits of bf16 can give where the Triton error happens
to be small.
"""
import math

import pytest
import torch

from stableflash.attention import gluon as sg
# the forward's cases and markers
from tests.attention.test_gluon_hopper import CASES, against_float64, needs_gluon, on_hopper
from tests.attention.test_triton import expanded_reference


def test_unavailable_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sg, "unavailable_reason", lambda: "triton 3.1 has no triton.experimental.gluon")
    q = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="flash_backward_hopper is not available: triton 3.1 has no"):
        sg.flash_backward_hopper(q, q, q, q, q, None, torch.zeros(1, 1, 8), True)


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _args(**changes):
    """(do, q, k, v, o, residual, lse, causal) of a valid call on the CPU, with some replaced."""
    args = dict(do=_bf16(1, 2, 8, 64), q=_bf16(1, 2, 8, 64), k=_bf16(1, 2, 8, 64), v=_bf16(1, 2, 8, 64),
                o=_bf16(1, 2, 8, 64), residual=_bf16(1, 2, 8, 64), lse=torch.zeros(1, 2, 8), causal=True)
    args.update(changes)
    return tuple(args.values())


@needs_gluon
@pytest.mark.parametrize("args, error, match", [
    (_args(do=_bf16(1, 2, 9, 64)), ValueError, r"do of shape \(1, 2, 9, 64\) is invalid; accepted: q's shape"),
    (_args(do=_bf16(2, 8, 64)), ValueError, r"do of shape \(2, 8, 64\) is invalid; accepted: 4 dimensions"),
    (_args(do=_bf16(1, 2, 8, 64).float()), TypeError, r"do of dtype torch.float32 is invalid; accepted: torch.bf"),
    (_args(do=_bf16(1, 2, 64, 8).transpose(2, 3)), ValueError,
     r"do with strides \(1024, 512, 1, 8\) is invalid; accepted: the last dimension contiguous"),
    (_args(o=[0.0]), TypeError, r"o of type list is invalid; accepted: a torch.Tensor"),
    (_args(o=_bf16(1, 2, 8, 64).half()), TypeError, r"o of dtype torch.float16 is invalid"),
    (_args(lse=torch.zeros(1, 2, 9)), ValueError, r"lse of shape \(1, 2, 9\) is invalid; accepted: q's \(B, H, N_q\)"),
    (_args(lse=torch.zeros(1, 2, 8, dtype=torch.float64)), TypeError,
     r"lse of dtype torch.float64 is invalid; accepted: torch.float32"),
    (_args(residual=_bf16(1, 2, 8, 32)), ValueError, r"residual of shape \(1, 2, 8, 32\) is invalid"),
    (_args(residual=1.0), TypeError, r"residual of type float is invalid"),
    (_args(q=_bf16(1, 2, 8, 96), k=_bf16(1, 2, 8, 96), v=_bf16(1, 2, 8, 96), do=_bf16(1, 2, 8, 96),
           o=_bf16(1, 2, 8, 96), residual=None), ValueError, r"head_dim=96 is invalid; accepted: one of \(64, 128\)"),
    (_args(k=_bf16(1, 3, 8, 64), v=_bf16(1, 3, 8, 64)), ValueError, r"q heads \(2\) must be a multiple of k/v heads"),
    (_args(causal=1), TypeError, r"causal=1 is invalid; accepted: True or False"),
    (_args(), ValueError, r"q on device cpu is invalid; accepted: a CUDA device of compute capability 9.0"),
])
def test_argument_errors_name_the_argument_and_what_is_accepted(args, error, match):
    if torch.cuda.is_available() and "device cpu" not in match:
        args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(error, match=match):
        sg.flash_backward_hopper(*args)


@needs_gluon
def test_tiles_the_kernels_have_no_schedule_for_are_refused():
    from stableflash.attention.gluon.hopper_backward import BackwardTiles, backward_tiles_for
    for d in (64, 128):
        backward_tiles_for(d, True).check()
    for bad in (BackwardTiles(192, 64, 2, 128, 64, 2), BackwardTiles(128, 48, 2, 128, 64, 2),
                BackwardTiles(128, 64, 1, 128, 64, 2), BackwardTiles(128, 64, 2, 128, 256, 2)):
        with pytest.raises(ValueError, match="block_n and dq_block_m 64 or 128"):
            bad.check()


# the two-kernel form's sm_90a compile checks: where the route runs it (head_dim 128, in
# deterministic mode), causal (its three loops); every configuration is two more compiles
CONFIGS = [(128, True)]


def test_atomic_dq_tiles():
    """The route's tiles for the backward adding dQ up by TMA reduce-adds: two consumer warpgroups over
    128 keys, splitting each block's dQ share between them — at head_dim 64 over 128-row query blocks
    (by rows), at 128 over 64-row blocks (by columns); a query block the head_dim's share cannot take is
    refused with it, and at 128 64-row blocks need both warpgroups. Where the dQ buffer is dQᵀ:
    narrower blocks at 128. A register cap is checked where given."""
    from stableflash.attention.gluon.hopper_backward import atomic_backward_tiles
    t = atomic_backward_tiles(64)
    t.check(64)
    assert t.atomic_dq and (t.block_n, t.block_m, t.stages, t.max_registers) == (128, 128, 2, None)
    assert t.split_dq(64) and not t.split_dq(128) and not t._replace(block_n=64).split_dq(64)
    from stableflash.attention.triton import assembler
    asked = {"num_warps": 4, "enable_fp_fusion": True, **assembler.options()}   # the ptxas chosen, where one is
    assert t.options == asked
    assert t._replace(max_registers=128).options == {**asked, "maxnreg": 128}
    for bad in (63, 256, 128.0, True, "128"):
        with pytest.raises(ValueError, match="max_registers None or an int from 64 to 255"):
            t._replace(max_registers=bad).check()
    from stableflash.attention.gluon.hopper_backward import HALF_SKIP_MAX_KEYS, route_backward_tiles
    assert route_backward_tiles(64, HALF_SKIP_MAX_KEYS - 1) == t._replace(skip_hidden=True)
    assert route_backward_tiles(64, HALF_SKIP_MAX_KEYS) == t and not t.skip_hidden
    assert route_backward_tiles(128, 1024) == route_backward_tiles(128, 8192) == atomic_backward_tiles(128)
    wide = atomic_backward_tiles(128)
    wide.check(128)
    assert wide.atomic_dq and (wide.block_n, wide.block_m, wide.stages, wide.max_registers) == (128, 64, 3, None)
    assert wide.split_dq(128) and not wide.split_dq(64)
    assert (wide.dq_tile(128), wide.dq_transposed(128), t.dq_tile(64), t.dq_transposed(64)) == ((64, 64), False,
                                                                                                  (64, 64), False)
    one = t._replace(block_n=64, block_m=64, stages=3, max_registers=128)    # one consumer: its whole share
    one.check(64)
    assert not one.split_dq(64) and one.dq_tile(64) == (64, 64) and t._replace(block_n=64).dq_tile(64) == (128, 64)
    narrow = wide._replace(block_m=32, stages=3)
    narrow.check(128)
    assert narrow.dq_tile(128) == (128, 32) and narrow.dq_transposed(128)
    with pytest.raises(ValueError, match="64 there with block_n 128"):
        wide._replace(block_n=64).check(128)
    with pytest.raises(ValueError, match="head_dim 96 is invalid for the backward with atomic dQ; accepted: 64 or 128"):
        atomic_backward_tiles(96)
    for tiles, d in ((narrow, 64), (t._replace(block_m=128), 128)):
        with pytest.raises(ValueError, match=f"at head_dim {d} is invalid; .*with atomic_dq: block_m 64 or 128 at "
                                             "head_dim 64, 16, 32 or 64 at head_dim 128"):
            tiles.check(d)


@needs_gluon
def test_l_and_delta_descriptors_keep_their_rows_aligned_for_tma():
    """``launch.vector_descriptor``: L or δ (B, H, N_q) fp32 as (B·H, N_q) rows, blocks of (1, block) —
    the tensor itself where N_q is a multiple of 4 and the base 16-byte aligned, otherwise a copy in
    rows padded to a multiple of 4 entries holding the same values; ``BackwardTiles.vector_block``:
    block_m, at least 32 (ring slots of 128 bytes)."""
    from stableflash.attention.gluon.hopper_backward import BackwardTiles, atomic_backward_tiles
    from stableflash.attention.gluon.launch import vector_descriptor
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(2, 3, 8, generator=gen)
    d = vector_descriptor(t, 64)
    assert d.base.data_ptr() == t.data_ptr() and (d.shape, d.strides, d.block_shape) == ([6, 8], [8, 1], [1, 64])
    for odd in (torch.randn(2, 3, 509, generator=gen), torch.randn(49, generator=gen)[1:].view(2, 3, 8)):
        d = vector_descriptor(odd, 32)
        n = odd.shape[2]
        assert d.shape == [6, n] and d.strides == [-(-n // 4) * 4, 1] and d.base.data_ptr() % 16 == 0, d
        assert d.base.data_ptr() != odd.data_ptr() and torch.equal(d.base, odd.reshape(6, n))
    assert BackwardTiles(64, 16, 4, 64, 32, 3).vector_block == 32
    assert (atomic_backward_tiles(64).vector_block, atomic_backward_tiles(128).vector_block) == (128, 64)


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "dq-transposed"])
def test_dq_scaling_kernel_writes_strided_bf16(transposed):
    """``scale_dq_kernel`` (Triton; the interpreter runs it without a GPU): dQ = bf16(sums · scale), rounded as
    torch rounds, into a (B, N, H, d) buffer seen as (B, H, N, d), the rows beside it untouched; the sums
    contiguous, or (``dq_buffer`` for transposed tiles) the transpose of a (B, H, d, N') tensor with N' > N."""
    from stableflash.attention.gluon.launch_backward import dq_buffer, scale_dq_kernel
    from stableflash.attention.triton.op import interpreting
    device = "cpu" if interpreting() else "cuda"
    gen = torch.Generator().manual_seed(0)
    B, H, N, d = 2, 3, 37, 128 if transposed else 64
    sums = dq_buffer(torch.empty(B, H, N, d, device=device), transposed)
    assert sums.shape == (B, H, N, d) and sums.dtype == torch.float32
    assert sums.stride() == ((H * d * 40, d * 40, 1, 40) if transposed else (H * N * d, N * d, d, 1))
    sums.copy_(torch.randn(B, H, N, d, generator=gen))
    out = torch.full((B, N + 1, H, d), 7.0, dtype=torch.bfloat16, device=device)
    dq = out[:, :N].transpose(1, 2)
    rows = B * H * N
    scale_dq_kernel[(math.ceil(rows / 64),)](sums, dq, rows, H, N, *sums.stride(), *dq.stride()[:3], 0.125,
                                             HEAD_DIM=d, BLOCK_R=64, SRC_T=transposed, INTERP=interpreting())
    assert torch.equal(dq, (sums * 0.125).to(torch.bfloat16))
    assert (out[:, N] == 7.0).all()


@pytest.mark.parametrize("d", [64, 128], ids=["rows", "dq-transposed"])
def test_delta_kernel_clears_the_dq_buffer(d):
    """The δ kernel (Triton; the interpreter runs it without a GPU) given the dQ buffer (``dq_buffer``,
    uninitialised: NaN here) zeroes every row of it while it computes δ = rowsum(dO ∘ (O + R)) — as
    ``_delta`` calls it before the kernel adding dQ up; N_q not a multiple of its 64-row blocks."""
    from stableflash.attention.gluon.launch_backward import _delta, dq_buffer
    from stableflash.attention.triton.op import interpreting
    device = "cpu" if interpreting() else "cuda"
    gen = torch.Generator().manual_seed(d)
    B, H, N = 2, 3, 70
    o, r, do = (torch.randn(B, H, N, d, generator=gen).to(torch.bfloat16).to(device) for _ in range(3))
    sums = dq_buffer(o, d == 128)                       # the transposed layout at 128, rows at 64
    sums.fill_(float("nan"))
    delta = _delta(do, o, r, clear=sums)
    assert torch.equal(sums, torch.zeros_like(sums))
    want = (do.double() * (o.double() + r.double())).sum(-1)
    assert torch.allclose(delta.double(), want, rtol=1e-5, atol=1e-5)


@needs_gluon
def test_each_backward_launch_goes_out_before_the_next_is_built(monkeypatch):
    """``launch_backward._atomic_launches`` hands δ's launch over before it builds the backward kernel's
    arguments: where N_q is not a multiple of 4 (130 here) ``vector_descriptor`` copies δ into padded
    rows as the descriptor is built, so a δ kernel launched after that would leave the copy unwritten
    (found on a GPU: the float64 comparisons at N_q = 130 failed when all three launches were built
    first). No GPU needed: the launches are recorded, not run."""
    from stableflash.attention.gluon import launch_backward as lb
    from stableflash.attention.gluon.hopper_backward import atomic_backward_tiles
    events = []
    real = lb.launch_args_backward
    monkeypatch.setattr(lb, "launch_args_backward", lambda *a, **kw: events.append("backward built") or real(*a, **kw))
    gen = torch.Generator().manual_seed(1)
    q, k, v, do, o, r = (torch.randn(1, 2, 130, 64, generator=gen).to(torch.bfloat16) for _ in range(6))
    lse = torch.randn(1, 2, 130, generator=gen)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    tiles = atomic_backward_tiles(64)
    lb._atomic_launches(do, q, k, v, o, r, lse, True, None, dq, dk, dv, tiles, *lb._atomic_buffers(q, tiles),
                        lambda index, kernel, grid, args, kwargs: events.append(kernel.__name__))
    assert events == ["delta_dot_kernel", "backward built", "attn_bwd_hopper_kernel", "scale_dq_kernel"]


@pytest.fixture(scope="module")
def offline():
    """The sm_90a compile checks of the two kernels at ``CONFIGS`` with the default tiles and of the
    route's kernel adding dQ up by TMA reduce-adds at head_dim 64 and 128, causal, and the launcher's arguments compiled through triton's runtime, in two fresh
    processes side by side: ({(head_dim, causal, kernel): row}, runtime). One test uses it, so that
    pytest-xdist's workers do not each compile everything."""
    from stableflash.attention.gluon import sass
    if not sass.tools_present():
        pytest.skip("this triton wheel ships no nvdisasm / cuobjdump")
    from stableflash.attention.gluon.hopper_backward import atomic_backward_tiles
    # dealt out in turn to two processes, the runtime compile in the second: the two head_dim-128 ones
    # (the longest) to the first
    configs = [(128, True, None), (64, True, atomic_backward_tiles(64)), (128, True, atomic_backward_tiles(128))]
    assert {(d, c) for d, c, t in configs if t is None} == set(CONFIGS)
    result = sass.offline_backward_checks(configs, runtime=True)
    return {(r["head_dim"], r["causal"], r["kernel"]): r for r in result["rows"]}, result["runtime"]


def _check_dkdv(r, t, d, causal):
    """Two consumer warpgroups, each its own partition (so the SASS holds the loop twice), with the
    loops over the masked diagonal (causal only), whole and masked tail query blocks: per step Sᵀ and
    dPᵀ (d/16 HGMMA each), dV and dK (block_m/16 each); two waits per step leave a product in flight
    (dPᵀ while Pᵀ's exponentials run — all of them are placed there — and P̄ᵀ·dO while dSᵀ is formed)
    and one waits for all. No spills (triton 3.6, 3.8 and 3.9, either of 3.9's assemblers)."""
    consumers, loops = t.block_n // 64, 3 if causal else 2
    assert r["target"] == "sm_90a" and consumers == 2
    assert r["hgmma"] == consumers * loops * (2 * d // 16 + 2 * t.block_m // 16), r
    assert r["wait_depths"] == {0: consumers * loops, 1: 2 * consumers * loops}, r
    assert r["ex2"] == consumers * loops * t.block_m // 2 and r["ex2_in_flight"] == r["ex2"], r
    assert r["tma_loads"] > 0 and r["tma_stores"] == 2 * consumers, r
    assert r["half_swaps"] == 0, r
    assert r["stl"] == 0 and r["ldl"] == 0, r
    assert 24 in r["setmaxnreg"] and 240 in r["setmaxnreg"], r


def _check_dq(r, t, d):
    """Two consumer warpgroups as partitions: key block 0 (S_0, dP_0), the loops over whole and
    masked key blocks (S_j, dP_j: d/16 HGMMA each; dQ += dS̄_{j−1}·K_{j−1}: block_n/16) and the last
    dQ product; per step the wait for S_j leaves two products in flight and the wait for dP_j one; dS̄ packed to
    bf16 in the order the dQ product reads it (no half-swapping PRMT)."""
    consumers = t.dq_block_m // 64
    assert r["hgmma"] == consumers * (3 * 2 * d // 16 + 3 * t.dq_block_n // 16), r
    assert r["wait_depths"].get(2, 0) == 2 * consumers and r["wait_depths"].get(1, 0) == 3 * consumers, r
    assert r["tma_loads"] > 0 and r["tma_stores"] == consumers, r
    assert r["stl"] == 0 and r["ldl"] == 0, r
    assert r["half_swaps"] == 0, r
    assert 24 in r["setmaxnreg"] and 240 in r["setmaxnreg"], r


def _spill_bounds(r, before, ptxas12, ptxas13):
    """The (stores, loads) a row's local memory is bounded by: ``before`` for triton 3.6-3.8; from 3.9 by
    the assembler that assembled it (``sass.assembled_by``): its CUDA 12 ptxas, what the launches choose
    (``triton.assembler``), or its CUDA 13 one, triton's default for sm_90."""
    from stableflash.attention.gluon.sass import assembled_by, release
    if release(r) < (3, 9):
        return before
    return ptxas12 if assembled_by(r) < (13, 0) else ptxas13


def _check_split_rows(r, t, d):
    """The kernel adding dQ up at head_dim 64 with the share split by rows, causal: per consumer
    partition and loop (the masked diagonal, whole and masked tail blocks) Sᵀ and dPᵀ (d/16 HGMMA each),
    dV and dK (block_m/16 each) and the previous block's share — its 64 rows of dS̄·K as two products
    over the two warpgroups' 64 keys (64/16 each) — then the last block's share; the wait for Sᵀ leaves
    the share in flight (some of Pᵀ's exponentials placed there), then the share, dPᵀ with P̄ᵀ·dO, and
    the step are each waited for whole; a reduce-add per loop and one for the last share. The dK, dV,
    Sᵀ and dPᵀ accumulators (32 + 32 + 64 + 64 fp32 registers a thread) leave some scalars to local
    memory: 47–57 stores and 55–74 loads under triton 3.6 and 3.8 (bound 64 / 80), 22–28 and 31–40 under 3.9
    assembled by its CUDA 12.9 ptxas, what the launches use (bound 32 / 48), 75–118 and 124–163 by its CUDA 13.4
    one (bound 128 / 176), with the half block or not (``_spill_bounds``). With ``skip_hidden`` the
    second consumer's diagonal loop runs over the block's last half of rows: its dV and dK products
    half as deep (block_m/32 HGMMA each) and half its exponentials."""
    consumers, loops = t.block_n // 64, 3
    half = t.skip_hidden
    assert (t.block_n, t.block_m) == (128, 128) and t.dq_tile(d) == (64, 64) and not t.dq_transposed(d)
    assert r["hgmma"] == (consumers * (loops * (2 * d // 16 + 2 * t.block_m // 16 + 2 * 64 // 16) + 2 * 64 // 16)
                          - (t.block_m // 16 if half else 0)), r
    assert r["wait_depths"] == {0: consumers * (3 * loops + 1), 1: consumers * loops}, r
    assert r["ex2"] == consumers * loops * t.block_m // 2 - (t.block_m // 4 if half else 0), r
    assert 0 < r["ex2_in_flight"] <= r["ex2"], r
    assert r["tma_reduces"] == consumers * (loops + 1) and r["tma_stores"] == 2 * consumers, r
    stores, loads = _spill_bounds(r, before=(64, 80), ptxas12=(32, 48), ptxas13=(128, 176))
    assert r["half_swaps"] == 0 and r["stl"] <= stores and r["ldl"] <= loads, r
    assert 24 in r["setmaxnreg"] and 240 in r["setmaxnreg"], r


def _check_split(r, t, d):
    """The kernel adding dQ up at head_dim 128 with the share split by columns, causal: per consumer
    partition and loop Sᵀ and dPᵀ (d/16 HGMMA each), dV and dK (block_m/16 each) and its half of
    dS̄·K as two products over the two warpgroups' 64 keys (64/16 each); two waits per step leave a
    product in flight (dPᵀ while Pᵀ's exponentials run, P̄ᵀ·dO while dSᵀ is formed), most of the
    exponentials placed there; a reduce-add per loop; no half-swapping PRMT. With ``skip_hidden`` the
    second consumer's loop over hidden blocks adds one product of 64 keys (64/16 HGMMA) and a reduce-add.
    The dK and dV accumulators with dQ's half share leave some scalars to local memory under triton 3.6
    and 3.8 (53–57 stores, 51–59 loads; bound 64 / 64) and under 3.9 assembled by its CUDA 13.4 ptxas (26 / 30,
    bound 32 / 40); assembled by its CUDA 12.9 one, what the launches use, none (bound 16 / 16)."""
    consumers, loops = t.block_n // 64, 3
    hidden = 1 if t.skip_hidden else 0
    assert t.block_m == 64 and consumers == 2 and t.dq_tile(d) == (64, 64) and not t.dq_transposed(d)
    assert r["hgmma"] == consumers * loops * (2 * d // 16 + 2 * t.block_m // 16 + 2 * 64 // 16) + hidden * 64 // 16, r
    assert r["wait_depths"].get(1, 0) == 2 * consumers * loops, r
    assert r["ex2"] == consumers * loops * t.block_m // 2 and r["ex2_in_flight"] >= r["ex2"] * 3 // 4, r
    assert r["tma_reduces"] == consumers * loops + hidden and r["tma_stores"] == 2 * consumers, r
    stores, loads = _spill_bounds(r, before=(64, 64), ptxas12=(16, 16), ptxas13=(32, 40))
    assert r["half_swaps"] == 0 and r["stl"] <= stores and r["ldl"] <= loads, r
    assert 24 in r["setmaxnreg"] and 240 in r["setmaxnreg"], r


@needs_gluon
def test_both_kernels_and_the_launcher_compile_for_sm90_without_a_gpu(offline):
    """``CONFIGS`` (head_dim 128, causal), default tiles: the dK/dV kernel's SASS as
    ``_check_dkdv`` says, the dQ kernel's as ``_check_dq`` says; the route's kernels adding dQ up
    by TMA reduce-adds, causal, as ``_check_split_rows`` (64) and ``_check_split`` (128) say. And ``launch_args_backward`` —
    rank-4 TMA descriptors over (B, H, N, d) tensors in a (B, N, H, d) buffer, grouped-query heads,
    N not a multiple of a block — bound to both kernels' signatures and compiled by triton's
    runtime for sm_90a with a stand-in for the CUDA driver: the launch path up to the driver call."""
    from stableflash.attention.gluon.hopper_backward import atomic_backward_tiles, backward_tiles_for
    rows, r = offline
    for d, causal in CONFIGS:
        t = backward_tiles_for(d, causal)
        _check_dkdv(rows[(d, causal, "dkdv")], t, d, causal)
        _check_dq(rows[(d, causal, "dq")], t, d)
    assert r["dkdv"]["grid"] == [2, 4], r                   # (key blocks, B·H_kv)
    assert r["dq"]["grid"] == [2, 8], r                     # (query blocks, B·H)
    assert all(r[k]["wgmma"] and r[k]["tma"] for k in r), r
    assert r["dkdv"]["num_warps"] == r["dq"]["num_warps"] == 12, r          # 2 consumer warpgroups, the producer's
    _check_split_rows(rows[(64, True, "fused")], atomic_backward_tiles(64), 64)
    assert r["fused"]["grid"] == [2, 4] and r["fused"]["wgmma"] and r["fused"]["tma"], r   # 150 keys, 128 a program
    _check_split(rows[(128, True, "fused")], atomic_backward_tiles(128), 128)


@needs_gluon
def test_the_head_dim_64_half_block_skip_compiles_for_sm90_without_a_gpu():
    """The head_dim-64 kernel with ``skip_hidden`` (what the route launches below ``HALF_SKIP_MAX_KEYS``
    keys), causal: its SASS as ``_check_split_rows`` says, within the same spill bounds (compiled in a
    fresh process, as the ``offline`` fixture's checks are)."""
    from stableflash.attention.gluon import sass
    if not sass.tools_present():
        pytest.skip("this triton wheel ships no nvdisasm / cuobjdump")
    from stableflash.attention.gluon.hopper_backward import atomic_backward_tiles
    t = atomic_backward_tiles(64)._replace(skip_hidden=True)
    row, = [r for r in sass.offline_backward_checks([(64, True, t)], jobs=1)["rows"] if r["kernel"] == "fused"]
    _check_split_rows(row, t, 64)


# --- on a Hopper GPU -----------------------------------------------------------------------------

@pytest.fixture
def fixed_triton_tiles(monkeypatch):
    """The Triton backward with its fixed tiles (correctness needs no autotuning)."""
    from stableflash.attention.triton import op as triton_op
    monkeypatch.setattr(triton_op, "AUTOTUNE", False)


def _inputs(B, H, Hk, n_q, n_k, d, tied, gen):
    q, do = (torch.randn(B, H, n_q, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, Hk, n_k, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    if tied:                                   # keys repeat every 16 positions: tied row maxima
        k = k[:, :, torch.arange(n_k, device="cuda") % 16].contiguous()
    return q, k, v, do


def _triton_backward(do, q, k, v, o, r, lse, causal, scale):
    from stableflash.attention.gluon.route import triton_only
    from stableflash.attention.triton.launch import stabilized_config
    from stableflash.attention.triton.op import _backward_impl
    config = stabilized_config(torch.bfloat16)
    assert config.delta.residual and not config.delta.extra_pass      # δ = rowsum(dO ∘ (O + R)), as here
    with triton_only():                                 # the Triton kernels, not the Hopper route
        return _backward_impl(do, q, k, v, o, r, lse, causal, scale, config)


@against_float64
def test_backward_against_float64(case, d, causal, tied, fixed_triton_tiles):
    """B×H×H_kv×N_q×N_k cases: none a multiple of the blocks but the second, grouped-query heads in
    the second, more keys than queries in the third (causal: keys past the last query get no
    gradient) and fewer in the last. Both forms: two kernels, and the one adding dQ up by TMA
    reduce-adds with the route's tiles (``atomic_backward_tiles``)."""
    B, H, Hk, n_q, n_k = case
    gen = torch.Generator(device="cuda").manual_seed(1000 * CASES.index(case) + 10 * d + 2 * causal + tied)
    q, k, v, do = _inputs(B, H, Hk, n_q, n_k, d, tied, gen)
    scale = 1.0 / math.sqrt(d)
    o, lse, r = sg.flash_forward_hopper(q, k, v, causal)
    from stableflash.attention.gluon.hopper_backward import atomic_backward_tiles
    atomic = [atomic_backward_tiles(d)]
    atomic += [atomic_backward_tiles(d)._replace(skip_hidden=not atomic_backward_tiles(d).skip_hidden)]
    if d == 128:                                        # narrower blocks
        atomic += [atomic_backward_tiles(d)._replace(block_m=32, stages=3)]
    runs = [sg.flash_backward_hopper(do, q, k, v, o, r, lse, causal)]
    runs += [sg.flash_backward_hopper(do, q, k, v, o, r, lse, causal, tiles=t) for t in atomic]
    triton_got = _triton_backward(do, q, k, v, o, r, lse, causal, scale)
    refs = expanded_reference(q, k, v, do, causal)[1:]
    for got in runs:
        for x, like in zip(got, (q, k, v)):
            assert x.shape == like.shape and x.dtype == torch.bfloat16 and x.stride() == like.stride()
        for name, x, x_t, ref in zip(("dQ", "dK", "dV"), got, triton_got, refs):
            assert torch.isfinite(x).all(), name
            err, err_t = (((y.double() - ref).norm() / ref.norm()).item() for y in (x, x_t))
            assert err <= 1.25 * err_t + 1e-4, (name, err, err_t)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("case", [(2, 4, 4, 509, 509), (1, 8, 2, 1024, 1024), (2, 3, 3, 130, 257), (1, 2, 2, 257, 130)],
                         ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("d", [64, 128])
def test_skipping_hidden_blocks_leaves_dk_and_dv_bit_for_bit(case, d):
    """Causal, the route's tiles with and without ``skip_hidden``: the consumer whose keys all come
    after a block's rows (head_dim 128) or its first half of rows (64) runs none of the products of
    those rows, which would have added zeros, so dK and dV are equal bit for bit (grouped-query heads,
    ragged lengths, more or fewer keys than queries); dQ, added up by reduce-adds in no fixed order,
    agrees to within that order's rounding."""
    from stableflash.attention.gluon.hopper_backward import atomic_backward_tiles
    B, H, Hk, n_q, n_k = case
    gen = torch.Generator(device="cuda").manual_seed(sum(case) + d)
    q, k, v, do = _inputs(B, H, Hk, n_q, n_k, d, False, gen)
    o, lse, r = sg.flash_forward_hopper(q, k, v, True)
    tiles = atomic_backward_tiles(d)
    skipped, kept = (sg.flash_backward_hopper(do, q, k, v, o, r, lse, True, tiles=tiles._replace(skip_hidden=s))
                     for s in (True, False))
    assert torch.equal(skipped[1], kept[1]) and torch.equal(skipped[2], kept[2])
    assert (skipped[0].double() - kept[0].double()).norm() <= 1e-2 * kept[0].double().norm()


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_and_layout_independent(d, causal):
    """Every gradient is summed in one fixed order (no atomics): two runs agree bit for bit, and q,
    k, v, dO, O as (B, N, H, d) buffers seen as (B, H, N, d) give what their contiguous copies give
    (the gradients then laid out like q and k); other tiles give the same gradients to within the
    summation order."""
    from stableflash.attention.gluon.hopper_backward import BackwardTiles
    gen = torch.Generator(device="cuda").manual_seed(11 + d + causal)
    q, k, v, do = (torch.randn(2, 333, 4, d, generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)
                   for _ in range(4))
    o, lse, r = sg.flash_forward_hopper(q, k, v, causal)
    first = sg.flash_backward_hopper(do, q, k, v, o, r, lse, causal)
    again = sg.flash_backward_hopper(do, q, k, v, o, r, lse, causal)
    packed = sg.flash_backward_hopper(*(x.contiguous() for x in (do, q, k, v, o)), r, lse, causal)
    other = sg.flash_backward_hopper(do, q, k, v, o, r, lse, causal, tiles=BackwardTiles(64, 16, 4, 64, 32, 3))
    for a, b, c, e, like in zip(first, again, packed, other, (q, k, v)):
        assert torch.equal(a, b) and torch.equal(a, c) and a.stride() == like.stride()
        assert (a.double() - e.double()).norm() <= 1e-2 * a.double().norm()


@pytest.mark.gpu
@on_hopper
def test_delta_from_the_stored_output_without_a_residual(fixed_triton_tiles):
    """residual=None: δ = rowsum(dO ∘ O) with O as stored, as the Triton backward computes it for an
    empty residual; the same gradients as the Triton backward's to within the summation order."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = _inputs(1, 4, 2, 300, 300, 64, False, gen)
    o, lse, _ = sg.flash_forward_hopper(q, k, v, True)
    got = sg.flash_backward_hopper(do, q, k, v, o, None, lse, True)
    want = _triton_backward(do, q, k, v, o, o.new_empty(0), lse, True, 0.125)
    for x, y in zip(got, want):
        assert (x.double() - y.double()).norm() <= 1e-2 * y.double().norm()


@needs_gluon
@pytest.mark.parametrize("copied", [None, "residual", "lse"])
def test_a_callers_plan_key_is_dropped_where_the_backward_copies_a_tensor(copied, monkeypatch):
    """``backward_into`` keeps a plan under the key its caller made (the op's, which the op replays with
    its own tensors) only where it launched on those tensors: a residual or L that it had to make
    contiguous keeps the plan under the key of the tensors it launched on instead. No GPU needed: the
    launches are stubbed."""
    from stableflash.attention.gluon import launch_backward as lb
    from stableflash.attention.triton import launch_cache
    kept = {}
    monkeypatch.setattr(lb, "_plans", kept)
    monkeypatch.setattr(lb, "_atomic_launches", lambda *a: ["launch"])
    monkeypatch.setattr(launch_cache.Plan, "record", classmethod(lambda cls, tensors, buffers, launches: "plan"))
    monkeypatch.setattr(launch_cache, "plan_key", lambda tensors, causal, scale: ("its own key",))
    gen = torch.Generator().manual_seed(2)
    q, k, v, do, o = (torch.randn(1, 2, 64, 64, generator=gen).to(torch.bfloat16) for _ in range(5))
    r = torch.randn(1, 2, 64, 64, generator=gen).to(torch.bfloat16)
    lse = torch.randn(1, 2, 64, generator=gen)
    if copied == "residual":
        r = r.transpose(2, 3).contiguous().transpose(2, 3)
    elif copied == "lse":
        lse = torch.randn(1, 64, 2, generator=gen).transpose(1, 2)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lb.backward_into(do, q, k, v, o, r, lse, True, None, dq, dk, dv, key=("the op's key",))
    assert kept == {("its own key",) if copied else ("the op's key",): "plan"}
