"""Translation pairs from small local files and folders: structured files, split files, plain parallel text; read
without a request to the network."""

from __future__ import annotations

import gzip
import json
import re

import datasets
import pytest

from vanilla_transformer.corpora import (
    iter_texts,
    language_keys,
    load_translation_dataset,
    resolve_languages,
    text_pairs,
)


ROWS = [
    {"id": "a", "translation": {"en": "In the beginning, “God” said.", "es": "En el principio crió Dios."}},
    {"id": "b", "translation": {"en": "It’s light — 光 😀", "es": "Sea la luz: y fué la luz."}},
]


def write_jsonl(path, rows):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json"])
def test_single_json_file_becomes_train_split(tmp_path, suffix):
    path = write_jsonl(tmp_path / f"pairs{suffix}", ROWS)
    data = load_translation_dataset(path)
    assert list(data) == ["train"]
    assert text_pairs(data["train"], "en", "es") == (
        [r["translation"]["en"] for r in ROWS],
        [r["translation"]["es"] for r in ROWS],
    )


def test_plain_columns_are_normalised(tmp_path):
    flat = [{"id": r["id"], **r["translation"]} for r in ROWS]
    csv_path = tmp_path / "pairs.csv"
    datasets.Dataset.from_list(flat).to_csv(csv_path, index=False)
    tsv_path = tmp_path / "pairs.tsv"
    tsv_path.write_text("en\tes\n" + "".join(f"{r['en']}\t{r['es']}\n" for r in flat), encoding="utf-8")
    parquet_path = tmp_path / "pairs.parquet"
    datasets.Dataset.from_list(flat).to_parquet(parquet_path)
    for path in (csv_path, tsv_path, parquet_path):
        data = load_translation_dataset(path, source_lang="es", target_lang="en")
        assert "translation" in data["train"].column_names, path
        assert text_pairs(data["train"], "es", "en")[1] == [r["en"] for r in flat], path
    # Naming one side is enough when there are two: the other one is kept too.
    data = load_translation_dataset(csv_path, target_lang="en")
    assert resolve_languages(data["train"], target_lang="en") == ("es", "en")
    assert language_keys(load_translation_dataset(parquet_path)["train"]) == ["en", "es"]
    # The helpers read the plain-column layout too, before any normalising.
    raw = datasets.Dataset.from_list(flat)
    assert text_pairs(raw, "en", "es")[0] == [r["en"] for r in flat]
    assert list(iter_texts(raw, ["es"])) == [r["es"] for r in flat]


def test_folder_of_split_files_and_save_to_disk(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl.gz", ROWS)
    write_jsonl(folder / "validation.jsonl", ROWS[:1])
    data = load_translation_dataset(folder)
    assert {k: len(v) for k, v in data.items()} == {"train": 2, "validation": 1}

    data.save_to_disk(tmp_path / "saved")
    again = load_translation_dataset(tmp_path / "saved")
    assert text_pairs(again["train"], "en", "es") == text_pairs(data["train"], "en", "es")


def test_empty_and_unreadable_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    with pytest.raises(ValueError, match="empty"):
        load_translation_dataset(empty)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="broken.jsonl.gz"):
        load_translation_dataset(broken)
    unknown = tmp_path / "pairs.txt"
    unknown.write_text("hello\n")
    with pytest.raises(ValueError, match="unknown file type"):
        load_translation_dataset(unknown)
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl.gz", ROWS)
    write_jsonl(folder / "test.jsonl.gz", [])
    with pytest.raises(ValueError, match="no rows"):
        load_translation_dataset(folder)
    header_only = tmp_path / "header.csv"
    header_only.write_text("en,es\n")
    with pytest.raises(ValueError, match="header.csv"):
        load_translation_dataset(header_only)


GOOD = [json.dumps({"translation": {"en": f"verse {i}", "es": f"versículo {i}"}}, ensure_ascii=False).encode() for i in range(30)]


@pytest.mark.parametrize(
    "name, bad_line, message",
    [
        ("pairs.jsonl", b'{"translation": {"en": "a", "es": "b"}', "pairs.jsonl, line 21: not valid JSON (Expecting ',' delimiter"),
        ("pairs.jsonl.gz", b'{"translation": {"en": "a", "es": "b"}', "pairs.jsonl.gz, line 21: not valid JSON"),
        ("pairs.json", b'{"translation": {"en": "a", "es": "b"}} x', "pairs.json, line 21: not valid JSON (Extra data"),
        ("pairs.jsonl", '{"translation": {"en": "crió", "es": "b"}}'.encode("latin-1"),
         "pairs.jsonl, line 21: byte 0xf3 at column 28 is not UTF-8"),
        ("pairs.jsonl", b'{"translation": {"en": "only English"}}',
         "pairs.jsonl, line 21: the translation has no 'es' text; every pair needs the languages of the others (en, es)"),
        ("pairs.csv", "crió,b".encode("latin-1"), "pairs.csv, line 21: byte 0xf3 at column 4 is not UTF-8"),
    ],
)
def test_a_bad_line_is_named_with_its_file_and_line(tmp_path, name, bad_line, message):
    # Named with its file and line, never `datasets`' "An error occurred while generating the dataset" or a bare
    # codec error.
    if name.endswith(".csv"):
        lines = [b"en,es"] + [f"verse {i},vers {i}".encode() for i in range(19)] + [bad_line]
    else:
        lines = [*GOOD[:20], bad_line, *GOOD[20:]]
    content = b"\n".join(lines) + b"\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(content) if name.endswith(".gz") else content)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_translation_dataset(path)


