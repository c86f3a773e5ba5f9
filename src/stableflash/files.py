"""Writing files so that no reader, and no process killed mid-write, ever sees half of one.

Every write goes to a temporary file beside the target (``.NAME.tmp-PID``), is flushed and fsynced,
then renamed over the target (atomic on one file system), and the folder is fsynced: at any moment
the target is its old complete content or its new one. A write that raises removes its temporary
file; one killed outright (SIGKILL, power loss) leaves it behind, and :func:`remove_stale_temps`
removes such leftovers (they are never valid).
"""
from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path


def temp_path(path: Path | str) -> Path:
    """The temporary file an atomic write of ``path`` by this process uses."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def fsync_dir(folder: Path | str) -> None:
    """Make a rename inside ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: Path | str, mode: str = "w", **open_kwargs):
    """Yield a file open on :func:`temp_path` of ``path``; on a clean exit it is flushed, fsynced and
    renamed over ``path``. On an exception (KeyboardInterrupt included) the temporary file is
    removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, mode, **open_kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path | str, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`atomic_write`), its parent created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "w") as handle:
        handle.write(text)
    return path


def remove_stale_temps(path: Path | str) -> list[Path]:
    """Remove the temporary files that killed atomic writes of ``path`` left beside it; returns them."""
    path = Path(path)
    stale = [p for p in path.parent.glob(f".{glob.escape(path.name)}.tmp-*") if p.is_file()]
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return stale
