"""Every stream bounded: standard input, --input-file, --source-file/--reference-file and the texts a
tokenizer learns from are read in bounded pieces, so that /dev/zero or a file without line ends is refused in one
line, in bounded memory, instead of a MemoryError traceback (and a main thread left waiting for its reader).

Each command runs as a real process under an address-space cap where memory is the point.
"""

import subprocess

import pytest

from commands import run_cli

MEMORY_CAP = 3 << 30  # the model's own run takes well under 1 GB; an unbounded line read fills any cap


def run_capped(*args, stdin=subprocess.DEVNULL, timeout=120) -> subprocess.CompletedProcess:
    return run_cli(*args, stdin=stdin, timeout=timeout, memory=MEMORY_CAP)


def _refused_in_one_line(result, command: str, message: str) -> None:
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert len(lines) == 1, result.stderr[-2000:]  # transformers' progress bar aside
    assert lines[0].startswith(f"vanilla-transformer {command}: error: {message}: no line end in its first 16,777,216 "
                               "bytes"), lines[0]


@pytest.mark.slow
def test_translate_refuses_standard_input_without_line_ends(hub_tiny_folder):
    # A line has a bound: endless input is refused in one line, never a MemoryError in the reader thread.
    with open("/dev/zero", "rb") as zeros:
        result = run_capped("translate", "--model", hub_tiny_folder, stdin=zeros)
    _refused_in_one_line(result, "translate", "standard input, line 1")


@pytest.mark.slow
def test_translate_refuses_an_input_file_without_line_ends(hub_tiny_folder):
    # A line has a bound: endless input is refused in one line, never a MemoryError.
    result = run_capped("translate", "--model", hub_tiny_folder, "--input-file", "/dev/zero")
    _refused_in_one_line(result, "translate", "/dev/zero, line 1")


@pytest.mark.slow
def test_evaluate_refuses_files_without_line_ends(hub_tiny_folder):
    # A line has a bound: endless input is refused in one line, never a MemoryError.
    result = run_capped("evaluate", "--model", hub_tiny_folder, "--source-file", "/dev/zero", "--reference-file", "/dev/zero")
    _refused_in_one_line(result, "evaluate", "/dev/zero, line 1")


@pytest.mark.slow
def test_tokenizer_training_cuts_a_long_line_without_spaces_and_says_so(tmp_path):
    # A long line without spaces would hold BPE training for minutes: it is cut, and a line says so.
    texts = tmp_path / "texts.txt"
    texts.write_text("In the beginning God created the heaven and the earth.\n" * 50 + "a" * 5_000_000 + "\nJesus wept.\n")
    result = run_capped("train-tokenizer", "--text-files", texts, "--vocab-size", 300, "--output-dir", tmp_path / "tok",
                        timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr == "1 of 52 texts are longer than 10,000 characters: the tokenizer learnt from the first 10,000 of each\n"
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
