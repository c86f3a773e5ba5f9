"""The Gluon Hopper forward (``stableflash.attention.gluon``).

Without a GPU: the package imports and answers ``available()`` on any machine; the launcher's
argument errors; the kernel compiles for sm_90a with the triton wheel's ptxas and its SASS holds
asynchronous warpgroup products with the softmax between their waits, TMA loads and stores, the
warp-specialised register split and no spills under triton 3.8 (head_dim 64, causal: a few seconds).

On an H100/H200 (compute capability 9.0; skipped elsewhere): O, the log-sum-exp and the residual R
against float64, on fresh random inputs and on inputs whose keys repeat every 16 positions (tied
row maxima), at head_dim 64 and 128, causal and not, sequence lengths that are not multiples of
the 128-row blocks, grouped-query heads. Tolerance: the error of O, of O + R (what the stabilized
backward's δ reads) and of the log-sum-exp against float64 is at most 1.25× the Triton forward's
error for ``stabilize=True`` on the same inputs (the same arithmetic, summed in another order;
1.25× is the bound the Triton kernels' GPU tests use against the emulated backend), and O is within
1/128 of the Triton forward's O relative to max |O| (about one bf16 rounding).
"""
import math

import pytest
import torch

from stableflash.attention import gluon as sg
from stableflash.attention.gluon import support

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_gluon = pytest.mark.skipif(not sg.available(), reason=f"Gluon Hopper API missing: {sg.unavailable_reason()}")
on_hopper = pytest.mark.skipif(not (HOPPER and sg.available()),
                               reason="needs a CUDA device of compute capability 9.0 and triton's Gluon")


def test_package_imports_and_answers_on_any_machine():
    assert isinstance(sg.available(), bool)
    reason = sg.unavailable_reason()
    assert (reason is None) == sg.available()
    assert reason is None or (isinstance(reason, str) and reason)


def test_unavailable_triton_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sg, "unavailable_reason", lambda: "triton 3.1 has no triton.experimental.gluon")
    q = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="not available: triton 3.1 has no triton.experimental.gluon"):
        sg.flash_forward_hopper(q, q, q, True)


@needs_gluon
def test_support_names_what_is_missing(monkeypatch):
    support.unavailable_reason.cache_clear()
    monkeypatch.setitem(support._NEEDED, "triton.experimental.gluon.language.nvidia.hopper", ("no_such_name",))
    try:
        assert "lacks no_such_name" in support.unavailable_reason()
    finally:
        support.unavailable_reason.cache_clear()


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@needs_gluon
@pytest.mark.parametrize("args, error, match", [
    ((_bf16(1, 2, 8, 64).float(), _bf16(1, 2, 8, 64), _bf16(1, 2, 8, 64), True), TypeError,
     r"q of dtype torch.float32 is invalid; accepted: torch.bfloat16"),
    ((_bf16(1, 2, 8, 96),) * 3 + (False,), ValueError, r"head_dim=96 is invalid; accepted: one of \(64, 128\)"),
    ((_bf16(1, 2, 64, 8).transpose(2, 3), _bf16(1, 2, 8, 64), _bf16(1, 2, 8, 64), False), ValueError,
     r"q with strides \(1024, 512, 1, 8\) is invalid; accepted: the last dimension contiguous"),
    ((_bf16(1, 2, 8, 64), _bf16(1, 3, 8, 64), _bf16(1, 3, 8, 64), False), ValueError,
     r"q heads \(2\) must be a multiple of k/v heads \(3\)"),
    ((_bf16(1, 2, 8, 64), _bf16(1, 2, 8, 64), _bf16(1, 2, 9, 64), False), ValueError, r"must have the same shape"),
    ((_bf16(2, 8, 64),) * 3 + (False,), ValueError, r"accepted: 4 dimensions \(B, H, N, d\)"),
    ((_bf16(1, 2, 8, 64),) * 3 + (1,), TypeError, r"causal=1 is invalid; accepted: True or False"),
    ((_bf16(1, 2, 8, 64),) * 3 + (False, -1.0), ValueError, r"scale=-1.0 is invalid"),
    ((_bf16(1, 2, 8, 64),) * 3 + (True,), ValueError,
     r"q on device cpu is invalid; accepted: a CUDA device of compute capability 9.0"),
])
def test_argument_errors_name_the_argument_and_what_is_accepted(args, error, match):
    if torch.cuda.is_available() and "device cpu" not in match:
        args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(error, match=match):
        sg.flash_forward_hopper(*args)


