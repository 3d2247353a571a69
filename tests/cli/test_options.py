"""The options several commands share, declared once: the same help in each, the same bounds where they are read."""

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch

from vanilla_transformer import cli
from vanilla_transformer.cli.options import BoundedOption


def _help_line(command: str, option: str) -> str:
    """The line of `command --help` that declares `option` (a terminal wide enough to keep it one line), its spaces
    made single: each command aligns its help column itself."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "COLUMNS": "400"}
    shown = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", command, "--help"], capture_output=True,
                           text=True, env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    return next(" ".join(line.split()) for line in shown.stdout.splitlines() if line.strip().startswith(option + " "))


@pytest.mark.slow
def test_a_shared_option_reads_the_same_in_every_command_s_help():
    device = _help_line("translate", "--device")
    assert "cuda:1" in device and _help_line("serve", "--device") == device == _help_line("evaluate", "--device")
    seed = _help_line("train", "--seed")
    assert "seeds weights" in seed and _help_line("quickstart", "--seed") == seed


@pytest.mark.parametrize("argv, message", [
    (["translate", "--model", "m", "--batch-size", "0"], "translate: error: --batch-size must be a positive integer; got 0"),
    (["evaluate", "--model", "m", "--batch-size", "-3"],
     "evaluate: error: --batch-size must be a positive integer; got -3"),
    (["translate", "--model", "m", "--nbest", "0"],
     "translate: error: --nbest must be a positive integer up to 32 (the beam holds N hypotheses); got 0"),
    (["translate", "--model", "m", "--nbest", "33"],
     "translate: error: --nbest must be a positive integer up to 32 (the beam holds N hypotheses); got 33"),
    (["evaluate", "--model", "m", "--max-samples", "0"], "evaluate: error: --max-samples must be a positive integer; got 0"),
    (["translate", "--model", "m", "--num-beams", "33"], "translate: error: --num-beams must be a positive integer up to "
     "32 (each beam holds a copy of the search's state); got 33"),
    (["attention", "--model", "m", "--max-new-tokens", "5000"], "attention: error: --max-new-tokens must be a positive "
     "integer up to 4096 (its cache is allocated up front); got 5000"),
    (["train", "--output-dir", "o", "--max-length", "0"], "train: error: --max-length must be a positive integer; got 0"),
    (["train", "--output-dir", "o", "--eval-samples", "-1"],
     "train: error: --eval-samples must be a non-negative integer; got -1"),
    (["train", "--output-dir", "o", "--adam-beta1", "1"], "train: error: --adam-beta1 must be a number in [0, 1); got 1.0"),
    (["train", "--output-dir", "o", "--time-limit", "inf"], "train: error: --time-limit must be a positive number; got inf"),
    (["quickstart", "--test-samples", "0"], "quickstart: error: --test-samples must be a positive integer; got 0"),
    (["serve", "--model", "m", "--port", "65536"], "serve: error: --port must be in 1..65535; got 65536"),
])
def test_a_bounded_option_is_refused_in_one_line_as_the_command_line_is_read(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"vanilla-transformer {message}\n"


def test_a_bounded_option_within_its_bounds_is_kept():
    args = cli.build_parser().parse_args(["translate", "--model", "m", "--nbest", "32", "--batch-size", "1"])
    assert (args.nbest, args.batch_size) == (32, 1)
    assert cli.build_parser().parse_args(["translate", "--model", "m"]).batch_size == 32  # the default, unchecked


def _bounded_options() -> list[tuple[str, argparse.Action]]:
    """(command, action) of every option that some command bounds as it reads its command line."""
    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    return [(name, action) for name, parser in commands.items() for action in parser._actions
            if isinstance(action, BoundedOption)]


# Each command's required arguments, so that only the bounded option is wrong.
REQUIRED = {"train-tokenizer": ["--output-dir", "{tmp}/out"], "train": ["--output-dir", "{tmp}/out"],
            "translate": ["--model", "{tmp}/m", "x"], "evaluate": ["--model", "{tmp}/m"],
            "export": ["--model", "{tmp}/m", "--format", "ctranslate2", "--output-dir", "{tmp}/out"],
            "attention": ["--model", "{tmp}/m", "x"], "serve": ["--model", "{tmp}/m"],
            "quickstart": ["--output-dir", "{tmp}/out"]}
# A value beyond each bound, and how the message shows it.
BEYOND = {"positive": ("0", "0"), "non-negative": ("-1", "-1"), "fraction": ("1", "1.0"), "cpus": ("0", "0"),
          "seed": ("-1", "-1"), "port": ("0", "0")}


def test_every_integer_option_of_every_command_is_bounded_where_it_is_declared():
    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    unbounded = [f"{name} {action.option_strings[0]}" for name, parser in commands.items() for action in parser._actions
                 if action.type is int and not isinstance(action, BoundedOption)]
    assert unbounded == []
    assert len(_bounded_options()) > 50


@pytest.mark.slow
@pytest.mark.parametrize("command, action", _bounded_options(),
                         ids=[f"{name}{action.option_strings[0]}" for name, action in _bounded_options()])
def test_every_bounded_option_refuses_a_value_beyond_it_in_one_line_of_one_shape(command, action, tmp_path):
    typed, shown = BEYOND[action.bound]
    if action.type is float and typed != "1":
        shown = str(float(typed))
    argv = [part.replace("{tmp}", str(tmp_path)) for part in REQUIRED[command]]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", command, *argv, action.option_strings[0],
                             typed], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    shape = rf"vanilla-transformer {command}: error: {action.option_strings[0]} must be (a|an|in) [^;]+; got {shown}\n"
    assert re.fullmatch(shape, result.stderr), result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("options, message", [
    (["--device", "banana"], "--device 'banana' is not a device; expected cpu, cuda, cuda:N or mps"),
    (["--max-new-tokens", "1000000000"], "--max-new-tokens must be a positive integer up to 4096"),
    (["--length-penalty", "1e308"], "--length-penalty must be between -10.0 and 10.0"),
])
def test_decoding_options_beyond_what_can_run_are_refused_in_one_line(tmp_path, options, message, capsys):
    from vanilla_transformer.cli import main

    with pytest.raises(SystemExit) as stop:  # refused before any model is read
        main(["translate", "--model", str(tmp_path), *options, "In the beginning."])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"vanilla-transformer translate: error: {message}")


def test_cuda_without_cuda_is_refused(monkeypatch):
    from vanilla_transformer.cli.options import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda:1: this machine has no CUDA device; use --device cpu"):
        check_device("cuda:1")
    check_device("cpu")
