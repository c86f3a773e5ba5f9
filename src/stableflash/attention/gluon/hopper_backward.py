"""The attention backward for Hopper (sm_90a) in Gluon: the counterpart of ``hopper_forward.py``.

What it computes is the Triton backward's (``attention/triton/backward.py``: attn_bwd_dkdv_kernel
and attn_bwd_dq_kernel, EMU = 0, no soft cap, no masks beyond CAUSAL) for the δ the host computed
beforehand with the Triton ``delta_dot_kernel`` (δ = rowsum(dO ∘ (O + R)) for the stabilized
forward's outputs): with the forward's log-sum-exp L (natural log) and c = scale·log2 e,
P = exp2(S·c − L·log2 e) from S = QKᵀ in fp32, dV = P̄ᵀ dO with P̄ = P rounded to bf16,
dP = dO Vᵀ, dS = P ∘ (dP − δ), dK = scale · dS̄ᵀ Q and dQ = scale · dS̄ K with dS̄ = dS rounded
to bf16; fp32 accumulators, bf16 outputs. Causal is top-left aligned (query i sees keys j ≤ i).
Grouped-query heads: the dK, dV of a key/value head sum over its query heads in one program.

dQ comes from a kernel of its own (one program per query block looping over the key blocks, as the
Triton path does), not from fp32 atomic adds of per-key-block partial sums: every dQ element is
then summed in one fixed order (deterministic, bit for bit from run to run) and written once in
bf16, with no fp32 dQ buffer and no conversion pass. It costs two products per block pair more
(S and dP are computed in both kernels: 7 products instead of 5).

dK/dV (``attn_bwd_dkdv_hopper_kernel``): one program per BLOCK_N keys of one batch·kv-head, K and
V resident in shared memory, one consumer warpgroup per 64 keys. It loops over the query heads of
the group and, for each, over the query blocks that see the keys (from the causal diagonal on):

- Q and dO tiles (BLOCK_M rows, rank-4 TMA descriptors over (B, H, N, d): a tile never crosses a
  head, rows past N read as zero) stream through a ring of STAGES slots, each with a "Q ready", a
  "dO ready" and a "slot free" barrier; L and δ of the block's rows are ordinary loads (BLOCK_M/4
  values per thread each), L issued before the wait for Q, δ before the wait for dPᵀ. Query rows
  past N_q are masked.
- The products are taken transposed, keys as rows, so that each one's result is the next one's
  register operand with no transpose in registers: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (Q and dO as
  permuted shared-memory views), dV += P̄ᵀ·dO and dK += dS̄ᵀ·Q (P̄ᵀ, dS̄ᵀ from registers).
- In flight: Sᵀ and dPᵀ are issued back to back; the wait for Sᵀ leaves dPᵀ in flight while Pᵀ's
  exponentials run; dV is issued, and the wait for dPᵀ leaves it in flight while dSᵀ is formed;
  then dK is issued and the block's products are waited for. Masked blocks (the causal diagonal,
  the ragged tail of the queries) run in loops of their own, so that no branch separates a
  product's issue from its wait.
- Epilogue: dK·scale and dV in bf16 through K's and V's shared memory and TMA stores (rows past
  N_k are not written).

dQ (``attn_bwd_dq_hopper_kernel``): one program per BLOCK_M query rows of one batch·head, one
consumer warpgroup per 64 rows, Q and dO resident, K and V streamed through the forward's ring
(its ``_producer``), longest query blocks first. Software-pipelined like the forward: for key
block j, S_j = Q·K_jᵀ, dP_j = dO·V_jᵀ and the previous block's dQ += dS̄_{j−1}·K_{j−1} are issued
back to back; the wait for S_j leaves the other two in flight, the wait for dP_j the dQ product.
No product issue depends on P_j between those waits, and ptxas places the wait for dP_j (and most
of the time the last wait too) above P_j's exponentials: within a warpgroup they overlap the
products less than in the dK/dV kernel (``sass.check_backward``'s "ex2_in_flight"), and the
overlap comes from the other warpgroup. L and δ of the program's rows are loaded once.

dK, dV and dQ in one kernel (``attn_bwd_hopper_kernel``, tiles with ``atomic_dq``: what the route
runs, at head_dim 64 from 1024 keys on and at 128 from 512): the dK/dV kernel above, each consumer warpgroup also
adding its 64 keys' share of dQ, dS̄·K, to an fp32 (B, H, N_q, d) buffer that the δ kernel zeroed
(``launch_backward.dq_buffer``), by a
TMA reduce-add (``cp.reduce.async.bulk.tensor``, UTMAREDG) from an fp32 tile in shared memory: 5
products per block pair instead of 7, and a pass afterwards scaling the sums into bf16 dQ
(``launch_backward.scale_dq_kernel``). The additions come in no fixed order, so dQ may differ in
its last bits from run to run (under ``torch.use_deterministic_algorithms`` the route runs the
two kernels above at head_dim 128, the Triton backward at 64). With one consumer warpgroup over 64
keys and 64-row query blocks (``_dkdv_pipelined_step``), per step the previous block's share is
issued beside Sᵀ and dPᵀ, A being the dS̄ᵀ that block left in shared memory (read transposed), B
the resident K; the wait for dPᵀ also completes it, its fp32 tile is staged while dV computes,
this block's dS̄ᵀ replaces the previous one under the same fence, and the reduce-add is issued
while dK computes — every product still waited for within the step.

At head_dim 64 the route runs two consumer warpgroups over 128 keys and 128-row query blocks
(``atomic_backward_tiles(64)``, ``_dkdv_split_pipelined_step``), the tile of FlashAttention-3's
head_dim-64 backward: each product is 64 keys × 128 query rows, so a block pair reads a quarter
fewer operand bytes from shared memory than four 64 × 64 steps, and each block's dQ share is split
by rows — both consumers leave their dS̄ᵀ (64 keys × 128 rows) in a shared-memory slot, and each
adds rows [64·W, 64·W + 64) of dS̄·K over all 128 keys, one 64 × 64 fp32 tile (half the staged
bytes of a share per key). The share is taken one block behind: the previous block's, issued
right after this block's Sᵀ, computes while Pᵀ's exponentials run and is staged before P̄ᵀ·dO and
dPᵀ are issued (in that order, so that the Sᵀ, dPᵀ and share accumulators are never all in flight:
with them the step's 224 accumulator registers would not fit beside the dK, dV ones and ptxas would
serialise every product).

At head_dim 128 the dK, dV accumulators take 128 fp32 registers a thread, and a consumer's own
share of dQ (64 query rows × 128 columns) would take 64 more. With 64-row query blocks (what the
route runs: ``atomic_backward_tiles(128)``, ``_dkdv_split_step``) the share is split by columns
instead: both consumers put their dS̄ᵀ (64 keys each) into one shared-memory slot, meet on a "ds
ready" barrier, and each computes columns [64·W, 64·W + 64) of dS̄·K over all 128 keys (32
registers a thread) and reduce-adds them; δ is the dPᵀ product's starting accumulator (dPᵀ − δ
comes out of the product), so that no δ registers live beside P. With narrower query blocks (16
or 32 rows) the share is taken transposed, dQᵀ = Kᵀ·dS̄ᵀ (``_dq_share``; the buffer is then dQᵀ,
(B, H, d, N_q)), whose products are too narrow to be fast (docs/kernels.md).

The TMA and CTA-barrier spellings of the triton release at hand are those bound in
``hopper_forward`` (``tma_load``, ``tma_store``, ``tma_atomic_add``, ``cta_barrier``), whose K/V
producer the dQ kernel shares.

Warp specialisation (both kernels): each consumer warpgroup is a partition of its own (the first
the default partition, launched with num_warps = 4; the second a worker of 4 warps, both raised to
240 registers) and one producer warp (24 registers) issues every TMA load and waits on the "free"
barriers, which count one release per consumer. Separate partitions let the two warpgroups drift
apart, one's elementwise work running while the other's products do: triton follows each product
wait of a partition of several warpgroups with a barrier across them, which would hold them in
step. A warpgroup releases a slot as soon as its products that read it are complete. With
``block_n`` 64 a program has one consumer warpgroup; launched under a register cap
(``BackwardTiles.max_registers``) two programs share an SM, the consumer raised to what the
producer's warpgroup gives up (232 registers at 128).
"""
from __future__ import annotations

from typing import NamedTuple

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from stableflash.attention.gluon.hopper_forward import (_a_operand, _init_kv_ring, _invalidate_kv_ring, _mask,
                                                        _producer, _query_program, _store_tile_pair, cta_barrier,
                                                        tma_atomic_add, tma_load, tma_store)
