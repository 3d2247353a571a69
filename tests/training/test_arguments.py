"""`vanilla-transformer train`'s options are generated from `TrainArguments`, each declared once.

The fields carry their help, group, choices and bounds; the parser is built from them, so these tests
check the generating (every field an option, a changed default shows), that `--help` stays torch-free,
and that each bound and choice is refused with the message users read.
"""

import argparse
import dataclasses
import os
import re
import subprocess
import sys

import pytest

from vanilla_transformer import cli
from vanilla_transformer.choices import PRESET_NAMES, TRACKERS
from vanilla_transformer.cli.options import argparse_options
from vanilla_transformer.cli.train import add_arguments
from vanilla_transformer.modeling.configuration_vanilla_transformer import PRESETS
from vanilla_transformer.tokenizer import DEFAULT_MIN_FREQUENCY
from vanilla_transformer.training.arguments import DATA_GROUP, GROUPS, RUN_OPTIONS, TrainArguments, option
from vanilla_transformer.training.schedule import SCHEDULES

FIELDS = {f.name: f for f in dataclasses.fields(TrainArguments)}


def subcommand(add, name: str) -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser().add_subparsers()
    add(sub)
    return sub.choices[name]


def train_parser() -> argparse.ArgumentParser:
    return subcommand(cli.train.add_parser, "train")


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_every_field_is_an_option_with_its_flag_help_and_group():
    parser = train_parser()
    options = options_of(parser)
    assert set(options) == set(FIELDS)
    group_of = {a.dest: group.title for group in parser._action_groups for a in group._group_actions}
    for name, action in options.items():
        metadata = FIELDS[name].metadata
        assert action.option_strings == ["--" + name.replace("_", "-")], name
        assert action.help.startswith(metadata["help"]), name
        assert group_of[name] == metadata["group"], name
        assert action.choices == metadata.get("choices"), name
    assert [g.title for g in parser._action_groups if g.title in GROUPS] == list(GROUPS)


def typed(parsed: argparse.Namespace) -> dict:
    """The options a parsed `train` command line holds: those typed."""
    return {k: v for k, v in vars(parsed).items() if k not in ("command", "func")}


def test_the_parsed_defaults_are_the_dataclasses():
    # An option left out is left out of the namespace: the dataclass gives its default (and `resume` the run's own).
    parsed = typed(cli.build_parser().parse_args(["train", "--output-dir", "runs/x"]))
    assert parsed == {"output_dir": "runs/x"}
    assert TrainArguments(**parsed) == TrainArguments(output_dir="runs/x")
    assert typed(cli.build_parser().parse_args(["train", "--output-dir", "x", "--lr", "0.5", "--resume"])) == {
        "output_dir": "x", "lr": 0.5, "resume": True}


def test_a_default_or_field_changed_in_the_dataclass_shows_in_the_parser():
    @dataclasses.dataclass
    class Longer(TrainArguments):
        max_length: int = dataclasses.field(default=512, metadata=FIELDS["max_length"].metadata)
        label_smoothing: float = dataclasses.field(default=0.2, metadata=FIELDS["label_smoothing"].metadata)
        warmup_ratio: float | None = option(None, group=DATA_GROUP, help="a field only the subclass has")

    parser = argparse.ArgumentParser()
    add_arguments(parser, Longer)
    parsed = Longer(**vars(parser.parse_args(["--output-dir", "x"])))
    assert (parsed.max_length, parsed.label_smoothing, parsed.warmup_ratio) == (512, 0.2, None)
    assert parser.parse_args(["--output-dir", "x", "--warmup-ratio", "0.5"]).warmup_ratio == 0.5
    assert "tokens per side, </s> included (default: 512)" in " ".join(parser.format_help().split())
    assert TrainArguments(**typed(train_parser().parse_args(["--output-dir", "x"]))).max_length == 256  # untouched


@pytest.mark.parametrize(("name", "allowed"), [("preset", tuple(PRESETS)), ("lr_schedule", SCHEDULES)])
def test_the_choices_are_the_ones_the_training_code_knows(name, allowed):
    assert set(options_of(train_parser())[name].choices) == set(allowed)
    assert set(PRESET_NAMES) == set(PRESETS)


