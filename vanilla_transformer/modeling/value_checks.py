"""Checks of plain values, one place each: the decoding options (§6.1's beam size, length penalty and longest
output), and finite numbers (the configuration's `is_finite_number`), for the model's `generate`, the pipeline,
the command line, the web app and training's scoring.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only the
standard library and the configuration beside it, whose checks of numbers it shares.
"""

from __future__ import annotations

import numbers

from .configuration_vanilla_transformer import is_finite_number

MAX_NUM_BEAMS = 32  # far beyond the paper's 4; each beam holds a copy of the search's state
MAX_NEW_TOKENS = 4096  # far beyond any sentence; a larger bound only sizes buffers that memory cannot hold
MAX_LENGTH_PENALTY = 10.0  # GNMT's ((5 + length) / 6) ** alpha stays finite in float32 below this


def check_decoding_options(num_beams=None, length_penalty=None, max_new_tokens=None, *, names=None) -> None:
    """Refuse settings that transformers would fail on many frames deep (num_beams=0 divides by zero), decode
    with silently (a NaN length penalty ranks every beam alike), or that no memory or float32 holds. None: not
    given. `names`: what the caller's users call an option (e.g. {"num_beams": "--num-beams"}); default `num_beams`."""
    names = names or {}

    def name(option: str) -> str:
        return names.get(option, f"`{option}`")

    for option, value in (("num_beams", num_beams), ("max_new_tokens", max_new_tokens)):
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name(option)} must be a positive integer; got {value!r}.")
    if length_penalty is not None and not is_finite_number(length_penalty):
        raise ValueError(f"{name('length_penalty')} must be a finite number (the paper's: 0.6); got {length_penalty!r}.")
    if length_penalty is not None and abs(length_penalty) > MAX_LENGTH_PENALTY:
        raise ValueError(f"{name('length_penalty')} must be between -{MAX_LENGTH_PENALTY} and {MAX_LENGTH_PENALTY} (the "
                         f"paper's: 0.6; larger ones overflow the beam scores); got {length_penalty!r}.")
    if num_beams is not None and num_beams > MAX_NUM_BEAMS:
        raise ValueError(f"{name('num_beams')} must be at most {MAX_NUM_BEAMS} (the paper's: 4; each beam holds a copy "
                         f"of the search's state); got {num_beams!r}.")
    if max_new_tokens is not None and max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(f"{name('max_new_tokens')} must be at most {MAX_NEW_TOKENS} (its cache is allocated up front); "
                         f"got {max_new_tokens!r}.")
