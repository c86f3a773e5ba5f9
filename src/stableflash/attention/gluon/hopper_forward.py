"""The attention forward for Hopper (sm_90a) in Gluon: TMA, mbarriers, asynchronous warpgroup
products, warp specialisation.

What it computes is the Triton forward's ``stabilize=True`` default on the "fa2" policy
(``attention/triton/forward.py`` with STAB = STANDARD, EMU = 0, DELTA_SRC = DO_O_R): per key block,
scores S = QKᵀ in fp32, the running shift m ← max(m, rowmax(S)·c) with c = scale·log2 e,
P = exp2(S·c − m), ℓ ← ℓ·α + rowsum(P) with α = exp2(m_old − m), Ō ← Ō·α + P̄V with P̄ = P rounded
to bf16; then O = Ō/ℓ stored in bf16, the log-sum-exp L = (m + log2 ℓ)·ln 2 in fp32, and the
residual R = bf16(O − bf16(O)) that the stabilized backward's δ = rowsum(dO ∘ (O + R)) reads (δ
source "dO·(O+R)", what ``stabilize=True`` resolves to for bf16 "fa2"). Causal is top-left aligned
(query i sees keys j ≤ i), as the Triton kernels' CAUSAL switch.

How (one program per BLOCK_M query rows of one batch·head, the last query blocks launched first):

- Q, K, V, O and R move through host-side TMA descriptors of rank 4 over the (B, H, N, d) tensors
  as they are laid out: a tile never crosses a head, rows past N read as zeros and are not
  written back, so N need not be a multiple of a block.
- K and V tiles stream through a ring of STAGES shared-memory slots, each with a "K ready" and a
  "V ready" mbarrier (TMA transaction counts) and a "slot free" mbarrier.
- The consumer warpgroups (BLOCK_M / 64 of them, 64 rows each) overlap within a warpgroup as
  FlashAttention-3 does: S_j = Q·K_jᵀ and the previous block's Ō += P̄_{j−1}·V_{j−1} are issued
  asynchronously back to back, the wait for S_j leaves the P̄V product in flight
  (``warpgroup_mma_wait(1)``) and block j's softmax runs while it computes. P̄ stays in registers
  as the product's A operand. Whole key blocks and masked ones (the causal diagonal, the ragged
  tail) run in two loops, so that no branch lies between a product's issue and its wait.
- WARP_SPECIALIZE: one producer warp (a ``gl.warp_specialize`` worker with 24 registers) issues
  every K/V load and waits on the "slot free" barriers; the consumer warpgroups (the default
  partition, raised to 240 registers) only compute. Without it the consumers issue the loads,
  refilling a slot once every warpgroup is done with it.
- PINGPONG (with WARP_SPECIALIZE, BLOCK_M = 128): the two consumer warpgroups run as partitions of
  their own (64 rows each, their own Q, O and R tiles) and take turns to issue their products
  through a pair of mbarriers (in the persistent kernel a pair of named barriers, which every
  thread passes without a barrier across its warpgroup first), so that one's softmax runs while the
  other's products do (FlashAttention-3's ping-pong); each frees its K tile as soon as its S is
  done.
- SCHED_FENCE: a warp synchronisation on the warp's active mask between the softmax and the wait for
  P̄V (``_schedule_fence``), without which ptxas schedules that wait above the softmax and nothing
  overlaps.
- Epilogue: O and R go through shared memory (Q's tile, and one more) and TMA stores; L through
  ordinary stores. STORE_R off (``stabilize=False``: δ from dO·O as stored): O alone, no R.

Gluon's spellings that differ between the triton releases the project meets (3.6 on the GPU
machines, 3.9 in CI) are bound once below: the TMA copies (``async_copy_global_to_shared`` /
``async_copy_shared_to_global`` in 3.6, ``async_load`` / ``async_store`` in 3.9, where the 3.6
names raise) and the CTA barrier (``thread_barrier`` in 3.6, ``barrier`` in 3.9).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from stableflash.attention.triton import assembler

# Gluon's names differ between the triton releases the project meets (3.6 on the GPU machines, 3.9 in
# CI): pick what this one offers, once, at import. In 3.9 the 3.6 TMA names still exist but raise.
if hasattr(tma, "async_load"):
    tma_load = tma.async_load
    tma_store = tma.async_store
else:
    tma_load = tma.async_copy_global_to_shared
    tma_store = tma.async_copy_shared_to_global
cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

# Proton's intra-kernel scopes (``benchmarks/tools/forward_timeline.py``): with proton's instrumentation
# off they emit nothing, and the kernels compile as without them
try:
    from triton.profiler.language import enter_scope, exit_scope
except ImportError:                                         # a triton without proton: no scopes
    @gluon.jit
    def enter_scope(name: gl.constexpr):
        pass

    @gluon.jit
    def exit_scope(name: gl.constexpr):
        pass

if hasattr(tma, "async_atomic_add"):
    tma_atomic_add = tma.async_atomic_add
else:
    # 3.6 has the operation (a TMA reduce-add from shared memory, ``cp.reduce.async.bulk.tensor``) in its
    # IR builder but no Gluon function for it: the same call as the later releases' async_atomic_add
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def tma_atomic_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile ``src`` element-wise into the global tile of ``tensor_desc`` at
        ``coord`` (TMA reduce-add; rows outside the tensor are skipped)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


class Tiles(NamedTuple):
    """A launch's tiles and schedule: BLOCK_M query rows (64 per consumer warpgroup), BLOCK_N keys per
    block, STAGES ring slots for K and V; whether a producer warp issues the loads (warp_specialize),
    the scheduling fence (sched_fence), and ping-pong: the two consumer warpgroups as partitions of
    their own, taking turns to issue their products; ``persistent`` (with ping-pong): at most one
    program per SM, each computing many query tiles (``_persistent_kernel``). ``max_registers``: a cap on the registers per
    thread at launch (triton's ``maxnreg``; None: the compiler's choice), so that more programs share
    an SM (a warp-specialised program of one consumer warpgroup is launched as 256 threads, the
    producer warp's warpgroup counting whole: two fit at 128, the consumer raised to what the
    producer gives up). ``narrow_diagonal`` (persistent, block_n = block_m; it acts under a causal
    mask): the first consumer, whose 64 rows keep none of the diagonal block's last 64 keys, computes
    that block's S and P̄V over its first 64 keys alone."""
    block_m: int
    block_n: int
    stages: int
    warp_specialize: bool = True
    sched_fence: bool = True
    pingpong: bool = False
    max_registers: int | None = None
    persistent: bool = False
    narrow_diagonal: bool = False

    def per_block(self) -> "Tiles":
        """These tiles on the kernel of one program per query block: not persistent, and so without
        the narrow diagonal (the persistent kernel's)."""
        return self._replace(persistent=False, narrow_diagonal=False)

    @property
    def num_warps(self) -> int:
        """The kernel's num_warps: its default partition's warps (the first consumer warpgroup alone
        with ping-pong)."""
        return 4 if self.pingpong else self.block_m // 16

    @property
    def q_rows(self) -> int:
        """The rows of a Q, O or R block (a TMA descriptor's block): each consumer's share."""
        return self.block_m // 2 if self.pingpong else self.block_m

    def constexprs(self, head_dim: int, causal: bool, residual: bool = True) -> dict:
        """The kernel's compile-time arguments for these tiles: what the launcher passes and the sm_90a
        compile check compiles. ``residual``: whether the kernel stores R (``stabilize=True``)."""
        return {"HEAD_DIM": head_dim, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "STAGES": self.stages,
                "CAUSAL": causal, "WARP_SPECIALIZE": self.warp_specialize, "SCHED_FENCE": self.sched_fence,
                "PINGPONG": self.pingpong, "STORE_R": residual, "PERSISTENT": self.persistent,
                "NARROW_DIAGONAL": self.narrow_diagonal}

    @property
    def options(self) -> dict:
        """The compile options: num_warps, and floating-point contraction asked for explicitly (S·c − m
        and ℓ·α + Σ P as FMAs, as the Triton kernels compile them under triton 3.6-3.9's default, which
        3.10 turns off); ``maxnreg`` where ``max_registers`` caps the registers; the assembler's PTX
        version where the kernels are assembled by another ``ptxas`` than triton's default
        (``triton.assembler``)."""
        options = {"num_warps": self.num_warps, "enable_fp_fusion": True, **assembler.options()}
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options

    def check(self) -> None:
        """ValueError for tiles the kernel has no schedule for (the loads without warp specialisation
        refill a slot only after its block is done: one slot would wait for itself)."""
        if (self.block_m % 64 or not 64 <= self.block_m <= 256 or self.block_n % 16 or not 16 <= self.block_n <= 256
                or not 2 <= self.stages <= 4):
            raise ValueError(f"{self} is invalid; accepted: block_m 64-256 in steps of 64, block_n 16-256 in steps "
                             "of 16, 2-4 stages")
        if self.pingpong and (self.block_m != 128 or not self.warp_specialize):
            raise ValueError(f"{self} is invalid; ping-pong takes block_m=128 and warp_specialize=True")
        if self.persistent and not self.pingpong:
            raise ValueError(f"{self} is invalid; persistent takes pingpong=True")
        if self.narrow_diagonal and not (self.persistent and self.block_n == self.block_m):
            raise ValueError(f"{self} is invalid; narrow_diagonal takes persistent=True and block_n == block_m")
        if self.max_registers is not None and (isinstance(self.max_registers, bool)
                                               or not isinstance(self.max_registers, int)
                                               or not 64 <= self.max_registers <= 255):
            raise ValueError(f"{self} is invalid; accepted: max_registers None or an int from 64 to 255")


