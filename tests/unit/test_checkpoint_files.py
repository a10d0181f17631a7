"""Durable checkpoint files (issue 15 item 3), single process, no Megatron: fsync before every
rename, hashing that fsyncs and reports its cost, and start-up removal of exactly the staging
directories a killed save leaves (never a user's file or directory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_logra import checkpoint_files
from megatron_logra.atomic_write import write_atomically
from megatron_logra.checkpoint_files import (
    MANIFEST,
    fsync_directories,
    hash_files,
    recover_interrupted_saves,
    remove_stale_staging,
    staging_name,
)


@pytest.fixture
def fsync_log(monkeypatch) -> list[tuple[str, str]]:
    """Every fsync and rename, in order: ("fsync", path) / ("replace", destination)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(Path(dst).resolve())))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_write_atomically_fsyncs_the_data_before_the_rename_and_the_directory_after(
    tmp_path, fsync_log
):
    target = tmp_path / "manifest.json"
    write_atomically(target, '{"files": {}}')
    tmp = str((tmp_path / ".manifest.json.tmp").resolve())
    assert fsync_log == [("fsync", tmp), ("replace", str(target.resolve())),
                         ("fsync", str(tmp_path.resolve()))]
    assert target.read_text() == '{"files": {}}'


def test_hashing_with_sync_fsyncs_every_file_once_and_reports_files_and_bytes(
    tmp_path, fsync_log
):
    (tmp_path / "sub").mkdir()
    sizes = {"a.distcp": 1000, "sub/b.distcp": 3, "common.pt": 0}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"x" * size)
    hashes, cost = hash_files(tmp_path, sorted(sizes), sync=True)
    assert sorted(path for _, path in fsync_log) == sorted(
        str((tmp_path / name).resolve()) for name in sizes)
    assert (cost.files, cost.bytes) == (3, 1003) and cost.seconds >= 0.0
    assert set(hashes) == set(sizes) and len(set(hashes.values())) == 3
    fsync_log.clear()
    assert hash_files(tmp_path, sorted(sizes), sync=False)[0] == hashes
    assert fsync_log == []


def test_fsync_directories_fsyncs_every_subdirectory_before_the_top(tmp_path, fsync_log):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "c").mkdir()
    fsync_directories(tmp_path)
    synced = [path for _, path in fsync_log]
    assert sorted(synced) == sorted(str(p.resolve()) for p in
                                    (tmp_path, tmp_path / "a", tmp_path / "a" / "b",
                                     tmp_path / "c"))
    assert synced[-1] == str(tmp_path.resolve())
    assert synced.index(str((tmp_path / "a" / "b").resolve())) < synced.index(
        str((tmp_path / "a").resolve()))


def test_remove_stale_staging_removes_our_staging_directories_with_their_files(tmp_path):
    ours = [staging_name("iter_0000004", "1a2b3c4d"),
            staging_name("iter_0000002", "deadbeef", retired=True),
            staging_name("model", "0123abcd")]
    for name in ours:
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "shard.distcp").write_bytes(b"partial")
    removed = remove_stale_staging(tmp_path)
    assert sorted(p.name for p in removed) == sorted(ours)
    assert list(tmp_path.iterdir()) == []


def test_remove_stale_staging_never_touches_a_users_files_or_other_directories(tmp_path):
    user_dir = tmp_path / "notes"
    user_dir.mkdir()
    kept_dirs = ["iter_0000002", ".staging-notes", ".staging-iter_0000004-XYZ12345",
                 "my.staging-iter_0000004-1a2b3c4d", ".staging-iter_0000004-1a2b3c4d0"]
    for name in kept_dirs:
        (tmp_path / name).mkdir()
    # A file with exactly our directory naming, and a symlink to a user's directory.
    (tmp_path / staging_name("iter_0000006", "abcdef12")).write_text("user data")
    (tmp_path / staging_name("iter_0000008", "abcdef12")).symlink_to(user_dir)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert remove_stale_staging(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert user_dir.is_dir()


def _checkpoint_copy(root: Path, name: str, content: str, *, complete: bool = True) -> Path:
    (root / name).mkdir()
    (root / name / "shard.distcp").write_text(content)
    if complete:
        (root / name / MANIFEST).write_text("{}")
    return root / name


def test_a_resave_killed_between_its_renames_keeps_the_step_publishing_the_new_copy(tmp_path):
    """What the crash leaves (the old copy retired, the new one complete but still staged, no
    iter_0000004): start-up publishes the new copy and only then removes the rest."""
    _checkpoint_copy(tmp_path, staging_name("iter_0000004", "0a0a0a0a", retired=True), "old")
    _checkpoint_copy(tmp_path, staging_name("iter_0000004", "1b1b1b1b"), "new")
    _checkpoint_copy(tmp_path, staging_name("iter_0000006", "2c2c2c2c"), "half", complete=False)
    assert recover_interrupted_saves(tmp_path) == [tmp_path / "iter_0000004"]
    remove_stale_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004"]
    assert (tmp_path / "iter_0000004" / "shard.distcp").read_text() == "new"
    assert (tmp_path / "iter_0000004" / MANIFEST).is_file()


def test_a_retired_copy_alone_is_published_again_and_a_published_step_is_left_alone(tmp_path):
    _checkpoint_copy(tmp_path, staging_name("iter_0000002", "3d3d3d3d", retired=True), "old")
    _checkpoint_copy(tmp_path, "iter_0000008", "published")
    _checkpoint_copy(tmp_path, staging_name("iter_0000008", "4e4e4e4e"), "other")
    assert recover_interrupted_saves(tmp_path) == [tmp_path / "iter_0000002"]
    assert (tmp_path / "iter_0000002" / "shard.distcp").read_text() == "old"
    assert (tmp_path / "iter_0000008" / "shard.distcp").read_text() == "published"


def test_an_unfinished_save_is_never_published(tmp_path):
    _checkpoint_copy(tmp_path, staging_name("iter_0000004", "5f5f5f5f"), "half", complete=False)
    assert recover_interrupted_saves(tmp_path) == []
    assert not (tmp_path / "iter_0000004").exists()


def test_staging_names_match_the_cleanup_pattern_and_a_bad_token_is_refused():
    assert checkpoint_files.STAGING_PATTERN.match(staging_name("iter_0000012", "0f0f0f0f"))
    with pytest.raises(ValueError, match="8 lowercase hex"):
        staging_name("iter_0000012", "XYZ")

