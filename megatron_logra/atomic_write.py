"""Replace a file's contents all at once: write a hidden sibling, then rename it over the file.

A reader (or a resumed run after a crash) sees the old contents or the new ones, never half of
the new. The sibling lives in the same directory so the rename stays on one filesystem.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: str | Path, data: str | bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)