from stableflash.attention.triton import assembler

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
# batch·kv-heads whose key blocks are launched together by programs of 128 keys (``_launch_order``)
KEY_ORDER_HEADS: gl.constexpr = gl.constexpr(4)


class BackwardTiles(NamedTuple):
    """A backward launch's tiles. dK/dV kernel: ``block_n`` keys per program (64 per consumer
    warpgroup: 64 or 128), ``block_m`` query rows per streamed block, ``stages`` ring slots for Q
    and dO. dQ kernel: ``dq_block_m`` query rows per program (64 per consumer warpgroup: 64 or
    128), ``dq_block_n`` keys per streamed block, ``dq_stages`` ring slots for K and V.
    ``atomic_dq``: dQ added up by the dK/dV kernel instead (``attn_bwd_hopper_kernel``: TMA
    reduce-adds into an fp32 buffer, 5 products instead of 7; the dq_* fields unused).
    ``max_registers``: a cap on the registers per thread at launch (triton's ``maxnreg``; None: the
    compiler's choice), so that more programs share an SM: a program of one consumer warpgroup is
    launched as 256 threads (its producer warp's warpgroup), two of them fit at 128.
    ``skip_hidden``: with the dQ shares split between the consumers (``split_dq``), under a causal mask
    the second consumer warpgroup leaves out the products of query rows that all come before its 64
    keys: at head_dim 128 (64-row blocks) it runs none of such a block's products but its part of the
    dQ share (``_dkdv_hidden_step``); at head_dim 64 (128-row blocks) it runs its diagonal block over
    the block's last 64 rows only (``_dkdv_split_pipelined_step`` with ``FIRST``). dK and dV are the
    same bit for bit, since the products left out add zeros."""
    block_n: int
    block_m: int
    stages: int
    dq_block_m: int
    dq_block_n: int
    dq_stages: int
    atomic_dq: bool = False
    max_registers: int | None = None
    skip_hidden: bool = False

    def dkdv_constexprs(self, head_dim: int, causal: bool) -> dict:
        """The dK/dV kernel's compile-time arguments: what the launcher passes and the sm_90a compile
        check compiles (SPLIT_DQ: ``split_dq``; SKIP_HIDDEN: ``skip_hidden`` where it applies, causal with
        the shares split)."""
        return {"HEAD_DIM": head_dim, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "STAGES": self.stages,
                "CAUSAL": causal, "SPLIT_DQ": self.split_dq(head_dim),
                "SKIP_HIDDEN": self.skip_hidden and causal and self.split_dq(head_dim)}

    def dq_constexprs(self, head_dim: int, causal: bool) -> dict:
        """The dQ kernel's compile-time arguments."""
        return {"HEAD_DIM": head_dim, "BLOCK_M": self.dq_block_m, "BLOCK_N": self.dq_block_n,
                "STAGES": self.dq_stages, "CAUSAL": causal}

    @property
    def options(self) -> dict:
        """The compile options of both kernels: num_warps 4 (the first consumer warpgroup; the other
        and the producer warp are worker partitions) and floating-point contraction asked for
        explicitly (S·c − L·log2 e as one FMA, as the Triton kernels compile it under triton
        3.6-3.9's default); ``maxnreg`` where ``max_registers`` caps the registers; the assembler's
        PTX version where the kernels are assembled by another ``ptxas`` than triton's default
        (``triton.assembler``)."""
        options = {"num_warps": 4, "enable_fp_fusion": True, **assembler.options()}
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options

    def split_dq(self, head_dim: int) -> bool:
        """Whether the two consumer warpgroups split each block's dQ share between them (with
        ``atomic_dq``): at head_dim 128 with 64-row query blocks by columns (``_dkdv_split_step``), at 64
        with 128 keys and 128-row query blocks by rows (``_dkdv_split_pipelined_step``) — each
        warpgroup adds a 64 × 64 fp32 tile, its part of the share of all 128 keys."""
        return self.atomic_dq and self.block_n == 128 and (head_dim, self.block_m) in ((128, 64), (64, 128))

    def dq_tile(self, head_dim: int) -> tuple[int, int]:
        """With ``atomic_dq``: (rows, columns) of the fp32 tile one reduce-add adds into the dQ buffer —
        (64, 64) where the consumers split the share (``split_dq``: each adds its half of the columns at
        head_dim 128, of the rows at 64); otherwise (block_m, d) at head_dim 64 and, at 128 with
        narrower query blocks, (d, block_m), the share transposed (``_dq_share``; the buffer is then dQᵀ)."""
        if self.split_dq(head_dim):
            return 64, 64
        return (self.block_m, head_dim) if head_dim != 128 else (head_dim, self.block_m)

    @property
    def vector_block(self) -> int:
        """Entries of L and δ the dK/dV producer loads per query block (TMA, with its Q and dO tiles):
        block_m, at least 32, so that every ring slot of them starts 128-byte aligned in shared
        memory, as TMA writes it (16-row blocks read the first 16)."""
        return max(self.block_m, 32)

    def dq_transposed(self, head_dim: int) -> bool:
        """Whether the dQ buffer these tiles add into is dQᵀ, (B, H, d, N_q) (``dq_tile``)."""
        return self.atomic_dq and head_dim == 128 and self.block_m != 64

    def check(self, head_dim: int | None = None) -> None:
        """ValueError for tiles the kernels have no schedule for (at ``head_dim``, where given: with
        ``atomic_dq`` the query block is a warpgroup product's rows at head_dim 64, 64 or 128, and its
        columns at 128, where the dQ share is taken transposed: 16, 32 or 64)."""
        atomic_rows = {64: (64, 128), 128: (16, 32, 64), None: (16, 32, 64, 128)}.get(head_dim, ())
        if (self.block_n not in (64, 128) or self.dq_block_m not in (64, 128) or self.block_m not in (16, 32, 64, 128)
                or self.dq_block_n not in (16, 32, 64, 128) or not 2 <= self.stages <= 4
                or not 2 <= self.dq_stages <= 4 or (self.atomic_dq and self.block_m not in atomic_rows)
                or (self.atomic_dq and head_dim == 128 and self.block_m == 64 and self.block_n != 128)
                or (self.max_registers is not None and (isinstance(self.max_registers, bool)
                                                        or not isinstance(self.max_registers, int)
                                                        or not 64 <= self.max_registers <= 255))):
            where = "" if head_dim is None else f" at head_dim {head_dim}"
            raise ValueError(f"{self}{where} is invalid; accepted: block_n and dq_block_m 64 or 128 (one or two "
                             "consumer warpgroups), block_m and dq_block_n 16, 32, 64 or 128 (with atomic_dq: block_m "
                             "64 or 128 at head_dim 64, 16, 32 or 64 at head_dim 128, 64 there with block_n 128), "
                             "2-4 stages each, "
                             "max_registers None or an int from 64 to 255")


def backward_tiles_for(head_dim: int, causal: bool) -> BackwardTiles:
    """The default tiles: dK/dV over 128 keys (two consumer warpgroups) with query blocks of 64
    rows in two slots at head_dim 64, of 32 rows in three slots at 128 (the dK, dV accumulators
    take d registers per thread next to the 64 × block_m tiles Sᵀ, dPᵀ: 64-row blocks spill at
    head_dim 128); dQ over 128 query rows (two consumer warpgroups) with key blocks of 128 in two
    slots at head_dim 64, of 32 in three slots at 128. No spills (``sass.check_backward``). At
    head_dim 128 the dQ tile is the fastest of the variants without spills
    timed on an H100 at 4×16×8192×128 (docs/kernels.md, "Hopper path")."""
    if head_dim <= 64:
        return BackwardTiles(128, 64, 2, 128, 128, 2)
    return BackwardTiles(128, 32, 3, 128, 32, 3)


