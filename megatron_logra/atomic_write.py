"""Replace a file's contents all at once, durably: write a hidden sibling, fsync it, rename it
over the file, fsync the directory.

A reader (or a resumed run after a crash) sees the old contents or the new ones, never half of
the new. The sibling lives in the same directory so the rename stays on one filesystem. The two
fsyncs make it hold across a node crash too: without the first, the rename can reach the disk
before the data (an empty or partial file under the final name after a power loss); without the
second, the rename itself may be lost.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(path: str | Path) -> None:
    """Make a directory's entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | Path, data: str | bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data if isinstance(data, bytes) else data.encode())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)
