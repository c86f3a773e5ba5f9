"""Per-step metrics as JSON lines (``metrics.jsonl``), optional TensorBoard, and events.

One JSON object per line, each with ``step`` and ``loss``: steps carry whatever else was measured
(``val_loss`` on evaluation steps); events (a non-finite loss, monitor warnings) also carry ``event``.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from stableflash.files import atomic_write, remove_stale_temps

log = logging.getLogger(__name__)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)            # JSON has no NaN/inf: write "nan", "inf"
    return value


class MetricsWriter:
    """Appends to run_dir/metrics.jsonl (flushed per line), and to TensorBoard when asked."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a") if enabled else None
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                log.warning("tensorboard=True but the tensorboard package is not installed; "
                            "metrics go to metrics.jsonl only")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        if self._tb is not None and "step" in record and "event" not in record:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, record["step"])

    def event(self, step: int, kind: str, **details) -> None:
        self.write({"step": step, "event": kind, **details})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _records(path: Path):
    """(line number, line without its newline, record) for each record of a JSON-lines file, read
    one line at a time. A malformed last line (a write cut short by a kill) is dropped with a
    warning naming the file; a malformed line before another record is a ValueError naming the
    file and the line."""
    path = Path(path)
    pending = None                                # a malformed line, an error if another record follows
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.rstrip(b"\r\n")
            if not line.strip():
                continue
            if pending is not None:
                raise ValueError(f"{path} line {pending[0]} is not a JSON object with a whole-number step "
                                 f"({pending[1]}), and records follow it; only the last line may be cut short "
                                 f"(a run killed mid-write). Remove or repair that line")
            try:
                record = json.loads(line)
                ok = isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool)
                why = "" if ok else f"got {line[:60].decode('utf-8', 'replace')!r}"
            except (ValueError, UnicodeDecodeError) as exc:      # JSONDecodeError is a ValueError
                ok, why = False, str(exc)
            if ok:
                yield number, line, record
            else:
                pending = (number, why)
    if pending is not None:
        log.warning("%s: dropped line %d, cut short (a run killed mid-write): %s", path, pending[0], pending[1])


def iter_records(path: Path):
    """The records of a JSON-lines file (``metrics.jsonl``, ``probes.jsonl``), in file order, read one
    line at a time; a malformed last line is dropped with a warning, one before it is an error."""
    for _, _, record in _records(path):
        yield record


def truncate_after(path: Path, step: int, on_kept=None) -> int:
    """Keep the records with step < ``step`` (a resumed run writes the later ones again) and drop a
    malformed last line, rewriting the file atomically: streamed into a temporary file beside it,
    fsynced and renamed over it, so a kill at any moment leaves the old file or the new one, whole.
    ``on_kept(record)`` sees each kept record in file order. Returns how many were kept."""
    path = Path(path)
    remove_stale_temps(path)
    if not path.exists():
        return 0
    kept = 0
    with atomic_write(path, "wb") as out:
        for _, line, record in _records(path):
            if record["step"] < step:
                out.write(line + b"\n")
                kept += 1
                if on_kept is not None:
                    on_kept(record)
    return kept


def read_metrics(path: Path) -> list[dict]:
    """All records of a JSON-lines file, as :func:`iter_records` reads them."""
    return list(iter_records(path))


@dataclass
class History:
    """What a resumed run keeps from its earlier steps' records: the best validation loss of every
    evaluation, and the last step record (the final loss of a run resumed with nothing left to do)."""

    best_val_loss: float = math.inf
    last: dict = field(default_factory=dict)

    def add(self, record: dict) -> None:
        if "event" in record:
            return
        val = record.get("val_loss")
        if isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val):
            self.best_val_loss = min(self.best_val_loss, float(val))
        if "loss" in record:
            self.last = record
