"""Writing files and folders whole or not at all, inside the folder they go to.

Every file the package writes that must appear whole goes through this module: one file with
`write_file_whole`, a folder's files with `staged_files` (each moved into place), a whole folder with
`staging_folder` and `publish_folder`; a scratch folder that lives as long as its holder, with
`temporary_folder`. What is being written is named `.vanilla-transformer-staging-*`
INSIDE the folder it goes to, then renamed into place (`_move`, the one rename). Staging inside
(never beside, in the parent) lets an output folder whose parent is read-only (a container's volume
mount) be written, and keeps every rename on one file system. A process killed while writing
leaves such an entry behind; the next run or save in that folder sweeps it (`sweep_staging`; the
next write of the same file or folder removes its own), and nothing without the prefix is ever touched.

A full disk surfaces from torch as "[enforce fail at inline_container.cc:672] unexpected pos" and from
safetensors as a SafetensorError, naming no file. `staging_folder` and `write_file_whole` turn it into `DiskFull`, an OSError
naming the file that did not fit and the cause, after removing what was half written.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "FULL_DISK_ERRNOS", "REPLACED", "STAGING_PREFIX", "DiskFull", "disk_full", "disk_full_error", "publish_files", "publish_folder", "set_aside",
    "staged_files", "staging_folder", "sweep_staging", "temporary_folder", "write_file_whole",
]

STAGING_PREFIX = ".vanilla-transformer-staging-"
REPLACED = f"{STAGING_PREFIX}replaced-"  # + a folder's name: the old folder, aside while its new one is published
_NEARLY_FULL = 1 << 20  # bytes free after a failed write below which the disk is taken to be full
# The errors of a write that found no space, and what a message calls each: every full-disk check reads them.
FULL_DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}

logger = logging.getLogger(__name__)


class DiskFull(OSError):
    """A write failed for want of space: the message names the file and the cause (errno ENOSPC or EDQUOT)."""

    def __init__(self, message: str, code: int = errno.ENOSPC):
        super().__init__(message)
        self.errno = code


def sweep_staging(folder: str | os.PathLike) -> list[str]:
    """Remove the staging entries a killed process left directly in `folder`; return their names."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    swept = []
    for entry in sorted(folder.iterdir()):
        original = folder / entry.name[len(REPLACED):]
        if entry.name.startswith(REPLACED) and entry.is_dir() and not original.exists():
            _move(entry, original)  # killed between publish_folder's two renames: the old folder is put back
            logger.warning(f"{original}: put back as it was before a write that did not finish")
        elif entry.name.startswith(STAGING_PREFIX):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            swept.append(entry.name)
    if swept:
        logger.info(f"removed what an interrupted save left in {folder}: {', '.join(swept)}")
    return swept


