"""A model folder's tokenizer files checked before the tokenizers library parses them.

The library reads tokenizer.json whole, holding every added token and pattern it names, and a regular
expression in it that backtracks without end makes it panic (a Rust traceback of hundreds of lines). What
is refused here is named in one line: a file larger than the config's vocabulary needs, more added
tokens than the model has embedding rows, a pattern with a repeated group of choices or repeats.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["TOKENIZER_FILES", "check_tokenizer_files", "max_tokenizer_bytes"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# A token's entry in tokenizer.json (its string, id, merges, score) takes tens of bytes; a kilobyte each, with a
# megabyte for the rest, is far past any tokenizer's own and far below what takes minutes to parse.
_BYTES_PER_TOKEN = 1024
_BYTES_BESIDES = 1 << 20

# A group holding a quantifier or a choice, itself repeated: `(a+)+`, `(\w+\s?)*`, `(a|aa)+`. Matching it can
# backtrack exponentially, and the regex engine's retry limit is a panic in the tokenizers library, not an error.
_REPEATED_GROUP = re.compile(r"\((?:[^()\\]|\\.)*(?:[+*|]|\{\d+,\d*\})(?:[^()\\]|\\.)*\)(?:[+*]|\{\d+,\d*\})")


def max_tokenizer_bytes(vocab_size: int) -> int:
    """The most bytes a tokenizer file of a `vocab_size`-token vocabulary is read to."""
    return _BYTES_BESIDES + _BYTES_PER_TOKEN * vocab_size


def check_tokenizer_files(folder: str | Path, vocab_size) -> None:
    """A ValueError naming the file and what is refused unless the tokenizer files in `folder` fit a model of
    `vocab_size` embedding rows (by their size and their added tokens) and hold no pattern that backtracks
    without end. Files that are not there, or a `vocab_size` that is no number, are left to the loader."""
    folder = Path(folder)
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        return
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file() and path.stat().st_size > max_tokenizer_bytes(vocab_size):
            raise ValueError(f"{path} is {path.stat().st_size:,} bytes, more than a tokenizer of the model's "
                             f"{vocab_size:,} tokens needs (at most {max_tokenizer_bytes(vocab_size):,}); it is not read. "
                             "Put the tokenizer the model was trained with beside it")
    path = folder / "tokenizer.json"
    if not path.is_file():
        return
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # the loader names what is wrong with it
    if not isinstance(tokenizer, dict):
        return
    added = tokenizer.get("added_tokens")
    if isinstance(added, list) and len(added) > vocab_size:
        raise ValueError(f"{path} adds {len(added):,} tokens to a model of {vocab_size:,}; it is not read. "
                         "Put the tokenizer the model was trained with beside it")
    for part in ("normalizer", "pre_tokenizer"):
        for pattern in _patterns(tokenizer.get(part)):
            if _REPEATED_GROUP.search(pattern):
                raise ValueError(f"{path}: its {part} matches the regular expression {pattern[:80]!r}, whose repeated "
                                 "group can take the matcher for ever; it is not read. Put the tokenizer the model was "
                                 "trained with beside it")


def _patterns(part) -> list[str]:
    """The regular expressions anywhere in a normalizer's or pre-tokenizer's description."""
    if isinstance(part, dict):
        found = [part["Regex"]] if isinstance(part.get("Regex"), str) else []
        return found + [pattern for value in part.values() for pattern in _patterns(value)]
    if isinstance(part, list):
        return [pattern for value in part for pattern in _patterns(value)]
    return []
