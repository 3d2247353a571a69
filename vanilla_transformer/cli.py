"""The `vanilla-transformer` command line: one sub-command per job.

Each sub-command has an `_add_<name>` function that declares its arguments and
points `func` at the code that runs it; heavy imports happen inside the
runners so that `vanilla-transformer --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys


def _add_train_tokenizer(sub: argparse._SubParsersAction) -> None:
    pass  # issue 3


def _add_train(sub: argparse._SubParsersAction) -> None:
    pass  # issue 4


def _add_translate(sub: argparse._SubParsersAction) -> None:
    pass  # issue 5


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    pass  # issue 5


def _add_attention(sub: argparse._SubParsersAction) -> None:
    pass  # issue 5


def _add_push(sub: argparse._SubParsersAction) -> None:
    pass  # issue 5


def _add_quickstart(sub: argparse._SubParsersAction) -> None:
    pass  # issue 7


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vanilla-transformer",
        description="Train, translate with and look inside the Transformer of 'Attention Is All You Need'.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_train_tokenizer, _add_train, _add_translate, _add_evaluate, _add_attention, _add_push, _add_quickstart):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
