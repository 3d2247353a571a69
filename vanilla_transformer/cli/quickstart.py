"""`vanilla-transformer quickstart`: train, score, translate and draw attention on the embedded corpus."""

from __future__ import annotations

import argparse

from ..choices import PRESET_NAMES, PRESET_SHAPES
from .options import add_threads_option, argparse_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quickstart",
        help="train, score, translate and draw attention on the embedded corpus in one go",
        description="Train a tokenizer and a Transformer on the embedded English-Spanish Bible, score the test "
        "split (BLEU, chrF), translate three verses with the saved pipeline, draw attention heat maps and leave "
        "a Hub-ready folder with a model card. Needs no network; uses the GPU when there is one.",
    )
    p.add_argument("--output-dir", default="runs/quickstart", help="where the model folder goes (default: %(default)s)")
    p.add_argument("--minutes", type=float, default=15.0,
                   help="time budget for the whole job; training gets all but what scoring and saving need (default: %(default)s)")
    p.add_argument("--preset", choices=PRESET_NAMES,
                   help=f"the model's size, a preset of its configuration, as train's --preset: {PRESET_SHAPES} "
                   "(default: base on a GPU, small on a CPU)")
    p.add_argument("--seed", **argparse_options("seed"))
    p.add_argument("--test-samples", **argparse_options("test_samples", help="score only the first N test pairs",
                                                         shown_default="all 634", bound="positive"))
    add_threads_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..quickstart import quickstart

    quickstart(args.output_dir, args.minutes, args.preset, args.seed, args.test_samples, args.threads)
    return 0
