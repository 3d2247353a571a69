"""The translation task's inputs, as fairseq's task loads them: the splits, the tokenizer, the tokenised pairs.

`prepare_data` reads the splits (holding out a validation slice where there is none), takes the tokenizer
and tokenises the pairs. The tokenizer is the one given (`tokenizer`), else the one already in `output_dir`
while it is what these options would train (`_keep_own_tokenizer`: the options it was learnt from are
recorded in checkpoints/tokenizer_options.json), else the model's (`model_name_or_path`), else a new one.
"""

from __future__ import annotations

import json
from pathlib import Path

from accelerate.logging import get_logger

from ..corpora import load_translation_dataset, resolve_languages
from ..errors import BadInput
from ..checks.files import read_json
from ..checks.model_folder import load_tokenizer
from ..staging import write_file_whole
from ..tokenizer import check_appends_eos, train_tokenizer
from .arguments import TrainArguments
from .data import tokenize_pairs
from .run_folder import CHECKPOINTS, TOKENIZER_OPTIONS

__all__ = ["load_splits", "prepare_data", "prepare_tokenizer"]

logger = get_logger(__name__)


def prepare_data(args: TrainArguments, accelerator):
    """The raw splits, the language pair, the tokenizer, and the tokenised training and evaluation splits."""
    # Each machine's first process reads the data and fills the map cache on its own disk before the others
    # read them; the tokenizer, in output_dir (which every machine shares), is learnt by the main process alone.
    with accelerator.local_main_process_first():
        data, source_lang, target_lang = load_splits(args)
    with accelerator.main_process_first():
        tokenizer = prepare_tokenizer(args, data, source_lang, target_lang)
    with accelerator.local_main_process_first():
        train_split = tokenize_pairs(
            data["train"], tokenizer, source_lang, target_lang, args.max_length, args.truncate, name="train"
        )
        # Evaluation scores every pair that has text on both sides: long ones are cut, not dropped.
        eval_splits = {
            name: tokenize_pairs(data[name], tokenizer, source_lang, target_lang, args.max_length, True, name, True)
            for name in ("validation", "test")
            if name in data
        }
    logger.info(f"{args.dataset}: {source_lang} -> {target_lang}")
    logger.info(train_split.describe("train", args.max_length, args.truncate))
    for name, split in eval_splits.items():
        logger.info(split.describe(name, args.max_length, True))
    if "test" not in eval_splits:
        logger.info("no test split: the final model is scored on validation only")
    return data, source_lang, target_lang, tokenizer, train_split, eval_splits


def load_splits(args: TrainArguments):
    """The raw splits and the language pair; without a validation split, a seeded slice of train held out."""
    data = load_translation_dataset(
        args.dataset, args.dataset_config, source_lang=args.source_lang, target_lang=args.target_lang,
        columns=args.columns,
    )
    if "train" not in data:
        raise BadInput(f"{args.dataset} has no 'train' split; its splits are {list(data)}")
    source_lang, target_lang = resolve_languages(data["train"], args.source_lang, args.target_lang)
    if "validation" not in data:
        # Hold out a small, seeded slice of the training data so that there is something to validate on.
        size = min(1000, max(1, len(data["train"]) // 50))
        if len(data["train"]) < 2:
            raise BadInput(f"{args.dataset} has no 'validation' split and too few pairs to hold some out")
        held = data["train"].train_test_split(test_size=size, seed=args.seed)
        data["train"], data["validation"] = held["train"], held["test"]
        logger.info(f"no validation split: {size} training pairs held out for validation (seed {args.seed})")
    return data, source_lang, target_lang


def prepare_tokenizer(args: TrainArguments, data, source_lang: str, target_lang: str):
    """An existing tokenizer folder, else the one saved in output_dir or with the model, else a new one."""
    output_dir = Path(args.output_dir)
    if args.tokenizer is not None:
        if not Path(args.tokenizer).is_dir():
            raise FileNotFoundError(f"`tokenizer`: no tokenizer folder at {args.tokenizer}")
        return _checked_tokenizer(args.tokenizer, f"`tokenizer` {args.tokenizer}")
    options = _tokenizer_options(args, source_lang, target_lang)
    if (output_dir / "tokenizer.json").is_file() and _keep_own_tokenizer(args.output_dir, args.resume, options):
        return _checked_tokenizer(output_dir, f"the tokenizer in {output_dir}")
    if args.model_name_or_path is not None and (Path(args.model_name_or_path) / "tokenizer.json").is_file():
        return _checked_tokenizer(args.model_name_or_path, f"`model_name_or_path` {args.model_name_or_path}'s tokenizer")
    logger.info(f"training a {args.vocab_size}-token joint {args.tokenizer_model} tokenizer on the train split; "
                f"it is saved to {output_dir} when trained")
    record = output_dir / CHECKPOINTS / TOKENIZER_OPTIONS
    record.unlink(missing_ok=True)  # the old record goes first: a tokenizer is never described by another's
    tokenizer = train_tokenizer(
        data["train"], languages=[source_lang, target_lang], vocab_size=args.vocab_size, output_dir=output_dir,
        model_type=args.tokenizer_model,
    )
    record.parent.mkdir(exist_ok=True)
    write_file_whole(record, json.dumps(options, indent=2) + "\n")  # whole or not at all: a record is trusted
    return tokenizer


def _checked_tokenizer(folder, name: str):
    """A saved tokenizer that ends every sentence with </s>, without which a model never learns to stop; one
    that cannot be read is a ValueError naming its file."""
    tokenizer = load_tokenizer(folder)
    check_appends_eos(tokenizer, name)
    return tokenizer


def _tokenizer_options(args: TrainArguments, source_lang: str, target_lang: str) -> dict:
    """What a tokenizer trained by this run is learnt from (recorded in checkpoints/tokenizer_options.json)."""
    return {"dataset": args.run_options()["dataset"], "dataset_config": args.dataset_config, "source_lang": source_lang,
            "target_lang": target_lang, "vocab_size": args.vocab_size, "tokenizer_model": args.tokenizer_model}


def _keep_own_tokenizer(output_dir: str, resuming: bool, options: dict) -> bool:
    """Whether the tokenizer already in `output_dir` is the one these options would train. A run interrupted
    before its first checkpoint and started again with other data or `vocab_size` trains a new one (a
    resumed run refuses instead); a tokenizer whose options were never recorded is used, with a warning."""
    record = Path(output_dir) / CHECKPOINTS / TOKENIZER_OPTIONS
    if not record.is_file():
        if resuming:  # a run from before tokenizers were recorded: its checkpoints hold its options
            return True
        logger.warning(f"using the tokenizer already in {output_dir} (what it was trained from is not recorded); "
                       "delete its tokenizer.json to train a new one, or pass `tokenizer`")
        return True
    before = {"tokenizer_model": "bpe", **read_json(record)}  # records from before the unigram choice
    changed = [f"{name} {before.get(name)!r} -> {value!r}" for name, value in options.items() if before.get(name) != value]
    if not changed:
        return True
    if resuming:
        raise BadInput(
            f"`resume`: the tokenizer of the run in {output_dir} was trained with other options: "
            f"{'; '.join(changed)}. Resume it with the options it was started with, or train into a new `output_dir`."
        )
    logger.warning(f"the tokenizer in {output_dir} was trained with other options ({'; '.join(changed)}) by a "
                   "run that saved no checkpoint: training a new one")
    return False
