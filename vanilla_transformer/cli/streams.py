"""The texts a command reads, as they come: the lines of a file or of standard input, in batches."""

from __future__ import annotations

import errno
import sys

from ..errors import BadInput


def batches_of(texts, size: int):
    """(line number of the first, list of up to `size` texts) for each batch of an iterable of texts."""
    batch, first = [], 1
    for number, text in enumerate(texts, 1):
        batch.append(text)
        if len(batch) == size:
            yield first, batch
            batch, first = [], number + 1
    if batch:
        yield first, batch


def batches_as_they_come(texts, size: int):
    """As `batches_of`, for lines that arrive one by one (a person typing): a batch is the next line and
    those already waiting behind it, so that each line is answered as soon as it comes."""
    import queue
    import threading

    waiting = queue.Queue(maxsize=4 * size)  # a fast pipe waits for the translations instead of filling memory
    end = object()

    def read():
        try:
            for text in texts:
                waiting.put(text)
        except (OSError, ValueError) as err:  # a line that is not UTF-8: refused once the lines before it are out
            waiting.put(err)
            return
        waiting.put(end)

    threading.Thread(target=read, daemon=True).start()  # daemon: a reader blocked on a terminal does not hold the exit
    first, last = 1, None
    while last is None:
        batch, item = [], waiting.get()
        while True:
            if item is end or isinstance(item, Exception):
                last = item
                break
            batch.append(item)
            if len(batch) == size or waiting.empty():
                break
            item = waiting.get()
        if batch:
            yield first, batch
            first += len(batch)
    if last is not end:
        raise last


def read_lines(path: str, option: str):
    """The lines of a file or of standard input ("-"), read as they are used; a file that cannot be opened
    fails here, before the model is loaded, in an error naming `option`."""
    from ..checks.files import utf8_lines

    if path != "-":
        try:
            file = open(path, "rb")
        except OSError as err:
            raise BadInput(f"{option} {path}: {err.strerror or err}") from None
        return _lines_of(file, path)
    closed = BadInput("standard input is closed; give the texts as arguments or with --input-file")
    if sys.stdin is None or sys.stdin.closed:  # started with it closed (`<&-`)
        raise closed

    def stdin_lines():
        try:
            yield from utf8_lines(sys.stdin.buffer, "standard input")
        except OSError as err:
            if err.errno == errno.EBADF:
                raise closed from None
            raise

    return stdin_lines()


def _lines_of(file, path: str):
    from ..checks.files import utf8_lines

    with file:
        yield from utf8_lines(file, path)
