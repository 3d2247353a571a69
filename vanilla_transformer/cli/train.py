"""`vanilla-transformer train`: its options are the fields of TrainArguments."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from functools import partial

from ..training.arguments import GROUPS, TrainArguments
from .options import argparse_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        # Every option in the usage line would fill a screen; they follow, by group.
        usage="%(prog)s --output-dir OUTPUT_DIR [option ...]",
        help="train a model from scratch, fine-tune one, or resume a run (also under `accelerate launch`)",
        description="Train the paper's Transformer with its recipe (§5): token-count batches, Adam with the "
        "warm-up / inverse-square-root schedule, label smoothing, checkpoint averaging, beam-search BLEU. "
        "Runs on one CPU or GPU as is, and on several processes under `accelerate launch -m "
        "vanilla_transformer.cli train ...`. The output folder ends as a complete Hub repository.",
    )
    add_arguments(p)  # one option per TrainArguments field
    p.set_defaults(func=partial(run, p))


def add_arguments(parser: argparse.ArgumentParser, arguments: type = TrainArguments) -> None:
    """One option per field of `arguments` (a TrainArguments, or a subclass or copy of it), in `GROUPS`. An option
    left out stays out of the namespace (its help still shows the default): the dataclass fills it in, and `resume`
    tells the options typed from those it restores by that alone."""
    groups = {title: parser.add_argument_group(title, description) for title, description in GROUPS.items()}
    for f in dataclasses.fields(arguments):
        options = {**argparse_options(f.name, arguments), "default": argparse.SUPPRESS}
        groups[f.metadata["group"]].add_argument("--" + f.name.replace("_", "-"), **options)


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ..training.loop import train
    from ..training.resume import restore_options
    from ..training.budget import TrainingInterrupted

    options = {k: v for k, v in vars(args).items() if k not in ("command", "func")}  # the options typed
    if "config_overrides" in options:
        options["config_overrides"] = _parse_overrides(p, options["config_overrides"])
    try:
        if options.get("resume"):  # the options not typed are the run's own
            options = restore_options(args.output_dir, options)
        train(TrainArguments(**options))
    except FloatingPointError as err:  # the loss became NaN: the last good checkpoint is kept
        print(f"vanilla-transformer train: error: {err}", file=sys.stderr)
        return 1
    except TrainingInterrupted as err:  # SIGINT/SIGTERM: the last step is saved; one line, 128 + signal
        print(f"vanilla-transformer train: {err}", file=sys.stderr)
        return err.exit_code
    return 0


def _parse_overrides(p: argparse.ArgumentParser, text: str) -> dict:
    """--config-overrides as a dict, each value read as JSON where it is JSON, else kept as a string."""
    import json

    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            p.error(f"--config-overrides: expected KEY=VALUE pairs separated by commas; got {item!r}")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value.strip()  # a bare string such as position_encoding=learned
    return overrides
