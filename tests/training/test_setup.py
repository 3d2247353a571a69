"""What `set_up` builds once: `Components` says what it holds, each field set at construction."""

import typing
from dataclasses import MISSING, fields

from vanilla_transformer.training.arguments import TrainArguments
from vanilla_transformer.training.setup import Components


def test_components_name_the_type_of_each_field():
    hints = typing.get_type_hints(Components)
    assert [name for name, hint in hints.items() if hint is typing.Any] == []


def test_components_are_given_the_options_the_run_trains_with():
    args = next(f for f in fields(Components) if f.name == "args")
    assert args.default is MISSING and args.default_factory is MISSING
    assert typing.get_type_hints(Components)["args"] is TrainArguments