def test_rows_with_an_extra_language_keep_the_pair(tmp_path):
    lines = [*GOOD[:5], json.dumps({"translation": {"en": "x", "es": "y", "fr": "z"}}).encode()]
    (tmp_path / "pairs.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    data = load_translation_dataset(tmp_path / "pairs.jsonl")
    assert language_keys(data["train"]) == ["en", "es"]
    assert text_pairs(data["train"], "en", "es")[1][-2:] == ["versículo 4", "y"]


def write_plain_pair(prefix, pairs, source_lang="fr", target_lang="en"):
    """`prefix.SRC` and `prefix.TGT`, one sentence a line, as OPUS and WMT ship parallel text."""
    for index, lang in ((0, source_lang), (1, target_lang)):
        prefix.with_name(f"{prefix.name}.{lang}").write_text("".join(pair[index] + "\n" for pair in pairs), encoding="utf-8")


@pytest.fixture(scope="module")
def fr_en_pairs():
    """Real French-English pairs, a direction the package does not embed."""
    french, english = text_pairs(load_translation_dataset("bible-en-fr")["validation"], "fr", "en")
    return list(zip(french, english))


@pytest.mark.parametrize("validation_name", ["valid", "dev", "validation"])
def test_a_folder_of_plain_parallel_text(tmp_path, fr_en_pairs, validation_name):
    write_plain_pair(tmp_path / "train", fr_en_pairs[:40])
    write_plain_pair(tmp_path / validation_name, fr_en_pairs[40:50])
    write_plain_pair(tmp_path / "test", fr_en_pairs[50:55])
    data = load_translation_dataset(tmp_path, source_lang="fr", target_lang="en")
    assert {split: len(rows) for split, rows in data.items()} == {"train": 40, "validation": 10, "test": 5}
    assert language_keys(data["train"]) == ["fr", "en"]
    assert list(zip(*text_pairs(data["validation"], "fr", "en"))) == fr_en_pairs[40:50]
    # One language named is enough: the other is the other file's.
    assert resolve_languages(load_translation_dataset(tmp_path, target_lang="en")["test"]) == ("fr", "en")


def test_a_prefix_names_one_pair_of_files_gzipped_or_not(tmp_path, fr_en_pairs):
    write_plain_pair(tmp_path / "corpus", fr_en_pairs[:20])
    with gzip.open(tmp_path / "other.en.gz", "wt", encoding="utf-8") as f:
        f.write("".join(english + "\n" for _, english in fr_en_pairs[:3]))
    (tmp_path / "other.fr").write_text("".join(french + "\n" for french, _ in fr_en_pairs[:3]), encoding="utf-8")
    data = load_translation_dataset(str(tmp_path / "corpus"), source_lang="fr", target_lang="en")
    assert list(data) == ["train"] and list(zip(*text_pairs(data["train"], "fr", "en"))) == fr_en_pairs[:20]
    assert text_pairs(load_translation_dataset(tmp_path / "other", source_lang="en")["train"], "en", "fr")[0] == \
        [english for _, english in fr_en_pairs[:3]]


def test_plain_text_refusals_name_the_files_and_the_options(tmp_path, fr_en_pairs):
    write_plain_pair(tmp_path / "train", fr_en_pairs[:5])
    with pytest.raises(ValueError, match=r"train.en, train.fr hold plain text: .*--source-lang and --target-lang"):
        load_translation_dataset(tmp_path)
    with pytest.raises(ValueError, match=r"--target-lang de: there is no file .*train.de; .* are for en, fr"):
        load_translation_dataset(tmp_path, source_lang="fr", target_lang="de")
    with pytest.raises(ValueError, match=r"^--source-lang and --target-lang are both 'en': a translation needs two"):
        load_translation_dataset(tmp_path, source_lang="en", target_lang="en")  # once an unpacking error
    with pytest.raises(ValueError, match=r"unknown file type.*give the files' prefix, .*train$"):
        load_translation_dataset(tmp_path / "train.fr")
    (tmp_path / "train.en").write_text("one line\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"train.fr has 5 lines and .*train.en 1"):
        load_translation_dataset(tmp_path, source_lang="fr", target_lang="en")
    write_plain_pair(tmp_path / "dev", fr_en_pairs[:2])
    write_plain_pair(tmp_path / "valid", fr_en_pairs[:2])
    with pytest.raises(ValueError, match=r"several files for the 'validation' split: valid.\*, dev.\*"):
        load_translation_dataset(tmp_path, source_lang="fr", target_lang="en")


def test_split_files_named_valid_or_dev_are_the_validation_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "dev.jsonl", ROWS[:1])
    assert {split: len(rows) for split, rows in load_translation_dataset(tmp_path).items()} == {"train": 2, "validation": 1}
    write_jsonl(tmp_path / "valid.jsonl", ROWS[:1])
    with pytest.raises(ValueError, match="several files for the 'validation' split"):
        load_translation_dataset(tmp_path)


@pytest.mark.parametrize("name, separator", [("pairs.tsv", "\t"), ("pairs.csv", ",")])
def test_columns_names_the_columns_of_a_table_without_a_header_row(tmp_path, fr_en_pairs, name, separator):
    """--columns reads a table without a header row: the file need not be edited."""
    (tmp_path / "data").mkdir()
    rows = [(str(i), fr.replace(",", ""), en.replace(",", "")) for i, (fr, en) in enumerate(fr_en_pairs[:5])]
    for split in ("train", "test"):
        (tmp_path / "data" / name.replace("pairs", split)).write_text(
            "".join(separator.join(row) + "\n" for row in rows), encoding="utf-8")
    data = load_translation_dataset(tmp_path / "data", columns="id,fr,en")
    assert {split: len(rows) for split, rows in data.items()} == {"train": 5, "test": 5}  # the first row is a pair
    assert text_pairs(data["test"], "fr", "en") == ([fr for _, fr, _ in rows], [en for _, _, en in rows])
    path = tmp_path / "data" / name.replace("pairs", "train")
    with pytest.raises(ValueError, match=rf"^--columns names 2 columns \(fr,en\) and the first row of {re.escape(str(path))} has 3$"):
        load_translation_dataset(path, columns="fr,en")
    path.write_text(f"id{separator}fr{separator}en\n" + path.read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(ValueError, match=r"the first row names the columns already \(id \| fr \| en\); leave out --columns$"):
        load_translation_dataset(path, columns="id,fr,en")
    for columns in ("fr", "fr,,en", "fr,fr"):
        with pytest.raises(ValueError, match="^--columns must name each column of the file once, in order"):
            load_translation_dataset(path, columns=columns)
    for dataset in ("bible-en-fr", write_jsonl(tmp_path / "rows.jsonl", ROWS)):
        with pytest.raises(ValueError, match="^--columns names the columns of headerless .tsv/.csv files"):
            load_translation_dataset(dataset, columns="fr,en")


@pytest.mark.parametrize("name, separator", [("pairs.tsv", "\t"), ("pairs.csv", ",")])
def test_a_table_without_a_header_row_is_refused_before_it_is_read(tmp_path, fr_en_pairs, name, separator):
    """`paste train.fr train.en`: the first pair would otherwise become the language names."""
    path = tmp_path / name
    path.write_text("".join(f"{fr.replace(',', '')}{separator}{en.replace(',', '')}\n" for fr, en in fr_en_pairs[:5]),
                    encoding="utf-8")
    with pytest.raises(ValueError, match=r"pairs\.\w+: the first row \(.*\) does not name the languages; .* needs a header row"):
        load_translation_dataset(path)
    path.write_text(f"fr{separator}en\n" + path.read_text(encoding="utf-8"), encoding="utf-8")
    assert resolve_languages(load_translation_dataset(path)["train"]) == ("fr", "en")


_NO_NETWORK = """
import socket, sys
attempts = []
def refuse(*args, **kwargs):
    attempts.append(repr(args[:2]))
    raise OSError("no network in this test")
socket.getaddrinfo = socket.create_connection = socket.socket.connect = refuse
from vanilla_transformer.cli import main

try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print("exit", code, "network", attempts)
"""


@pytest.mark.slow
def test_scoring_local_data_sends_no_request_when_not_offline(hub_tiny_folder, tmp_path):
    import json
    import os
    import subprocess
    import sys

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"en": f"In the beginning {i}.", "es": f"En el principio {i}."}) + "\n" for i in range(3)))
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_UPDATE_DOWNLOAD_COUNTS")}
    # datasets counted a download of its "json" builder with a request to S3 for every local file read.
    result = subprocess.run(
        [sys.executable, "-c", _NO_NETWORK, "evaluate", "--model", str(hub_tiny_folder), "--dataset", str(data),
         "--split", "train", "--device", "cpu", "--num-beams", "1", "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.stdout.strip().splitlines()[-1] == "exit 0 network []", result.stderr[-2000:]
