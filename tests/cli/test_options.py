"""The options several commands share, declared once: the same help in each, the same bounds where they are read."""

import os
import subprocess
import sys

import pytest

from vanilla_transformer import cli


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
    (["translate", "--model", "m", "--batch-size", "0"], "translate: error: --batch-size must be at least 1; got 0"),
    (["evaluate", "--model", "m", "--batch-size", "-3"], "evaluate: error: --batch-size must be at least 1; got -3"),
    (["translate", "--model", "m", "--nbest", "0"],
     "translate: error: --nbest must be between 1 and 32 (the beam holds N hypotheses); got 0"),
    (["translate", "--model", "m", "--nbest", "33"],
     "translate: error: --nbest must be between 1 and 32 (the beam holds N hypotheses); got 33"),
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
