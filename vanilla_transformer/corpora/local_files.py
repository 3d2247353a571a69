"""Translation pairs read from local files and folders: one structured file (.json, .jsonl, .csv, .tsv,
.parquet, each optionally .gz), a folder of split files, or plain parallel text, one sentence a line (train.en +
train.fr), with the checks that name the file and line at fault.
"""

from __future__ import annotations

import csv
import glob
import gzip
import json
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import datasets
import pyarrow

from ..errors import BadInput
from ..checks.files import utf8_lines
from .languages import _METADATA_COLUMNS

__all__ = ["SPLITS", "SPLIT_NAMES"]

SPLITS = ("train", "validation", "test")
# The names a split goes by in file names; the loader calls it by the first.
SPLIT_NAMES = {"train": ("train",), "validation": ("validation", "valid", "dev"), "test": ("test",)}

# File suffix (after an optional .gz) -> (datasets builder, builder options).
# TSV is read without quote handling: verses contain bare " characters.
_BUILDERS: dict[str, tuple[str, dict]] = {
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t", "quoting": csv.QUOTE_NONE}),
    ".parquet": ("parquet", {}),
}

# What datasets (5) makes of a `translation` column whose rows hold different keys; older versions fill None.
_UNTYPED_JSON = getattr(datasets, "Json", ())

# What a language key in a header row or a file suffix looks like ("en", "pt_BR", "zh-Hans", "english"):
# a sentence taken for one (a CSV without a header) has spaces or punctuation.
_LANGUAGE_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")


def _file_suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def _is_blank(path: Path) -> bool:
    """True for a file (compressed or not) that holds nothing but white space."""
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    try:
        with opener(path, "rb") as f:
            return not f.read(1 << 16).strip()
    except OSError as err:  # e.g. a .gz that is not gzip
        raise BadInput(f"could not read {path}: {err}") from err


@contextmanager
def _no_download_count():
    """Unless offline, `load_dataset` sends a request to count a download of the builder ("json", "csv")
    even for local files; local files are not a download of anything."""
    counts = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts


def _load_files(files: dict[str, Path], columns: list[str] | None = None) -> datasets.DatasetDict:
    """Read one file per split; all files must share a format. `columns` names the columns of headerless .csv/.tsv files."""
    builders = {_BUILDERS[_file_suffix(path)][0] for path in files.values()}
    if len(builders) > 1:
        raise BadInput(f"split files must share one format, got {sorted(str(p) for p in files.values())}")
    first = next(iter(files.values()))
    builder, options = _BUILDERS[_file_suffix(first)]
    if columns and builder != "csv":
        raise BadInput(f"--columns names the columns of headerless .tsv/.csv files; {first} names its own")
    for split, path in files.items():
        if _is_blank(path):
            raise BadInput(f"{path} is empty: the {split!r} split has no rows")
        if builder == "csv":
            _check_header(path, options, columns)
    if columns:
        options = {**options, "column_names": columns}
    names = ", ".join(str(p) for p in files.values())
    try:
        with _no_download_count():
            loaded = datasets.load_dataset(builder, data_files={s: str(p) for s, p in files.items()}, **options)
    except StopIteration:  # what the json builder raises on a compressed file with no rows
        raise BadInput(f"a data file in {names} has no rows") from None
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as err:
        raise BadInput(_first_bad_line(files.values()) or f"could not read {names} as {builder}: {err}") from err
    for split, data in loaded.items():
        try:  # Arrow's JSON reader lets bytes that are not UTF-8 through; reading the row would fail later
            data.data.table.validate(full=True)
        except pyarrow.ArrowInvalid as err:
            raise BadInput(_first_bad_line([files[split]]) or f"could not read {files[split]}: {err}") from None
        if isinstance(data.features.get("translation"), _UNTYPED_JSON):
            loaded[split] = _same_languages_in_every_row(data, files[split])
    return loaded


