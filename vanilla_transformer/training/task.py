"""The translation task's inputs, as fairseq's task loads them: the splits, the tokenizer, the tokenised pairs, and
the batches they are cut into.

`prepare_data` reads the splits (holding out a validation slice where there is none), takes the tokenizer
and tokenises the pairs. The tokenizer is the one given (`tokenizer`), else the one already in `output_dir`
while it is what these options would train (`_keep_own_tokenizer`: the options it was learnt from are
recorded in checkpoints/tokenizer_options.json), else the model's (`model_name_or_path`), else a new one.

The batches: how many tokens each holds and how many make an optimiser step (`size_batches`), and the sampler that
cuts the training split into them (`training_sampler`). §5.1 trains on batches of about 25,000 source and 25,000
target tokens. Given `max_tokens`, a run takes it; on a GPU without it, the paper's step sized to the device's memory
(`gpu_batch`); elsewhere CPU_MAX_TOKENS, one batch a step. The plan is returned, and the run's options take it
(`set_up`): nothing here changes the options given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType
from datasets import DatasetDict
from transformers import PreTrainedTokenizerBase

from ..corpora import load_translation_dataset, resolve_languages
from ..errors import BadInput
from ..checks.files import read_json
from ..checks.model_folder import load_tokenizer
from ..staging import write_file_whole
from ..tokenizer import check_appends_eos, train_tokenizer
from .arguments import CPU_MAX_TOKENS, TrainArguments
from .data import TokenBatchSampler, TokenizedSplit, bucket_shapes, tokenize_pairs
from .run_folder import CHECKPOINTS, TOKENIZER_OPTIONS

__all__ = ["GPU_BUCKETS", "PAPER_STEP_TOKENS", "BatchPlan", "TaskInputs", "gpu_batch", "load_splits", "prepare_data",
           "prepare_tokenizer", "size_batches", "training_sampler"]

logger = get_logger(__name__)


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


# The batches

PAPER_STEP_TOKENS = 25_000  # §5.1: "approximately 25000 source tokens and 25000 target tokens" per batch
GPU_BUCKETS = 16  # batch shapes on a GPU by default: each is one compilation of a compiled step


def gpu_batch(memory: int, config, parameters: int, processes: int, max_length: int,
              accumulation: int | None = None) -> tuple[int, int]:
    """(max_tokens, gradient_accumulation_steps) of about the paper's 25000 tokens per optimiser step over
    `processes`, each batch fitting a device of `memory` bytes beside the model's `parameters`: with
    `accumulation` given, the batch it needs (within what fits); else the fewest batches whose largest fits.

    The estimate is coarse and errs towards less: 20 bytes a parameter (fp32 weights, gradients, Adam's two
    moments, autocast's bf16 copies), and per token of a batch what a layer keeps for backward in bf16
    autocast (about 30 d_model + 5 d_ff bytes, more in the decoder, which also attends to the source) and the
    output layer's logits with their fp32 log-softmax and gradients (12 bytes a vocabulary entry), doubled for
    the allocator's fragments and temporaries, within 80% of the memory."""
    d, d_ff = config.d_model, config.d_ff
    per_token = (config.encoder_layers * (30 * d + 5 * d_ff) + config.decoder_layers * (44 * d + 5 * d_ff)
                 + 12 * config.vocab_size)
    fits = int((0.8 * memory - 20 * parameters) / (2 * per_token))
    if fits < max_length:
        raise BadInput(f"a batch of `max_length` ({max_length}) tokens does not fit the device's "
                       f"{memory / 2**30:.1f} GiB beside the model's {parameters:,} parameters; lower `max_length` "
                       "or give `max_tokens`")
    if accumulation is None:
        accumulation = -(-PAPER_STEP_TOKENS // (processes * fits))  # rounded up
    wanted = -(-PAPER_STEP_TOKENS // (processes * accumulation))
    return max(min(wanted, fits), max_length), accumulation


class BatchPlan(NamedTuple):
    """The batches of every optimiser step: `max_tokens` tokens each, `gradient_accumulation_steps` of them a process."""

    max_tokens: int
    gradient_accumulation_steps: int


def size_batches(args: TrainArguments, accelerator, model) -> BatchPlan:
    """`max_tokens` and `gradient_accumulation_steps`, those given or, where left unset, on a GPU the paper's batch
    sized to its memory (`gpu_batch`), elsewhere CPU_MAX_TOKENS and one batch per step; one line says what was chosen."""
    accumulation = args.gradient_accumulation_steps
    if args.max_tokens is not None or accelerator.distributed_type == DistributedType.DEEPSPEED:
        accumulation = accumulation or 1  # DeepSpeed: one batch a step
    if args.max_tokens is not None:
        return BatchPlan(args.max_tokens, accumulation)
    processes = accelerator.num_processes
    if accelerator.device.type == "cuda":
        memory = torch.cuda.get_device_properties(accelerator.device).total_memory
        parameters = sum(p.numel() for p in model.parameters())
        plan = BatchPlan(*gpu_batch(memory, model.config, parameters, processes, args.max_length, accumulation))
        why = (f"the paper's ~{PAPER_STEP_TOKENS} per step, sized to the GPU's {memory / 2**30:.1f} GiB and "
               f"{parameters:,} parameters")
    else:
        plan, why = BatchPlan(CPU_MAX_TOKENS, accumulation or 1), "the default off a GPU"
    step_tokens = plan.max_tokens * plan.gradient_accumulation_steps * processes
    logger.info(f"batch: {plan.max_tokens} tokens x {plan.gradient_accumulation_steps} batch(es) x {processes} "
                f"process(es) = {step_tokens} tokens per optimiser step ({why}; --max-tokens and "
                "--gradient-accumulation-steps choose them)")
    return plan


def training_sampler(accelerator, split: TokenizedSplit, epoch: int, max_tokens: int, seed: int, *,
                     shape_count: int | None, compiled: bool) -> TokenBatchSampler:
    """The training batches of at most `max_tokens` tokens, shuffled by `seed`, padded to `shape_count` shapes (by
    default GPU_BUCKETS on a GPU or for a `compiled` step, none elsewhere); one line says the shapes and the padding
    they waste beside that of batches as long as their longest pair."""
    count = shape_count
    if count is None:
        count = GPU_BUCKETS if accelerator.device.type == "cuda" or compiled else 0
    shapes = bucket_shapes(split.lengths, max_tokens, count) if count else None
    shard = dict(seed=seed, num_replicas=accelerator.num_processes, rank=accelerator.process_index)
    sampler = TokenBatchSampler(split.lengths, max_tokens, shapes=shapes, **shard)
    if shapes is None:
        logger.info(f"batches: each as long as its longest pair; {sampler.padding(epoch):.1%} of their slots pad")
    else:
        plain = TokenBatchSampler(split.lengths, max_tokens, **shard).padding(epoch)
        logger.info(f"batches: {len(shapes)} shapes (rows x length: {', '.join(f'{r}x{n}' for r, n in shapes)}); "
                    f"{sampler.padding(epoch):.1%} of their slots pad (as long as their longest pair: {plain:.1%})")
    return sampler
