"""Reading the files users hand us, and checking the files we wrote, so that a bad one is named.

A byte that is not UTF-8, a line that is not JSON or a truncated weights file otherwise surfaces
as a codec, Arrow or safetensors error that names neither the file nor the line.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import zipfile
from collections.abc import Iterable, Iterator
import re
from pathlib import Path

from ..errors import BadInput


# A Hub repository id, user/name: how a name the user gives is told from a folder that is not there.
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

__all__ = ["MACHINE_ERRNOS", "MAX_LINE_BYTES", "REPO_ID", "bounded_lines", "check_inside", "check_output_file", "check_plain_file",
           "check_plain_pickle", "check_repo_id", "check_weights_file", "parse_json", "raise_machine_error", "read_json",
           "utf8_lines"]

# The most bytes one line of text is read to: far past any sentence (translate cuts a long one to what the model
# reads), it bounds the memory a file without line ends (/dev/zero, a binary file) takes before it is refused.
MAX_LINE_BYTES = 16 * 1024 * 1024
# An OSError of these is the machine's, not the file's: a file that cannot be read now is not damaged for it.
MACHINE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EIO, errno.ENOMEM, errno.EMFILE, errno.ENFILE)


def utf8_lines(lines: Iterable[bytes], name: str) -> Iterator[str]:
    """Decode the lines of a binary file (or of standard input), without their line ends.

    A UTF-8 byte-order mark opening the first line (Notepad and PowerShell write one) is dropped: it
    would otherwise become part of the first text. A byte that is not UTF-8 is a ValueError naming `name`,
    the line and the column; so is a line of more than MAX_LINE_BYTES, read no further than that.
    """
    for number, raw in enumerate(bounded_lines(lines, name), 1):
        if number == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8):]
        try:
            yield raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as err:
            raise BadInput(
                f"{name}, line {number}: byte {raw[err.start]:#04x} at column {err.start + 1} is not UTF-8; "
                "save the file as UTF-8"
            ) from None


def bounded_lines(lines: Iterable[bytes], name: str, max_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The lines of a binary file, each read in one piece of at most `max_bytes` (a file object's own iteration
    reads a line whole, however long); a longer line is a ValueError naming `name` and the line."""
    if not hasattr(lines, "readline"):  # a list of lines, already in memory
        yield from lines
        return
    for number, raw in enumerate(iter(lambda: lines.readline(max_bytes + 1), b""), 1):
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            raise BadInput(f"{name}, line {number}: no line end in its first {max_bytes:,} bytes; give a text file "
                           "with one text per line")
        yield raw


def read_json(path: str | os.PathLike, max_bytes: int | None = None):
    """A JSON file we wrote, or a ValueError naming it and where it stops being JSON; one of more than
    `max_bytes` bytes is refused before it is read (a parser holds the whole file, and many times its size)."""
    if max_bytes is not None and (size := Path(path).stat().st_size) > max_bytes:
        raise BadInput(f"{path} is {size:,} bytes, more than such a file holds (at most {max_bytes:,}); it is not read")
    try:
        return parse_json(Path(path).read_text(encoding="utf-8"), path)
    except UnicodeDecodeError as err:
        raise BadInput(f"{path} is damaged: byte {err.start} is not UTF-8") from None
    except json.JSONDecodeError as err:
        raise BadInput(f"{path} is damaged: not valid JSON ({err})") from None


def parse_json(text: str | bytes, name):
    """`json.loads(text)`; a text nested deeper than Python's parser follows (its RecursionError, which no
    `except ValueError` catches) is refused as damaged, in a ValueError naming `name`."""
    try:
        return json.loads(text)
    except RecursionError:
        raise BadInput(f"{name} is damaged: its values nest deeper than a JSON parser follows") from None


