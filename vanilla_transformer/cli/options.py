"""What several commands share: their options, declared once.
An option a command shares with `train` takes its default and help from TrainArguments
(training/arguments.py, which imports no torch): `argparse_options` turns a field into the keywords of
`add_argument`, as transformers' HfArgumentParser does, and `BoundedOption` refuses a number beyond its bound
(checks/bounds.py's BOUNDS) as the command line is read."""

from __future__ import annotations

import argparse
import dataclasses

from ..choices import ENGINES, TRANSLATION_BATCH_SIZE
from ..errors import BadInput, as_bad_input
from ..checks.bounds import BOUNDS, field_kind, within_bound
from ..training.arguments import TrainArguments


class BoundedOption(argparse.Action):
    """Stores a numeric option's value, or refuses it in one line, exit status 2, as the command line is read:
    "--option must be <what BOUNDS calls `bound`>; got <value>", the one form of every command's numeric bounds.
    `high`: an upper bound besides (a function, called only when the option is given, so that --help imports
    nothing), and `why`, what it is."""

    def __init__(self, option_strings, dest, bound: str, high=None, why: str = "", **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.bound, self.high, self.why = bound, high, why

    def __call__(self, parser, namespace, value, option_string=None):
        what = BOUNDS[self.bound, self.type][0]
        high = self.high() if callable(self.high) else self.high
        if high is not None:
            what = f"{what} up to {high}{self.why}"
        if not within_bound(self.bound, self.type, value) or (high is not None and value > high):
            parser.exit(2, f"{parser.prog}: error: {self.option_strings[0]} must be {what}; got {value!r}\n")
        setattr(namespace, self.dest, value)


def boolean(text: str) -> bool:
    """A typed true or false, as transformers' HfArgumentParser reads one."""
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false; got {text!r}")


def argparse_options(name: str, arguments: type = TrainArguments, **changes) -> dict:
    """The keywords of `add_argument` for the field `name` (its `--kebab-case` flag aside), as `train` declares it;
    `changes` replace some for another command (say, `default=None`, `shown_default="the model's"`)."""
    f = next(f for f in dataclasses.fields(arguments) if f.name == name)
    kind, _ = field_kind(arguments, f)
    options = {"help": f.metadata["help"], "default": f.default}
    if kind is dict:
        options["default"] = ""  # KEY=VALUE,... as typed: the command reads it (cli/train.py's _parse_overrides)
    elif f.default is dataclasses.MISSING:
        options.update(required=True, default=None)
    elif kind is bool and f.default is None:  # left out, the run chooses: --flag (true) or --flag true/false
        options.update(type=boolean, nargs="?", const=True, metavar="true|false")
    elif kind is bool:
        options["action"] = "store_true"
    elif kind is not str:
        options["type"] = kind
    if "bound" in f.metadata:  # refused as the command line is read, in BoundedOption's words
        options.update(action=BoundedOption, **{key: f.metadata[key] for key in ("bound", "high", "why") if key in f.metadata})
    options.update({key: f.metadata[key] for key in ("choices", "metavar") if key in f.metadata})
    options.update(changes)
    default = options["default"]  # None, False and "": the help says what leaving the option out does
    # The value itself, not argparse's %(default)s: `train` leaves an option out of the namespace when not typed.
    shown = None if default is None or default is False or default == "" else str(default).replace("%", "%%")
    shown = options.pop("shown_default", shown)
    if shown is not None:
        options["help"] += f" (default: {shown})"
    return options


def add_data_options(
    p: argparse.ArgumentParser, reads: str, languages: str = "the corpus pair, or the two keys there are",
    text_files: bool = False, dataset: str | None = "bible-en-es",
) -> argparse._ArgumentGroup:
    """The data set and its two language keys, as `train`, `evaluate` and `train-tokenizer` read them
    (`reads`: what the command reads of it; `text_files`: or plain text files instead; `dataset`: the
    default, None for the model's own). Returns the group, for the command's own data options."""
    data = p.add_argument_group("data")
    source = data.add_mutually_exclusive_group() if text_files else data
    shown = "%(default)s" if dataset else "the data set recorded in the model's config.json"
    options = argparse_options("dataset", default=dataset, shown_default=shown)
    source.add_argument("--dataset", **{**options, "help": f"{options['help']}; {reads}"})
    if text_files:
        source.add_argument("--text-files", nargs="+", metavar="FILE",
                            help="plain UTF-8 text files, one text per line, instead of --dataset")
    data.add_argument("--dataset-config", **argparse_options("dataset_config"))
    data.add_argument("--columns", **argparse_options("columns"))
    data.add_argument("--source-lang", help=f"source language key (default: {languages})")
    data.add_argument("--target-lang", help="target language key")
    return data


def add_vocab_size(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--vocab-size", **argparse_options("vocab_size"))


def add_model_option(p: argparse.ArgumentParser, engines: bool = False) -> None:
    """--model, the folder or Hub id to load; `engines`: or, with --engine ctranslate2, an exported folder."""
    exported = "; with --engine ctranslate2, a folder written by `export`" if engines else ""
    p.add_argument("--model", required=True,
                   help=f"model folder (written by training or save_for_hub) or Hub id user/name{exported}")


def add_threads_option(p: argparse.ArgumentParser) -> None:
    """--threads, as `train` declares it, for a command that computes."""
    p.add_argument("--threads", **argparse_options("threads"))


def apply_threads_option(args: argparse.Namespace) -> str:
    """Set torch's threads from --threads (or its default), args.threads to the number, and return the line that
    says so: a run logs it; a command whose standard error is for errors alone names args.threads where it times."""
    import torch

    from ..threads import use_threads

    line = use_threads(args.threads)
    args.threads = torch.get_num_threads()
    return line


def add_decoding_options(p: argparse.ArgumentParser, batches: bool = True) -> None:
    """Decoding options; `batches`: also the engine and --batch-size (commands translating many texts)."""
    decoding = p.add_argument_group("decoding")
    if batches:
        decoding.add_argument(
            "--engine", choices=ENGINES, default=ENGINES[0],
            help="transformers: a model folder or Hub id, decoded by its own generate (the paper's search); "
            "ctranslate2: a folder written by `export --format ctranslate2`, decoded by CTranslate2 with the "
            "folder's defaults (its length penalty and stopping differ slightly: see the folder's README) "
            "(default: %(default)s)",
        )
        add_bounded_int(decoding, "--batch-size", default=TRANSLATION_BATCH_SIZE,
                        help="texts per batch (default: %(default)s)")
    add_beam_options(decoding)
    add_bounded_int(decoding, "--max-new-tokens", **NEW_TOKENS_BOUND,
                    help="longest translation in tokens (default: input length + 50, §6.1)")
    add_device_option(decoding)


def add_device_option(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--device, for a command that loads a model to run it."""
    p.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: the GPU when there is one)")


def add_bounded_int(p, flag: str, bound: str = "positive", high=None, why: str = "", **kwargs) -> None:
    """An integer option that keeps `bound` (a name in checks/bounds.py's BOUNDS) and `high`, checked as the
    command line is read, in the words of `train`'s options; `why`: what the upper bound is."""
    p.add_argument(flag, type=int, action=BoundedOption, bound=bound, high=high, why=why, **kwargs)


def _max_new_tokens() -> int:
    from ..modeling.value_checks import MAX_NEW_TOKENS  # here, not above: --help imports no transformers

    return MAX_NEW_TOKENS


NEW_TOKENS_BOUND = dict(high=_max_new_tokens, why=" (its cache is allocated up front)")  # what generate accepts


def add_beam_options(group: argparse._ArgumentGroup) -> None:
    """--num-beams and --length-penalty as `train` declares them, but None by default: the model's own."""
    for name in ("num_beams", "length_penalty"):
        group.add_argument("--" + name.replace("_", "-"),
                           **argparse_options(name, default=None, shown_default="the model's"))


def decoding_options(args: argparse.Namespace) -> dict:
    """The decoding options given, checked (and --batch-size where the command has it, bounded when read)."""
    from ..modeling.value_checks import check_decoding_options

    batches = {"batch_size": args.batch_size} if hasattr(args, "batch_size") else {}
    decoding = {name: getattr(args, name) for name in ("num_beams", "length_penalty", "max_new_tokens")}
    with as_bad_input():  # the model's own check
        check_decoding_options(**decoding, names={name: "--" + name.replace("_", "-") for name in decoding})
    if getattr(args, "device", None) is not None and getattr(args, "engine", "transformers") != "ctranslate2":
        check_device(args.device)  # CTranslate2 names the devices it takes itself
    return {**batches, **decoding}


def check_device(device: str) -> None:
    """--device names a device this machine has, or a BadInput says which it has."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise BadInput(f"--device {device!r} is not a device; expected cpu, cuda, cuda:N or mps") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(kind, True):
        raise BadInput(f"--device {device}: this machine has no {kind.upper()} device; use --device cpu")
