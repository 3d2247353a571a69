"""staging.py's writers: one file whole, a folder's files moved in, a folder replaced whole; a scratch folder; and
no other module that renames or makes temporary files."""

from __future__ import annotations

import ast
import errno
import os
import shutil
from pathlib import Path

import pytest

from vanilla_transformer import staging
from vanilla_transformer.staging import (
    REPLACED, STAGING_PREFIX, DiskFull, publish_folder, set_aside, staged_files, sweep_staging, write_file_whole,
)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_file_written_whole_gets_the_mode_open_gives_from_text_bytes_or_a_writer(tmp_path, umask):
    previous = os.umask(umask)
    try:
        write_file_whole(tmp_path / "a.txt", "é\n")
        write_file_whole(tmp_path / "b.bin", b"\x00\x01")
        write_file_whole(tmp_path / "c.png", lambda staging: staging.write_bytes(staging.name.encode()))
    finally:
        os.umask(previous)
    assert (tmp_path / "a.txt").read_bytes() == "é\n".encode() and (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    given = (tmp_path / "c.png").read_text()  # the writer's path ends as the file's does (matplotlib reads the suffix)
    assert given.startswith(STAGING_PREFIX) and given.endswith("-c.png")
    assert {path.name: path.stat().st_mode & 0o777 for path in tmp_path.iterdir()} == dict.fromkeys(
        ["a.txt", "b.bin", "c.png"], 0o666 & ~umask)


def test_a_full_disk_names_the_file_and_leaves_the_old_one_whole(tmp_path):
    target = tmp_path / "results.json"
    write_file_whole(target, "old\n")

    def fill_the_disk(staging):
        staging.write_text("ha")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def interrupted(staging):
        staging.write_text("ha")
        raise KeyboardInterrupt

    with pytest.raises(DiskFull, match=rf"^could not write {target}: no space left on device$"):
        write_file_whole(target, fill_the_disk)
    with pytest.raises(KeyboardInterrupt):
        write_file_whole(target, interrupted)
    assert [path.name for path in tmp_path.iterdir()] == ["results.json"] and target.read_text() == "old\n"


def test_staged_files_move_in_by_name_and_the_last_ones_last(tmp_path, monkeypatch):
    from vanilla_transformer import staging

    moved = []
    real_move = staging._move
    monkeypatch.setattr(staging, "_move", lambda source, destination: (moved.append(destination.name),
                                                                         real_move(source, destination)))
    (tmp_path / "keep.txt").write_text("mine")
    with staged_files(tmp_path, "model", last=["config.json"]) as folder:
        for name in ("config.json", "b.bin", "a.json"):
            (folder / name).write_text(name)
    assert moved == ["a.json", "b.bin", "config.json"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.json", "b.bin", "config.json", "keep.txt"]


def test_a_folder_is_replaced_whole_and_a_damaged_one_set_aside_under_a_free_name(tmp_path):
    old, new = tmp_path / "adapter", tmp_path / f"{STAGING_PREFIX}adapter"
    for folder, text in ((old, "old"), (new, "new")):
        folder.mkdir()
        (folder / f"{text}.txt").write_text(text)
    publish_folder(new, old)
    assert [path.name for path in tmp_path.iterdir()] == ["adapter"] and os.listdir(old) == ["new.txt"]
    (tmp_path / "damaged-adapter").mkdir()
    assert set_aside(old, "damaged-adapter").name == "damaged-adapter-again"
    assert sorted(os.listdir(tmp_path)) == ["damaged-adapter", "damaged-adapter-again"]


def test_a_replaced_folder_is_removed_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    old, new = tmp_path / "adapter", tmp_path / f"{STAGING_PREFIX}adapter"
    for folder, text in ((old, "old"), (new, "new")):
        folder.mkdir()
        (folder / f"{text}.txt").write_text(text)
    seen_while_removing = []
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda path, *args, **kwargs: seen_while_removing.append(
        (os.listdir(old), sorted(os.listdir(path)))) or real_rmtree(path, *args, **kwargs))
    publish_folder(new, old)
    assert seen_while_removing == [(["new.txt"], ["old.txt"])]
    assert [path.name for path in tmp_path.iterdir()] == ["adapter"]


def test_a_folder_whose_replacement_was_killed_between_the_renames_is_put_back_by_the_next_sweep(tmp_path, monkeypatch):
    old, new = tmp_path / "adapter", tmp_path / f"{STAGING_PREFIX}adapter"
    for folder, text in ((old, "old"), (new, "new")):
        folder.mkdir()
        (folder / f"{text}.txt").write_text(text)
    real_move = staging._move
    moves = []

    def dies_at_the_second_rename(source, destination):
        moves.append(destination.name)
        if len(moves) == 2:
            raise KeyboardInterrupt  # as a kill there leaves it
        real_move(source, destination)

    monkeypatch.setattr(staging, "_move", dies_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        publish_folder(new, old)
    assert moves == [f"{REPLACED}adapter", "adapter"] and not old.exists()
    monkeypatch.setattr(staging, "_move", real_move)
    assert sweep_staging(tmp_path) == [new.name]
    assert [path.name for path in tmp_path.iterdir()] == ["adapter"] and os.listdir(old) == ["old.txt"]


def test_the_mode_of_a_written_file_is_opens_and_the_umask_is_read_without_being_set(tmp_path, monkeypatch):
    umask = os.umask(0o022)
    try:
        monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("the umask was set: every thread would see it"))
        written = write_file_whole(tmp_path / "a.json", "{}")
    finally:
        monkeypatch.undo()
        os.umask(umask)
    assert written.stat().st_mode & 0o777 == 0o644


def test_a_file_written_again_removes_what_a_killed_write_of_it_left_and_nothing_else(tmp_path):
    left = tmp_path / f"{STAGING_PREFIX}abcd1234-results.json"  # as a write killed before its rename leaves it
    kept = [tmp_path / f"{STAGING_PREFIX}abcd1234-old-results.json", tmp_path / f"{STAGING_PREFIX}model", tmp_path / "notes"]
    for path in (left, *kept):
        path.write_text("mine")
    write_file_whole(tmp_path / "results.json", "{}\n")
    assert sorted(tmp_path.iterdir()) == sorted([tmp_path / "results.json", *kept])


def test_what_is_published_reaches_the_disk_before_its_rename_and_the_rename_after(tmp_path, monkeypatch):
    # A power cut, not only a killed process, must leave the old file or folder or the new one whole.
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(b))), real_replace(a, b)))
    write_file_whole(tmp_path / "config.json", "{}")
    staged, rename, folder = events
    assert staged[0] == "sync" and staged[1].endswith("-config.json") and STAGING_PREFIX in staged[1]
    assert rename == ("rename", str(tmp_path / "config.json"))
    assert folder == ("sync", str(tmp_path))

    events.clear()
    with staged_files(tmp_path / "model", "save") as staging_dir:
        (staging_dir / "sub").mkdir()
        (staging_dir / "sub" / "weights.bin").write_bytes(b"w")
    synced_before = [path for kind, path in events[: events.index(("rename", str(tmp_path / "model" / "sub")))]
                     if kind == "sync"]
    assert any(path.endswith("sub/weights.bin") for path in synced_before)
    assert events[events.index(("rename", str(tmp_path / "model" / "sub"))) + 1] == ("sync", str(tmp_path / "model"))