def atomic_backward_tiles(head_dim: int) -> BackwardTiles:
    """The tiles of the backward that adds dQ up by TMA reduce-adds (what the route runs). Head_dim 64:
    128 keys per program (two consumer warpgroups), query blocks of 128 rows in two slots (194 KiB of
    shared memory), each block's dQ share split by rows between the warpgroups and taken one block
    behind (``_dkdv_split_pipelined_step``; 4–14% faster than one warpgroup over 64 keys and 64-row
    blocks, two programs an SM, and 2–4% faster than the same tiles with the share waited for within
    its step, docs/kernels.md). Head_dim 128: 128 keys per program, query blocks of 64 rows in three
    slots (226 KiB of shared memory; two slots: 3–5% slower at 1024–8192 tokens, causal), each block's dQ
    share split by columns (``_dkdv_split_step``; 32-row blocks with the share transposed were slower
    than the two kernels, and the share taken one block behind 12–14% slower under a causal mask,
    docs/kernels.md), and under a causal mask the second consumer's first diagonal block, which its
    keys all follow, skipped (``skip_hidden``: the backward 1–11% faster at 8192–1024 tokens)."""
    if head_dim == 64:
        return BackwardTiles(128, 128, 2, 128, 128, 2, atomic_dq=True)
    if head_dim == 128:
        return BackwardTiles(128, 64, 3, 128, 128, 2, atomic_dq=True, skip_hidden=True)
    raise ValueError(f"head_dim {head_dim} is invalid for the backward with atomic dQ; accepted: 64 or 128")


# head_dim 64: the half diagonal block skipped below this many keys (``route_backward_tiles``)
HALF_SKIP_MAX_KEYS = 2048


def route_backward_tiles(head_dim: int, n_keys: int) -> BackwardTiles:
    """The tiles the route's backward launches: ``atomic_backward_tiles``, at head_dim 64 with
    ``skip_hidden`` below ``HALF_SKIP_MAX_KEYS`` keys: with it the backward alone is faster at 32×12×1024×64
    in every process timed, and at 2048 and 4096 tokens slower in most, by up to 3% (docs/kernels.md)."""
    tiles = atomic_backward_tiles(head_dim)
    if head_dim == 64:
        return tiles._replace(skip_hidden=n_keys < HALF_SKIP_MAX_KEYS)
    return tiles


# --- dK, dV ---------------------------------------------------------------------------------------

