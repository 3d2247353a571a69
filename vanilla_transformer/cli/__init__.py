"""The `vanilla-transformer` command line: one sub-command per job, one module per sub-command.

Each command's module has `add_parser`, which declares its arguments and points `func` at its `run`;
heavy imports happen inside the runners so that `vanilla-transformer --help` stays instant. `train`'s
options are generated from the fields of `TrainArguments` (training/arguments.py, which imports no
torch); an option other commands share with it takes its default and help from there, and one several
other commands take is declared once (options.py). The texts a command reads come through streams.py.

How a command ends is `main`'s alone, one table for all: a check's `BadInput` (an optional package not installed,
`MissingPackage`, among them) and a path that is not what it names are usage errors, one line and status 2 (as
argparse's own); any other OSError is the machine's (a full disk, a failing device, a permission), one line and
status 1; Ctrl-C 130, a closed pipe 141; `train` adds its run's own ends (a stop signal, 128 + its number; a loss that is not finite, 1). Any other
exception is a bug's and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from ..errors import BadInput
from ..staging import FULL_DISK_ERRNOS
from . import attention, evaluate, export, push, quickstart, serve, train, train_tokenizer, translate

# A path given that is not what it names, or a folder another run holds: refused as bad input is.
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)

# In the order `--help` lists them.
COMMANDS = (train_tokenizer, train, translate, evaluate, export, attention, serve, push, quickstart)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vanilla-transformer",
        description="Train, translate with and look inside the Transformer of 'Attention Is All You Need'.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


_TEXT_ARGUMENTS = {"texts": "TEXT", "text": "text", "special_tokens": "--special-tokens", "source_lang": "--source-lang",
                   "target_lang": "--target-lang"}


def _check_text_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Text given as an argument must be UTF-8: Python keeps another byte as a lone surrogate, which the
    tokenizer would refuse with a TypeError. (Paths may hold any bytes: they are left alone.)"""
    for name, shown in _TEXT_ARGUMENTS.items():
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            bad = next((i for i, c in enumerate(value or "") if "\udc80" <= c <= "\udcff"), None)
            if bad is not None:
                parser.exit(2, f"{parser.prog} {args.command}: error: argument {shown}: byte {ord(value[bad]) - 0xDC00:#04x} "
                               f"at character {bad + 1} is not UTF-8; give the text in UTF-8\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_text_arguments(parser, args)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its bar of weights loaded: standard error is for errors and warnings
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # here, so that a failing write is reported below, not as a traceback at exit
        return code
    except KeyboardInterrupt:  # Ctrl-C outside a training loop: nothing to save, one line instead of a traceback
        print(f"vanilla-transformer {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other command-line tools do
        _silence_standard_output()
        return 141
    except (BadInput, *PATH_ERRORS) as err:  # a usage error, as argparse's own: status 2
        parser.exit(2, f"vanilla-transformer {args.command}: error: {err}\n")
    except OSError as err:  # the machine's: a full disk, a failing device, a permission
        print(f"vanilla-transformer {args.command}: error: {_machine_error(err)}", file=sys.stderr)
        return 1
    except BaseException as err:
        if type(err).__name__ != "PanicException":  # the tokenizers library's panic: a BaseException from Rust
            raise
        where = f"{args.model}/tokenizer.json" if getattr(args, "model", None) else "the tokenizer"
        reason = str(err).splitlines()[0] if str(err) else "a panic"
        print(f"vanilla-transformer {args.command}: error: the tokenizers library failed on {where}: {reason}; "
              "put the tokenizer the model was trained with beside it", file=sys.stderr)
        return 2


def _machine_error(err: OSError) -> str:
    """The one line of an OSError that is not the user's, naming its file where it has one; only a full disk or
    quota is said to be a failed write (a failing device fails reads too)."""
    if err.strerror is None:  # raised with a message of its own (staging's DiskFull names the file and the cause)
        return str(err)
    if err.errno in (*FULL_DISK_ERRNOS, errno.EBADF, errno.EIO) and sys.stdout is not None:
        _silence_standard_output()  # it may be the output that failed: Python's flush at exit would fail again
    full = err.errno in FULL_DISK_ERRNOS
    if err.filename is not None:
        return f"{'cannot write ' if full else ''}{os.fsdecode(err.filename)}: {err.strerror}"
    if full:
        return f"cannot write the output: {err.strerror}"
    if err.errno in (errno.EBADF, errno.EIO):  # no file named: one of the standard streams
        return f"the standard input or output failed: {err.strerror}"
    return str(err)


def _silence_standard_output() -> None:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
