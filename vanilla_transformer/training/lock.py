"""One training run per output folder.

Two runs writing one folder (a command launched twice, a retry while the first still runs) would
prune each other's checkpoints and overwrite each other's model. A run therefore holds
`output_dir/.train.lock` from start to end: an exclusive `flock` on it, which the operating system
drops when the process ends in any way (kill -9 included), and in it the holder's PID, host, start
time and command, so that a second run can say who holds the folder. A lock file whose holder has
died is not locked: the next run takes it over and says whose it was. Where a process that the dead run
forked still holds it, the PID in it tells: the file of a run on this host whose process is gone is
replaced, with the same warning.

Without `fcntl` (Windows) the file's existence is the lock, and a dead run's file must be deleted
by hand; the error says which file.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path

from ..checks.files import read_json

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = ["LOCK_FILE", "LockLost", "RunLock"]

LOCK_FILE = ".train.lock"
# A holder's record: its PID, host, start time and command line, which the system bounds far below this.
MAX_RECORD_BYTES = 1 << 20
logger = logging.getLogger(__name__)


class LockLost(FileExistsError):
    """The folder's lock is no longer this run's: another run may hold the folder."""


class RunLock:
    """`RunLock(folder).acquire()` ... `release()`; acquire raises FileExistsError naming the holder."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None
        self._made_folder = False

    def acquire(self) -> None:
        self._made_folder = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        while self._fd is None:
            if fcntl is None:
                try:
                    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    raise self._in_use(f"If that run has ended, delete {self.path}.") from None
                break
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(self.path)
                same_file = os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino
                os.close(fd)
                if same_file and _gone(holder):  # a process the dead run forked still holds the file: a new one
                    logger.warning(f"taking over {self.path}: the run that left it ({_describe(holder)}) is no longer "
                                   "running (a process it started still holds the old file)")
                    self.path.unlink(missing_ok=True)
                    continue
                raise self._in_use("Wait for it to end, or choose another `output_dir`.") from None
            if os.fstat(fd).st_nlink == 0:  # the holder removed the file between our open and flock: again
                os.close(fd)
                continue
            self._fd = fd
        previous = _read(self.path)
        if previous:
            logger.warning(f"taking over {self.path}: {_why_free(previous)}")
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": shlex.join(sys.argv)}
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, json.dumps(holder).encode())

    def check(self) -> None:
        """Raise LockLost unless this run's file is still the folder's lock: a run whose file was removed (or
        replaced by another run's) no longer has the folder to itself, and stops before it writes there again."""
        if self._fd is None or self.holds():
            return
        raise LockLost(f"{self.path} was removed or replaced while this run trained, so another run may be writing "
                       f"{self.folder}; this run stops before writing its next checkpoint. Check which run should go "
                       "on, then `resume` it alone")

    def holds(self) -> bool:
        """Whether the file at `path` is the one this run locked."""
        try:
            return self._fd is not None and os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False

    def release(self, discard: bool = False) -> None:
        """Remove the file (while still holding it, so that no one waits on a removed file) and let go; another run's
        file, in its place since, stays. A folder the lock made goes if it is empty, or with what is in it when
        `discard` is true."""
        if self._fd is None:
            return
        if self.holds():
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
        if self._made_folder and discard:
            shutil.rmtree(self.folder, ignore_errors=True)
        elif self._made_folder and not any(self.folder.iterdir()):
            self.folder.rmdir()  # a run that failed at once leaves nothing behind

    def _in_use(self, advice: str) -> FileExistsError:
        return FileExistsError(
            f"{self.folder} is in use by another training run ({_describe(_read(self.path))}). {advice}"
        )


def _read(path: Path) -> dict:
    """The holder's record in a lock file, or {} where the file is gone, being written, or holds no lock's record."""
    try:
        record = read_json(path, MAX_RECORD_BYTES)
    except (OSError, ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def _gone(holder: dict) -> bool:
    """Whether the run that wrote `holder` ran on this host and its process is no longer there."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid < 1:
        return False
    try:
        os.kill(pid, 0)  # signal 0: is there such a process, nothing sent
    except ProcessLookupError:
        return True
    except OSError:  # there is one, another user's
        return False
    return False


def _why_free(holder: dict) -> str:
    """Why a lock file that names a holder is not locked, as far as this machine can tell."""
    pid, host = holder.get("pid"), holder.get("host")
    if _gone(holder):
        return f"the run that left it ({_describe(holder)}) is no longer running"
    if host == socket.gethostname():
        return (f"it names PID {pid} on this host, a running process that does not hold the lock, so no run of this "
                f"folder (the PID reused, or the file written by hand): {_describe(holder)}")
    return (f"it names a run on host {host}, which this machine cannot see; no process here holds the lock "
            f"({_describe(holder)})")


def _describe(holder: dict) -> str:
    if not holder:
        return "a process that is starting"
    return (f"PID {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command')}")