@gluon.jit
def _qdo_producer(q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready,
                  free, b, hk, group, m_lo, per_head, n_heads, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr):
    """The dK/dV kernel's producer partition (one warp): the u-th streamed block — query head
    hk·group + u // per_head, query block m_lo + u % per_head — into slot u % STAGES, Q and L of its
    rows completing "Q ready", dO and δ "dO ready" (transaction counts of whole tiles: TMA counts the
    zeros it fills in); a slot's r-th reuse (r ≥ 1) waits for the consumers' r-th release of it
    ("free" phase r − 1)."""
    for u in range(group * per_head):
        slot = u % STAGES
        if u >= STAGES:
            mbarrier.wait(free.index(slot), ((u // STAGES) & 1) ^ 1)
        h = hk * group + u // per_head
        start_m = (m_lo + u % per_head) * BLOCK_M
        bh = b * n_heads + h
        mbarrier.expect(q_ready.index(slot), BLOCK_M * HEAD_DIM * 2 + lse_desc.block_shape[1] * 4)
        tma_load(q_desc, [b, h, start_m, 0], q_ready.index(slot), q_smem.index(slot))
        tma_load(lse_desc, [bh, start_m], q_ready.index(slot), lse_smem.index(slot))
        mbarrier.expect(do_ready.index(slot), BLOCK_M * HEAD_DIM * 2 + delta_desc.block_shape[1] * 4)
        tma_load(do_desc, [b, h, start_m, 0], do_ready.index(slot), do_smem.index(slot))
        tma_load(delta_desc, [bh, start_m], do_ready.index(slot), delta_smem.index(slot))


@gluon.jit
def _dkdv_step(k, v, k_all, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv, zero_t, t,
               start_n, start_m, n_q, qk_scale, dq_desc, ds_smem, ds_bar, dq_smem, W: gl.constexpr, zero_q, b,
               h, prev_h, prev_m, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, MASKED: gl.constexpr, ATOMIC_DQ: gl.constexpr, SPLIT: gl.constexpr,
               mma_t: gl.constexpr, mma_d: gl.constexpr):
    """The t-th streamed block of consumer W's loop: where dQ's shares are split between the consumers
    (SPLIT) ``_dkdv_split_pipelined_step`` at head_dim 64 (by rows, one block behind) and
    ``_dkdv_split_step`` at 128 (by columns), else ``_dkdv_pipelined_step``. Returns (dK, dV, h,
    start_m): this block's head and rows, whose dQ share the next step adds where shares are one block
    behind."""
    if SPLIT:
        if HEAD_DIM == 64:
            dk, dv = _dkdv_split_pipelined_step(
                k, v, k_all, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv, zero_t, t,
                start_n, start_m, n_q, qk_scale, dq_desc, ds_smem, ds_bar, dq_smem.index(W), zero_q, b, prev_h,
                prev_m, W, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, MASKED, mma_t, mma_d)
        else:
            dk, dv = _dkdv_split_step(k, v, k_all, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free,
                                      dk, dv, zero_t, t, start_n, start_m, n_q, qk_scale, dq_desc, ds_smem, ds_bar,
                                      dq_smem.index(W), zero_q, b, h, W, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, MASKED,
                                      mma_t, mma_d)
        prev_h = h
        prev_m = start_m
    else:
        dk, dv, prev_h, prev_m = _dkdv_pipelined_step(
            k, v, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv, zero_t, t, start_n, start_m,
            n_q, qk_scale, dq_desc, ds_smem, dq_smem, 2 * W, zero_q, b, h, prev_h, prev_m, HEAD_DIM, BLOCK_M,
            STAGES, CAUSAL, MASKED, ATOMIC_DQ, mma_t, mma_d)
    return dk, dv, prev_h, prev_m


@gluon.jit
def _streamed_block(q_smem, do_smem, lse_smem, delta_smem, t, start_m, HEAD_DIM: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, mma_t: gl.constexpr, FIRST: gl.constexpr = 0):
    """The t-th streamed block of a dK/dV consumer: its ring slot and phase, its Q and dO tiles, its L
    and δ (shared-memory vectors, read as ``_column_values``), and the indices of its query columns in
    the transposed tiles' layout ``mma_t``; from row FIRST of the block on (``mma_t`` over the rest)."""
    ROWS: gl.constexpr = BLOCK_M - FIRST
    slot = t % STAGES
    q = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    if FIRST > 0:
        q = q.slice(FIRST, ROWS, dim=0)
        do = do.slice(FIRST, ROWS, dim=0)
        start_m = start_m + FIRST
    cols = start_m + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_t))
    vec: gl.constexpr = lse_smem.shape[2]                  # ≥ BLOCK_M (``BackwardTiles.vector_block``)
    lse = lse_smem.index(slot).reshape([vec]).slice(FIRST, ROWS)
    delta = delta_smem.index(slot).reshape([vec]).slice(FIRST, ROWS)
    return slot, (t // STAGES) & 1, q, do, lse, delta, cols


@gluon.jit
def _column_values(vector, mma_t: gl.constexpr):
    """A block's L or δ (its shared-memory vector, landed with its Q or dO tile) along the query columns
    of the transposed tiles' layout ``mma_t``; zeros past N_q."""
    return vector.load(gl.SliceLayout(0, mma_t))


@gluon.jit
def _probabilities_t(s, qk_scale, lse2, cols, n_q, start_n, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                     mma_t: gl.constexpr):
    """Pᵀ = exp2(Sᵀ·c − L·log2 e) of 64 keys from start_n × the block's query columns ``cols``; where
    MASKED, 0 for columns past N_q and (CAUSAL) for keys past the query."""
    p = gl.exp2(s * qk_scale - lse2[None, :])
    if MASKED:
        keep = cols[None, :] < n_q
        if CAUSAL:
            rows = start_n + gl.arange(0, 64, layout=gl.SliceLayout(1, mma_t))
            keep = keep & (rows[:, None] <= cols[None, :])
        p = gl.where(keep, p, 0.0)
    return p


@gluon.jit
def _share_products(ds_all, k_all, ds_slot, zero_q, W: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Consumer W's part of a block's dQ share from both consumers' dS̄ᵀ in ``ds_all``'s slot ds_slot
    and both K tiles, issued as two asynchronous products of 64 keys: at head_dim 128 columns
    [64·W, 64·W + 64) of all the block's 64 rows, at 64 rows [64·W, 64·W + 64) of its 128, every column."""
    if HEAD_DIM == 128:
        a0 = ds_all.index(2 * ds_slot).permute((1, 0))
        a1 = ds_all.index(2 * ds_slot + 1).permute((1, 0))
        k0 = k_all.index(0).reshape([64, HEAD_DIM]).slice(W * 64, 64, dim=1)
        k1 = k_all.index(1).reshape([64, HEAD_DIM]).slice(W * 64, 64, dim=1)
    else:
        a0 = ds_all.index(2 * ds_slot).slice(W * 64, 64, dim=1).permute((1, 0))
        a1 = ds_all.index(2 * ds_slot + 1).slice(W * 64, 64, dim=1).permute((1, 0))
        k0 = k_all.index(0).reshape([64, HEAD_DIM])
        k1 = k_all.index(1).reshape([64, HEAD_DIM])
    tok = warpgroup_mma(a0, k0, zero_q, use_acc=False, is_async=True)
    return warpgroup_mma(a1, k1, tok, is_async=True)


@gluon.jit
def _add_split_share(dq_desc, dq_buf, b, h, m, W: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The TMA reduce-add of consumer W's part of a block's dQ share (``_share_products``), staged in
    ``dq_buf``, into the fp32 dQ buffer: rows m …, columns 64·W … at head_dim 128; rows m + 64·W … at 64."""
    if HEAD_DIM == 128:
        tma_atomic_add(dq_desc, [b, h, m, W * 64], dq_buf)
    else:
        tma_atomic_add(dq_desc, [b, h, m + W * 64, 0], dq_buf)


@gluon.jit
def _stage_and_add_split_share(dq, dq_buf, dq_desc, b, h, m, W: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Consumer W's part of a block's dQ share (fp32 registers) staged in ``dq_buf`` once the reduce-add
    before it has read the buffer, made visible to TMA (a fence and the warpgroup's barrier), and
    reduce-added (``_add_split_share``)."""
    _stage_dq_share(dq, dq_buf, 0)
    fence_async_shared()
    cta_barrier()
    _add_split_share(dq_desc, dq_buf, b, h, m, W, HEAD_DIM)


@gluon.jit
def _dkdv_split_pipelined_step(k, v, k_all, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv,
                               zero_t, t, start_n, start_m, n_q, qk_scale, dq_desc, ds_all, ds_bar, dq_buf, zero_q,
                               b, prev_h, prev_m, W: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr,
                               mma_t: gl.constexpr, mma_d: gl.constexpr, FIRST: gl.constexpr = 0):
    """``_dkdv_split_step`` with the dQ share one block behind (head_dim 64, split by rows): Sᵀ is issued,
    then share t — the dS̄ᵀ both consumers left for block t − 1 in ``ds_all``'s slot t % 2 (zeros
    before the first block); the wait for Sᵀ leaves the share in flight while Pᵀ's exponentials run;
    the share is staged in fp32 (once the reduce-add from ``dq_buf`` before it has read it), P̄ᵀ·dO and
    dPᵀ − δ are issued and waited for, dSᵀ formed, dK += dS̄ᵀ·Q issued, and while it computes block t's
    dS̄ᵀ is written as share t + 1 into slot (t + 1) % 2 ("ds ready" of that slot) and the share is
    reduce-added into rows prev_m + 64·W … of head prev_h. Slot (t + 1) % 2 held share t − 1: this
    consumer's product reading it completed in step t − 1, the other's before it wrote share t, which
    this step's wait on "ds ready" of slot t % 2 has seen. FIRST = BLOCK_M/2 (a diagonal block whose
    first half of rows all come before this consumer's keys: head_dim 64, consumer 1's first diagonal
    block): Sᵀ, dPᵀ, P̄ᵀ·dO and dS̄ᵀ·Q over the block's last half of rows only — the first half's
    entries of Pᵀ and dSᵀ would be zero and add nothing — with ``mma_t`` and ``zero_t`` over those
    rows, and zeros as the first half's columns of this block's dS̄ᵀ."""
    gl.static_assert(FIRST == 0 or 2 * FIRST == BLOCK_M)
    slot, phase, q, do, lse_s, delta_s, cols = _streamed_block(q_smem, do_smem, lse_smem, delta_smem, t, start_m,
                                                               HEAD_DIM, BLOCK_M, STAGES, mma_t, FIRST)
    mbarrier.wait(q_ready.index(slot), phase)              # every barrier wait before the first product: a wait
    mbarrier.wait(do_ready.index(slot), phase)             # loop between two would complete the one issued
    mbarrier.wait(ds_bar.index(t % 2), (t // 2) & 1)        # share t written by both consumers
    s_tok = warpgroup_mma(k, q.permute((1, 0)), zero_t, use_acc=False, is_async=True)
    dq_tok = _share_products(ds_all, k_all, t % 2, zero_q, W, HEAD_DIM)
    lse2 = _column_values(lse_s, mma_t) * LOG2E
    s = warpgroup_mma_wait(1, deps=[s_tok])                 # Sᵀ done; the share in flight
    p = _probabilities_t(s, qk_scale, lse2, cols, n_q, start_n, CAUSAL, MASKED, mma_t)
    dq = warpgroup_mma_wait(0, deps=[dq_tok])
    _stage_dq_share(dq, dq_buf, 0)
    delta = _column_values(delta_s, mma_t)
    p_bar = _a_operand(p, mma_d)
    dv_tok = warpgroup_mma(p_bar, do, dv, is_async=True)
    dp_tok = warpgroup_mma(v, do.permute((1, 0)), zero_t - delta[None, :], is_async=True)   # dPᵀ − δ
    dp = warpgroup_mma_wait(0, deps=[dp_tok])               # P̄ᵀ·dO and dPᵀ done
    ds = (p * dp).to(gl.bfloat16)
    ds_bar_ = _a_operand(ds, mma_d)
    dk_tok = warpgroup_mma(ds_bar_, q, dk, is_async=True)
    nxt = ds_all.index(2 * ((t + 1) % 2) + W)
    if FIRST > 0:
        nxt.slice(0, FIRST, dim=1).store(gl.zeros([64, FIRST], gl.bfloat16, layout=mma_t))
        nxt.slice(FIRST, BLOCK_M - FIRST, dim=1).store(ds)
    else:
        nxt.store(ds)
    fence_async_shared()
    cta_barrier()                                           # this warpgroup's dS̄ᵀ and fp32 share written
    mbarrier.arrive(ds_bar.index((t + 1) % 2), count=1)
    _add_split_share(dq_desc, dq_buf, b, prev_h, prev_m, W, HEAD_DIM)
    dv, dk, p_bar, ds_bar_ = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_bar, ds_bar_])
    mbarrier.arrive(free.index(slot), count=1)
    return dk, dv


@gluon.jit
def _dkdv_split_step(k, v, k_all, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv, zero_t,
                     t, start_n, start_m, n_q, qk_scale, dq_desc, ds_all, ds_bar, dq_buf, zero_q, b, h, W: gl.constexpr,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                     MASKED: gl.constexpr, mma_t: gl.constexpr, mma_d: gl.constexpr):
    """The t-th streamed block of consumer W (keys start_n …, 64 of the program's 128) where dQ's
    share is split by columns (head_dim 128, 64 query rows): Sᵀ and dPᵀ − δ (δ the product's starting
    accumulator) issued back to back, Pᵀ while dPᵀ computes, dV += P̄ᵀ·dO, dSᵀ, dK += dS̄ᵀ·Q; this
    consumer's dS̄ᵀ goes to its half of ``ds_all``'s slot t % 2, which the other consumer's half
    completes ("ds ready", two arrivals); then columns [64·W, 64·W + 64) of the block's dQ share,
    dS̄·K over both consumers' 128 keys (two products of 64 keys), 32 fp32 registers a thread, are
    added into the fp32 dQ buffer by a TMA reduce-add from ``dq_buf``. A slot is written again two
    blocks later, when the other consumer's arrival for the block between has shown its products
    of this one complete (each consumer waits for all its products within the step)."""
    slot, phase, q, do, lse_s, delta_s, cols = _streamed_block(q_smem, do_smem, lse_smem, delta_smem, t, start_m,
                                                               HEAD_DIM, BLOCK_M, STAGES, mma_t)
    ds_slot = t % 2
    mbarrier.wait(q_ready.index(slot), phase)              # both before either product: a barrier's wait loop
    mbarrier.wait(do_ready.index(slot), phase)             # between them would complete the first product
    delta = _column_values(delta_s, mma_t)
    s_tok = warpgroup_mma(k, q.permute((1, 0)), zero_t, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(v, do.permute((1, 0)), zero_t - delta[None, :], is_async=True)   # dPᵀ − δ
    lse2 = _column_values(lse_s, mma_t) * LOG2E
    s = warpgroup_mma_wait(1, deps=[s_tok])                 # Sᵀ done, dPᵀ still in flight
    p = _probabilities_t(s, qk_scale, lse2, cols, n_q, start_n, CAUSAL, MASKED, mma_t)
    p_bar = _a_operand(p, mma_d)
    dv_tok = warpgroup_mma(p_bar, do, dv, is_async=True)
    dp = warpgroup_mma_wait(1, deps=[dp_tok])               # dPᵀ done, P̄ᵀ·dO still in flight
    ds = (p * dp).to(gl.bfloat16)
    ds_bar_ = _a_operand(ds, mma_d)
    dk_tok = warpgroup_mma(ds_bar_, q, dk, is_async=True)
    ds_all.index(2 * ds_slot + W).store(ds)
    fence_async_shared()
    cta_barrier()                                           # the whole warpgroup's half written
    mbarrier.arrive(ds_bar.index(ds_slot), count=1)
    mbarrier.wait(ds_bar.index(ds_slot), (t // 2) & 1)      # and the other consumer's
    dq_tok = _share_products(ds_all, k_all, ds_slot, zero_q, W, HEAD_DIM)
    dv, dk, dq, p_bar, ds_bar_ = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok, p_bar, ds_bar_])
    mbarrier.arrive(free.index(slot), count=1)
    _stage_and_add_split_share(dq, dq_buf, dq_desc, b, h, start_m, W, HEAD_DIM)
    return dk, dv


@gluon.jit
def _dkdv_hidden_step(k_all, free, t, start_m, ds_all, ds_bar, dq_buf, zero_q, dq_desc, b, h, W: gl.constexpr,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, mma_t: gl.constexpr):
    """``_dkdv_split_step`` for consumer W = 1 and a block whose query rows all come before its 64 keys
    (under a causal mask: the first of its two diagonal blocks). Pᵀ and dSᵀ would be zero and the dK, dV
    products would add zeros, so none of them runs and the block's Q and dO are not read: zeros go
    into this consumer's half of the dS̄ᵀ slot, the slot is released, and its part of the block's dQ
    share is the other consumer's keys' product alone (the same sum: the half left out is zeros)."""
    ds_slot = t % 2
    ds_all.index(2 * ds_slot + W).store(gl.zeros([64, BLOCK_M], gl.bfloat16, layout=mma_t))
    fence_async_shared()
    cta_barrier()                                           # the whole warpgroup's half written
    mbarrier.arrive(ds_bar.index(ds_slot), count=1)
    mbarrier.arrive(free.index(t % STAGES), count=1)        # nothing of the slot is read
    mbarrier.wait(ds_bar.index(ds_slot), (t // 2) & 1)      # the other consumer's half
    seen = ds_all.index(2 * ds_slot + 1 - W).permute((1, 0))
    k_seen = k_all.index(1 - W).reshape([64, HEAD_DIM]).slice(W * 64, 64, dim=1)
    dq = warpgroup_mma_wait(0, deps=[warpgroup_mma(seen, k_seen, zero_q, use_acc=False, is_async=True)])
    _stage_and_add_split_share(dq, dq_buf, dq_desc, b, h, start_m, W, HEAD_DIM)


@gluon.jit
def _dkdv_pipelined_step(k, v, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv, zero_t, t,
                         start_n, start_m, n_q, qk_scale, dq_desc, ds_smem, dq_smem, dq_slot0, zero_q, b, h,
                         prev_h, prev_m, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                         CAUSAL: gl.constexpr, MASKED: gl.constexpr, ATOMIC_DQ: gl.constexpr, mma_t: gl.constexpr,
                         mma_d: gl.constexpr):
    """The t-th streamed block (query rows start_m … of head h, slot t % STAGES) of a consumer's loop:
    Sᵀ and dPᵀ issued back to back, L of its rows read while they compute, Pᵀ while dPᵀ computes,
    dV += P̄ᵀ·dO issued, δ read and dSᵀ formed while it computes,
    dK += dS̄ᵀ·Q, then the slot released (this warpgroup's products that read it are complete).
    MASKED (compile time): the block holds the causal diagonal or query rows past N_q, whose
    entries of Pᵀ (and so of dSᵀ) are set to zero.

    ATOMIC_DQ: the previous block's share of dQ (rows prev_m … of head prev_h), dS̄·K from the dS̄ᵀ
    that block left in ``ds_smem``, is issued after dPᵀ; once it is complete (while dV and dK
    compute) it goes to shared memory in fp32 and a TMA reduce-add, and this block's dS̄ᵀ takes
    its place in ``ds_smem``. Every product is waited for within the step (ptxas waits at the
    loop's back edge anyway). Returns (dK, dV, h, start_m)."""
    slot, phase, q, do, lse_s, delta_s, cols = _streamed_block(q_smem, do_smem, lse_smem, delta_smem, t, start_m,
                                                               HEAD_DIM, BLOCK_M, STAGES, mma_t)
    mbarrier.wait(q_ready.index(slot), phase)
    s_tok = warpgroup_mma(k, q.permute((1, 0)), zero_t, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(slot), phase)
    dp_tok = warpgroup_mma(v, do.permute((1, 0)), zero_t, use_acc=False, is_async=True)
    lse2 = _column_values(lse_s, mma_t) * LOG2E
    if ATOMIC_DQ:
        dq_tok = _dq_share(k, ds_smem, zero_q, HEAD_DIM, True)
        s = warpgroup_mma_wait(2, deps=[s_tok])             # Sᵀ done; dPᵀ, the previous dQ share in flight
    else:
        s = warpgroup_mma_wait(1, deps=[s_tok])             # Sᵀ done, dPᵀ still in flight
    p = _probabilities_t(s, qk_scale, lse2, cols, n_q, start_n, CAUSAL, MASKED, mma_t)
    p_bar = _a_operand(p, mma_d)
    dv_tok = warpgroup_mma(p_bar, do, dv, is_async=True)
    delta = _column_values(delta_s, mma_t)
    if ATOMIC_DQ:
        dp, dq = warpgroup_mma_wait(1, deps=[dp_tok, dq_tok])   # dPᵀ and the dQ share done, P̄ᵀ·dO in flight
        buf = dq_smem.index(dq_slot0 + t % 2)
        _stage_dq_share(dq, buf)
    else:
        dp = warpgroup_mma_wait(1, deps=[dp_tok])           # dPᵀ done, P̄ᵀ·dO still in flight
    ds = (p * (dp - delta[None, :])).to(gl.bfloat16)
    ds_bar = _a_operand(ds, mma_d)
    dk_tok = warpgroup_mma(ds_bar, q, dk, is_async=True)
    if ATOMIC_DQ:
        ds_smem.store(ds)                                   # the product that read the previous dS̄ᵀ is done
        _add_dq_share(dq_desc, buf, b, prev_h, prev_m, HEAD_DIM)
    dv, dk, p_bar, ds_bar = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_bar, ds_bar])
    mbarrier.arrive(free.index(slot), count=1)
    return dk, dv, h, start_m


@gluon.jit
def _dq_share(k, ds_smem, zero_q, HEAD_DIM: gl.constexpr, IS_ASYNC: gl.constexpr):
    """A block's share of dQ from its dS̄ᵀ (keys × query rows, in ``ds_smem``) and the warpgroup's K:
    dS̄·K (query rows × d) at head_dim 64; at 128 its transpose Kᵀ·dS̄ᵀ (d × query rows), whose
    fp32 registers are block_m·d/128 a thread instead of 64·d/128 and whose product's rows are d,
    so that query blocks narrower than a warpgroup product's 64 rows can add their share."""
    if HEAD_DIM == 128:
        share = warpgroup_mma(k.permute((1, 0)), ds_smem, zero_q, use_acc=False, is_async=IS_ASYNC)
    else:
        share = warpgroup_mma(ds_smem.permute((1, 0)), k, zero_q, use_acc=False, is_async=IS_ASYNC)
    return share


@gluon.jit
def _stage_dq_share(dq, buf, IN_FLIGHT: gl.constexpr = 1):
    """A dQ share (fp32 registers) written to ``buf``, once at most IN_FLIGHT reduce-adds are still
    reading shared memory: 1 where a consumer alternates two buffers (the one issued from ``buf``
    two shares ago has read it), 0 where it has one."""
    tma.store_wait(IN_FLIGHT)
    cta_barrier()                                           # every warp past the wait before buf is written
    buf.reshape(dq.shape).store(dq)


@gluon.jit
def _add_dq_share(dq_desc, buf, b, h, m, HEAD_DIM: gl.constexpr):
    """The TMA reduce-add of the share in ``buf`` into rows m … of head h of the fp32 dQ buffer (at
    head_dim 128 the buffer is dQᵀ, (B, H, d, N_q): into its columns m …), after a fence and a
    barrier that also publish any other shared-memory writes of the partition."""
    fence_async_shared()
    cta_barrier()
    if HEAD_DIM == 128:
        tma_atomic_add(dq_desc, [b, h, 0, m], buf)
    else:
        tma_atomic_add(dq_desc, [b, h, m, 0], buf)


@gluon.jit
def _dkdv_consumer(dk_desc, dv_desc, dq_desc, lse_smem, delta_smem, k_all, v_all, q_smem, do_smem, ds_smem, ds_bar,
                   dq_smem, W: gl.constexpr, kv_bar, q_ready, do_ready, free, b, hk, start_n, group, n_q,
                   m_lo, diag_end, full_end, per_head, qk_scale, scale, HEAD_DIM: gl.constexpr,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                   SPLIT: gl.constexpr, SKIP_HIDDEN: gl.constexpr = False):
    """Consumer warpgroup W: keys [start_n, start_n + 64) (its K and V tiles ``k_all.index(W)``,
    ``v_all.index(W)``). Per query head of the group: the masked diagonal blocks [m_lo, diag_end), the whole
    blocks [diag_end, full_end), the ragged tail [full_end, m_lo + per_head); then dK·scale and dV
    in bf16 through its K and V tiles and TMA stores (rows past N_k are not written). SPLIT: both
    consumers meet once more after their last block ("ds ready" of the block after it), before
    either overwrites its K tile, which the other's dQ products read; at head_dim 64, where the
    shares are one block behind, each first leaves zeros as the share before the first block and
    adds the last block's share before that meeting. SKIP_HIDDEN (split shares, causal): at head_dim 128
    consumer 1's diagonal blocks whose rows all come before its keys take ``_dkdv_hidden_step``; at
    head_dim 64 its diagonal block, whose first 64 rows come before its keys, runs over the last 64
    (``_dkdv_split_pipelined_step`` with ``FIRST``), and it compiles no loop over whole diagonal blocks:
    with 128-row blocks and programs of 128 keys it has none."""
    k_smem = k_all.index(W)
    v_smem = v_all.index(W)
    mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_M, 16])
    mma_d: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEAD_DIM, 16])
    k = k_smem.reshape([64, HEAD_DIM])
    v = v_smem.reshape([64, HEAD_DIM])
    zero_t = gl.zeros([64, BLOCK_M], gl.float32, layout=mma_t)
    dk = gl.zeros([64, HEAD_DIM], gl.float32, layout=mma_d)
    dv = gl.zeros([64, HEAD_DIM], gl.float32, layout=mma_d)
    prev_h = hk * group                                     # the dQ share before the first: zeros
    prev_m = m_lo * BLOCK_M
    if SPLIT:                                               # a 64 × 64 part of the share
        zero_q = gl.zeros([64, 64], gl.float32, layout=gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
        if HEAD_DIM == 64:                                  # share 0, before the first block: zeros
            ds_smem.index(W).store(gl.zeros([64, BLOCK_M], gl.bfloat16, layout=mma_t))
            fence_async_shared()
            cta_barrier()
            mbarrier.arrive(ds_bar.index(0), count=1)
    elif ATOMIC_DQ:
        if HEAD_DIM == 128:                                 # the share transposed: d × query rows
            zero_q = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, layout=mma_t)
        else:
            zero_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=mma_d)
        ds_smem = ds_smem.index(W)                          # the pipelined step's share before the first
        ds_smem.store(gl.zeros([64, BLOCK_M], gl.bfloat16, layout=mma_t))
        fence_async_shared()
        cta_barrier()
    else:
        zero_q = dv
    mbarrier.wait(kv_bar, 0)
    for g in range(group):
        base = g * per_head - m_lo                          # block m of head g is streamed block base + m
        h = hk * group + g
        if CAUSAL:
            if SKIP_HIDDEN and W == 1 and HEAD_DIM == 64:   # blocks whose first half of rows precede its keys
                # (128-row blocks, programs of 128 keys: the one diagonal block, so no loop over whole ones)
                HALF: gl.constexpr = BLOCK_M // 2
                mma_h: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                instr_shape=[16, HALF, 16])
                m_seen = gl.minimum(gl.maximum((start_n - HALF) // BLOCK_M + 1, m_lo), diag_end)
                for m in range(m_lo, m_seen):
                    dk, dv = _dkdv_split_pipelined_step(
                        k, v, k_all, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv,
                        gl.zeros([64, HALF], gl.float32, layout=mma_h), base + m, start_n, m * BLOCK_M, n_q,
                        qk_scale, dq_desc, ds_smem, ds_bar, dq_smem.index(W), zero_q, b, prev_h, prev_m, W,
                        HEAD_DIM, BLOCK_M, STAGES, CAUSAL, True, mma_h, mma_d, HALF)
                    prev_h = h
                    prev_m = m * BLOCK_M
            else:
                m_seen = m_lo
                if SKIP_HIDDEN and W == 1 and HEAD_DIM == 128:  # blocks of rows that all precede its keys
                    m_seen = gl.minimum(gl.maximum(start_n // BLOCK_M, m_lo), diag_end)
                    for m in range(m_lo, m_seen):
                        _dkdv_hidden_step(k_all, free, base + m, m * BLOCK_M, ds_smem, ds_bar, dq_smem.index(W),
                                          zero_q, dq_desc, b, h, W, HEAD_DIM, BLOCK_M, STAGES, mma_t)
                for m in range(m_seen, diag_end):
                    dk, dv, prev_h, prev_m = _dkdv_step(
                        k, v, k_all, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv, zero_t,
                        base + m, start_n, m * BLOCK_M, n_q, qk_scale, dq_desc, ds_smem, ds_bar, dq_smem, W, zero_q,
                        b, h, prev_h, prev_m, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, True, ATOMIC_DQ, SPLIT, mma_t,
                        mma_d)
        for m in range(diag_end, full_end):
            dk, dv, prev_h, prev_m = _dkdv_step(
                k, v, k_all, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv, zero_t, base + m,
                start_n, m * BLOCK_M, n_q, qk_scale, dq_desc, ds_smem, ds_bar, dq_smem, W, zero_q, b, h,
                prev_h, prev_m, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, False, ATOMIC_DQ, SPLIT, mma_t, mma_d)
        for m in range(full_end, m_lo + per_head):
            dk, dv, prev_h, prev_m = _dkdv_step(
                k, v, k_all, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready, free, dk, dv, zero_t, base + m,
                start_n, m * BLOCK_M, n_q, qk_scale, dq_desc, ds_smem, ds_bar, dq_smem, W, zero_q, b, h,
                prev_h, prev_m, HEAD_DIM, BLOCK_M, STAGES, CAUSAL, True, ATOMIC_DQ, SPLIT, mma_t, mma_d)
    if SPLIT and HEAD_DIM == 64:                            # the last block's share, then both meet
        last = group * per_head
        mbarrier.wait(ds_bar.index(last % 2), (last // 2) & 1)
        dq = warpgroup_mma_wait(0, deps=[_share_products(ds_smem, k_all, last % 2, zero_q, W, HEAD_DIM)])
        _stage_and_add_split_share(dq, dq_smem.index(W), dq_desc, b, prev_h, prev_m, W, HEAD_DIM)
        mbarrier.arrive(ds_bar.index((last + 1) % 2), count=1)
        mbarrier.wait(ds_bar.index((last + 1) % 2), ((last + 1) // 2) & 1)
        tma.store_wait(0)
    elif SPLIT:
        last = group * per_head
        mbarrier.arrive(ds_bar.index(last % 2), count=1)
        mbarrier.wait(ds_bar.index(last % 2), (last // 2) & 1)
        tma.store_wait(0)
    elif ATOMIC_DQ:                                         # the last block's dQ share
        dq = _dq_share(k, ds_smem, zero_q, HEAD_DIM, False)
        buf = dq_smem.index(2 * W + (group * per_head) % 2)
        _stage_dq_share(dq, buf)
        _add_dq_share(dq_desc, buf, b, prev_h, prev_m, HEAD_DIM)
        tma.store_wait(0)
    k.store((dk * scale).to(gl.bfloat16))                   # every product reading K and V is complete
    v.store(dv.to(gl.bfloat16))
    _store_tile_pair(dk_desc, k_smem, dv_desc, v_smem, b, hk, start_n)


@gluon.jit
def attn_bwd_dkdv_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
                                n_q, n_k, n_heads, group, qk_scale, scale,
                                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_DQ: gl.constexpr = False,
                                SKIP_HIDDEN: gl.constexpr = False):
    """One program: dK and dV of keys [start_n, start_n + BLOCK_N) of one batch·kv-head, on a grid of
    (key blocks, B·H_kv) taken in ``_launch_order`` (with BLOCK_N 128, under a causal mask the first
    key blocks, which see the most queries, of four heads at a time start first). Descriptors: rank 4 over (B, H, N, d) — k, v, dk, dv with 64-row blocks (one
    per consumer warpgroup), q and do with BLOCK_M-row blocks; ``lse_desc``, ``delta_desc``: rank 2
    over L and δ as (B·H, N_q) fp32 (``launch.vector_descriptor``), blocks of (1, max(BLOCK_M, 32))
    (``BackwardTiles.vector_block``). ``group``: query heads per key/value head;
    ``qk_scale``: scale·log2 e; ``scale``: the softmax scale (dK's factor). Launch with
    num_warps = 4: the first consumer warpgroup; the second (BLOCK_N = 128) and the producer warp
    are worker partitions. SPLIT_DQ: the fused kernel's (``BackwardTiles.dkdv_constexprs`` gives it
    to both; without atomic dQ it is False) and SKIP_HIDDEN (False there), unused here."""
    _key_program(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dk_desc, lse_desc, delta_desc, n_q, n_k, n_heads,
                 group, qk_scale, scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, False, False)


@gluon.jit
def attn_bwd_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc,
                           n_q, n_k, n_heads, group, qk_scale, scale,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, SPLIT_DQ: gl.constexpr = False,
                           SKIP_HIDDEN: gl.constexpr = False):
    """``attn_bwd_dkdv_hopper_kernel`` that also adds each block pair's share of dQ, dS̄·K unscaled, to
    an fp32 (B, H, N_q, d) buffer that starts at zero: ``dq_desc``, a rank-4 descriptor of fp32 blocks
    of ``BackwardTiles.dq_tile`` — (1, 1, BLOCK_M, d); with SPLIT_DQ (``BackwardTiles.split_dq``)
    (1, 1, 64, 64), each consumer warpgroup adding half the columns at head_dim 128
    (``_dkdv_split_step``) or half the rows at 64 (``_dkdv_split_pipelined_step``); with query blocks
    under 64 rows at head_dim 128, of dQᵀ, (1, 1, d, BLOCK_M) blocks of a (B, H, d, N_q) buffer
    (``_dq_share``) — through TMA
    reduce-adds (one per consumer warpgroup and streamed block; the order of the additions is not
    fixed)."""
    _key_program(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc, n_q, n_k, n_heads,
                 group, qk_scale, scale, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL, True, SPLIT_DQ, SKIP_HIDDEN)


@gluon.jit
def _launch_order(HEADS: gl.constexpr):
    """(key block, batch·kv-head) of this program on the (key blocks, B·H_kv) grid, launched in
    groups of HEADS batch·kv-heads, key block by key block within a group (the first key blocks, which
    under a causal mask see the most queries, of all HEADS heads first; the grid's own order is each
    head's key blocks in turn, which leaves the last heads' longest programs to start last). HEADS 1:
    the grid's own order."""
    if HEADS == 1:
        return gl.program_id(0), gl.program_id(1)
    n_blocks = gl.num_programs(0)
    n_bh = gl.num_programs(1)
    lin = gl.program_id(0) + n_blocks * gl.program_id(1)
    first = lin // (HEADS * n_blocks) * HEADS
    size = gl.minimum(n_bh - first, HEADS)
    within = lin - first * n_blocks
    return within // size, first + within % size


@gluon.jit
def _key_program(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_desc, delta_desc,
                 n_q, n_k, n_heads, group, qk_scale, scale,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr, SPLIT: gl.constexpr,
                 SKIP_HIDDEN: gl.constexpr = False):
    """The program of both kernels above: shared memory, barriers, the partitions. SPLIT: dQ's shares
    split between the consumers (``BackwardTiles.split_dq``, with ATOMIC_DQ): by columns at head_dim
    128, by rows at 64. SKIP_HIDDEN: ``BackwardTiles.skip_hidden``."""
    CONSUMERS: gl.constexpr = BLOCK_N // 64
    # grouped at 128 keys a program (1.5% at head_dim 128 causal); the grid's order at 64 keys, where the
    # grouping measured no faster and its arithmetic adds a spill under a 128-register cap
    key_block, bhk = _launch_order(KEY_ORDER_HEADS if BLOCK_N == 128 else 1)
    start_n = key_block * BLOCK_N
    n_kv_heads = n_heads // group
    b = bhk // n_kv_heads
    hk = bhk % n_kv_heads
    # query blocks that see this key block, per query head: [m_lo, m_hi); of them the ones holding
    # the causal diagonal [m_lo, diag_end), whole ones [diag_end, full_end), the tail [full_end, m_hi)
    n_full = n_q // BLOCK_M
    m_hi = (n_q + BLOCK_M - 1) // BLOCK_M
    if CAUSAL:
        m_lo = gl.minimum(start_n // BLOCK_M, m_hi)
        diag_end = gl.maximum(gl.minimum((start_n + BLOCK_N + BLOCK_M - 1) // BLOCK_M, n_full), m_lo)
    else:
        m_lo = start_n * 0
        diag_end = m_lo
    full_end = gl.maximum(n_full, diag_end)
    per_head = m_hi - m_lo

    k_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, 1, 1, 64, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, 1, 1, 64, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, lse_desc.block_shape[1]], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, delta_desc.block_shape[1]], delta_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = kv_bar
    if SPLIT:                                               # two slots of both consumers' dS̄ᵀ; a dQ tile each
        ds_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * CONSUMERS, 64, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], gl.bfloat16))
        dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 1, 1, 64, 64], dq_desc.layout)
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_bar.index(i), count=CONSUMERS)
    elif ATOMIC_DQ:
        ds_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, 64, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], gl.bfloat16))
        if HEAD_DIM == 128:                                 # dQᵀ shares: (d, query rows) tiles
            dq_smem = gl.allocate_shared_memory(gl.float32, [2 * CONSUMERS, 1, 1, HEAD_DIM, BLOCK_M], dq_desc.layout)
        else:
            dq_smem = gl.allocate_shared_memory(gl.float32, [2 * CONSUMERS, 1, 1, BLOCK_M, HEAD_DIM], dq_desc.layout)
    else:
        ds_smem = k_smem
        dq_smem = k_smem
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(free.index(i), count=CONSUMERS)
    fence_async_shared()

    mbarrier.expect(kv_bar, CONSUMERS * 2 * 64 * HEAD_DIM * 2)
    for i in gl.static_range(CONSUMERS):
        tma_load(k_desc, [b, hk, start_n + i * 64, 0], kv_bar, k_smem.index(i))
        tma_load(v_desc, [b, hk, start_n + i * 64, 0], kv_bar, v_smem.index(i))
    # (Gluon's frontend takes no starred arguments: each partition's list is written out)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, dq_desc, lse_smem, delta_smem, k_smem, v_smem, q_smem, do_smem,
                              ds_smem, ds_bar, dq_smem, 0, kv_bar, q_ready, do_ready, free, b, hk, start_n, group,
                              n_q, m_lo, diag_end, full_end, per_head, qk_scale, scale, HEAD_DIM, BLOCK_M,
                              STAGES, CAUSAL, ATOMIC_DQ, SPLIT, SKIP_HIDDEN)),
            (_dkdv_consumer, (dk_desc, dv_desc, dq_desc, lse_smem, delta_smem, k_smem, v_smem, q_smem, do_smem,
                              ds_smem, ds_bar, dq_smem, 1, kv_bar, q_ready, do_ready, free, b, hk, start_n + 64, group,
                              n_q, m_lo, diag_end, full_end, per_head, qk_scale, scale, HEAD_DIM, BLOCK_M,
                              STAGES, CAUSAL, ATOMIC_DQ, SPLIT, SKIP_HIDDEN)),
            (_qdo_producer, (q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, q_ready,
                             do_ready, free, b, hk, group, m_lo, per_head, n_heads, BLOCK_M, HEAD_DIM, STAGES)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_dkdv_consumer, (dk_desc, dv_desc, dq_desc, lse_smem, delta_smem, k_smem, v_smem, q_smem, do_smem,
                              ds_smem, ds_bar, dq_smem, 0, kv_bar, q_ready, do_ready, free, b, hk, start_n, group,
                              n_q, m_lo, diag_end, full_end, per_head, qk_scale, scale, HEAD_DIM, BLOCK_M,
                              STAGES, CAUSAL, ATOMIC_DQ, SPLIT, SKIP_HIDDEN)),
            (_qdo_producer, (q_desc, do_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem, q_ready,
                             do_ready, free, b, hk, group, m_lo, per_head, n_heads, BLOCK_M, HEAD_DIM, STAGES)),
        ], [1], [24])
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(q_ready.index(i))
        mbarrier.invalidate(do_ready.index(i))
        mbarrier.invalidate(free.index(i))
    if SPLIT:
        for i in gl.static_range(2):
            mbarrier.invalidate(ds_bar.index(i))