def _check_header(path: Path, options: dict, columns: list[str] | None = None) -> None:
    """A CSV/TSV file's first row names its columns: without a header row, the first sentence pair would
    become the language names (and end up in the model's config and card). With `columns` (--columns), the
    file has no header row and as many columns as named."""
    first = next(line for line in _lines(path) if line.strip())
    row = next(csv.reader([first], **options))
    if columns:
        if row == columns:
            raise BadInput(f"{path}: the first row names the columns already ({' | '.join(row)}); leave out --columns")
        if len(row) != len(columns):
            raise BadInput(f"--columns names {len(columns)} columns ({','.join(columns)}) and the first row of {path} "
                           f"has {len(row)}")
        return
    names = [name for name in row if name not in _METADATA_COLUMNS]
    if not all(_LANGUAGE_KEY.fullmatch(name) for name in names):
        separator = "<TAB>" if options.get("delimiter") == "\t" else ","
        shown = " | ".join(names)
        raise BadInput(
            f"{path}: the first row ({shown[:100]}{'...' * (len(shown) > 100)}) does not name the languages; a .tsv/.csv file "
            f"needs a header row such as 'en{separator}fr', or --columns en,fr naming its columns (or give plain text "
            "files train.en and train.fr)"
        )


def _lines(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "rb") as f:
        yield from utf8_lines(f, str(path))