@needs_gluon
def test_residual_must_be_a_bool():
    q = _bf16(1, 2, 8, 64)
    with pytest.raises(TypeError, match="residual='no' is invalid; accepted: True or False"):
        sg.flash_forward_hopper(q, q, q, True, residual="no")


@pytest.fixture(scope="module")
def offline():
    """The sm_90a compile checks of head_dim 64, causal — the default tiles' shape with one consumer
    partition of 128 rows, and with ping-pong (the default), storing R or not (``stabilize=True`` or
    ``False``) — and the launcher's arguments compiled
    through triton's runtime, in one go (in a process of their own when this one runs Triton's
    interpreter: ``sass.offline_checks``)."""
    from stableflash.attention.gluon import sass
    from stableflash.attention.gluon.hopper_forward import tiles_for
    if not sass.tools_present():
        pytest.skip("this triton wheel ships no nvdisasm / cuobjdump")
    t = tiles_for(64, True)
    assert t.pingpong and t.persistent
    single = t.per_block()._replace(pingpong=False)
    result = sass.offline_checks([(64, True, single), (64, True, t), (64, True, t, False)], runtime=True)
    return {"single": (single, result["rows"][0]), "pingpong": (t, result["rows"][1]),
            "pingpong-no-residual": (t, result["rows"][2]), "runtime": result["runtime"]}


