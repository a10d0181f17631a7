"""A checkpoint directory's files on disk: hashing with fsync, staging names, stale staging.

A save writes into ``.staging-<name>-<8 hex>`` next to the final ``<name>`` and renames it when
it is whole (``.staging-retired-<name>-<8 hex>`` holds a replaced copy until it is removed). A
process killed mid-save leaves such a directory behind; :func:`remove_stale_staging` removes
those at start-up -- only directories whose name is exactly that pattern, never a file and
never anything else a user keeps there.

Hashing reads every byte of a checkpoint; the same pass fsyncs each file (its data is then on
disk before the manifest that vouches for it is written), and reports what it cost
(:class:`HashCost`), since a save or a verified load pays it every time.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_logra.atomic_write import fsync_directory

# Every complete checkpoint holds it (each file's size and SHA-256), written last.
MANIFEST = "manifest.json"
STAGING_PREFIX = ".staging-"
RETIRED = "retired-"
_TOKEN_HEX = 8
STAGING_PATTERN = re.compile(
    rf"^{re.escape(STAGING_PREFIX)}(?:{RETIRED})?.+-[0-9a-f]{{{_TOKEN_HEX}}}$"
)
_HASH_CHUNK = 1 << 22


def staging_name(name: str, token: str, *, retired: bool = False) -> str:
    """The staging (or retired) directory name of checkpoint ``name``; ``token``: 8 hex."""
    if not re.fullmatch(rf"[0-9a-f]{{{_TOKEN_HEX}}}", token):
        raise ValueError(f"staging token must be {_TOKEN_HEX} lowercase hex digits, got {token!r}")
    return f"{STAGING_PREFIX}{RETIRED if retired else ''}{name}-{token}"


@dataclass(frozen=True)
class HashCost:
    """What hashing (and fsyncing) a set of files took on one rank."""

    files: int
    bytes: int
    seconds: float

    @staticmethod
    def total(costs: Iterable[HashCost]) -> HashCost:
        """Files and bytes summed; seconds of the slowest rank (the ranks hash in parallel)."""
        costs = list(costs)
        return HashCost(sum(c.files for c in costs), sum(c.bytes for c in costs),
                        max((c.seconds for c in costs), default=0.0))

    def describe(self) -> str:
        rate = self.bytes / self.seconds / 1e6 if self.seconds > 0 else float("inf")
        return (f"{self.files} files, {self.bytes / 1e6:.1f} MB in {self.seconds:.3f} s "
                f"({rate:.0f} MB/s)")


def hash_and_sync(path: Path, *, sync: bool) -> str:
    """SHA-256 of a file; with ``sync`` also fsync it (its data reaches the disk)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
        if sync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def hash_files(
    directory: Path, names: Sequence[str], *, sync: bool
) -> tuple[dict[str, str], HashCost]:
    """SHA-256 of ``directory / name`` for every name, and what it cost."""
    start = time.perf_counter()
    hashes = {name: hash_and_sync(directory / name, sync=sync) for name in names}
    size = sum((directory / name).stat().st_size for name in names)
    return hashes, HashCost(len(names), size, time.perf_counter() - start)


def fsync_directories(directory: Path) -> None:
    """fsync every directory under ``directory`` (deepest first) and ``directory`` itself, so
    the files created in them are reachable after a crash."""
    subdirs = sorted((p for p in directory.rglob("*") if p.is_dir()),
                     key=lambda p: len(p.parts), reverse=True)
    for path in [*subdirs, directory]:
        fsync_directory(path)


def remove_stale_staging(root: Path) -> list[Path]:
    """Remove the staging directories a killed save left in ``root``; returns them.

    Only directories (not symlinks, not files) whose name matches :data:`STAGING_PATTERN`.
    Call it before this run saves anything (at start-up, on one rank).
    """
    removed = []
    if not root.is_dir():
        return removed
    for path in sorted(root.iterdir()):
        if STAGING_PATTERN.match(path.name) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            removed.append(path)
    return removed
