"""The run's folder: one run per folder, what a new run may write there, and what a run that filled the disk kept.

`output_dir` holds the finished model (a Hub folder, hub.py) and `output_dir/checkpoints/`, the run's
checkpoints (checkpoints.py). A run takes the folder's lock and sweeps what a run killed while saving
left behind (`take_folder`). A new run refuses a folder that holds an earlier run, a finished model, a card or a
file it would write over (`check_new_folder`); resuming one is resume.py's. A run that fills the disk says what it
kept (`explain_disk_full`).

One run per folder (`RunLock`): two runs writing one folder (a command launched twice, a retry while the first still
runs) would prune each other's checkpoints and overwrite each other's model. A run therefore holds
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

from ..errors import BadInput
from ..checks.files import read_json
from ..hub import DESCRIPTION_FILES
from ..staging import FULL_DISK_ERRNOS, DiskFull, sweep_staging
from .checkpoints import checkpoint_step, latest_checkpoint, list_checkpoints, read_state

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = [
    "ADAPTER_DIR", "CHECKPOINTS", "LOCK_FILE", "LockLost", "MODEL_FILES", "RunLock", "TOKENIZER_OPTIONS",
    "check_new_folder", "explain_disk_full", "take_folder",
]

CHECKPOINTS = "checkpoints"  # sub-folder of output_dir; the rest of output_dir is the Hub folder (hub.py)
ADAPTER_DIR = "adapter"  # where a LoRA run keeps PEFT's adapter, beside the merged model
TOKENIZER_OPTIONS = "tokenizer_options.json"  # in CHECKPOINTS: what the run's own tokenizer was trained from
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")  # a saved model

LOCK_FILE = ".train.lock"
# A holder's record: its PID, host, start time and command line, which the system bounds far below this.
MAX_RECORD_BYTES = 1 << 20
logger = logging.getLogger(__name__)


def take_folder(lock: RunLock) -> None:
    """Lock the run's folder, then remove what a run killed while saving left in it."""
    lock.acquire()
    for folder in (lock.folder, lock.folder / CHECKPOINTS):
        sweep_staging(folder)


def check_new_folder(output_dir: str, checkpoint_root: Path, lora_rank: int | None) -> None:
    """Without `resume`: refuse an `output_dir` that holds an earlier run, a finished model, a card or a file the run
    would write over (a LoRA run, of `lora_rank`, writes its adapter too)."""
    if list_checkpoints(checkpoint_root):
        raise BadInput(
            f"{output_dir} holds checkpoints of an earlier run; pass `resume` to continue it, or pick a new `output_dir`"
        )
    model_files = [name for name in MODEL_FILES if (Path(output_dir) / name).exists()]
    if model_files:  # a finished model (from the Hub, or a run whose checkpoints were removed): never replaced
        raise BadInput(
            f"{output_dir} holds a model ({', '.join(model_files)}) that a new run would replace; pass `resume` "
            f"to continue its run (it needs its {CHECKPOINTS}/ folder), `model_name_or_path {output_dir}` "
            "to fine-tune it into another `output_dir`, or pick another `output_dir`"
        )
    cards = [name for name in DESCRIPTION_FILES if (Path(output_dir) / name).exists()]
    if cards:  # not this run's: the finished model's card and scores would replace them
        raise BadInput(f"{output_dir} holds {', '.join(cards)}, which the finished model's card and scores would "
                       "replace; pick another `output_dir`, or move them")
    check_nothing_to_replace(Path(output_dir), lora_rank)


def check_nothing_to_replace(folder: Path, lora_rank: int | None) -> None:
    """A new run refuses a folder holding a path it would write over or delete: the model's code and settings, its
    log, the weights of another layout, a LoRA run's `adapter/`, a tokenizer's settings without its tokenizer.json,
    in `checkpoints/` a checkpoint's name or records other than those of a run that stopped before its first
    checkpoint (whose tokenizer and log are this folder's own, used or kept)."""
    from ..hub import STALE_WEIGHTS
    from ..modeling.saving import CODE_FILES
    from .logs import LOG_FILE

    started = _run_record(folder / CHECKPOINTS / "config.json")  # a run of this folder got as far as its model
    written = [*CODE_FILES, "generation_config.json", *([] if started else [LOG_FILE]),
               *([ADAPTER_DIR] if lora_rank is not None else []),
               *([] if (folder / "tokenizer.json").is_file() else ["tokenizer_config.json", "special_tokens_map.json"])]
    found = [name for name in written if (folder / name).exists() or (folder / name).is_symlink()]
    found += sorted(entry.name for entry in folder.iterdir() if STALE_WEIGHTS.match(entry.name))
    found += _not_run_records(folder / CHECKPOINTS)
    found = [f"{name}/" if (folder / name).is_dir() else name for name in found]
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise BadInput(f"{folder} holds {', '.join(found[:3])}{more}, which a new run would write over or delete; "
                       "pick another `output_dir`, or move them")


def _not_run_records(checkpoints: Path) -> list[str]:
    """What in `checkpoints/` a run would write over and did not write: a folder named as a checkpoint (an incomplete
    one: complete ones are an earlier run's), or a config or tokenizer record that is not a run's. Other names a
    run never touches."""
    if not checkpoints.is_dir():
        return []
    return sorted(f"{CHECKPOINTS}/{entry.name}" for entry in checkpoints.iterdir()
                  if checkpoint_step(entry.name) is not None
                  or (entry.name in ("config.json", TOKENIZER_OPTIONS) and not _run_record(entry)))


def _run_record(path: Path) -> bool:
    """Whether `path` is a JSON object a run wrote (a model's config names its `model_type`)."""
    try:
        record = read_json(path) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and (path.name != "config.json" or "model_type" in record)


def explain_disk_full(err: OSError, output_dir: str) -> DiskFull | None:
    """A full disk or quota as one DiskFull that says what the run kept and how to go on; None for another error."""
    if err.errno not in FULL_DISK_ERRNOS:
        return None
    named = str(err) if isinstance(err, DiskFull) else f"could not write {err.filename or 'a file'}: {FULL_DISK_ERRNOS[err.errno]}"
    return DiskFull(f"{named}; {_what_was_saved(output_dir)}", err.errno)


def _what_was_saved(output_dir: str) -> str:
    """What a run that could not save has kept, and how to go on."""
    checkpoint = latest_checkpoint(Path(output_dir) / CHECKPOINTS)
    if checkpoint is None:
        return "no checkpoint was saved; free some space, then run the same command again"
    return (f"the newest complete checkpoint is {checkpoint} (step {read_state(checkpoint)['step']}); free some "
            "space, then run the same command with --resume to continue")


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
