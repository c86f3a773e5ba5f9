"""The order in which interleaved benchmark rounds visit their cases."""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def round_order(cases: Sequence[T], index: int) -> list[T]:
    """The cases in the order round ``index`` visits them: the sequence turned by ``index``, so that
    over any len(cases) rounds in a row each case takes every place once (a case's time can depend on
    the case before it: the GPU's clocks, the host's caches, the allocator's state)."""
    cases = list(cases)
    if not cases:
        raise ValueError("cases is empty; accepted: one or more cases to order")
    shift = index % len(cases)
    return cases[shift:] + cases[:shift]