def test_no_module_but_staging_renames_or_makes_temporary_files():
    # One convention for what is written then moved into place, and for scratch folders: a module that renamed or
    # made a temporary file itself would leave what no sweep finds. (`os.replace` by name; str.replace is another.)
    package = Path(staging.__file__).parent
    temporary = {"mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory", "TemporaryFile", "SpooledTemporaryFile"}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "staging.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
                name = node.func.attr
                if name in temporary or name == "rename" or (owner, name) in {("os", "replace"), ("shutil", "move")}:
                    found.append(f"{path.relative_to(package)}:{node.lineno} {name}")
    assert not found


def test_a_temporary_folder_lives_as_long_as_it_is_held(tmp_path):
    held = staging.temporary_folder(tmp_path / "cache", "app-")
    folder = Path(held.name)
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("app-") and folder.is_dir()
    (folder / "page.html").write_text("x")
    held.cleanup()
    assert not folder.exists() and (tmp_path / "cache").is_dir()


def test_a_write_that_fails_names_the_file_not_its_staging_name_and_keeps_the_errno(tmp_path):
    # A parent that is a file: mkstemp's error named `.vanilla-transformer-staging-xxxxxxxx-out.txt`, a file the
    # user never asked for and that does not exist.
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError) as failed:
        write_file_whole(tmp_path / "file" / "out.txt", "text")
    assert str(failed.value) == f"could not write {tmp_path / 'file' / 'out.txt'}: Not a directory"
    assert failed.value.errno == errno.ENOTDIR

    def fails(staging):
        raise PermissionError(errno.EACCES, "Permission denied", str(staging))

    with pytest.raises(OSError, match=rf"^could not write {tmp_path / 'out.txt'}: Permission denied$"):
        write_file_whole(tmp_path / "out.txt", fails)
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]