@needs_gluon
@pytest.mark.parametrize("variant", ["single", "pingpong", "pingpong-no-residual"])
def test_compiles_for_sm90_without_a_gpu(offline, variant):
    """head_dim 64, causal, the default tiles (ping-pong consumers), without R (one TMA store per
    consumer: O), and one consumer partition: HGMMA at the three S
    sites (d/16 each) and the three P̄V sites (BLOCK_N/16 each) of each consumer partition; a wait
    that leaves a product in flight, with the softmax's exponentials placed before the next wait;
    TMA loads and stores; the producer/consumer register split; no local-memory spills; P̄ packed to bf16 in
    the order the P̄V product reads it (no half-swapping PRMT: carried packed across the loop's back edge, each of
    its registers was swapped before every product); no NANOSLEEP (the scheduling fence synchronises the warp
    instead of yielding it); the persistent kernel's turns through named barriers, as many taken as
    given at each."""
    t, r = offline[variant]
    consumers = 2 if t.pingpong else 1
    assert r["target"] == "sm_90a" and t.warp_specialize
    # the narrow diagonal (the default at head_dim 64): the first consumer's last key block as a path of its
    # own, S over 64 keys, the previous block's P̄V and the last P̄V over 64 keys
    narrow = t.narrow_diagonal and t.persistent
    assert r["hgmma"] == consumers * (3 * (64 // 16) + 3 * (t.block_n // 16)) + narrow * (64 // 16 + t.block_n // 16
                                                                                          + 64 // 16), r
    assert r["hgmma"] + r["ex2"] < r["instructions"], r      # the listing's instructions, those among them
    assert r["wait_depths"].get(1, 0) >= 2 * consumers, r  # per loop: S_j done, P̄V still in flight
    from stableflash.attention.gluon import sass
    release = sass.release(r)
    # the softmax of both loops between the waits (triton 3.9 places three of the one-consumer form's after)
    assert r["ex2_in_flight"] >= consumers * t.block_n - (3 if release >= (3, 9) and not t.pingpong else 0), r
    assert r["residual"] == (variant != "pingpong-no-residual"), r
    assert r["tma_loads"] > 0 and r["tma_stores"] == (2 if r["residual"] else 1) * consumers, r
    # local memory, by triton release and assembler. After the register split: 3.6 spills a few scalars of the
    # persistent kernel's loop over query tiles (2 stores at this tile; 31 while the causal mask compared indices
    # twice an entry), 3.8 and 3.9 none. Before it: 3.9's code assembled by its CUDA 13 ptxas (triton's default
    # for sm_90) keeps a few thread-index values that the prologue (which every warpgroup runs) computes in
    # local memory (5 stores, 16 reloads in the partitions); assembled by its CUDA 12 ptxas (what the launches
    # choose: triton.assembler), as 3.6 and 3.8, none
    after_split = 4 if t.persistent and release < (3, 8) else 0
    prologue, reloads = (5, 16) if sass.assembled_by(r) >= (13, 0) else (0, after_split)
    assert r["stl"] - r["stl_before_split"] <= after_split and r["stl_before_split"] <= prologue, r
    assert r["ldl"] <= reloads, r
    assert r["half_swaps"] == 0 and r["sleeps"] == 0, r
    assert 24 in r["setmaxnreg"] and 240 in r["setmaxnreg"], r
    # the persistent kernel's turns: named barrier 8 taken by warpgroup 0 and given by warpgroup 1, 9 the
    # other way, at each issue site (block 0, both loops, the last P̄V; warpgroup 0's narrow diagonal adds
    # two) and once more for warpgroup 0's first turn; the other kernels take turns through mbarriers
    turns = r["turn_barriers"]
    if t.persistent:
        assert turns["sync_8"] == turns["arrive_8"] + 2 * narrow and turns["arrive_8"] >= 4, r
        assert turns["arrive_9"] == turns["sync_9"] + 2 * narrow and turns["sync_9"] >= 4, r
        # and triton's own barriers keep clear of 8 and 9 (the kernel's would deadlock with them)
        named = {int(n): counts for n, counts in r["named_barriers"].items()}
        assert named[8] == named[9] == [256] and max(n for n in named if n not in (8, 9)) < 8, r
    else:
        assert sum(turns.values()) == 0, r



@needs_gluon
def test_the_summary_counts_the_prologues_local_stores_apart():
    """``sass._stores_before_split``: the STL of the kernel's code before its first USETMAXREG (the prologue
    every warpgroup runs), none of those after it nor any before the kernel's ``.text`` section; and
    ``sass.release``, the (major, minor) of the triton that compiled a summary."""
    from stableflash.attention.gluon import sass
    listing = """\t//----- nvinfo : EIATTR_EXIT_INSTR_OFFSETS STL
.text.attn_fwd_hopper_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*00e0*/                   STL [R1+0x8], R3 ;
        /*0160*/                   STL.64 [R1], R2 ;
        /*0220*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x100 ;
        /*0300*/                   STL [R1+0x4], R2 ;
        /*0400*/                   LDL R3, [R1+0x4] ;
"""
    assert sass._stores_before_split(listing) == 2
    assert sass._stores_before_split(listing.replace("USETMAXREG", "NOP")) == 3      # no split: every store
    # the release a summary's bounds are chosen by: numeric, so that 3.10 sorts after 3.9
    assert sass.release({"triton": "3.10.0"}) == (3, 10) > sass.release({"triton": "3.9.0+git1a2b"}) == (3, 9)


@needs_gluon
def test_the_launchers_arguments_compile_through_tritons_runtime(offline):
    """``launch.launch_args`` — host TMA descriptors over (B, H, N, d) tensors in a (B, N, H, d)
    buffer, grouped-query heads, N not a multiple of the block — bound to the kernel's signature and
    compiled by triton's runtime (``warmup``, nothing launched) for sm_90a with a stand-in for the
    CUDA driver (``sass.compile_through_runtime``): the launch path up to the driver call."""
    r = offline["runtime"]
    assert r["grid"] == [8, 1] and r["wgmma"] and r["tma"], r     # B·H = 8 units of one pair of query blocks
    assert r["num_warps"] == 12, r                          # 8 consumer warps, the producer warp's warpgroup


@needs_gluon
def test_the_runtime_compile_gives_tritons_driver_back(monkeypatch):
    """The stand-in driver is triton's active driver during ``compile_through_runtime`` alone: a GPU
    launch later in the same process reaches the real one (with the stand-in left active, every
    launch after the compile check failed on a GPU)."""
    from triton.runtime import driver

    from stableflash.attention.gluon import sass
    marker = object()
    monkeypatch.setattr(driver, "_active", marker)
    seen = {}

    def warmup(*args, **kwargs):
        seen["active"] = driver._active
        raise RuntimeError("stop after the driver swap")
    monkeypatch.setattr(sass.attn_fwd_hopper_kernel, "warmup", warmup)
    with pytest.raises(RuntimeError, match="stop after the driver swap"):
        sass.compile_through_runtime()
    assert isinstance(seen["active"], sass._StandInDriver)
    assert driver._active is marker


@needs_gluon
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_descriptors_are_what_tensor_descriptor_makes(dtype):
    """``launch.tensor_descriptor`` (the launches' descriptors, built without the constructor's checks)
    gives the fields ``TensorDescriptor(...)`` gives — a (B, N, H, d) buffer seen as (B, H, N, d), bf16
    and the dQ buffer's fp32 — with the layouts made once per block shape; a base off 16 bytes is
    refused with the constructor's rule named."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from stableflash.attention.gluon.hopper_forward import descriptor_layout
    from stableflash.attention.gluon.launch import tensor_descriptor
    from stableflash.attention.gluon.launch_backward import dq_buffer_layout
    t = torch.zeros(2, 300, 3, 4, 64, dtype=dtype)[:, :, 1].transpose(1, 2)
    layout = (descriptor_layout if dtype == torch.bfloat16 else dq_buffer_layout)(64, 64)
    assert layout is (descriptor_layout if dtype == torch.bfloat16 else dq_buffer_layout)(64, 64)
    want = TensorDescriptor(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=[1, 1, 64, 64],
                            layout=layout)
    got = tensor_descriptor(t, 64, layout)
    assert type(got) is TensorDescriptor and vars(got).keys() == vars(want).keys()
    for name, value in vars(want).items():
        assert (got.base is t) if name == "base" else getattr(got, name) == value, name
    with pytest.raises(ValueError, match="data_ptr % 16 = 2 is invalid for TMA; accepted: a 16-byte aligned base"):
        tensor_descriptor(torch.zeros(2, 4, 65, 64, dtype=torch.bfloat16)[:, :, :, 1:], 64, layout)


@needs_gluon
def test_tiles_the_kernel_has_no_schedule_for_are_refused():
    from stableflash.attention.gluon.hopper_forward import Tiles
    with pytest.raises(ValueError, match="2-4 stages"):
        Tiles(128, 512, 2).check()
    with pytest.raises(ValueError, match="2-4 stages"):
        Tiles(128, 128, 1).check()
    with pytest.raises(ValueError, match="ping-pong takes block_m=128 and warp_specialize=True"):
        Tiles(128, 128, 2, warp_specialize=False, pingpong=True).check()
    with pytest.raises(ValueError, match="persistent takes pingpong=True"):
        Tiles(128, 128, 2, persistent=True).check()
    Tiles(128, 128, 2, pingpong=True).check()
    for bad in (Tiles(128, 128, 2, pingpong=True, narrow_diagonal=True),
                Tiles(128, 64, 2, pingpong=True, persistent=True, narrow_diagonal=True)):
        with pytest.raises(ValueError, match="narrow_diagonal takes persistent=True and block_n == block_m"):
            bad.check()
    for bad in (63, 256, 128.0, True):
        with pytest.raises(ValueError, match="max_registers None or an int from 64 to 255"):
            Tiles(64, 128, 2, max_registers=bad).check()


# --- on a Hopper GPU -----------------------------------------------------------------------------

def _inputs(B, H, Hk, n_q, n_k, d, tied, gen):
    q = torch.randn(B, H, n_q, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(B, Hk, n_k, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    if tied:                                   # keys repeat every 16 positions: tied row maxima
        k = k[:, :, torch.arange(n_k, device="cuda") % 16].contiguous()
    return q, k, v


def _triton_forward(q, k, v, causal, scale):
    from stableflash.attention.gluon.route import triton_only
    from stableflash.attention.triton.launch import stabilized_config
    from stableflash.attention.triton.op import _forward
    config = stabilized_config(torch.bfloat16)
    assert config.delta.residual                       # the δ source these outputs serve: dO·(O+R)
    with triton_only():                                 # the Triton kernels, not the Hopper route
        return _forward(q, k, v, causal, scale, config)


CASES = [(2, 4, 4, 509, 509), (1, 8, 2, 1024, 1024), (2, 3, 3, 130, 257), (1, 2, 2, 257, 130)]


def against_float64(test):
    """The marks of a Hopper GPU test run over every case of CASES × head_dim 64, 128 × causal or
    not × random or tied-maxima inputs (the forward's and the backward's)."""
    marks = (pytest.mark.gpu, on_hopper,
             pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"]),
             pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"]),
             pytest.mark.parametrize("d", [64, 128]),
             pytest.mark.parametrize("case", CASES, ids=["x".join(map(str, c)) for c in CASES]))
    for mark in reversed(marks):                           # applied bottom-up, as decorators are
        test = mark(test)
    return test


@against_float64
def test_forward_against_float64(case, d, causal, tied):
    """B×H×H_kv×N_q×N_k cases: none a multiple of the 128-row blocks but the second, grouped-query
    heads in the second, fewer keys than queries in the last (causal: top-left aligned). The kernel
    without R (``residual=False``, what ``stabilize=False`` runs) under the same bounds for O and L."""
    from stableflash.attention import reference
    B, H, Hk, n_q, n_k = case
    gen = torch.Generator(device="cuda").manual_seed(1000 * CASES.index(case) + 10 * d + 2 * causal + tied)
    q, k, v = _inputs(B, H, Hk, n_q, n_k, d, tied, gen)
    scale = 1.0 / math.sqrt(d)
    o, lse, r = sg.flash_forward_hopper(q, k, v, causal)
    o_t, lse_t, r_t = _triton_forward(q, k, v, causal, scale)
    assert o.shape == q.shape and o.dtype == torch.bfloat16 and o.stride() == q.stride()
    assert lse.shape == (B, H, n_q) and lse.dtype == torch.float32
    assert r.shape == q.shape and r.dtype == torch.bfloat16 and r.is_contiguous()
    rep = H // Hk
    ref, ref_lse = reference.attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), causal=causal,
                                       return_lse=True)
    err = lambda x: ((x.double() - ref).norm() / ref.norm()).item()
    assert err(o) <= 1.25 * err(o_t), (err(o), err(o_t))
    assert err(o.float() + r.float()) <= 1.25 * err(o_t.float() + r_t.float()), (
        err(o.float() + r.float()), err(o_t.float() + r_t.float()))
    lse_err, lse_err_t = ((x.double() - ref_lse).abs().max().item() for x in (lse, lse_t))
    assert lse_err <= 1.25 * lse_err_t + 1e-6, (lse_err, lse_err_t)
    assert (o.double() - o_t.double()).abs().max().item() <= o_t.double().abs().max().item() / 128
    o_n, lse_n, r_n = sg.flash_forward_hopper(q, k, v, causal, residual=False)
    assert r_n.numel() == 0 and o_n.stride() == q.stride()
    assert err(o_n) <= 1.25 * err(o_t), (err(o_n), err(o_t))
    assert (lse_n.double() - ref_lse).abs().max().item() <= 1.25 * lse_err_t + 1e-6


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_variants_and_layouts_agree_bit_for_bit(d, causal):
    """The same arithmetic in the same order whatever issues the loads (warp specialisation on or
    off), whether the scheduling fence is there, whether the two consumer warpgroups take turns
    as partitions of their own (ping-pong) and whether a program computes one query block or, persistent
    (the default), many — 3 query blocks (an odd count: one pair and one lone block), and 2·48 heads of 8
    (more units than SMs); q, k, v as (B, N, H, d) buffers seen as (B, H, N, d) give what their
    contiguous copies give; without R (``residual=False``) O and L are the same."""
    from stableflash.attention.gluon.hopper_forward import tiles_for
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 333, 4, d, generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    base = sg.flash_forward_hopper(q, k, v, causal)
    t = tiles_for(d, causal)
    assert t.pingpong                                  # the default: ping-pong consumers
    per_block = t.per_block()
    single = per_block._replace(pingpong=False)
    for other in (sg.flash_forward_hopper(q, k, v, causal, tiles=single._replace(warp_specialize=False)),
                  sg.flash_forward_hopper(q, k, v, causal, tiles=t._replace(sched_fence=False)),
                  sg.flash_forward_hopper(q, k, v, causal, tiles=single),
                  sg.flash_forward_hopper(q, k, v, causal, tiles=per_block),
                  sg.flash_forward_hopper(*(x.contiguous() for x in (q, k, v)), causal)):
        for a, b in zip(base, other):
            assert torch.equal(a, b)
    # persistent programs taking several units each (2·48·4 units of two query blocks, one program per SM)
    many = [torch.randn(2, 48, 1000, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]
    want = sg.flash_forward_hopper(*many, causal)
    for a, b in zip(want, sg.flash_forward_hopper(*many, causal, tiles=per_block)):
        assert torch.equal(a, b)
    # the first consumer's causal diagonal block over the 64 keys its rows keep, and over all 128 (the default
    # at head_dim 64 and at 128, in turn; the same kernel without a causal mask)
    other = t._replace(narrow_diagonal=not t.narrow_diagonal)
    for ref, got in ((want, sg.flash_forward_hopper(*many, causal, tiles=other)),
                     (base, sg.flash_forward_hopper(q, k, v, causal, tiles=other))):
        for a, b in zip(ref, got):
            assert torch.equal(a, b), other
    o, lse, r = sg.flash_forward_hopper(q, k, v, causal, residual=False)       # stabilize=False: no R stored
    assert torch.equal(o, base[0]) and torch.equal(lse, base[1]) and r.numel() == 0
