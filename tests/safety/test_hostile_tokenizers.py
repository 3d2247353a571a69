"""Hostile tokenizer files in a model folder: one that is far larger than the model's vocabulary needs
is refused before it is parsed, and a pattern that makes the tokenizers library panic is refused, or its panic
told in one line naming the file, instead of a Rust traceback of hundreds of lines."""

import json
import shutil
import subprocess

import pytest

from commands import run_cli

MEMORY_CAP = 3 << 30


def _translate(folder, text: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return run_cli("translate", "--model", folder, "--num-beams", 1, text, timeout=timeout, memory=MEMORY_CAP)


def _with_tokenizer(hub_tiny_folder, tmp_path, edit):
    folder = tmp_path / "model"
    shutil.copytree(hub_tiny_folder, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    edit(tokenizer)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def _split_first(pattern: str):
    def edit(tokenizer):
        split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
        tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tokenizer["pre_tokenizer"]]}
    return edit


@pytest.mark.slow
def test_a_tokenizer_file_far_larger_than_the_vocabulary_is_refused_before_it_is_parsed(hub_tiny_folder, tmp_path):
    # The file's size is checked against the vocabulary before it is parsed: millions of added tokens would take
    # minutes and gigabytes; 100,000 here.
    def add_tokens(tokenizer):
        start = len(tokenizer["model"]["vocab"])
        tokenizer["added_tokens"] += [{"id": start + i, "content": f"tok{i}", "single_word": False, "lstrip": False,
                                       "rstrip": False, "normalized": True, "special": False} for i in range(100_000)]

    folder = _with_tokenizer(hub_tiny_folder, tmp_path, add_tokens)
    result = _translate(folder, "Jesus wept.", timeout=60)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert f"error: {folder / 'tokenizer.json'} is {(folder / 'tokenizer.json').stat().st_size:,} bytes, more than a " \
           "tokenizer of the model's 600 tokens needs (at most 1,662,976); it is not read" in result.stderr


@pytest.mark.slow
def test_more_added_tokens_than_the_model_has_rows_are_refused_before_they_are_added(hub_tiny_folder, tmp_path):
    def add_tokens(tokenizer):
        tokenizer["added_tokens"] += [{**tokenizer["added_tokens"][0], "id": 600 + i, "content": f"t{i}", "special": False}
                                      for i in range(700)]

    folder = _with_tokenizer(hub_tiny_folder, tmp_path, add_tokens)
    result = _translate(folder, "Jesus wept.")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert f"error: {folder / 'tokenizer.json'} adds 704 tokens to a model of 600; it is not read" in result.stderr


@pytest.mark.slow
def test_a_pattern_that_backtracks_without_end_is_refused_before_the_library_runs_it(hub_tiny_folder, tmp_path):
    # The pattern is refused in one line before the tokenizers library runs it and panics.
    folder = _with_tokenizer(hub_tiny_folder, tmp_path, _split_first("(a+)+$"))
    result = _translate(folder, "a" * 40 + "b")
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert f"error: {folder / 'tokenizer.json'}: its pre_tokenizer matches the regular expression '(a+)+$', whose " \
           "repeated group can take the matcher for ever; it is not read" in result.stderr


@pytest.mark.slow
def test_a_panic_of_the_tokenizers_library_is_told_in_one_line_naming_the_file(hub_tiny_folder, tmp_path):
    # A pattern the check above lets through that still runs past the regex engine's retry limit.
    folder = _with_tokenizer(hub_tiny_folder, tmp_path, _split_first("a*a*a*a*a*a*a*a*$"))
    result = _translate(folder, "a" * 100 + "b")
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "PanicException" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1] == (
        f"vanilla-transformer translate: error: the tokenizers library failed on {folder}/tokenizer.json: Onig: Regex "
        "search error: retry-limit-in-match over; put the tokenizer the model was trained with beside it")
