"""Progress bars for long work: tqdm's, without its monitor thread.

tqdm starts a monitor thread for every bar, disabled ones too, and leaves it running (a daemon
thread) into the interpreter's shutdown; in a torchrun rank such a thread outlives the process
group. The monitor only re-checks a bar's refresh interval, which none of these bars needs.
"""
from __future__ import annotations

from tqdm.auto import tqdm


class progress_bar(tqdm):  # noqa: N801  (used like tqdm)
    """``tqdm.auto.tqdm`` (same arguments) that starts no monitor thread."""

    monitor_interval = 0