# --- dQ -------------------------------------------------------------------------------------------

@gluon.jit
def _dq_step(q, do, k_smem, v_smem, k_ready, v_ready, k_free, v_free, ds_prev, dq, zero_s, lse2, delta, start_m,
             j, n_k, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             CAUSAL: gl.constexpr, MASKED: gl.constexpr, mma_s: gl.constexpr, mma_q: gl.constexpr):
    """Key block j ≥ 1 of a consumer's loop: issue S_j = Q·K_jᵀ, dP_j = dO·V_jᵀ and
    dQ += dS̄_{j−1}·K_{j−1} back to back; P_j while dP_j and the dQ product compute, dS_j while the
    dQ product does (the tile fences keep ptxas from placing the waits above that work); release
    V_j and K_{j−1}. MASKED (compile time): block j holds the causal diagonal or keys past N_k."""
    slot = j % STAGES
    prev = (j - 1) % STAGES
    # dS̄_{j−1} is packed to bf16 here, in the block of the product that reads it: carried packed across
    # the loop's back edge, each of its registers had its 16-bit halves swapped (a PRMT) before that product
    ds_prev = _a_operand(ds_prev, mma_q)
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                           use_acc=False, is_async=True)
    dq_tok = warpgroup_mma(ds_prev, k_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
    s = warpgroup_mma_wait(2, deps=[s_tok])                 # S_j done; dP_j and dS̄_{j−1}·K_{j−1} in flight
    p = gl.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        p = _mask(p, start_m, j * BLOCK_N, n_k, 64, BLOCK_N, CAUSAL, mma_s, 0.0)
    dp = warpgroup_mma_wait(1, deps=[dp_tok])               # dP_j done; the dQ product in flight
    mbarrier.arrive(v_free.index(slot), count=1)
    ds = p * (dp - delta[:, None])
    dq, ds_prev = warpgroup_mma_wait(0, deps=[dq_tok, ds_prev])
    mbarrier.arrive(k_free.index(prev), count=1)
    return ds, dq


@gluon.jit
def _dq_consumer(dq_desc, lse_ptr, delta_ptr, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_free,
                 v_free, b, h, start_m, n_q, n_k, n_blocks, full, row0, qk_scale, scale,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """One consumer warpgroup: query rows [start_m, start_m + 64) (its Q and dO tiles). Key block 0,
    whole key blocks, masked ones (from ``full`` on), the last dQ product; then dQ·scale in bf16
    through its Q tile and a TMA store (rows past N_q are not written)."""
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEAD_DIM, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    q = q_smem.reshape([64, HEAD_DIM])
    do = do_smem.reshape([64, HEAD_DIM])
    rows = start_m + gl.arange(0, 64, layout=row_s)
    lse2 = gl.load(lse_ptr + row0 + rows, mask=rows < n_q, other=0.0) * LOG2E
    delta = gl.load(delta_ptr + row0 + rows, mask=rows < n_q, other=0.0)
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, layout=mma_s)
    dq = gl.zeros([64, HEAD_DIM], gl.float32, layout=mma_q)

    mbarrier.wait(q_bar, 0)
    # key block 0: S_0 and dP_0, then dS_0 (no dQ product to overlap with yet)
    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(v_ready.index(0), 0)
    s_tok = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    dp_tok = warpgroup_mma(do, v_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                           use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=[s_tok])
    # masked whether it needs to be or not: a branch here would make ptxas wait for dP_0 before it
    p = _mask(gl.exp2(s * qk_scale - lse2[:, None]), start_m, 0, n_k, 64, BLOCK_N, CAUSAL, mma_s, 0.0)
    dp = warpgroup_mma_wait(0, deps=[dp_tok])
    mbarrier.arrive(v_free.index(0), count=1)
    ds_prev = p * (dp - delta[:, None])                     # fp32: packed to bf16 by the step that reads it
    # whole key blocks first, then the masked ones: no branch between a product's issue and its wait
    n_full = gl.maximum(full // BLOCK_N, 1)
    for j in range(1, n_full):
        ds_prev, dq = _dq_step(q, do, k_smem, v_smem, k_ready, v_ready, k_free, v_free, ds_prev, dq, zero_s, lse2,
                               delta, start_m, j, n_k, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, False, mma_s,
                               mma_q)
    for j in range(n_full, n_blocks):
        ds_prev, dq = _dq_step(q, do, k_smem, v_smem, k_ready, v_ready, k_free, v_free, ds_prev, dq, zero_s, lse2,
                               delta, start_m, j, n_k, qk_scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, True, mma_s,
                               mma_q)
    last = (n_blocks - 1) % STAGES
    dq = warpgroup_mma(_a_operand(ds_prev, mma_q), k_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), dq)

    q.store((dq * scale).to(gl.bfloat16))                   # every product reading Q is complete
    fence_async_shared()
    cta_barrier()
    tma_store(dq_desc, [b, h, start_m, 0], q_smem)
    tma.store_wait(0)


@gluon.jit
def attn_bwd_dq_hopper_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, n_q, n_k, n_heads,
                              group, qk_scale, scale,
                              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                              STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """One program: dQ of query rows [start_m, start_m + BLOCK_M) of batch·head program_id(1), on a
    grid of (query blocks, B·H) whose first axis runs longest-first. Descriptors: rank 4 over
    (B, H, N, d) — q, do, dq with 64-row blocks (one per consumer warpgroup), k and v with
    BLOCK_N-row blocks. ``lse_ptr``, ``delta_ptr``: (B, H, N_q) fp32, contiguous. Launch with
    num_warps = 4: the first consumer warpgroup; the second (BLOCK_M = 128) and the producer warp
    are worker partitions."""
    CONSUMERS: gl.constexpr = BLOCK_M // 64
    start_m, b, h, hk, n_blocks, full, row0 = _query_program(n_q, n_k, n_heads, group, BLOCK_M, BLOCK_N, CAUSAL)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, 1, 1, 64, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, 1, 1, 64, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(i), count=1)
    _init_kv_ring(k_ready, v_ready, k_free, v_free, STAGES, CONSUMERS)
    fence_async_shared()

    for i in gl.static_range(CONSUMERS):
        mbarrier.expect(q_bar.index(i), 2 * 64 * HEAD_DIM * 2)
        tma_load(q_desc, [b, h, start_m + i * 64, 0], q_bar.index(i), q_smem.index(i))
        tma_load(do_desc, [b, h, start_m + i * 64, 0], q_bar.index(i), do_smem.index(i))
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_dq_consumer, (dq_desc, lse_ptr, delta_ptr, q_smem.index(0), do_smem.index(0), k_smem, v_smem,
                            q_bar.index(0), k_ready, v_ready, k_free, v_free, b, h, start_m, n_q, n_k, n_blocks,
                            full, row0, qk_scale, scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL)),
            (_dq_consumer, (dq_desc, lse_ptr, delta_ptr, q_smem.index(1), do_smem.index(1), k_smem, v_smem,
                            q_bar.index(1), k_ready, v_ready, k_free, v_free, b, h, start_m + 64, n_q, n_k, n_blocks,
                            full, row0, qk_scale, scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, b, hk, n_blocks,
                         BLOCK_N, HEAD_DIM, STAGES)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_dq_consumer, (dq_desc, lse_ptr, delta_ptr, q_smem.index(0), do_smem.index(0), k_smem, v_smem,
                            q_bar.index(0), k_ready, v_ready, k_free, v_free, b, h, start_m, n_q, n_k, n_blocks,
                            full, row0, qk_scale, scale, HEAD_DIM, BLOCK_N, STAGES, CAUSAL)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_free, v_free, b, hk, n_blocks,
                         BLOCK_N, HEAD_DIM, STAGES)),
        ], [1], [24])
    for i in gl.static_range(CONSUMERS):
        mbarrier.invalidate(q_bar.index(i))
    _invalidate_kv_ring(k_ready, v_ready, k_free, v_free, STAGES)
