"""`vanilla-transformer train` and `TrainingArguments` state each option once, and agree.

The command line writes its defaults out (importing the training code would make `--help` slow);
these tests are what keeps the two copies one fact: the same options, defaults, types and choices.
"""

import argparse
import dataclasses
import types
import typing

import pytest

from vanilla_transformer import cli
from vanilla_transformer.modeling.configuration_vanilla_transformer import PRESETS
from vanilla_transformer.tokenizer import DEFAULT_MIN_FREQUENCY, DEFAULT_VOCAB_SIZE
from vanilla_transformer.training.loop import TrainingArguments
from vanilla_transformer.training.schedule import SCHEDULES

FIELDS = {f.name: f for f in dataclasses.fields(TrainingArguments)}
HINTS = typing.get_type_hints(TrainingArguments)


def subcommand(add, name: str) -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser().add_subparsers()
    add(sub)
    return sub.choices[name]


def train_options() -> dict[str, argparse.Action]:
    """The `train` options by destination, as its parser declares them."""
    parser = subcommand(cli._add_train, "train")
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_every_field_is_an_option_and_every_option_a_field():
    options = train_options()
    assert set(options) == set(FIELDS)
    for name, action in options.items():
        assert action.option_strings == ["--" + name.replace("_", "-")], name


def test_the_command_lines_defaults_are_the_dataclasses():
    parsed = vars(cli.build_parser().parse_args(["train", "--output-dir", "runs/x"]))
    parsed = {k: v for k, v in parsed.items() if k not in ("command", "func")}
    expected = dataclasses.asdict(TrainingArguments(output_dir="runs/x"))
    assert parsed.pop("config_overrides") == "" and expected.pop("config_overrides") == {}  # no KEY=VALUE: no overrides
    assert parsed == expected


@pytest.mark.parametrize("name", sorted(set(FIELDS) - {"config_overrides", "output_dir"}))
def test_each_option_parses_to_the_fields_type(name):
    action = train_options()[name]
    hint = HINTS[name]
    kinds = set(typing.get_args(hint)) - {type(None)} if isinstance(hint, types.UnionType) else {hint}
    assert len(kinds) == 1, f"{name}: {hint}"
    (kind,) = kinds
    if kind is bool:
        assert isinstance(action, argparse._StoreTrueAction) and FIELDS[name].default is False
    else:
        assert (action.type or str) is kind, name


@pytest.mark.parametrize(("name", "allowed"), [("preset", tuple(PRESETS)), ("lr_schedule", SCHEDULES)])
def test_the_choices_are_the_ones_the_training_code_knows(name, allowed):
    assert set(train_options()[name].choices) == set(allowed)


def test_every_choice_offered_passes_validation(tmp_path):
    for name, action in train_options().items():
        for choice in action.choices or ():
            try:
                TrainingArguments(output_dir=str(tmp_path), **{name: choice}).validate()
            except ValueError as err:  # the one choice that also needs a package, which may not be installed
                assert (name, choice) == ("report_to", "tensorboard") and "needs the tensorboard package" in str(err)


@pytest.mark.parametrize("value", [1e308, -11.0, float("inf")])
def test_the_python_api_refuses_a_length_penalty_the_command_line_refuses(tmp_path, value):
    # The bound beam search can score with lives in TrainingArguments, which `train`'s options go through:
    # `train` refuses it before reading anything, not after training and saving.
    from vanilla_transformer.training.loop import train

    with pytest.raises(ValueError, match=r"^`length_penalty` must be between -10.0 and 10.0 .* got "):
        train(TrainingArguments(output_dir=str(tmp_path / "out"), length_penalty=value))
    assert not (tmp_path / "out").exists()
    TrainingArguments(output_dir=str(tmp_path), length_penalty=-10.0).validate()


def test_train_tokenizer_defaults_are_the_tokenizers():
    parser = subcommand(cli._add_train_tokenizer, "train-tokenizer")
    defaults = {a.dest: a.default for a in parser._actions}
    assert defaults["vocab_size"] == DEFAULT_VOCAB_SIZE and defaults["min_frequency"] == DEFAULT_MIN_FREQUENCY


def test_an_attention_implementation_the_model_cannot_run_is_refused_before_any_data(tmp_path):
    # Proves: a variant that runs only on its explicit function refuses sdpa at validation, before the data.
    args = TrainingArguments(output_dir=str(tmp_path), config_overrides={"attention_score": "general"},
                             attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"`attn_implementation`='sdpa'.*runs only on its own explicit"):
        args.validate()
    TrainingArguments(output_dir=str(tmp_path), config_overrides={"attention_score": "general"},
                      attn_implementation="eager").validate()
