"""Reading the files users hand us, and checking the files we wrote, so that a bad one is named.

A byte that is not UTF-8, a line that is not JSON or a truncated weights file otherwise surfaces
as a codec, Arrow or safetensors error that names neither the file nor the line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["utf8_lines"]


def utf8_lines(lines: Iterable[bytes], name: str) -> Iterator[str]:
    """Decode the lines of a binary file (or of standard input), without their line ends.

    A byte that is not UTF-8 is a ValueError naming `name`, the line and the column.
    """
    for number, raw in enumerate(lines, 1):
        try:
            yield raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{name}, line {number}: byte {raw[err.start]:#04x} at column {err.start + 1} is not UTF-8; "
                "save the file as UTF-8"
            ) from None