def _is_json_lines(path: Path) -> bool:
    if _file_suffix(path) == ".jsonl":
        return True
    first = next((line for line in _lines(path) if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def _first_bad_line(paths) -> str | None:
    """What the data readers do not say: the file and line of the first byte that is not UTF-8 or
    (in JSON lines) the first line that is not JSON. None when no line is at fault."""
    for path in paths:
        try:
            json_lines = _BUILDERS[_file_suffix(path)][0] == "json" and _is_json_lines(path)
            for number, line in enumerate(_lines(path), 1):
                if json_lines and line.strip():
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as err:
                        return f"{path}, line {number}: not valid JSON ({err.msg}, column {err.colno})"
        except ValueError as err:  # not UTF-8: utf8_lines names the line
            return str(err)
    return None


def _same_languages_in_every_row(data: datasets.Dataset, path: Path) -> datasets.Dataset:
    """datasets reads a `translation` column whose rows hold different languages as untyped JSON. Name the
    first row that lacks a language most rows have; keep those languages as a plain string struct."""
    rows = data["translation"]
    counts = Counter(key for row in rows if isinstance(row, dict) for key in row)
    languages = [key for key, count in counts.items() if count > len(rows) / 2]
    for index, row in enumerate(rows):
        missing = [lang for lang in languages if not isinstance(row, dict) or lang not in row]
        if missing:
            where = f"line {_line_of_row(path, index)}" if _is_json_lines(path) else f"row {index + 1}"
            raise BadInput(
                f"{path}, {where}: the translation has no {' or '.join(map(repr, missing))} text; every pair needs "
                f"the languages of the others ({', '.join(languages)}): {json.dumps(row, ensure_ascii=False)[:200]}"
            )
    features = datasets.Features({"translation": {lang: datasets.Value("string") for lang in languages}})
    return data.map(
        lambda batch: {"translation": [{lang: row[lang] for lang in languages} for row in batch["translation"]]},
        batched=True, features=features, desc="translation layout",
    )


def _line_of_row(path: Path, index: int) -> int:
    """The line of a JSON-lines file that holds row `index` (blank lines hold no row)."""
    rows = (number for number, line in enumerate(_lines(path), 1) if line.strip())
    return next(islice(rows, index, None))


def _split_files(folder: Path) -> dict[str, Path]:
    """The one structured file (.jsonl, .csv, ...) of each split in `folder`, by split."""
    files = {}
    for split, names in SPLIT_NAMES.items():
        found = sorted(p for name in names for p in folder.glob(f"{name}.*") if _file_suffix(p) in _BUILDERS)
        if len(found) > 1:
            raise BadInput(f"{folder} has several files for the {split!r} split: {[p.name for p in found]}")
        if found:
            files[split] = found[0]
    return files


def _text_language(path: Path, stem: str) -> str | None:
    """The language of a plain text file `stem.LANG` or `stem.LANG.gz`, else None."""
    name = path.name[: -len(".gz")] if path.name.lower().endswith(".gz") else path.name
    lang = name[len(stem) + 1 :] if name.startswith(stem + ".") else ""
    return lang if _LANGUAGE_KEY.fullmatch(lang) and f".{lang.lower()}" not in _BUILDERS else None


def _text_pair(prefix: Path, source_lang: str | None, target_lang: str | None) -> dict[str, Path] | None:
    """{source language: file, target language: file} of the plain text files `prefix.LANG` (each optionally
    .gz); None when there is no such file. A language left out is the other file's when there are two."""
    found = {}
    for path in sorted(prefix.parent.glob(f"{glob.escape(prefix.name)}.*")):
        lang = _text_language(path, prefix.name)
        if lang and path.is_file():
            if lang in found:
                raise BadInput(f"{prefix.parent} has both {found[lang].name} and {path.name}; keep one")
            found[lang] = path
    if not found:
        return None
    named = [lang for lang in (source_lang, target_lang) if lang]
    for option, lang in (("--source-lang", source_lang), ("--target-lang", target_lang)):
        if lang and lang not in found:
            raise BadInput(f"{option} {lang}: there is no file {prefix}.{lang}; the plain text files of {prefix} "
                           f"are for {', '.join(found)}")
    others = [lang for lang in found if lang not in named]
    if not named or len(named) == 1 and len(others) != 1:
        raise BadInput(f"{', '.join(p.name for p in found.values())} hold plain text: say which language is the "
                       f"source and which the target with --source-lang and --target-lang")
    source, target = (source_lang, target_lang) if len(named) == 2 else \
        (source_lang or others[0], target_lang or others[0])
    return {source: found[source], target: found[target]}


def _load_text_pairs(pairs: dict[str, dict[str, Path]]) -> datasets.DatasetDict:
    """Plain parallel text: line i of one file translates line i of the other."""
    loaded = datasets.DatasetDict()
    for split, files in pairs.items():
        (source_lang, source), (target_lang, target) = files.items()
        features = datasets.Features({"translation": {lang: datasets.Value("string") for lang in files}})
        sides = [list(_lines(source)), list(_lines(target))]
        if len(sides[0]) != len(sides[1]):
            raise BadInput(f"{source} has {len(sides[0])} lines and {target} {len(sides[1])}: the two sides of "
                           "a pair must hold one sentence a line, in the same order")
        rows = [{source_lang: s, target_lang: t} for s, t in zip(*sides)]
        loaded[split] = datasets.Dataset.from_dict({"translation": rows}, features=features)
    return loaded


def _load_folder(folder: Path, source_lang: str | None, target_lang: str | None,
                 columns: list[str] | None = None) -> datasets.DatasetDict:
    """A folder of structured split files, or else of plain parallel text."""
    files = _split_files(folder)
    if files:
        return _load_files(files, columns)
    if columns:
        raise BadInput(f"--columns names the columns of headerless .tsv/.csv files; {folder} has none")
    pairs = {}
    for split, names in SPLIT_NAMES.items():
        found = {name: pair for name in names if (pair := _text_pair(folder / name, source_lang, target_lang))}
        if len(found) > 1:
            raise BadInput(f"{folder} has several files for the {split!r} split: {', '.join(f'{n}.*' for n in found)}")
        if found:
            pairs[split] = next(iter(found.values()))
    if not pairs:
        raise FileNotFoundError(
            f"{folder} holds neither split files ({', '.join(s + '.jsonl.gz' for s in SPLITS)}, or .json/.csv/.tsv/"
            ".parquet), plain text (train.en + train.fr, valid.*, test.*) nor a dataset written by save_to_disk"
        )
    return _load_text_pairs(pairs)
