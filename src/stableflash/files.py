"""Writing a small file so that no reader, and no run killed mid-write, ever sees half of it."""
from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path | str, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path`` (its parent created if missing), then rename
    it over ``path`` (atomic on one file system). Checkpoints, binary and fsynced, have their own
    (``train.checkpoint.save``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