def publish_files(folder: str | os.PathLike) -> None:
    """Give every file under `folder` the mode a plain `open` gives (0666 less the umask): safetensors and
    mkstemp write 0600, which the other users of a shared model folder cannot read."""
    mode = _open_mode()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def _open_mode() -> int:
    """The mode `open` gives a new file: 0666 less the umask, as Linux shows it; elsewhere the umask is read by
    setting it, for a moment, to the tightest mask (another thread's file made then is private, not open)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            umask = next((int(line.split()[1], 8) for line in status if line.startswith("Umask:")), None)
    except OSError:
        umask = None
    if umask is None:
        umask = os.umask(0o077)
        os.umask(umask)
    return 0o666 & ~umask


def _move(source: Path, destination: Path) -> None:
    """The one rename that publishes what was staged (a test kills its process right before it). What was written
    reaches the disk before the rename, and the rename after it, so a power cut too leaves the old or the new whole."""
    _sync(source)
    os.replace(source, destination)
    _sync(destination.parent, recursive=False)


def _sync(path: Path, recursive: bool = True) -> None:
    """Flush `path` to the disk: a file, or a folder's entries and (`recursive`) every file and folder under it."""
    paths = [path, *path.rglob("*")] if recursive and path.is_dir() and not path.is_symlink() else [path]
    for entry in paths:
        if entry.is_symlink() or (os.name == "nt" and entry.is_dir()):  # Windows opens no folder to flush
            continue
        handle = os.open(entry, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def disk_full(err: BaseException, folder: str | os.PathLike) -> int | None:
    """ENOSPC or EDQUOT when `err` (or what caused it) is a write that found no space in `folder`, else None.

    torch names no errno, so a failed write in a folder with (nearly) no space left counts as one."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL_DISK_ERRNOS:
            return seen.errno
        if "os error 28" in str(seen):  # safetensors (Rust) spells ENOSPC this way
            return errno.ENOSPC
        seen = seen.__cause__ or seen.__context__
    try:
        stats = os.statvfs(folder)
    except (OSError, AttributeError):  # gone, or no statvfs (Windows)
        return None
    return errno.ENOSPC if stats.f_bavail * stats.f_frsize < _NEARLY_FULL else None


def disk_full_error(err: BaseException, staging: Path, target: str | os.PathLike) -> DiskFull | None:
    """The DiskFull to raise for `err`, a failed write into `staging` of files bound for `target`: it names
    the file that did not fit (the newest in `staging`) under `target`. None when the disk is not full."""
    code = disk_full(err, staging.parent)
    if code is None:
        return None
    written = [p for p in staging.rglob("*") if p.is_file()] if staging.is_dir() else []
    last = max(written, key=lambda p: p.stat().st_mtime_ns, default=None)
    path = Path(target) / last.relative_to(staging) if last is not None else Path(target)
    return DiskFull(f"could not write {path}: {FULL_DISK_ERRNOS[code]}", code)


@contextmanager
def staging_folder(folder: str | os.PathLike, name: str, target: str | os.PathLike | None = None) -> Iterator[Path]:
    """A new staging folder `folder/.vanilla-transformer-staging-<name>` for the files bound for `target`
    (default `folder`, made if missing), removed on the way out: the caller moves its files into place
    before leaving. On a failure, a `folder` made for these files goes too, and a write that found the
    disk full is raised as DiskFull naming the file."""
    folder = Path(folder)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f"{STAGING_PREFIX}{name}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        yield staging
    except BaseException as err:
        full = disk_full_error(err, staging, target or folder) if isinstance(err, Exception) else None
        shutil.rmtree(staging, ignore_errors=True)
        if made and not any(folder.iterdir()):
            folder.rmdir()
        if full is None:
            raise
        raise full from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def staged_files(folder: str | os.PathLike, name: str, last: Iterable[str] = ()) -> Iterator[Path]:
    """`staging_folder` whose files are moved into `folder` on the way out, in name order and those named
    in `last` last (a folder whose readers wait for that file sees the rest first)."""
    folder, last = Path(folder), set(last)
    with staging_folder(folder, name) as staging:
        yield staging
        publish_files(staging)
        for entry in sorted(staging.iterdir(), key=lambda entry: (entry.name in last, entry.name)):
            _move(entry, folder / entry.name)


def publish_folder(staging: Path, target: Path) -> None:
    """Put the folder `staging` in place of `target`. An old `target` is renamed aside (`REPLACED` + its name) and
    removed once the new one is in place: a reader finds the old folder whole or the new one, never one half
    removed; a process killed between the two renames leaves the old one aside, and the next sweep puts it back."""
    aside = target.with_name(REPLACED + target.name)
    if target.exists():
        if aside.exists():  # left by a kill after an earlier new folder was in place
            shutil.rmtree(aside, ignore_errors=True)
        _move(target, aside)
    _move(staging, target)
    shutil.rmtree(aside, ignore_errors=True)


def set_aside(path: Path, name: str) -> Path:
    """Rename `path` to `name` beside it, "-again" added until the name is free; return the new path."""
    aside = path.with_name(name)
    while aside.exists():  # set aside before
        aside = aside.with_name(aside.name + "-again")
    _move(path, aside)
    return aside


def write_file_whole(path: str | os.PathLike, content: str | bytes | Callable[[Path], object]) -> Path:
    """Write `path` whole or not at all: `content` (text as UTF-8, bytes, or a function that writes the file
    it is given) goes to a staging file beside it, which gets the mode `open` gives and is renamed into place.
    A failure leaves the old file as it was; a full disk is raised as DiskFull naming `path`, another OSError as
    one naming `path` (not its staging name) with its errno. What a killed write of `path` left beside it is
    removed first, so `path` has one writer at a time (threads that may write the same file hold a lock)."""
    path = Path(path)
    for left in path.parent.glob(f"{STAGING_PREFIX}{'?' * 8}-{glob.escape(path.name)}"):  # mkstemp's 8 letters
        if left.is_file():
            left.unlink(missing_ok=True)
    # The staging name ends as `path` does: writers such as matplotlib pick the format from the suffix.
    try:
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=STAGING_PREFIX, suffix=f"-{path.name}")
    except OSError as err:
        raise _naming(err, path) from None
    staging = Path(name)
    try:
        if callable(content):
            os.close(handle)
            content(staging)
        elif isinstance(content, bytes):
            with os.fdopen(handle, "wb") as f:
                f.write(content)
        else:
            with os.fdopen(handle, "w", encoding="utf-8") as f:
                f.write(content)
        os.chmod(staging, _open_mode())  # mkstemp makes it 0600
        _move(staging, path)
    except BaseException as err:
        staging.unlink(missing_ok=True)
        code = disk_full(err, path.parent) if isinstance(err, Exception) else None
        if code is not None:
            raise DiskFull(f"could not write {path}: {FULL_DISK_ERRNOS[code]}", code) from None
        if isinstance(err, OSError):
            raise _naming(err, path) from None
        raise
    return path


def _naming(err: OSError, path: Path) -> OSError:
    """`err` as an OSError that names `path`, the file being written, and keeps its errno."""
    named = OSError(f"could not write {path}: {err.strerror or err}")
    named.errno = err.errno
    return named


def temporary_folder(parent: str | os.PathLike, prefix: str) -> tempfile.TemporaryDirectory:
    """A new folder `parent/<prefix>...` (`parent` made if missing) for files that live as long as the returned
    object is held: removed when it is collected or cleaned up, or when the process exits. Its files are written
    with `write_file_whole` all the same, since they are read while it lives."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix=prefix, dir=parent)
