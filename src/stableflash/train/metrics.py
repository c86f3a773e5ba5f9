"""Per-step metrics as JSON lines (``metrics.jsonl``), optional TensorBoard, and events.

One JSON object per line, each with ``step`` and ``loss``: steps carry whatever else was measured
(``val_loss`` on evaluation steps); events (a non-finite loss, monitor warnings) also carry ``event``.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

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


def truncate_after(path: Path, step: int) -> None:
    """Drop lines with step >= ``step`` (a resumed run rewrites them)."""
    path = Path(path)
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", -1) < step]
    path.write_text("".join(line + "\n" for line in kept))


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
