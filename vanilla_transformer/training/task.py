"""The translation task's inputs, as fairseq's task loads them: the splits, the tokenizer, the tokenised pairs.

`prepare_data` reads the splits (holding out a validation slice where there is none), takes the tokenizer
and tokenises the pairs. The tokenizer is the one given (`tokenizer`), else the one already in `output_dir`
while it is what these options would train (`_keep_own_tokenizer`: the options it was learnt from are
recorded in checkpoints/tokenizer_options.json), else the model's (`model_name_or_path`), else a new one.

Tokenising drops what cannot be trained on: a pair with an empty side, and one longer than `max_length` tokens on
either side unless `truncate` cuts it (`tokenize_pairs`); a large split is tokenised by several processes.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
from accelerate.logging import get_logger
from datasets import DatasetDict
from transformers import PreTrainedTokenizerBase

from ..corpora import load_translation_dataset, resolve_languages
from ..errors import BadInput
from ..checks.files import read_json
from ..inference import load_tokenizer
from ..staging import write_file_whole
from ..tokenizer import check_appends_eos, train_tokenizer
from .arguments import TrainArguments
from .run_folder import CHECKPOINTS, TOKENIZER_OPTIONS

__all__ = ["TaskInputs", "TokenizedSplit", "encode_texts", "load_splits", "prepare_data", "prepare_tokenizer",
           "tokenization_workers", "tokenize_pairs"]

logger = get_logger(__name__)

PAIRS_PER_WORKER = 200_000  # below this a worker process costs more (start, pickling the tokenizer) than it saves
NUM_PROC_ENV = "VANILLA_TRANSFORMER_NUM_PROC"  # set to override how many processes tokenise a large split


@dataclass(frozen=True)
class TaskInputs:
    """What the task reads once, on every process: the raw pairs, the language pair, the tokenizer and the tokenised
    splits."""

    data: DatasetDict  # the raw pairs, by split
    source_lang: str
    target_lang: str
    tokenizer: PreTrainedTokenizerBase
    train_split: TokenizedSplit
    eval_splits: dict[str, TokenizedSplit]  # "validation", and "test" where the data has one


def prepare_data(args: TrainArguments, accelerator) -> TaskInputs:
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
    return TaskInputs(data, source_lang, target_lang, tokenizer, train_split, eval_splits)


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


# The tokenised pairs


def tokenization_workers(pairs: int) -> int | None:
    """How many processes `Dataset.map` tokenises `pairs` pairs with: None (this process) for small splits, else
    one per PAIRS_PER_WORKER pairs up to the CPUs this process may use; `VANILLA_TRANSFORMER_NUM_PROC` overrides.
    Every process of a run computes the same number, which the map cache's file names depend on."""
    if os.environ.get(NUM_PROC_ENV):
        text = os.environ[NUM_PROC_ENV].strip()
        if not text.isdigit():
            raise BadInput(f"{NUM_PROC_ENV} must be a whole number of processes (1: this process only); got {text!r}.")
        workers = int(text)
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = min(cpus, pairs // PAIRS_PER_WORKER)
    return workers if workers > 1 else None


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts)["input_ids"]`, from the Rust tokenizer directly where that gives the same ids (a backend
    that neither truncates nor pads on its own), without transformers' wrapping, which costs time on large corpora."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer(texts)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch(texts)]


def map_fingerprint(dataset: datasets.Dataset, tokenizer, **options) -> str | None:
    """The map cache's key for tokenising `dataset` with `tokenizer` and `options`: what the result depends on
    (the data, the tokenizer's vocabulary and rules, the options, this module's code), not how the tokenizer
    object came to be. `Dataset.map` hashes the pickled tokenizer otherwise, and a tokenizer just trained
    pickles differently from the same one loaded from its file: the run after the one that trained it tokenised
    2M pairs again (benchmarks/big_corpus.py). None (let `datasets` hash) for a tokenizer without a backend, or
    where this module's source cannot be read."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        code = inspect.getsource(tokenize_pairs) + inspect.getsource(encode_texts) + inspect.getsource(blank_to_empty)
    except OSError:  # installed without sources
        return None
    described = {
        "data": dataset._fingerprint,
        "tokenizer": [type(tokenizer).__name__, backend.to_str(), tokenizer.all_special_tokens],
        "options": options,
        "code": code,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def column(dataset: datasets.Dataset, name: str) -> np.ndarray:
    """A whole numeric column as a NumPy array, read through Arrow: `np.asarray(dataset[name])` converts it
    row by row, most of the wait before the first step on a large corpus (benchmarks/big_corpus.py)."""
    return dataset.with_format("arrow")[name].to_numpy()


@dataclass
class TokenizedSplit:
    """A split ready for training, with what was left out of it and why."""

    dataset: datasets.Dataset  # columns: input_ids, labels, length
    total: int  # pairs before filtering
    empty: int  # pairs with a side that is empty or only white space (it tokenises to </s> alone)
    too_long: int  # pairs with a side over max_length (dropped, or truncated when truncate=True)

    @property
    def lengths(self) -> np.ndarray:
        """Each pair's longer side, in tokens: what batches are built from."""
        return column(self.dataset, "length")

    def describe(self, name: str, max_length: int, truncate: bool) -> str:
        kept = len(self.dataset)
        action = "truncated" if truncate else "dropped"
        return (
            f"{name}: {kept:,} of {self.total:,} pairs kept; {self.empty:,} dropped with an empty or blank side, "
            f"{self.too_long:,} {action} for a side over {max_length} tokens"
        )


def blank_to_empty(text: str | None) -> str:
    """"" for a missing text or one of white space only, which then tokenises to </s> alone: an empty side."""
    return text if text and text.strip() else ""


def pair_encoder(tokenizer, source_lang: str, target_lang: str, max_length: int, truncate: bool,
                 keep_references: bool):
    """The batched `Dataset.map` function of `tokenize_pairs`: both sides encoded, with their lengths."""

    def encode(batch):
        pairs = batch["translation"]
        # A blank side would otherwise be a pair teaching that a space translates to a sentence, or to nothing.
        sources = [blank_to_empty((p or {}).get(source_lang)) for p in pairs]
        targets = [blank_to_empty((p or {}).get(target_lang)) for p in pairs]
        raw_src, raw_tgt = encode_texts(tokenizer, sources), encode_texts(tokenizer, targets)
        options = dict(truncation=True, max_length=max_length)
        src = tokenizer(sources, **options)["input_ids"] if truncate else raw_src
        tgt = tokenizer(targets, **options)["input_ids"] if truncate else raw_tgt
        references = {"reference": targets} if keep_references else {}
        return {
            **references,
            "input_ids": src,
            "labels": tgt,
            "length": [max(len(s), len(t)) for s, t in zip(src, tgt)],
            "min_length": [min(len(s), len(t)) for s, t in zip(src, tgt)],
            "raw_length": [max(len(s), len(t)) for s, t in zip(raw_src, raw_tgt)],
        }

    return encode


def tokenize_pairs(
    dataset: datasets.Dataset,
    tokenizer,
    source_lang: str,
    target_lang: str,
    max_length: int,
    truncate: bool = False,
    name: str = "split",
    keep_references: bool = False,
    num_proc: int | None | str = "auto",
) -> TokenizedSplit:
    """Tokenise the `translation` column with `Dataset.map` (batched; cached on disk for file-backed data).

    Both sides are encoded with the one joint tokenizer, which appends </s>. A pair whose
    source or target is empty or only white space is dropped (and counted); a pair with a side longer than `max_length` tokens
    is dropped, or cut to `max_length` (keeping </s>) when `truncate`. `keep_references` keeps
    the target text in a `reference` column, to score translations against. `num_proc` processes
    tokenise ("auto": `tokenization_workers`); for file-backed data the result is cached next to the
    data set's files and a later run with the same tokenizer and options reads it back instead.
    """
    if max_length < 2:
        raise BadInput(f"`max_length` must be at least 2 (a token and </s>); got {max_length!r}.")

    encode = pair_encoder(tokenizer, source_lang, target_lang, max_length, truncate, keep_references)
    if num_proc == "auto":
        num_proc = tokenization_workers(len(dataset))
    options = dict(source_lang=source_lang, target_lang=target_lang, max_length=max_length, truncate=truncate,
                   keep_references=keep_references)
    encoded = dataset.map(
        encode, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc=f"tokenising {name}",
        new_fingerprint=map_fingerprint(dataset, tokenizer, **options),
    )
    min_length, raw_length = column(encoded, "min_length"), column(encoded, "raw_length")
    empty = min_length <= 1  # nothing but </s>
    too_long = ~empty & (raw_length > max_length)
    keep = ~empty if truncate else ~empty & ~too_long
    kept = encoded.select(np.flatnonzero(keep)).remove_columns(["min_length", "raw_length"])
    split = TokenizedSplit(kept, len(encoded), int(empty.sum()), int(too_long.sum()))
    if len(kept) == 0:
        raise BadInput(
            f"no pairs left in the {name} split: {split.describe(name, max_length, truncate)}. Check the "
            f"language keys ({source_lang!r}, {target_lang!r}), `max_length`, or pass `truncate`."
        )
    return split