def tiles_for(head_dim: int, causal: bool) -> Tiles:
    """The default tiles: the persistent kernel, 128 query rows as two ping-pong consumer warpgroups
    of 64 and 128 keys per block, two ring slots (shared memory: Q, O, R and 2 × (K, V) tiles of
    128 × d bf16, 224 KiB at d = 128). The fastest schedule at every shape timed on an H200
    (docs/kernels.md, "Hopper path"). At head_dim 64 the first consumer computes a causal tile's
    diagonal block over the 64 keys its rows keep (``narrow_diagonal``; faster on an H100 at 1024 and
    2048 tokens, level at 4096; slower at head_dim 128, where it adds spills)."""
    return Tiles(128, 128, 2, pingpong=True, persistent=True, narrow_diagonal=head_dim == 64)


@functools.cache
def descriptor_layout(rows: int, head_dim: int):
    """The shared-memory layout of a (1, 1, rows, head_dim) bf16 TMA block (128-byte swizzle): the
    layout of the host descriptors and of the kernel's tiles (made once per block shape: building
    one costs a launch tens of microseconds)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], gl.bfloat16)


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, hk, j,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of key block j's K and V tiles into ring slot j % STAGES, each completing its own
    "ready" barrier (the transaction count is the whole tile, rows past N included: TMA counts
    the zeros it fills in)."""
    slot = j % STAGES
    mbarrier.expect(k_ready.index(slot), BLOCK_N * HEAD_DIM * 2)
    tma_load(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
    mbarrier.expect(v_ready.index(slot), BLOCK_N * HEAD_DIM * 2)
    tma_load(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, b, hk, n_blocks,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ring0=0):
    """The producer partition (one warp): key blocks 0 .. n_blocks − 1 into the ring, K before V; a
    slot's u-th reuse (u ≥ 1) waits for the consumers' u-th release of its K ("K free" phase u − 1)
    and of its V ("V free"). ``ring0``: the ring position of block 0 (the blocks the program's
    earlier query tiles streamed; 0 but in the persistent kernel)."""
    for j in range(n_blocks):
        g = ring0 + j
        slot = g % STAGES
        if g >= STAGES:
            mbarrier.wait(k_free.index(slot), ((g // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(slot), BLOCK_N * HEAD_DIM * 2)
        tma_load(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        if g >= STAGES:
            mbarrier.wait(v_free.index(slot), ((g // STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(slot), BLOCK_N * HEAD_DIM * 2)
        tma_load(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _mask(s, start_m, start_n, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
          layout: gl.constexpr, FILL: gl.constexpr = float("-inf")):
    """A (BLOCK_M queries from start_m) × (BLOCK_N keys from start_n) tile with its entries of keys
    past n_k, and with CAUSAL of keys j > i, set to FILL (the Triton kernel's masked blocks: the
    diagonal and the ragged tail): −inf for scores, 0 for the backward's probabilities."""
    # one comparison an entry. Causal: key j is kept for query i when j ≤ min(i, n_k − 1), the row's
    # bound taken once per row (two a thread), where comparing j < n_k and j ≤ i separately and
    # combining them cost about four instructions an entry and kept the index vectors live across the
    # persistent kernel's tiles, spilled under triton 3.6. Without a mask: the column counted from the
    # tile's corner against n_k − start_n, which leaves no vector of absolute column indices either.
    if CAUSAL:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        keep = cols[None, :] <= gl.minimum(rows, n_k - 1)[:, None]
    else:
        keep = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))[None, :] < n_k - start_n
    return gl.where(keep, s, FILL)


@gluon.jit
def _query_program(n_q, n_k, n_heads, group, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """What a program over BLOCK_M query rows works on, on a grid of (query blocks, B·H) whose first
    axis runs longest-first (the last query blocks see the most keys under a causal mask):
    ``_query_block``'s tuple."""
    return _query_block(gl.num_programs(0) - 1 - gl.program_id(0), gl.program_id(1), n_q, n_k, n_heads, group,
                        BLOCK_M, BLOCK_N, CAUSAL)


@gluon.jit
def _query_block(m_block, bh, n_q, n_k, n_heads, group, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr):
    """Query block ``m_block`` (BLOCK_M rows) of batch·head ``bh``: (start_m, b, h, hk, n_blocks, full,
    row0) — its first query row, batch, query head, key/value head, the key blocks it visits, where
    the whole (unmasked) ones end, and its first row of the (B, H, n_q) log-sum-exp."""
    start_m = m_block * BLOCK_M
    b = bh // n_heads
    h = bh % n_heads
    hk = h // group
    if CAUSAL:
        stop = gl.minimum(n_k, start_m + BLOCK_M)
        full = gl.minimum((n_k // BLOCK_N) * BLOCK_N, (start_m // BLOCK_N) * BLOCK_N)
    else:
        stop = n_k
        full = (n_k // BLOCK_N) * BLOCK_N
    n_blocks = (stop + BLOCK_N - 1) // BLOCK_N
    return start_m, b, h, hk, n_blocks, full, bh * n_q


@gluon.jit
def _pair(u, n_pairs, n_m):
    """Work unit u of the persistent kernel: batch·head u // n_pairs, query-block pair p = u % n_pairs
    — blocks n_m − 1 − p and p, the same causal work (n_m + 1 key blocks) in every pair, so that
    units dealt round-robin keep the programs even — as (bh, the later block, the earlier one, how
    many blocks: 2, or 1 where they coincide)."""
    p = u % n_pairs
    hi = n_m - 1 - p
    return u // n_pairs, hi, p, 1 + (p < hi).to(gl.int32)


@gluon.jit
def _init_kv_ring(k_ready, v_ready, k_free, v_free, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The K/V ring's barriers: "ready" completed by a TMA load's bytes, "free" by every consumer."""
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_free.index(i), count=CONSUMERS)
        mbarrier.init(v_free.index(i), count=CONSUMERS)


@gluon.jit
def _invalidate_kv_ring(k_ready, v_ready, k_free, v_free, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(k_free.index(i))
        mbarrier.invalidate(v_free.index(i))


@gluon.jit
def _a_operand(x, mma: gl.constexpr):
    """x (fp32 in the accumulator layout ``mma``) rounded to bf16 and laid out as the register A operand of
    a warpgroup product whose accumulator layout is ``mma`` (P̄ for P̄V; the backward's P̄ᵀ and dS̄)."""
    return gl.convert_layout(x.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))


@gluon.jit
def _schedule_fence(x):
    """x unchanged, after ``bar.warp.sync`` on the warp's active mask, which ptxas does not move
    instructions across and which costs one VOTE in SASS. Applied to ℓ (which sums every exponential
    of the block) just before the wait for the P̄V product: without it ptxas's scheduler places that
    wait above the softmax's exponentials (0-2 of the loops' 132 MUFU.EX2 stay between the waits,
    ``sass.check``), and the softmax no longer overlaps the product. With it all 132 do. A 0 ns
    NANOSLEEP holds the schedule as well but yields the warp, a cost the stall samples showed in the
    consumer loop; ``bar.warp.sync -1`` (a constant mask) holds it only with ping-pong partitions."""
    return gl.inline_asm_elementwise("{ .reg .b32 m; activemask.b32 m; bar.warp.sync m; }\n\tmov.b32 $0, $1;", "=r,r",
                                     [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _max_combine(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _add_combine(a, b):
    return a + b


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale):
    """One key block of the "fa2" arithmetic with the standard row maximum (the Triton forward's
    EMU = 0, STAB = STANDARD branch): (P, m, ℓ, α). The row maximum and sum are ``gl.reduce`` with
    the combines of ``tl.max`` and ``tl.sum`` written here: ``gl.max`` / ``gl.sum`` wrap
    triton.language's combine functions, which become interpreted functions (and cannot be
    compiled) in a process where TRITON_INTERPRET=1 — the CPU test suite's."""
    m_new = gl.maximum(m_i, gl.reduce(s, 1, _max_combine) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.reduce(p, 1, _add_combine)
    return p, m_new, l_i, alpha


@gluon.jit
def _named_barrier(ID: gl.constexpr, ARRIVE: gl.constexpr):
    """``bar.arrive ID, 256`` (ARRIVE: the warp goes on) or ``bar.sync ID, 256`` (it waits until 256
    threads, its own warpgroup's and the other consumer's, have reached barrier ID), once per thread
    of a 4-warp partition. Named barriers 8 and 9 carry the persistent kernel's ping-pong turns:
    triton's own barriers use 0-2 (a partition's, the CTA's), and unlike an mbarrier arrival, which
    Gluon makes one thread's after a barrier across the partition, every thread arrives here
    without waiting for the others."""
    barrier = gl.full([128], ID, gl.int32, layout=gl.BlockedLayout([1], [32], [4], [0]))   # one a thread
    if ARRIVE:
        gl.inline_asm_elementwise("bar.arrive $1, 256;\n\tmov.b32 $0, $1;", "=r,r", [barrier], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync $1, 256;\n\tmov.b32 $0, $1;", "=r,r", [barrier], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _take_turn(sched_mine, t, PINGPONG: gl.constexpr, NAMED: gl.constexpr = False):
    """Ping-pong: wait until the other consumer warpgroup has issued its products of issue point
    t − 1 (warpgroup 0's first wait is met by the arrival made at launch). NAMED: ``sched_mine`` is
    the named barrier (8 or 9, a constexpr) this warpgroup's turns arrive on."""
    if PINGPONG:
        if NAMED:
            _named_barrier(sched_mine, False)
        else:
            mbarrier.wait(sched_mine, t & 1)


@gluon.jit
def _pass_turn(sched_other, PINGPONG: gl.constexpr, NAMED: gl.constexpr = False):
    """Ping-pong: this warpgroup has issued its products; the other one may issue its own."""
    if PINGPONG:
        if NAMED:
            _named_barrier(sched_other, True)
        else:
            mbarrier.arrive(sched_other, count=1)


@gluon.jit
def _step(q, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, sched_mine, sched_other,
          p, acc, m_i, l_i, zero_s, start_m, j, ring, turn, b, hk, n_k, n_blocks, qk_scale, HEAD_DIM: gl.constexpr,
          ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
          WARP_SPECIALIZE: gl.constexpr, SCHED_FENCE: gl.constexpr, PINGPONG: gl.constexpr, mma_s: gl.constexpr,
          mma_o: gl.constexpr, NAMED: gl.constexpr = False, q_free=None):
    """Key block j ≥ 1 of a consumer's loop: issue S_j = Q·K_jᵀ and Ō += P̄_{j−1}·V_{j−1}
    asynchronously, wait for S_j alone, run block j's softmax while the P̄V product computes, then
    wait for it, free K_j and V_{j−1} (or, without WARP_SPECIALIZE, refill slot (j − 1) % STAGES)
    and rescale Ō by α_j. A consumer of one warpgroup (PINGPONG) frees K_j as soon as S_j is done,
    as CUTLASS's pipelines do (one thread of the warpgroup arrives once the product it waited for
    is complete); a consumer of several warpgroups first waits for all of them (a barrier of the
    partition). MASKED (compile time): block j holds the causal diagonal or the ragged tail. ``ring``:
    block j's position in the K/V ring, ``turn``: its issue point in the ping-pong order (both j but in
    the persistent kernel, where they run on across the program's query tiles). S_j covers the block's
    first ``zero_s.shape[1]`` keys (fewer than BLOCK_N: the narrow diagonal, ``mma_s`` that width's
    layout, m and ℓ in its rows' layout); ``q_free``: Q's tile handed back once S_j is done."""
    KEYS: gl.constexpr = zero_s.shape[1]
    slot = ring % STAGES
    prev = (ring - 1) % STAGES
    # P̄_{j−1} is packed to bf16 here, in the block of the product that reads it: carried across the
    # loop's back edge as bf16 halves, ptxas packed them in the other order and swapped every register
    # back (a PRMT per pair) before the product
    p = _a_operand(p, mma_o)
    mbarrier.wait(k_ready.index(slot), (ring // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((ring - 1) // STAGES) & 1)
    _take_turn(sched_mine, turn, PINGPONG, NAMED)
    s_tok = warpgroup_mma(q, _rows(k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]), KEYS).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
    o_tok = warpgroup_mma(p, v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    _pass_turn(sched_other, PINGPONG, NAMED)
    s = warpgroup_mma_wait(1, deps=[s_tok])                 # S_j done, P̄_{j−1}V_{j−1} still in flight
    if PINGPONG:
        mbarrier.arrive(k_free.index(slot), count=1)
    if q_free is not None:
        mbarrier.arrive(q_free, count=1)
    if MASKED:
        s = _mask(s, start_m, j * BLOCK_N, n_k, ROWS, KEYS, CAUSAL, mma_s)
    p_new, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale)
    if SCHED_FENCE:
        l_i = _schedule_fence(l_i)
    acc, p = warpgroup_mma_wait(0, deps=[o_tok, p])
    if not PINGPONG:                                        # every warpgroup of the partition is done with slot prev
        cta_barrier()                                       # (one warpgroup's product is complete for all its warps)
    if WARP_SPECIALIZE:
        if not PINGPONG:
            mbarrier.arrive(k_free.index(slot), count=1)
        mbarrier.arrive(v_free.index(prev), count=1)
    else:
        if j - 1 + STAGES < n_blocks:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, hk, j - 1 + STAGES, BLOCK_N, HEAD_DIM,
                      STAGES)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
    return p_new, acc, m_i, l_i


@gluon.jit
def _last_pv(v_smem, v_ready, v_free, q_free, sched_mine, sched_other, p, acc, ring, turn, HEAD_DIM: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr,
             mma_o: gl.constexpr):
    """A consumer's last P̄V (the block at ring position ``ring``, issued at ``turn``; P̄'s columns: V's
    first rows), waited for; ``q_free`` (not None) handed back first (the last S is done) and, in the
    persistent kernel, V's slot after."""
    if q_free is not None:                                  # the last S is done: the next tile's Q may come
        mbarrier.arrive(q_free, count=1)
    last = ring % STAGES
    mbarrier.wait(v_ready.index(last), (ring // STAGES) & 1)
    _take_turn(sched_mine, turn, PINGPONG, PERSISTENT)
    acc = warpgroup_mma(_a_operand(p, mma_o), _rows(v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), p.shape[1]),
                        acc)
    _pass_turn(sched_other, PINGPONG, PERSISTENT)
    if PERSISTENT:                                          # the last V is read: its slot is free
        mbarrier.arrive(v_free.index(last), count=1)
    return acc


@gluon.jit
def _rows(tile, n: gl.constexpr):
    """A (BLOCK_N, d) shared-memory tile's first n rows (the tile itself when n is all of them)."""
    if n < tile.shape[0]:
        tile = tile.slice(0, n)
    return tile


@gluon.jit
def _store_tile_pair(desc_a, smem_a, desc_b, smem_b, b, h, row):
    """An epilogue's two tiles, already written to shared memory from registers, stored by TMA at
    (b, h, row): a fence makes the writes visible to the async proxy, a barrier waits for every warp
    of the partition, then both stores are issued and waited for."""
    fence_async_shared()
    cta_barrier()
    tma_store(desc_a, [b, h, row, 0], smem_a)
    tma_store(desc_b, [b, h, row, 0], smem_b)
    tma.store_wait(0)


@gluon.jit
def _consumer(k_desc, v_desc, o_desc, r_desc, lse_ptr, q_smem, k_smem, v_smem, r_smem,
              q_bar, k_ready, v_ready, k_free, v_free, sched_mine, sched_other,
              b, h, hk, start_m, n_q, n_k, n_blocks, full, lse_row0, qk_scale,
              HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, WARP_SPECIALIZE: gl.constexpr, SCHED_FENCE: gl.constexpr,
              PINGPONG: gl.constexpr, STORE_R: gl.constexpr, ring0=0, turn0=0, q_phase=0, q_free=None,
              o_smem=None, PERSISTENT: gl.constexpr = False, NARROW: gl.constexpr = False):
    """ROWS query rows from start_m (ROWS / 64 warpgroups, the warps of the partition it runs in):
    Algorithm 1's loop over key blocks 0 .. n_blocks − 1 (blocks from ``full`` on masked),
    software-pipelined so that block j's softmax overlaps block j − 1's P̄V, then the epilogue (O, and
    R where STORE_R, through shared memory and TMA; L). Without WARP_SPECIALIZE it also issues the loads: slot
    (j − 1) % STAGES is refilled with block j − 1 + STAGES once every warpgroup is done with it.
    PINGPONG: one of two such consumers, each its own partition, taking turns to issue products
    (``sched_mine`` / ``sched_other``) so that one's softmax runs while the other's products do.
    PERSISTENT: one query tile of many — block 0 sits at ring position ``ring0`` and issue point
    ``turn0``, Q's tile arrives with phase ``q_phase`` of ``q_bar`` and is handed back (``q_free``) once
    the last S is done, and O leaves through ``o_smem``, its store waited for only before the next
    tile's epilogue writes there; otherwise O leaves through Q's tile and the stores are waited for.
    NARROW (causal, BLOCK_N = 2·ROWS, the tile's first ROWS rows): where the last key block is the
    diagonal one starting at start_m and not the first, its S and the last P̄V run over its first ROWS
    keys, the only ones these rows keep (the keys past them are masked in every row: the same O, ℓ and
    m, their exponentials being zeros)."""
    WARPS: gl.constexpr = ROWS // 16                        # 4 warps (one warpgroup) per 64 rows
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, HEAD_DIM, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)

    q = q_smem.reshape([ROWS, HEAD_DIM])
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=mma_s)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=mma_o)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_s)

    enter_scope("q_wait")
    mbarrier.wait(q_bar, q_phase)
    exit_scope("q_wait")
    enter_scope("first_block")
    # key block 0: its scores, then its softmax (nothing to overlap with yet)
    first = ring0 % STAGES
    mbarrier.wait(k_ready.index(first), (ring0 // STAGES) & 1)
    _take_turn(sched_mine, turn0, PINGPONG, PERSISTENT)
    s = warpgroup_mma(q, k_smem.index(first).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s, use_acc=False)
    _pass_turn(sched_other, PINGPONG, PERSISTENT)
    if WARP_SPECIALIZE:                                     # K_0 is free once every warpgroup's S_0 is done
        if not PINGPONG:
            cta_barrier()
        mbarrier.arrive(k_free.index(first), count=1)
    if full <= 0:
        s = _mask(s, start_m, 0, n_k, ROWS, BLOCK_N, CAUSAL, mma_s)
    p, m_i, l_i, _ = _softmax(s, m_i, l_i, qk_scale)
    # whole key blocks first, then the masked ones (the causal diagonal, the ragged tail): two loops,
    # so that no branch separates a product's issue from its wait (ptxas waits for every product
    # in flight where control flow joins)
    exit_scope("first_block")
    n_full = gl.maximum(full // BLOCK_N, 1)
    enter_scope("full_blocks")
    for j in range(1, n_full):
        p, acc, m_i, l_i = _step(q, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, sched_mine,
                                 sched_other, p, acc, m_i, l_i, zero_s, start_m, j, ring0 + j, turn0 + j, b, hk, n_k,
                                 n_blocks, qk_scale, HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, False, WARP_SPECIALIZE,
                                 SCHED_FENCE, PINGPONG, mma_s, mma_o, PERSISTENT)
    exit_scope("full_blocks")
    enter_scope("masked_blocks")
    narrow = False                                          # (compile time where not NARROW)
    n_wide = n_blocks
    if NARROW:
        narrow = (n_blocks > 1) & ((n_blocks - 1) * BLOCK_N == start_m)
        n_wide = n_blocks - narrow.to(gl.int32)
    for j in range(n_full, n_wide):
        p, acc, m_i, l_i = _step(q, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, sched_mine,
                                 sched_other, p, acc, m_i, l_i, zero_s, start_m, j, ring0 + j, turn0 + j, b, hk, n_k,
                                 n_blocks, qk_scale, HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, True, WARP_SPECIALIZE,
                                 SCHED_FENCE, PINGPONG, mma_s, mma_o, PERSISTENT)
    if narrow:
        mma_h: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, ROWS, 16])
        row_h: gl.constexpr = gl.SliceLayout(1, mma_h)
        j = n_blocks - 1
        p_h, acc, m_h, l_h = _step(q, k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free,
                                   sched_mine, sched_other, p, acc, gl.convert_layout(m_i, row_h),
                                   gl.convert_layout(l_i, row_h), gl.zeros([ROWS, ROWS], gl.float32, layout=mma_h),
                                   start_m, j, ring0 + j, turn0 + j, b, hk, n_k, n_blocks, qk_scale, HEAD_DIM,
                                   ROWS, BLOCK_N, STAGES, CAUSAL, True, WARP_SPECIALIZE, SCHED_FENCE, PINGPONG,
                                   mma_h, mma_o, PERSISTENT, q_free)
        acc = _last_pv(v_smem, v_ready, v_free, None, sched_mine, sched_other, p_h, acc, ring0 + j,
                       turn0 + n_blocks, HEAD_DIM, BLOCK_N, STAGES, PINGPONG, PERSISTENT, mma_o)
        m_i = gl.convert_layout(m_h, row_s)
        l_i = gl.convert_layout(l_h, row_s)
    else:
        acc = _last_pv(v_smem, v_ready, v_free, q_free, sched_mine, sched_other, p, acc, ring0 + n_blocks - 1,
                       turn0 + n_blocks, HEAD_DIM, BLOCK_N, STAGES, PINGPONG, PERSISTENT, mma_o)

    exit_scope("masked_blocks")
    enter_scope("epilogue")
    # epilogue: O = Ō/ℓ (bf16), its store's residual R (bf16), L = (m + log2 ℓ)·ln 2
    l_o = gl.convert_layout(l_i, row_o)
    o = acc / l_o[:, None]
    o16 = o.to(gl.bfloat16)
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    rows = start_m + gl.arange(0, ROWS, layout=row_s)
    gl.store(lse_ptr + lse_row0 + rows, lse, mask=rows < n_q)
    if PERSISTENT:
        out = o_smem
        tma.store_wait(0)                                   # the last tile's O and R stores have read out, r_smem
    else:
        out = q_smem
    cta_barrier()                                           # (and every warpgroup's last S is done: Q's tile is free)
    out.reshape([ROWS, HEAD_DIM]).store(o16)
    if STORE_R:
        r_smem.reshape([ROWS, HEAD_DIM]).store((o - o16.to(gl.float32)).to(gl.bfloat16))
    fence_async_shared()
    cta_barrier()
    tma_store(o_desc, [b, h, start_m, 0], out)
    if STORE_R:
        tma_store(r_desc, [b, h, start_m, 0], r_smem)
    if not PERSISTENT:
        tma.store_wait(0)
    exit_scope("epilogue")


@gluon.jit
def _persistent_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, k_free,
                         v_free, n_q, n_k, n_heads, group, n_bh, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """The persistent kernel's producer (one warp): for each query tile of the program's units
    (``_pair``), the two consumers' Q tiles (each once its consumer handed the last one back), then the
    tile's key blocks into the K/V ring, whose positions run on across tiles."""
    ROWS: gl.constexpr = BLOCK_M // 2
    n_m = (n_q + BLOCK_M - 1) // BLOCK_M
    n_pairs = (n_m + 1) // 2
    ring = n_q * 0
    tile = n_q * 0
    for u in range(gl.program_id(0), n_bh * n_pairs, gl.num_programs(0)):
        bh, hi, lo, n_tiles = _pair(u, n_pairs, n_m)
        for t in range(n_tiles):
            start_m, b, h, hk, n_blocks, full, row0 = _query_block(hi - t * (hi - lo), bh, n_q, n_k, n_heads, group,
                                                                   BLOCK_M, BLOCK_N, CAUSAL)
            for i in gl.static_range(2):
                if tile > 0:
                    mbarrier.wait(q_free.index(i), (tile - 1) & 1)
                mbarrier.expect(q_bar.index(i), ROWS * HEAD_DIM * 2)
                tma_load(q_desc, [b, h, start_m + i * ROWS, 0], q_bar.index(i), q_smem.index(i))
            _producer(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, b, hk, n_blocks, BLOCK_N,
                      HEAD_DIM, STAGES, ring)
            ring += n_blocks
            tile += 1


@gluon.jit
def _persistent_consumer(k_desc, v_desc, o_desc, r_desc, lse_ptr, q_smem, o_smem, k_smem, v_smem, r_smem,
                         q_bar, q_free, k_ready, v_ready, k_free, v_free,
                         n_q, n_k, n_heads, group, n_bh, qk_scale, W: gl.constexpr, HEAD_DIM: gl.constexpr,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                         SCHED_FENCE: gl.constexpr, STORE_R: gl.constexpr, NARROW_DIAGONAL: gl.constexpr):
    """Ping-pong consumer W of the persistent kernel: rows W·BLOCK_M/2 … of each query tile the
    producer streams (the same sequence of tiles), ring positions and issue points running on across
    tiles; its last O and R stores waited for at the end. Turns pass through named barriers: W takes
    its turns on barrier 8 + W and passes them on 9 − W; warpgroup 1's arrival at the start gives
    warpgroup 0 the first, and warpgroup 0's last wait takes warpgroup 1's last arrival, so both
    barriers end empty."""
    MINE: gl.constexpr = 8 + W
    OTHER: gl.constexpr = 9 - W
    if W == 1:
        _named_barrier(8, True)
    ROWS: gl.constexpr = BLOCK_M // 2
    n_m = (n_q + BLOCK_M - 1) // BLOCK_M
    n_pairs = (n_m + 1) // 2
    ring = n_q * 0
    tile = n_q * 0
    for u in range(gl.program_id(0), n_bh * n_pairs, gl.num_programs(0)):
        bh, hi, lo, n_tiles = _pair(u, n_pairs, n_m)
        for t in range(n_tiles):
            start_m, b, h, hk, n_blocks, full, row0 = _query_block(hi - t * (hi - lo), bh, n_q, n_k, n_heads, group,
                                                                   BLOCK_M, BLOCK_N, CAUSAL)
            # issue points: n_blocks + 1 a tile, so block 0's is ring + tile
            _consumer(k_desc, v_desc, o_desc, r_desc, lse_ptr, q_smem, k_smem, v_smem, r_smem, q_bar, k_ready,
                      v_ready, k_free, v_free, MINE, OTHER, b, h, hk, start_m + W * ROWS, n_q, n_k,
                      n_blocks, full, row0, qk_scale, HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, True, SCHED_FENCE,
                      True, STORE_R, ring, ring + tile, tile & 1, q_free, o_smem, True,
                      NARROW_DIAGONAL and CAUSAL and W == 0)
            ring += n_blocks
            tile += 1
    if W == 0:
        _named_barrier(8, False)
    tma.store_wait(0)


@gluon.jit
def attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, r_desc, lse_ptr, n_q, n_k, n_heads, group, n_bh, qk_scale,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
                           SCHED_FENCE: gl.constexpr, PINGPONG: gl.constexpr, STORE_R: gl.constexpr,
                           PERSISTENT: gl.constexpr, NARROW_DIAGONAL: gl.constexpr):
    """One program: query rows [start_m, start_m + BLOCK_M) of batch·head program_id(1), on a grid of
    (query blocks, B·H) whose first axis runs longest-first (the last query blocks see the most
    keys under a causal mask). Descriptors: rank 4 over (B, H, N, d), blocks (1, 1, rows, d): k_desc
    and v_desc BLOCK_N rows; q_desc, o_desc and r_desc BLOCK_M rows, or BLOCK_M / 2 with PINGPONG.
    ``lse_ptr``: (B, H, n_q) fp32, contiguous. ``group``: query heads per key/value head.
    ``qk_scale``: the softmax scale times log2 e. Launch with num_warps = BLOCK_M // 16 (the
    consumer warpgroups; WARP_SPECIALIZE adds a producer warp), or 4 with PINGPONG (the first
    consumer warpgroup; the second and the producer are worker partitions). PINGPONG needs
    WARP_SPECIALIZE and BLOCK_M = 128. STORE_R off: O alone (r_desc unused; the launcher passes
    o's). ``n_bh``: B·H. PERSISTENT (with PINGPONG): a grid of at most one program per SM, each
    taking the units ``_pair`` deals round-robin (``_persistent_kernel``); NARROW_DIAGONAL: the first
    consumer's diagonal block over the keys its rows keep."""
    if PERSISTENT:
        _persistent_kernel(q_desc, k_desc, v_desc, o_desc, r_desc, lse_ptr, n_q, n_k, n_heads, group, n_bh, qk_scale,
                           HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, SCHED_FENCE, STORE_R, NARROW_DIAGONAL)
    else:
        _program_kernel(q_desc, k_desc, v_desc, o_desc, r_desc, lse_ptr, n_q, n_k, n_heads, group, qk_scale,
                        HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, WARP_SPECIALIZE, SCHED_FENCE, PINGPONG, STORE_R)


@gluon.jit
def _persistent_kernel(q_desc, k_desc, v_desc, o_desc, r_desc, lse_ptr, n_q, n_k, n_heads, group, n_bh, qk_scale,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, SCHED_FENCE: gl.constexpr, STORE_R: gl.constexpr,
                       NARROW_DIAGONAL: gl.constexpr):
    """The persistent ping-pong forward: the program's shared memory, barriers and partitions set up
    once; the producer streams every query tile of the program's units and the two consumers compute
    them, so one tile's epilogue, the next one's Q load and its first key blocks overlap the other
    consumer's products instead of a new program's start. Shared memory: Q, O (and R) tiles per
    consumer, the K/V ring."""
    ROWS: gl.constexpr = BLOCK_M // 2
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 1, 1, ROWS, HEAD_DIM], q_desc.layout)
    o_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 1, 1, ROWS, HEAD_DIM], o_desc.layout)
    if STORE_R:
        r_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 1, 1, ROWS, HEAD_DIM], r_desc.layout)
    else:
        r_smem = o_smem
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_free.index(i), count=1)
    _init_kv_ring(k_ready, v_ready, k_free, v_free, STAGES, 2)
    fence_async_shared()

    gl.warp_specialize([
        (_persistent_consumer, (k_desc, v_desc, o_desc, r_desc, lse_ptr, q_smem.index(0), o_smem.index(0), k_smem,
                                v_smem, r_smem.index(0), q_bar.index(0), q_free.index(0), k_ready, v_ready, k_free,
                                v_free, n_q, n_k, n_heads, group, n_bh, qk_scale, 0,
                                HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, SCHED_FENCE, STORE_R, NARROW_DIAGONAL)),
        (_persistent_consumer, (k_desc, v_desc, o_desc, r_desc, lse_ptr, q_smem.index(1), o_smem.index(1), k_smem,
                                v_smem, r_smem.index(1), q_bar.index(1), q_free.index(1), k_ready, v_ready, k_free,
                                v_free, n_q, n_k, n_heads, group, n_bh, qk_scale, 1,
                                HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, SCHED_FENCE, STORE_R, NARROW_DIAGONAL)),
        (_persistent_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready,
                                k_free, v_free, n_q, n_k, n_heads, group, n_bh, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                                CAUSAL)),
    ], [4, 1], [240, 24])
    for i in gl.static_range(2):
        mbarrier.invalidate(q_bar.index(i))
        mbarrier.invalidate(q_free.index(i))
    _invalidate_kv_ring(k_ready, v_ready, k_free, v_free, STAGES)


@gluon.jit
def _program_kernel(q_desc, k_desc, v_desc, o_desc, r_desc, lse_ptr, n_q, n_k, n_heads, group, qk_scale,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, WARP_SPECIALIZE: gl.constexpr, SCHED_FENCE: gl.constexpr,
                    PINGPONG: gl.constexpr, STORE_R: gl.constexpr):
    """The forward of one program per query block (``attn_fwd_hopper_kernel`` without PERSISTENT)."""
    start_m, b, h, hk, n_blocks, full, lse_row0 = _query_program(n_q, n_k, n_heads, group, BLOCK_M, BLOCK_N,
                                                                 CAUSAL)

    CONSUMERS: gl.constexpr = 2 if PINGPONG else 1          # partitions computing (each frees a slot)
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS                # query rows per computing partition
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, 1, 1, ROWS, HEAD_DIM], q_desc.layout)
    if STORE_R:
        r_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, 1, 1, ROWS, HEAD_DIM], r_desc.layout)
    else:
        r_smem = q_smem
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(sched.index(i), count=1)
    _init_kv_ring(k_ready, v_ready, k_free, v_free, STAGES, CONSUMERS)
    fence_async_shared()

    for i in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bar.index(i), ROWS * HEAD_DIM * 2)
        tma_load(q_desc, [b, h, start_m + i * ROWS, 0], q_bar.index(i), q_smem.index(i))
    if PINGPONG:
        mbarrier.arrive(sched.index(0), count=1)           # warpgroup 0 issues first
        gl.warp_specialize([
            (_consumer, (k_desc, v_desc, o_desc, r_desc, lse_ptr, q_smem.index(0), k_smem, v_smem, r_smem.index(0),
                         q_bar.index(0), k_ready, v_ready, k_free, v_free, sched.index(0), sched.index(1),
                         b, h, hk, start_m, n_q, n_k, n_blocks, full, lse_row0, qk_scale,
                         HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, True, SCHED_FENCE, True, STORE_R)),
            (_consumer, (k_desc, v_desc, o_desc, r_desc, lse_ptr, q_smem.index(1), k_smem, v_smem, r_smem.index(1),
                         q_bar.index(1), k_ready, v_ready, k_free, v_free, sched.index(1), sched.index(0),
                         b, h, hk, start_m + ROWS, n_q, n_k, n_blocks, full, lse_row0, qk_scale,
                         HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, True, SCHED_FENCE, True, STORE_R)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, b, hk, n_blocks,
                         BLOCK_N, HEAD_DIM, STAGES)),
        ], [4, 1], [240, 24])
    elif WARP_SPECIALIZE:
        gl.warp_specialize([
            (_consumer, (k_desc, v_desc, o_desc, r_desc, lse_ptr, q_smem.index(0), k_smem, v_smem, r_smem.index(0),
                         q_bar.index(0), k_ready, v_ready, k_free, v_free, sched.index(0), sched.index(1),
                         b, h, hk, start_m, n_q, n_k, n_blocks, full, lse_row0, qk_scale,
                         HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, True, SCHED_FENCE, False, STORE_R)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, b, hk, n_blocks,
                         BLOCK_N, HEAD_DIM, STAGES)),
        ], [1], [24])
    else:
        for j in gl.static_range(STAGES):
            if j < n_blocks:
                _issue_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, hk, j, BLOCK_N, HEAD_DIM, STAGES)
        _consumer(k_desc, v_desc, o_desc, r_desc, lse_ptr, q_smem.index(0), k_smem, v_smem, r_smem.index(0),
                  q_bar.index(0), k_ready, v_ready, k_free, v_free, sched.index(0), sched.index(1),
                  b, h, hk, start_m, n_q, n_k, n_blocks, full, lse_row0, qk_scale,
                  HEAD_DIM, ROWS, BLOCK_N, STAGES, CAUSAL, False, SCHED_FENCE, False, STORE_R)
    for i in gl.static_range(CONSUMERS):
        mbarrier.invalidate(q_bar.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(sched.index(i))
    _invalidate_kv_ring(k_ready, v_ready, k_free, v_free, STAGES)