def test_every_choice_offered_passes_validation(tmp_path):
    for name, action in options_of(train_parser()).items():
        for choice in action.choices or ():
            try:
                TrainArguments(output_dir=str(tmp_path), **{name: choice}).validate()
            except ValueError as err:  # the trackers also need their package, which may not be installed
                assert name == "report_to" and f"needs the {TRACKERS[choice]} package" in str(err)


def test_train_help_prints_every_group_and_imports_no_torch():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    shown = subprocess.run([sys.executable, "-X", "importtime", "-m", "vanilla_transformer.cli", "train", "--help"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    help_text = " ".join(shown.stdout.split())  # argparse wraps lines
    for title in GROUPS:
        assert f"{title}:" in help_text, title
    for name in FIELDS:
        assert "--" + name.replace("_", "-") in help_text, name
    imported = {line.split("|")[-1].strip() for line in shown.stderr.splitlines() if line.startswith("import time:")}
    assert "vanilla_transformer.training.arguments" in imported  # the options came from the dataclass ...
    assert not {name.split(".")[0] for name in imported} & {"torch", "transformers", "datasets", "accelerate"}


@pytest.mark.parametrize(("name", "value", "message"), [
    ("max_length", 0, "`max_length` must be a positive integer; got 0."),
    ("vocab_size", 2.5, "`vocab_size` must be a positive integer; got 2.5."),
    ("vocab_size", 259, "`vocab_size` must be at least 260 (the 256 bytes every vocabulary starts with, and the special "
                        "tokens); got 259."),
    ("max_steps", -1, "`max_steps` must be a positive integer or None; got -1."),
    ("num_epochs", 0, "`num_epochs` must be a positive integer or None; got 0."),
    ("eval_samples", -1, "`eval_samples` must be a non-negative integer or None; got -1."),
    ("test_samples", -1, "`test_samples` must be a non-negative integer or None; got -1."),
    ("time_limit", float("inf"), "`time_limit` must be a positive number or None; got inf."),
    ("max_grad_norm", 0.0, "`max_grad_norm` must be a positive number or None; got 0.0."),
    ("ddp_timeout", 0, "`ddp_timeout` must be a positive integer; got 0."),
    ("bucket_shapes", -1, "`bucket_shapes` must be a non-negative integer or None; got -1."),
    ("max_tokens", 0, "`max_tokens` must be a positive integer or None; got 0."),
    ("preset", "huge", "`preset` must be one of 'tiny', 'small', 'base', 'big'; got 'huge'."),
    ("mixed_precision", "fp8", "`mixed_precision` must be one of 'no', 'fp16', 'bf16' or None; got 'fp8'."),
    ("attn_implementation", "fast", "`attn_implementation` must be one of 'eager', 'sdpa', 'flex_attention', "
                                    "'flash_attention_2' or None; got 'fast'."),
    ("warmup_steps", 0, "`warmup_steps` must be a positive integer; got 0."),
    ("lr_scale", float("nan"), "`lr_scale` must be a positive number; got nan."),
    ("ema_decay", 1.0, "`ema_decay` must be a number in (0, 1), e.g. 0.999, or None; got 1.0."),
    ("label_smoothing", 1.0, "`label_smoothing` must be a number in [0, 1); got 1.0."),
    ("num_beams", 0, "`num_beams` must be a positive integer; got 0."),
    ("num_beams", 33, "`num_beams` must be at most 32 (the paper's: 4; each beam holds a copy of the search's state)"),
    ("length_penalty", float("nan"), "`length_penalty` must be a finite number (the paper's: 0.6); got nan."),
])
def test_each_bound_and_choice_is_refused_naming_the_option(tmp_path, name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainArguments(output_dir=str(tmp_path), **{name: value}).validate()


@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge' (choose from "),  # quoted or not: Python's
    (["--max-steps", "many"], "argument --max-steps: invalid int value: 'many'"),
    (["--lr-scale", "x"], "argument --lr-scale: invalid float value: 'x'"),
    (["--config-overrides", "d_model"], "--config-overrides: expected KEY=VALUE pairs separated by commas; got 'd_model'"),
    (["--truncate=yes"], "argument --truncate: ignored explicit argument 'yes'"),
])
def test_malformed_options_are_argparse_errors_as_before(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "--output-dir", str(tmp_path / "out"), *argv])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"vanilla-transformer train: error: {message}")
    assert not (tmp_path / "out").exists()


