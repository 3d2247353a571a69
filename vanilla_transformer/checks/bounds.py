"""What an option's value must be, for the command line and the Python API alike.

An option declared as a dataclass field (training/arguments.py's `TrainArguments`) holds the type of its
annotation (`field_kind`) and may name a bound (`BOUNDS`): the command line refuses a value beyond it as it is
read (cli/options.py's `BoundedOption`), and `TrainArguments.validate` words the same bound naming the field.
Both import this module, which imports neither torch nor transformers, so that `--help` stays instant.
"""

import dataclasses
import math
import numbers
import types
import typing

from ..threads import machine_cpus

__all__ = ["BOUNDS", "field_kind", "max_num_beams", "within_bound"]

# The bounds a field's metadata may name, by the field's type: what an error calls it, and the test.
BOUNDS = {
    ("positive", int): ("a positive integer", lambda value: value >= 1),
    ("non-negative", int): ("a non-negative integer", lambda value: value >= 0),
    ("positive", float): ("a positive number", lambda value: value > 0),
    ("non-negative", float): ("a non-negative number", lambda value: value >= 0),
    ("fraction", float): ("a number in [0, 1)", lambda value: 0 <= value < 1),
    # More threads than CPUs only wait for one another; tens of thousands fail to start and crash the process.
    ("cpus", int): (f"a positive integer up to {machine_cpus()} (this machine's CPUs)",
                    lambda value: 1 <= value <= machine_cpus()),
    ("seed", int): ("an integer in [0, 2**32)", lambda value: 0 <= value < 2**32),  # what NumPy's generator takes
    ("port", int): ("in 1..65535", lambda value: 0 < value < 65536),
}


def max_num_beams() -> int:
    from ..modeling.value_checks import MAX_NUM_BEAMS  # here, not above: the model's checks bring transformers

    return MAX_NUM_BEAMS


def within_bound(bound: str, kind: type, value) -> bool:
    """Whether `value` is a number of `kind` (a finite one, for a float) that keeps `bound`, a name in BOUNDS."""
    if kind is float:
        number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    else:
        number = isinstance(value, int) and not isinstance(value, bool)
    return number and BOUNDS[bound, kind][1](value)


def field_kind(arguments: type, f: dataclasses.Field) -> tuple[type, bool]:
    """(the type the field `f` of the dataclass `arguments` holds, whether it may be None), from `int`,
    `int | None` and the like."""
    hint = _hint(arguments, f)
    if isinstance(hint, types.UnionType):
        kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)]
        return kinds[0], len(kinds) < len(typing.get_args(hint))
    return hint, False


def _hint(arguments: type, f: dataclasses.Field):
    """A field's annotation: the type itself in a module without postponed annotations (evaluating strings
    for every option would slow `--help`), a string in a subclass written with them."""
    return typing.get_type_hints(arguments)[f.name] if isinstance(f.type, str) else f.type
