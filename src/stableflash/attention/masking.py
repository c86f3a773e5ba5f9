"""What each query may see: the causal mask and its alignment, a sliding window, and attention dropout.

Every backend follows these definitions; ``visible`` and ``dropout_keep`` compute them densely in
PyTorch (the reference and the emulated backend use them, the tests compare the kernels with them).

Visibility. Query i of a sequence with n_q queries over n_k keys has its diagonal at key
i + offset, where offset is 0 for ``Alignment.TOP_LEFT`` (torch SDPA's ``is_causal``) and
n_k − n_q for ``Alignment.BOTTOM_RIGHT`` (FlashAttention's: the last query is the last key, which
is what decoding and a prefill that continues a KV cache need). Key j is visible to query i when

    i + offset − left  ≤  j  ≤  i + offset + right

with ``Window(left, right)`` (None: unbounded on that side); ``causal`` makes right at most 0.
With n_q = 2, n_k = 5, causal (1 = visible):

    top-left        bottom-right
    1 0 0 0 0       1 1 1 1 0
    1 1 0 0 0       1 1 1 1 1

In a varlen batch (sequences packed along one axis, FlashAttention's ``cu_seqlens``) every
sequence has its own n_q and n_k, and positions are counted from the sequence's start.

A query that sees no key (a fully masked row) has output 0, log-sum-exp −inf, and passes no
gradient.

Dropout. With probability p each P = softmax(S) entry is dropped and the rest are scaled by
1 / (1 − p), in the forward and identically in the backward. Whether entry (i, j) of head h of
sequence (batch element) b is kept is a pure function of a 64-bit seed and the place: the first
output of Philox-4x32-10 (Salmon et al., 2011; the generator ``triton.language.philox`` implements)
keyed by the seed's low and high 32 bits, with counter (j, i, b·H + h, 0) — positions counted
within the sequence — is compared with ⌊p·2³²⌋: kept when not below it. The seed is drawn from
torch's default (CPU) generator for each call (``draw_seed``), so ``torch.manual_seed`` makes a
call reproducible and activation checkpointing, which restores that generator, replays it.
"""
from __future__ import annotations

import enum
import numbers
from typing import NamedTuple

import torch


class Alignment(enum.Enum):
    """Where the causal diagonal (and a window's centre) sits when n_q ≠ n_k."""

    TOP_LEFT = "top-left"          # query i's diagonal is key i (torch SDPA)
    BOTTOM_RIGHT = "bottom-right"  # query i's diagonal is key i + n_k − n_q (FlashAttention)

    @classmethod
    def parse(cls, value, name: str = "align") -> "Alignment":
        if isinstance(value, cls):
            return value
        found = _ALIGNMENTS.get(value) if isinstance(value, str) else None
        if found is None:
            raise ValueError(f"{name}={value!r} is invalid; accepted: " + ", ".join(map(repr, _ALIGNMENTS)))
        return found


# by name: a dict lookup, which torch.compile traces (iterating an Enum class it does not, in torch 2.11)
_ALIGNMENTS = {"top-left": Alignment.TOP_LEFT, "bottom-right": Alignment.BOTTOM_RIGHT}


class Window(NamedTuple):
    """A sliding (local) window: query i sees keys from its diagonal − left to its diagonal +
    right; None is unbounded on that side. (A NamedTuple, as Masking: torch.compile takes
    them as constants where it cannot wrap a dataclass built inside a traced call.)"""

    left: int | None = None
    right: int | None = None

    @property
    def unbounded(self) -> bool:
        return self.left is None and self.right is None

    @classmethod
    def parse(cls, value, name: str = "window", unbounded=(None,)) -> "Window":
        """A Window from None, a Window, or a pair (left, right) of ints ≥ 0, each side also taking
        any of ``unbounded`` (None; FlashAttention's window_size also −1) for no bound."""
        if value is None:
            return UNBOUNDED
        if isinstance(value, cls):
            return value
        accepted = ("None, or a pair (left, right) of ints ≥ 0" +
                    (" or -1 (unbounded)" if -1 in unbounded else " or None (unbounded)"))
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"{name}={value!r} is invalid; accepted: {accepted}")
        sides = []
        for side in value:
            if side is None and None in unbounded:
                sides.append(None)
            elif isinstance(side, bool) or not isinstance(side, numbers.Integral):
                raise ValueError(f"{name}={value!r} is invalid; accepted: {accepted}")
            elif side in unbounded and side is not None:
                sides.append(None)
            elif side < 0:
                raise ValueError(f"{name}={value!r} is invalid; accepted: {accepted}")
            else:
                sides.append(int(side))
        return cls(*sides)


UNBOUNDED = Window()


class Masking(NamedTuple):
    """The positional mask of a call: causal or not, the diagonal's alignment, a window."""

    causal: bool = False
    align: Alignment = Alignment.TOP_LEFT
    window: Window = UNBOUNDED

    @property
    def bounds(self) -> tuple[int | None, int | None]:
        """(left, right) of the visible band around the diagonal, causal included (None: unbounded)."""
        right = self.window.right
        if self.causal:
            right = 0 if right is None else min(right, 0)
        return self.window.left, right

    @property
    def masks_anything(self) -> bool:
        return self.bounds != (None, None)

    def offset(self, n_q: int, n_k: int) -> int:
        """The diagonal's key index for query 0."""
        return n_k - n_q if self.align is Alignment.BOTTOM_RIGHT else 0


def visible(n_q: int, n_k: int, masking: Masking, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean (n_q, n_k): True where query i sees key j (module docstring)."""
    i = torch.arange(n_q, device=device).unsqueeze(1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    diag = i + masking.offset(n_q, n_k)
    left, right = masking.bounds
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if right is not None:
        keep &= j <= diag + right
    if left is not None:
        keep &= j >= diag - left
    return keep


def segments(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, slice, slice]]:
    """(sequence index, its query rows, its key rows) of each sequence of a varlen batch; the
    offsets are read on the host."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(s, slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])) for s in range(len(cq) - 1)]


# Philox-4x32-10's constants (the same as triton.language.random's for 32-bit counters)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a·b for a uint32 constant and uint32 values held in int64,
    computed in 16-bit pieces so that no int64 product overflows."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    t = a_lo * b                                    # < 2**48
    u = a_hi * b + (t >> 16)                        # < 2**49
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
           rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 of the uint32 counters (int64 tensors, broadcast together) under the 64-bit
    ``seed``: four uint32 outputs as int64 tensors."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0, c1, c2, c3 = torch.broadcast_tensors(*(c.to(torch.int64) & _U32 for c in (c0, c1, c2, c3)))
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _U32, (k1 + _KEY_B) & _U32
    return c0, c1, c2, c3


def drop_threshold(p: float) -> int:
    """⌊p·2³²⌋: an entry is dropped when its random uint32 is below this."""
    return int(p * 2.0 ** 32)


def dropout_keep(seed: int, p: float, heads: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """Boolean (*heads.shape, n_q, n_k): which P entries dropout keeps. ``heads``: int64 tensor of
    b·H + h per (batch, head) — the third Philox counter — on the device the mask is wanted on."""
    dev = heads.device
    i = torch.arange(n_q, device=dev, dtype=torch.int64).view(n_q, 1)
    j = torch.arange(n_k, device=dev, dtype=torch.int64).view(1, n_k)
    bh = heads.to(torch.int64).view(*heads.shape, 1, 1)
    r = philox(seed, j, i, bh, torch.zeros((), dtype=torch.int64, device=dev))[0]
    return r >= drop_threshold(p)


def draw_seed() -> int:
    """A dropout seed (63 bits) from torch's default generator."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64))