def test_the_decoding_commands_take_the_beam_options_from_the_one_declaration():
    translate = subcommand(cli.translate.add_parser, "translate")
    for name in ("num_beams", "length_penalty"):
        action = options_of(translate)[name]
        assert action.default is None and action.type is argparse_options(name)["type"]
        assert action.help == argparse_options(name, default=None, shown_default="the model's")["help"]
        assert action.help.startswith(FIELDS[name].metadata["help"]) and action.help.endswith("(default: the model's)")


@pytest.mark.parametrize("value", [1e308, -11.0, float("inf")])
def test_the_python_api_refuses_a_length_penalty_the_command_line_refuses(tmp_path, value):
    # The bound beam search can score with lives in TrainArguments, which `train`'s options go through:
    # `train` refuses it before reading anything, not after training and saving.
    from vanilla_transformer.training.loop import train

    with pytest.raises(ValueError, match=r"^`length_penalty` must be (between -10.0 and 10.0|a finite number) .* got "):
        train(TrainArguments(output_dir=str(tmp_path / "out"), length_penalty=value))
    assert not (tmp_path / "out").exists()
    TrainArguments(output_dir=str(tmp_path), length_penalty=-10.0).validate()


def test_train_tokenizer_defaults_are_trains_and_the_tokenizers():
    parser = subcommand(cli.train_tokenizer.add_parser, "train-tokenizer")
    defaults = {a.dest: a.default for a in parser._actions}
    assert defaults["vocab_size"] == FIELDS["vocab_size"].default and defaults["min_frequency"] == DEFAULT_MIN_FREQUENCY
    assert defaults["dataset"] == FIELDS["dataset"].default


def test_an_attention_implementation_the_model_cannot_run_is_refused_before_any_data(tmp_path):
    # Proves: a variant that runs only on its explicit function refuses sdpa at validation, before the data.
    args = TrainArguments(output_dir=str(tmp_path), config_overrides={"attention_score": "general"},
                             attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"`attn_implementation`='sdpa'.*runs only on its own explicit"):
        args.validate()
    TrainArguments(output_dir=str(tmp_path), config_overrides={"attention_score": "general"},
                      attn_implementation="eager").validate()


@pytest.mark.slow
def test_a_vocabulary_too_small_is_refused_before_any_data_is_read_or_folder_made(tmp_path):
    done = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "train", "--output-dir", str(tmp_path / "out"),
                           "--preset", "tiny", "--vocab-size", "200", "--max-steps", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "tokenizer" not in done.stderr.replace("`vocab_size` must", "")
    assert done.stderr.splitlines()[-1] == ("vanilla-transformer train: error: `vocab_size` must be at least 260 (the 256 "
                                            "bytes every vocabulary starts with, and the special tokens); got 200.")
    assert not (tmp_path / "out").exists()


def test_the_two_records_of_a_runs_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.tsv").write_text("a\tb\n")
    args = TrainArguments(output_dir="out", dataset="pairs.tsv", resume=True, max_steps=3)
    defining = args.run_options()
    assert defining["dataset"] == str(tmp_path / "pairs.tsv")  # a local path, made absolute: the same data from anywhere
    assert set(defining) == set(RUN_OPTIONS) and "max_steps" not in defining  # a resume may extend its limits
    recorded = args.recorded_options()
    assert recorded["dataset"] == "pairs.tsv" and recorded["max_steps"] == 3  # as typed, for `resume` to restore
    assert "output_dir" not in recorded and "resume" not in recorded