def check_weights_file(path: str | os.PathLike) -> None:
    """Check that a safetensors file (its header and the extent it gives every tensor) or a torch.save
    file (a zip archive: its directory and every member's CRC) is whole; a ValueError names it otherwise."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt"):
                pass
            return
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        if bad is not None:
            raise BadInput(f"the CRC of {bad} does not match")
    except (SafetensorError, zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise_machine_error(err)
        size = path.stat().st_size if path.exists() else 0
        raise BadInput(f"{path} is damaged (truncated or corrupt; {size:,} bytes): {err}") from None


def raise_machine_error(err: Exception) -> None:
    """Raise `err` as it is where it is the machine's (a permission, a failing disk, no memory or file handles
    left), which says nothing of the file: a checkpoint that cannot be read now is not set aside as damaged."""
    if isinstance(err, OSError) and err.errno in MACHINE_ERRNOS:
        raise err


def check_plain_pickle(path: str | os.PathLike, allowed=()):
    """What the torch.save file `path` holds, read without running anything from it (its tensors mapped from
    the file), or a ValueError naming it unless it holds tensors, plain values and the `allowed` classes
    (what `torch.serialization.safe_globals` takes) alone. Transformers, Accelerate and DeepSpeed read such
    files next, some with `weights_only=False`."""
    import pickle
    import warnings

    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on another pickle protocol: the refusal below names it
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        if _unpickling_reason(err).startswith("Unsupported operand"):
            raise BadInput(f"{path} is written with pickle instructions that cannot be read without running the file "
                           f"({_unpickling_reason(err)}; torch.save writes protocol 2); it is not read") from None
        raise BadInput(f"{path} holds more than tensors and plain values, so reading it could run code from the "
                       f"file; it is not read ({_unpickling_reason(err)})") from None
    except Exception as err:  # noqa: BLE001 -- whatever else stops torch (a zip that is no torch archive): unreadable
        raise_machine_error(err)
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise BadInput(f"{path} is not a torch.save file that can be read; it is not read ({reason})") from None


def _unpickling_reason(err: Exception) -> str:
    """What torch's refusal says is wrong, without its advice to load the file with weights_only=False."""
    advice = ("Weights only load failed", "(1)", "(2)", "Check the documentation", "Please file an issue")
    for line in str(err).split("WeightsUnpickler error:")[-1].splitlines():
        if line.strip() and not line.strip().startswith(advice):
            return line.strip().split(" Please use")[0]
    return type(err).__name__


def check_inside(path: Path) -> None:
    """A ValueError unless a file of a model folder that is a link points inside the folder: a folder someone
    hands you reads nothing from elsewhere on the machine."""
    if path.is_symlink() and not any(path.resolve().is_relative_to(home) for home in _link_homes(path.parent)):
        raise BadInput(f"{path} is a link to {path.resolve()}, outside the model folder; it is not read")


def _link_homes(folder: Path) -> list[Path]:
    """Where a model folder's links may point: the folder, and for a snapshot of the Hub's cache
    (models--ORG--NAME/snapshots/REVISION) its repository's blobs, where the cache keeps the files."""
    folder = folder.resolve()
    homes = [folder]
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        homes.append(folder.parent.parent / "blobs")
    return homes


def check_plain_file(path: str | os.PathLike, what: str) -> None:
    """A file written to a temporary name and renamed into place would replace a link or a device itself:
    a ValueError saying so, `what` naming the option and path."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise BadInput(f"{what} is a link or a device, which the file written would replace; give the name of a "
                       "plain file")


def check_output_file(option: str, path: str | None) -> None:
    """A file an option names for a command's result can be written there (a ValueError saying why not),
    checked before the work whose result goes there, not after it."""
    if path is None:
        return
    folder = Path(path).parent
    if Path(path).is_dir():
        raise BadInput(f"{option} {path} is a folder; give the name of a file to write")
    check_plain_file(path, f"{option} {path}")
    if not folder.is_dir():
        raise BadInput(f"{option} {path}: there is no folder {folder} to write it in")
    if not os.access(folder, os.W_OK) or (Path(path).exists() and not os.access(path, os.W_OK)):
        raise BadInput(f"{option} {path}: not allowed to write there")


def check_outputs_apart(outputs: dict[str, str | None], inputs: Iterable[str | os.PathLike]) -> None:
    """Raise ValueError unless every output file (option -> path) is neither an input of the command
    (a file, or a file inside an input folder) nor the path of another output."""
    seen: dict[Path, str] = {}
    resolved_inputs = [Path(p).expanduser().resolve() for p in inputs if p and Path(p).expanduser().exists()]
    for option, path in outputs.items():
        if path is None:
            continue
        target = Path(path).expanduser().resolve()
        if target in seen:
            raise BadInput(f"{option} {path} is also the file of {seen[target]}; give each output its own file")
        seen[target] = option
        for source in resolved_inputs:
            if target == source or source in target.parents:
                raise BadInput(f"{option} {path} is an input of this command ({source}); writing there would "
                               "destroy it: give another file")


def check_repo_id(repo_id) -> str:
    """A Hub model id must read "user-or-org/name"."""
    if not isinstance(repo_id, str) or not REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise BadInput(
            f"`repo_id` must look like 'user-or-org/model-name' (letters, digits, '-', '_', '.'; one '/'); "
            f"got {repo_id!r}"
        )
    return repo_id
