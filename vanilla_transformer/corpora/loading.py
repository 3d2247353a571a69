"""One loader for every translation data set the package reads.

`load_translation_dataset` turns any of these into a `datasets.DatasetDict`:

- an embedded corpus by short name (`"bible-en-es"`, `"bible-en-fr"`, see
  `EMBEDDED_CORPORA`), shipped inside the package so that everything works
  offline;
- a local file (.json, .jsonl, .csv, .tsv, .parquet, each optionally .gz),
  which becomes the "train" split;
- a folder of split files (train.jsonl.gz, validation.csv, test.parquet, ...);
- a folder of plain parallel text, one sentence a line, as OPUS and WMT ship it:
  train.en + train.fr, valid.* or dev.*, test.* (each optionally .gz), with the
  pair named by `source_lang`/`target_lang`; or the prefix of one such pair of
  files (`DIR/train` for DIR/train.en + DIR/train.fr), which becomes "train";
- a folder written by `save_to_disk`;
- a Hugging Face Hub data set name (needs the network).

Rows come in one of two layouts, and both are normalised to the first:

    {"translation": {"en": "...", "es": "..."}}   # the layout of the Hub's translation sets
    {"en": "...", "es": "..."}                     # plain columns named after the languages

Downstream code then reads strings with `text_pairs` (training pairs) or
`iter_texts` (tokenizer training), never touching the layout itself.
"""

from __future__ import annotations

import glob
from pathlib import Path

import datasets

from ..errors import BadInput
from .embedded import EMBEDDED_CORPORA
from .languages import _to_translation_layout, language_keys, resolve_languages
from .local_files import (
    _BUILDERS,
    _file_suffix,
    _load_files,
    _load_folder,
    _load_text_pairs,
    _split_files,
    _text_language,
    _text_pair,
)

__all__ = ["load_translation_dataset", "recorded_name"]


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix.lower() in {*_BUILDERS, ".gz"}


def _load_raw(
    name_or_path: str | Path, config_name: str | None, source_lang: str | None, target_lang: str | None,
    columns: list[str] | None = None,
) -> datasets.DatasetDict:
    """Load without normalising: decide what `name_or_path` names, then read it."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    if columns and not (path.is_file() or (path.is_dir() and _split_files(path))):
        raise BadInput(f"--columns names the columns of headerless .tsv/.csv files; {name} is none")
    if name in EMBEDDED_CORPORA:
        return _load_files(_split_files(EMBEDDED_CORPORA[name].path))
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            try:
                loaded = datasets.load_from_disk(str(path))
            except Exception as err:  # datasets raises many types here (IndexError on an empty save)
                raise BadInput(f"could not load the save_to_disk folder {path}: {err!r}") from err
            return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)
        return _load_folder(path, source_lang, target_lang, columns)
    if path.is_file():
        if _file_suffix(path) not in _BUILDERS:
            prefix, _, _ = (path.name[: -len(".gz")] if path.name.lower().endswith(".gz") else path.name).rpartition(".")
            side = f"; for plain parallel text give the files' prefix, {path.parent / prefix}" \
                if prefix and _text_language(path, prefix) else ""
            raise BadInput(f"{path}: unknown file type; expected one of {sorted(_BUILDERS)} (optionally .gz){side}")
        return _load_files({"train": path}, columns)
    pair = _text_pair(path, source_lang, target_lang) if path.name and path.parent.is_dir() else None
    if pair:
        return _load_text_pairs({"train": pair})
    if isinstance(name_or_path, Path) or _looks_like_path(name):
        raise FileNotFoundError(f"no such file or folder: {path}")
    try:
        loaded = datasets.load_dataset(name, config_name)
    except (ConnectionError, FileNotFoundError) as err:
        raise FileNotFoundError(
            f"{name!r} is not an embedded corpus ({', '.join(EMBEDDED_CORPORA)}), a local path, "
            f"or a data set the Hub could provide here: {err}"
        ) from err
    return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)


def recorded_name(name_or_path: str) -> str:
    """`name_or_path` as a model's config.json records it: a local file, folder or prefix of plain text files as
    its absolute path, so that the model's folder finds its data from any directory; an embedded corpus or a
    Hub data set as it is."""
    name = str(name_or_path)
    if name in EMBEDDED_CORPORA:
        return name
    path = Path(name).expanduser()
    if path.exists() or (path.name and path.parent.is_dir() and any(path.parent.glob(f"{glob.escape(path.name)}.*"))):
        return str(path.resolve())
    return name


def load_translation_dataset(
    name_or_path: str | Path,
    config_name: str | None = None,
    *,
    source_lang: str | None = None,
    target_lang: str | None = None,
    columns: str | None = None,
) -> datasets.DatasetDict:
    """Load a translation data set into the `{"translation": {lang: text}}` layout.

    `columns` ("en,fr", --columns) names the columns of .tsv/.csv files that have no header row, in order.

    `source_lang`/`target_lang`, when given, must be among the data set's
    language keys (ValueError lists the keys that exist). For embedded corpora
    they default to the corpus pair; plain parallel text needs them (or one, with two files). Split files
    named valid.* or dev.* become "validation". Raises FileNotFoundError for a path that
    does not exist and ValueError for an empty split or an unreadable file.
    """
    if source_lang is not None and source_lang == target_lang:
        raise BadInput(f"--source-lang and --target-lang are both {source_lang!r}: a translation needs two languages")
    if str(name_or_path) in EMBEDDED_CORPORA:
        corpus = EMBEDDED_CORPORA[str(name_or_path)]
        source_lang, target_lang = source_lang or corpus.source_lang, target_lang or corpus.target_lang
    dataset = _load_raw(name_or_path, config_name, source_lang, target_lang, _column_names(columns))
    for split, data in dataset.items():
        if len(data) == 0:
            raise BadInput(f"the {split!r} split of {name_or_path} has no rows")
        # With a language named, check (and complete) the pair; otherwise keep every language key.
        chosen = list(resolve_languages(data, source_lang, target_lang)) if source_lang or target_lang else None
        if "translation" not in data.column_names:
            chosen = chosen or language_keys(data)
            if not chosen:
                raise BadInput(
                    f"the {split!r} split of {name_or_path} has no 'translation' column and no text columns; "
                    f"columns are {data.column_names}"
                )
            dataset[split] = _to_translation_layout(data, chosen)
    return dataset


def _column_names(columns: str | None) -> list[str] | None:
    """--columns "en,fr" as a list of distinct names, or a ValueError saying what was expected."""
    if columns is None:
        return None
    names = [name.strip() for name in columns.split(",")]
    if len(names) < 2 or not all(names) or len(set(names)) < len(names):
        raise BadInput(f"--columns must name each column of the file once, in order, separated by commas (e.g. "
                       f"en,fr or id,en,fr); got {columns!r}")
    return names
