"""`BadInput`: what every check of the package raises on an option, file or folder that is not what was expected.

It is a ValueError, as transformers raises for bad arguments, so that code catching ValueError still catches it.
The command line refuses a `BadInput` in one line naming what was wrong (exit status 2, cli/__init__.py's `main`)
and lets any other exception, a bug's, show its traceback. The model's own files (modeling/, which ship with saved
models and import nothing of the package) raise plain ValueError: where a user's input reaches their checks, the
caller reads their refusal `as_bad_input`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["BadInput", "MissingPackage", "as_bad_input"]


class BadInput(ValueError):
    """An option, file or folder refused by a check; the message names it and says what was expected."""


class MissingPackage(BadInput, ImportError):
    """A feature asked for needs an optional package that is not installed; the message says how to install it. An
    ImportError too, as Python raises for a module that is not there (any other ImportError is a bug's)."""


@contextmanager
def as_bad_input(where: str = "") -> Iterator[None]:
    """Inside it, a ValueError (a check of the model's files, run on a user's input) is raised as a `BadInput`,
    its message after `where` (say, "`config_overrides`: ")."""
    try:
        yield
    except BadInput:
        raise
    except ValueError as err:
        raise BadInput(f"{where}{err}") from None
