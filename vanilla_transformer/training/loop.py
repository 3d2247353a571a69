"""The training driver: `train(TrainingArguments(...))`, on one CPU, one GPU or many, with Accelerate.

    vanilla-transformer train --output-dir runs/en-es --preset tiny --warmup-steps 400 --time-limit 15
    accelerate launch -m vanilla_transformer.cli train ...        # the same, on every process

One optimiser step (§5.2) takes `gradient_accumulation_steps` batches of at most `max_tokens`
tokens on every process, sums the label-smoothed loss (§5.4) over their non-padding target
tokens and divides by the number of those tokens in the whole step (see loss.py). Adam and the
warm-up / inverse-square-root schedule are §5.3's (schedule.py); a run with a budget may decay
to zero at its end instead (`lr_schedule` linear or cosine) and keep an average of its weights
(`ema_decay`, averaging.py), which becomes the final model when it scores better on validation.
Every `save_steps` the full state is checkpointed (checkpoints.py); every `eval_steps` the
validation split is scored: loss, perplexity, and BLEU and chrF of beam-search translations
(sacrebleu, through `evaluate`). At the end the last `average_last` checkpoints are averaged (§6.1)
and saved with the config and tokenizer, then the test split is scored, and `output_dir` becomes a
complete Hub repository.

`train` is three parts around a `_Run` record: `_setup` (one run per folder, the checkpoint to
resume from, data, model, optimiser), `_train_until_done` (the steps) and `_finish` (the model
first; scores, card and upload after it, none of which can lose it).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from ..corpora import load_translation_dataset, resolve_languages
from ..file_checks import read_json
from ..modeling.generation_vanilla_transformer import paper_generation_config
from ..hub import RESULTS_FILE, save_model_files, write_model_card, write_results
from ..inference import load_pretrained
from ..metrics import load as load_metric, repeated_phrase
from ..modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration
from ..staging import STAGING_PREFIX, DiskFull, sweep_staging
from ..tokenizer import train_tokenizer
from .arguments import RUN_OPTIONS, TrainingArguments
from .averaging import WeightAverage
from .checkpoints import (
    average_checkpoints,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    newest_sound_checkpoint,
    read_state,
    save_checkpoint,
)
from .data import PadCollator, PrefetchedBatches, TokenBatchSampler, TokenizedSplit, tokenize_pairs
from .distributed import configure_deepspeed, default_mixed_precision, end_training, start_accelerator
from .kernels import fastest_attention
from .lock import RunLock
from .schedule import PAPER_WARMUP_STEPS, make_optimizer, make_scheduler

__all__ = ["TrainingArguments", "evaluate", "full_model", "prepare", "train"]

logger = get_logger(__name__)  # logs on the main process only

CHECKPOINTS = "checkpoints"  # sub-folder of output_dir; the rest of output_dir is the Hub folder (hub.py)
TOKENIZER_OPTIONS = "tokenizer_options.json"  # in CHECKPOINTS: what the run's own tokenizer was trained from
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")  # a saved model

# ------------------------------------------------------------------------------------------
# Setting up: data, tokenizer, model
# ------------------------------------------------------------------------------------------


def _load_splits(args: TrainingArguments):
    data = load_translation_dataset(
        args.dataset, args.dataset_config, source_lang=args.source_lang, target_lang=args.target_lang
    )
    if "train" not in data:
        raise ValueError(f"{args.dataset} has no 'train' split; its splits are {list(data)}")
    source_lang, target_lang = resolve_languages(data["train"], args.source_lang, args.target_lang)
    if "validation" not in data:
        # Hold out a small, seeded slice of the training data so that there is something to validate on.
        size = min(1000, max(1, len(data["train"]) // 50))
        if len(data["train"]) < 2:
            raise ValueError(f"{args.dataset} has no 'validation' split and too few pairs to hold some out")
        held = data["train"].train_test_split(test_size=size, seed=args.seed)
        data["train"], data["validation"] = held["train"], held["test"]
        logger.info(f"no validation split: {size} training pairs held out for validation (seed {args.seed})")
    return data, source_lang, target_lang


def _load_tokenizer(args: TrainingArguments, data, source_lang: str, target_lang: str):
    """An existing tokenizer folder, else the one saved in output_dir or with the model, else a new one."""
    output_dir = Path(args.output_dir)
    if args.tokenizer is not None:
        if not Path(args.tokenizer).is_dir():
            raise FileNotFoundError(f"`tokenizer`: no tokenizer folder at {args.tokenizer}")
        return AutoTokenizer.from_pretrained(args.tokenizer)
    options = _tokenizer_options(args, source_lang, target_lang)
    if (output_dir / "tokenizer.json").is_file() and _keep_own_tokenizer(args, options):
        return AutoTokenizer.from_pretrained(output_dir)
    if args.model_name_or_path is not None and (Path(args.model_name_or_path) / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(args.model_name_or_path)
    logger.info(f"training a {args.vocab_size}-token joint BPE tokenizer on the train split; saved to {output_dir}")
    record = output_dir / CHECKPOINTS / TOKENIZER_OPTIONS
    record.unlink(missing_ok=True)  # the old record goes first: a tokenizer is never described by another's
    tokenizer = train_tokenizer(
        data["train"], languages=[source_lang, target_lang], vocab_size=args.vocab_size, output_dir=output_dir
    )
    record.parent.mkdir(exist_ok=True)
    staging = record.with_name(f"{STAGING_PREFIX}{record.name}")  # whole or not at all: a record is trusted
    staging.write_text(json.dumps(options, indent=2) + "\n")
    os.replace(staging, record)
    return tokenizer


def _tokenizer_options(args: TrainingArguments, source_lang: str, target_lang: str) -> dict:
    """What a tokenizer trained by this run is learnt from (recorded in checkpoints/tokenizer_options.json)."""
    options = _run_options(args)
    return {"dataset": options["dataset"], "dataset_config": args.dataset_config, "source_lang": source_lang,
            "target_lang": target_lang, "vocab_size": args.vocab_size}


def _keep_own_tokenizer(args: TrainingArguments, options: dict) -> bool:
    """Whether the tokenizer already in output_dir is the one these options would train. A run interrupted
    before its first checkpoint and started again with other data or `vocab_size` trains a new one (a
    resumed run refuses instead); a tokenizer whose options were never recorded is used, with a warning."""
    record = Path(args.output_dir) / CHECKPOINTS / TOKENIZER_OPTIONS
    if not record.is_file():
        if args.resume:  # a run from before tokenizers were recorded: its checkpoints hold its options
            return True
        logger.warning(f"using the tokenizer already in {args.output_dir} (what it was trained from is not recorded); "
                       "delete its tokenizer.json to train a new one, or pass `tokenizer`")
        return True
    before = read_json(record)
    changed = [f"{name} {before.get(name)!r} -> {value!r}" for name, value in options.items() if before.get(name) != value]
    if not changed:
        return True
    if args.resume:
        raise ValueError(
            f"`resume`: the tokenizer of the run in {args.output_dir} was trained with other options: "
            f"{'; '.join(changed)}. Resume it with the options it was started with, or train into a new `output_dir`."
        )
    logger.warning(f"the tokenizer in {args.output_dir} was trained with other options ({'; '.join(changed)}) by a "
                   "run that saved no checkpoint: training a new one")
    return False


def _load_model(args: TrainingArguments, tokenizer, resume_from: Path | None):
    config_file = Path(args.output_dir) / CHECKPOINTS / "config.json"
    if resume_from is not None:  # the architecture of the run being resumed; its weights come with load_state
        return VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_json_file(config_file))
    if args.model_name_or_path is not None:
        if not Path(args.model_name_or_path).is_dir():
            raise FileNotFoundError(f"`model_name_or_path`: no saved model folder at {args.model_name_or_path}")
        model = load_pretrained(args.model_name_or_path, **args.config_overrides)
        if len(tokenizer) > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the model {args.model_name_or_path} only "
                f"{model.config.vocab_size}; fine-tune with the model's own tokenizer"
            )
        return model
    config = VanillaTransformerConfig.from_preset(
        args.preset,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **args.config_overrides,
    )
    return VanillaTransformerForConditionalGeneration(config)


def _check_max_length(args: TrainingArguments, config) -> None:
    """`max_length` within every length the model reads: a longer pair would fail at its batch, on every resume."""
    bounds = {"location_max_length": config.location_max_length} if config.attention_score == "location" else {}
    if config.position_encoding == "learned":
        bounds["max_position_embeddings"] = config.max_position_embeddings
    for name, bound in bounds.items():
        if args.max_length > bound:
            raise ValueError(f"`max_length` ({args.max_length}) is over the model's {name} ({bound}), the longest "
                             f"sequence it reads: give a `max_length` of at most {bound}.")


# ------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(accelerator, model, tokenizer, split: TokenizedSplit, args: TrainingArguments, translate_samples=None) -> dict:
    """Loss, perplexity and (unless `translate_samples` is 0) BLEU and chrF of beam-search translations.

    Each process scores its share of the batches; `gather_for_metrics` brings the sums and the
    translations together. `loss` is the label-smoothed training objective per target token,
    `perplexity` exp(NLL per target token) without smoothing. BLEU and chrF are the package's
    `evaluate` metric (`metrics.BLEU_CHRF`: sacrebleu's command-line defaults), with signatures.
    """
    model = full_model(accelerator, model)
    was_training = model.training
    model.eval()
    collate = PadCollator(tokenizer.pad_token_id)
    shard = dict(shuffle=False, num_replicas=accelerator.num_processes, rank=accelerator.process_index)
    sums, tokens = torch.zeros(2, dtype=torch.float64, device=accelerator.device), 0  # loss, nll; target tokens
    sampler = TokenBatchSampler(split.lengths, args.max_tokens, **shard)
    with PrefetchedBatches(split, sampler, collate, accelerator.device) as batches, accelerator.autocast():
        for batch, batch_tokens in batches:
            loss, nll = _loss(model, batch)
            sums += torch.stack([loss.double(), nll.double()])
            tokens += batch_tokens
    sums = torch.cat([sums, sums.new_tensor([tokens])])
    loss, nll, tokens = accelerator.gather_for_metrics(sums.unsqueeze(0)).sum(0).tolist()
    metrics = {"loss": loss / tokens, "nll": nll / tokens, "perplexity": math.exp(min(nll / tokens, 100.0))}

    count = len(split.dataset) if translate_samples is None else min(translate_samples, len(split.dataset))
    if count:
        subset = TokenizedSplit(split.dataset.select(range(count)), count, 0, 0)
        # Beam search holds num_beams hypotheses per sentence: fewer sentences per batch.
        lengths = subset.lengths
        budget = max(args.max_tokens // args.num_beams, int(lengths.max()))
        sampler = TokenBatchSampler(lengths, budget, **shard)
        indices = list(sampler)
        with PrefetchedBatches(subset, indices, collate, accelerator.device) as batches, accelerator.autocast():
            translations = _translate(model, tokenizer, batches, indices, args)
        translations = sorted(accelerator.gather_for_metrics(translations, use_gather_object=True))
        hypotheses = [text for _, text in translations]
        references = [subset.dataset[i]["reference"] for i, _ in translations]
        scores = load_metric().compute(predictions=hypotheses, references=references)
        metrics.update(
            {key: scores[key] for key in ("bleu", "chrf", "bleu_signature", "chrf_signature")},
            translated=len(hypotheses),
            # Translations that loop ("y de su mujer, y de su mujer"), and beside them the references that
            # repeat a phrase too: a coordination ("á todos los ganados ... á todos los animales") is no loop
            # but counts: read the first count against the second.
            repeating=sum(repeated_phrase(h) is not None for h in hypotheses),
            references_repeating=sum(repeated_phrase(r) is not None for r in references),
            examples=[{"reference": r, "translation": h} for r, h in zip(references[:3], hypotheses[:3])],
        )
    model.train(was_training)
    return metrics


def full_model(accelerator, model):
    """The model unwrapped, to evaluate, decode and save. Under FSDP2, whose layers hold shards of their
    weights and gather them in every forward (all processes together), a plain copy with the whole weights
    on each process, gathered by all of them here: each can then score and decode its own batches, of
    different numbers and lengths, without waiting for the others."""
    from torch.distributed.fsdp import FSDPModule

    unwrapped = accelerator.unwrap_model(model)
    if not isinstance(unwrapped, FSDPModule):
        return unwrapped
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(unwrapped, options=StateDictOptions(full_state_dict=True))
    full = VanillaTransformerForConditionalGeneration(unwrapped.config).to(accelerator.device)
    _load_weights(full, weights)
    full.generation_config = unwrapped.generation_config
    return full.train(unwrapped.training)


def _load_weights(model, weights: dict) -> None:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - set(model.all_tied_weights_keys):
        raise RuntimeError(f"the weights do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()


def _translate(model, tokenizer, batches, indices: list[list[int]], args: TrainingArguments) -> list[tuple[int, str]]:
    """(pair index, translation) for every pair of `batches`, whose pairs `indices` lists batch by batch."""
    translations = []
    for (batch, _), batch_indices in zip(batches, indices):
        generated = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            # §6.1: beam search, GNMT length penalty, at most source length + 50 tokens per sentence.
            generation_config=paper_generation_config(
                model.config, num_beams=args.num_beams, length_penalty=args.length_penalty
            ),
        )
        translations += zip(batch_indices, tokenizer.batch_decode(generated, skip_special_tokens=True))
    return translations


def _loss(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's label-smoothed loss and NLL, each summed over its target tokens (§5.4): the model's own loss
    from `labels` (summed: `num_items_in_batch=1`; the loop divides by the step's target tokens over every
    micro-batch and process), for training and evaluation alike."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                num_items_in_batch=1)
    return out.loss, out.nll


def _describe(metrics: dict) -> str:
    text = f"loss {metrics['loss']:.4f}, perplexity {metrics['perplexity']:.2f}"
    if "bleu" in metrics:
        text += (f", BLEU {metrics['bleu']:.2f}, chrF {metrics['chrf']:.2f} ({metrics['translated']} sentences, "
                 f"{metrics['repeating']} repeating a 3-word phrase; references: {metrics['references_repeating']})")
    return text


# ------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """What a training run holds between its setup, its steps and its finish."""

    args: TrainingArguments
    accelerator: Accelerator
    model: torch.nn.Module  # as prepared by Accelerate (DDP-wrapped on several processes)
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    data: Any  # the DatasetDict of raw pairs
    source_lang: str
    target_lang: str
    train_split: TokenizedSplit
    eval_splits: dict[str, TokenizedSplit]
    sampler: TokenBatchSampler
    state: dict  # epoch, batches_done, train_tokens, history: saved with each checkpoint
    step: int
    last_saved: int | None  # the step of the newest checkpoint this run wrote or resumed from
    epoch_batches: int  # batches per epoch on each process
    scheduler: Any = None  # torch's LambdaLR (Noam) or a BudgetSchedule, built on the record: it asks `remaining_steps`
    average: WeightAverage | None = None  # `ema_decay`
    start_step: int = 0  # where this session began
    started: float = field(default_factory=time.perf_counter)
    elapsed: float = 0.0  # seconds since `started` on the main process, as of the current step (the same on every process)
    tokens_since_start: int = 0
    window_tokens: int = 0  # target tokens since the losses were last read
    loss_sums: torch.Tensor | None = None  # on the device: loss, NLL since then, and the first step that was not finite
    stop_requests: Any = None  # the _StopRequests recording signals while training
    stop_signal: int = 0  # SIGINT or SIGTERM received by the main process: checkpoint and stop (the same on every process)
    attention_chosen: bool = False  # the attention implementation is timed on the first batch (kernels.py)

    def remaining_steps(self, step: int) -> float:
        """The optimiser steps left after `step`, to the first limit: `max_steps`, `num_epochs` or `time_limit` (at
        the mean time of a step so far in this session). What a `BudgetSchedule` decays over."""
        args, left = self.args, [math.inf]
        if args.max_steps is not None:
            left.append(args.max_steps - step)
        if args.num_epochs is not None:
            batches = (args.num_epochs - self.state["epoch"]) * self.epoch_batches - self.state["batches_done"]
            left.append(batches / args.gradient_accumulation_steps)
        timed = step - 1 - self.start_step  # steps whose time `elapsed` (measured as step `step` began) covers
        if args.time_limit is not None and timed > 0:
            left.append((args.time_limit * 60 - self.elapsed) / (self.elapsed / timed) - 1)
        return min(left)

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.args.output_dir) / CHECKPOINTS


def train(args: TrainingArguments) -> dict:
    """Train (or fine-tune, or resume) as `args` says; returns the results written to results.json."""
    args.validate()
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # one line per file saved is noise
    accelerator = start_accelerator(  # refuses a launch whose processes would train alone; logs what runs
        ddp_timeout=args.ddp_timeout,
        mixed_precision=args.mixed_precision or default_mixed_precision(),
        log_with=args.report_to,
        project_dir=str(Path(args.output_dir) / "runs") if args.report_to else None,
    )
    lock = RunLock(args.output_dir)  # one run per folder: taken by the main process for all of them
    _on_main(accelerator, lambda: _take_folder(lock))
    try:
        run = _setup(args, accelerator)
        with _StopRequests() as stop:
            run.stop_requests = stop
            _train_until_done(run)
        if run.stop_signal:
            raise TrainingInterrupted(run.stop_signal, args.output_dir, run.step)
        return _finish(run)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskFull(f"{_named(err)}; {_what_was_saved(args)}", err.errno) from None
    finally:
        lock.release()


def _take_folder(lock: RunLock) -> None:
    """Lock the run's folder, then remove what a run killed while saving left in it."""
    lock.acquire()
    for folder in (lock.folder, lock.folder / CHECKPOINTS):
        sweep_staging(folder)


def _named(err: OSError) -> str:
    """`err` as "could not write FILE: CAUSE" (DiskFull says so already; a plain OSError names its file)."""
    if isinstance(err, DiskFull):
        return str(err)
    return f"could not write {err.filename or 'a file'}: {os.strerror(err.errno).lower()}"


def _what_was_saved(args: TrainingArguments) -> str:
    """What a run that could not save has kept, and how to go on."""
    checkpoint = latest_checkpoint(Path(args.output_dir) / CHECKPOINTS)
    if checkpoint is None:
        return "no checkpoint was saved; free some space, then run the same command again"
    return (f"the newest complete checkpoint is {checkpoint} (step {read_state(checkpoint)['step']}); free some "
            "space, then run the same command with --resume to continue")


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM stopped the run after its current step, saved as a checkpoint; `exit_code` is 128 + signal."""

    def __init__(self, signum: int, output_dir: str, step: int):
        self.exit_code = 128 + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}, saved in {Path(output_dir) / CHECKPOINTS}; "
            "run the same command with --resume to continue"
        )


class _StopRequests:
    """While training: SIGINT and SIGTERM are recorded (the step under way finishes, then a checkpoint is
    written) instead of killing the run and losing every step since the last checkpoint. A second signal
    acts at once, as it would without this."""

    def __init__(self):
        self.signum, self._previous = 0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.signum = signum
        for number, handler in self._previous.items():  # the next one interrupts for real
            signal.signal(number, handler)
        logger.warning(f"{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
                       "(send it again to stop at once, unsaved)")

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _on_main(accelerator, decide) -> int | None:
    """Run `decide()`, which returns an int or None, on the main process only, before the other processes
    can race it; every process gets the answer, or stops with the main process's error."""
    answer, error = None, None
    if accelerator.is_main_process:
        try:
            answer = decide()
        except Exception as err:
            error = err
    # [failed, answer] as a tensor reduction, as the loop's own (torch's broadcast_object_list left the gloo
    # processes hanging at exit)
    if accelerator.num_processes > 1:
        sent = [int(error is not None), -1 if answer is None else answer] if accelerator.is_main_process else [0, 0]
        failed, answer = accelerator.reduce(torch.tensor(sent, device=accelerator.device), "sum").tolist()
        answer = None if answer == -1 else answer
        if failed and error is None:
            error = ValueError("the main process refused to start this run; its error says why")
    if error is not None:
        raise error
    return answer


# --- setup -----------------------------------------------------------------------------------


def _setup(args: TrainingArguments, accelerator) -> _Run:
    """On every process: where to resume from, the data, tokenizer, model, optimiser and schedule."""
    if accelerator.distributed_type == DistributedType.FSDP and args.ema_decay is not None:
        raise ValueError("`ema_decay` is not supported under FSDP: the moving average would hold each process's "
                         "shards of the weights; train without it, or with DDP")
    checkpoint_root = Path(args.output_dir) / CHECKPOINTS
    resume_step = _on_main(accelerator, lambda: _resume_step(args, checkpoint_root))
    resume_from = None if resume_step is None else checkpoint_path(checkpoint_root, resume_step)
    set_seed(args.seed)  # the same initial weights on every process
    data, source_lang, target_lang, tokenizer, train_split, eval_splits = _prepare_data(args, accelerator)

    model = _load_model(args, tokenizer, resume_from)
    model.config.label_smoothing = args.label_smoothing  # the model's own loss is the run's objective (§5.4)
    if args.attn_implementation:  # refused before the first step (a missing kernel package, for one)
        _set_attention(model, args.attn_implementation)
    _check_max_length(args, model.config)
    _record_language_pair(model.config, source_lang, target_lang, args.dataset)
    if accelerator.is_main_process and resume_from is None:
        checkpoint_root.mkdir(parents=True, exist_ok=True)
        model.config.to_json_file(checkpoint_root / "config.json")
    logger.info(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; {model.config.to_diff_dict()}")
    d_model = model.config.d_model
    optimizer = make_optimizer(model, accelerator.device)  # built before `prepare` moves the model there
    configure_deepspeed(accelerator, args)  # the batch sizes DeepSpeed asks for; nothing without DeepSpeed
    model, prepared_optimizer = prepare(accelerator, model, optimizer)
    state = {"epoch": 0, "batches_done": 0, "train_tokens": 0, "history": [], "run_options": _run_options(args)}
    if resume_from is not None:
        state = read_state(resume_from)  # the counters; the weights and the rest come with load_state below
    sampler = TokenBatchSampler(
        train_split.lengths, args.max_tokens, seed=args.seed,
        num_replicas=accelerator.num_processes, rank=accelerator.process_index,
    )
    step = state.get("step", 0)
    run = _Run(
        args, accelerator, model, prepared_optimizer, tokenizer, data, source_lang, target_lang, train_split,
        eval_splits, sampler, state, step, last_saved=step if resume_from is not None else None,
        epoch_batches=len(sampler.local_batches(state["epoch"])), start_step=step,
    )
    # A budget schedule asks the run how many steps are left. The scheduler is not prepared: Accelerate
    # would step it once per process, and the Noam schedule counts optimiser steps. It is registered so
    # that save_state/load_state keep it.
    run.scheduler = make_scheduler(optimizer, d_model, args.warmup_steps, args.lr_scale, args.lr_schedule,
                                   remaining_steps=run.remaining_steps)
    accelerator.register_for_checkpointing(run.scheduler)
    if args.ema_decay is not None:
        run.average = WeightAverage(accelerator.unwrap_model(model), args.ema_decay)
        accelerator.register_for_checkpointing(run.average)
    _log_recipe(args, accelerator, d_model)

    if resume_from is not None:
        accelerator.load_state(str(resume_from))  # weights, optimiser, scheduler, RNG states
        logger.info(f"resumed from {resume_from} (step {step})")
    else:
        set_seed(args.seed, device_specific=True)  # different dropout masks on each process
    if accelerator.is_main_process:
        accelerator.init_trackers("train", config={k: v for k, v in asdict(args).items() if not isinstance(v, dict)})
    return run


def prepare(accelerator, model, optimizer):
    """`accelerator.prepare(model, optimizer)`, without Accelerate's wrapper of `forward`, which returns every
    output in fp32: a copy of the (batch, length, vocabulary) logits. The loop enters `accelerator.autocast()`
    itself instead, for training, evaluation and decoding alike."""
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    return model, optimizer


def _resume_step(args: TrainingArguments, checkpoint_root: Path) -> int | None:
    """The step of the checkpoint `resume` continues from; without `resume`, refuse a folder that holds an earlier run."""
    if args.resume:
        if not list_checkpoints(checkpoint_root):
            raise FileNotFoundError(f"`resume`: no complete checkpoint in {checkpoint_root} to resume from")
        checkpoint, problems = newest_sound_checkpoint(checkpoint_root)
        for problem in problems:
            logger.warning(f"`resume`: {problem}")
        state = read_state(checkpoint)
        _check_same_run(args, state.get("run_options"))
        step = state["step"]
        if problems:
            logger.warning(f"`resume`: continuing from {checkpoint.name}, the newest checkpoint that reads back whole; "
                           f"the steps after {step} are trained again")
        read_json(checkpoint_root / "config.json")  # the run's architecture, read by every process next
        return step
    if list_checkpoints(checkpoint_root):
        raise ValueError(
            f"{args.output_dir} holds checkpoints of an earlier run; pass `resume` to continue it, or pick a new `output_dir`"
        )
    model_files = [name for name in MODEL_FILES if (Path(args.output_dir) / name).exists()]
    if model_files:  # a finished model (from the Hub, or a run whose checkpoints were removed): never replaced
        raise ValueError(
            f"{args.output_dir} holds a model ({', '.join(model_files)}) that a new run would replace; pass `resume` "
            f"to continue its run (it needs its {CHECKPOINTS}/ folder), `model_name_or_path {args.output_dir}` "
            "to fine-tune it into another `output_dir`, or pick another `output_dir`"
        )
    return None


def _run_options(args: TrainingArguments) -> dict:
    """The options that define a run (RUN_OPTIONS), local paths made absolute, as its checkpoints record them."""
    options = {name: getattr(args, name) for name in RUN_OPTIONS}
    for name in ("dataset", "tokenizer", "model_name_or_path"):
        if options[name] is not None and Path(options[name]).expanduser().exists():
            options[name] = str(Path(options[name]).expanduser().resolve())
    return options


def _check_same_run(args: TrainingArguments, started_with: dict | None) -> None:
    """`resume` continues the run in `output_dir` as it was started: other data, tokenizer, model or batches
    would silently be ignored or change what was being trained. (Checkpoints from before runs recorded
    their options have nothing to compare with.)"""
    if started_with is None:
        return
    now = _run_options(args)
    defaults = TrainingArguments(output_dir="")  # options newer than the checkpoint had their default
    before = {name: started_with.get(name, getattr(defaults, name)) for name in RUN_OPTIONS}
    changed = [f"{name} {before[name]!r} -> {now[name]!r}" for name in RUN_OPTIONS if before[name] != now[name]]
    if changed:
        raise ValueError(
            f"`resume`: the run in {args.output_dir} was started with other options: {'; '.join(changed)}. "
            "Resume it with the options it was started with, or train into a new `output_dir`."
        )


def _record_language_pair(config, source_lang: str, target_lang: str, dataset: str) -> None:
    """Saved with the model, so that evaluating or translating another pair is warned about."""
    if (config.source_lang, config.target_lang) not in ((None, None), (source_lang, target_lang)):
        logger.warning(f"fine-tuning a model trained on {config.source_lang}->{config.target_lang} "
                       f"to translate {source_lang}->{target_lang}")
    config.update({"source_lang": source_lang, "target_lang": target_lang, "dataset_name": dataset})


def _prepare_data(args: TrainingArguments, accelerator):
    """The raw splits, the language pair, the tokenizer, and the tokenised training and evaluation splits."""
    # Each machine's first process reads the data and fills the map cache on its own disk before the others
    # read them; the tokenizer, in output_dir (which every machine shares), is learnt by the main process alone.
    with accelerator.local_main_process_first():
        data, source_lang, target_lang = _load_splits(args)
    with accelerator.main_process_first():
        tokenizer = _load_tokenizer(args, data, source_lang, target_lang)
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


def _log_recipe(args: TrainingArguments, accelerator, d_model: int) -> None:
    peak = d_model**-0.5 * args.warmup_steps**-0.5 * args.lr_scale
    if args.lr_schedule == "noam":
        schedule = f"lr = {args.lr_scale} * {d_model}^-0.5 * min(step^-0.5, step * {args.warmup_steps}^-1.5)"
    else:
        schedule = f"lr: linear warm-up, then {args.lr_schedule} decay to 0 at the end of the budget (not the paper's)"
    average = f"; moving average of the weights, decay {args.ema_decay}" if args.ema_decay is not None else ""
    logger.info(
        f"Adam(0.9, 0.98, 1e-9), {schedule} "
        f"(peak {peak:.2e} at step {args.warmup_steps}; the paper warms up for {PAPER_WARMUP_STEPS}){average}; "
        f"label smoothing {args.label_smoothing}; {accelerator.num_processes} process(es), "
        f"{args.gradient_accumulation_steps} batch(es) of <= {args.max_tokens} tokens each per step; "
        f"mixed precision {accelerator.mixed_precision}"
    )


# --- steps -----------------------------------------------------------------------------------


def _train_until_done(run: _Run) -> None:
    """Optimiser steps until `max_steps`, `num_epochs` or `time_limit`; a checkpoint every `save_steps` and at the end.

    The host never waits for the device within a step: batches come ready (PrefetchedBatches), the step's
    counts are one reduction whose result the host reads only once the step's work is queued behind it,
    and the losses are read every `log_steps` (and before a checkpoint). The step under way when the time
    limit passes or a signal comes finishes, then the run stops.
    """
    args, state, accelerator = run.args, run.state, run.accelerator
    collate = PadCollator(run.tokenizer.pad_token_id)
    bar = tqdm(total=args.max_steps, initial=run.step, disable=not accelerator.is_local_main_process, desc="training")
    with bar as progress:  # closed on the way out, so that a failure's one line comes after the bar, not before
        done = args.max_steps is not None and run.step >= args.max_steps
        while not done:
            if args.num_epochs is not None and state["epoch"] >= args.num_epochs:
                break
            run.sampler.set_epoch(state["epoch"], state["batches_done"])
            with PrefetchedBatches(run.train_split, run.sampler, collate, accelerator.device) as batches:
                while not done:
                    micro_batches = list(islice(batches, args.gradient_accumulation_steps))
                    if not micro_batches:
                        break
                    if not run.attention_chosen:
                        _choose_attention(run, micro_batches[0][0])
                    total_tokens, lr = _optimizer_step(run, micro_batches)
                    _record_step(run, progress, len(micro_batches), total_tokens, lr)
                    out_of_time = args.time_limit is not None and run.elapsed > args.time_limit * 60
                    if out_of_time and not run.stop_signal:
                        logger.info(f"time limit of {args.time_limit} min reached at step {run.step}")
                    done = (args.max_steps is not None and run.step >= args.max_steps) or out_of_time or bool(run.stop_signal)
                    if run.step % args.save_steps == 0 or done:
                        _checkpoint(run)
            if not done:
                state["epoch"] += 1
                state["batches_done"] = 0
                logger.info(f"epoch {state['epoch']} finished at step {run.step}")
    if run.last_saved != run.step:
        _checkpoint(run)


def _choose_attention(run: _Run, batch: dict) -> None:
    """Put the model on `attn_implementation`, on the one the resumed run chose, or on the one that trains the
    first batch fastest here (kernels.py); checkpoints record it, so that a resumed run computes as it did."""
    run.attention_chosen = True
    model = run.accelerator.unwrap_model(run.model)
    chosen = run.args.attn_implementation or run.state.get("attn_implementation")
    if chosen:
        _set_attention(model, chosen)
    elif seconds := fastest_attention(run.accelerator, run.model, batch, lambda m, b: _loss(m, b)[0]):
        timings = ", ".join(f"{name} {1000 * s:.0f} ms" for name, s in seconds.items())
        logger.info(f"attention: {model.config._attn_implementation}, the fastest here on the first batch, forward "
                    f"and backward ({timings})")
    run.state["attn_implementation"] = model.config._attn_implementation


def _set_attention(model, implementation: str) -> None:
    try:
        model.set_attn_implementation(implementation)
    except (ValueError, ImportError) as err:
        raise ValueError(f"`attn_implementation` {implementation!r} cannot run this model: {err}") from None


def _step_counts(run: _Run, local_tokens: int):
    """The step's one reduction, started and not waited for: [target tokens, the main process's elapsed ms,
    its stop signal], summed over processes. Returns the device tensor (the step's token count divides
    each micro-batch's loss there) and a function that reads the sums on the host when called: by then the
    device has long finished this reduction, queued ahead of the step's forward and backward passes."""
    accelerator = run.accelerator
    elapsed_ms = int((time.perf_counter() - run.started) * 1000) if accelerator.is_main_process else 0
    stop_signal = run.stop_requests.signum if run.stop_requests is not None and accelerator.is_main_process else 0
    counts = torch.tensor([local_tokens, elapsed_ms, stop_signal], dtype=torch.float64)
    if accelerator.device.type == "cuda":
        counts = counts.pin_memory()
    counts = accelerator.reduce(counts.to(accelerator.device, non_blocking=True), "sum")
    return counts, _read_later(counts)


def _read_later(tensor: torch.Tensor):
    """Start copying `tensor` to the host; the returned function waits for that copy alone (a CUDA event), not
    for the work queued after it, and returns the values as a list."""
    if tensor.device.type != "cuda":
        return tensor.tolist
    host = tensor.to("cpu", non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list:
        copied.synchronize()
        return host.tolist()

    return read


def _optimizer_step(run: _Run, micro_batches: list[tuple[dict, int]]) -> tuple[int, float]:
    """§5.2-§5.4: forward and backward over the micro-batches (each with its target-token count), one Adam
    update. Returns the step's target-token count over all processes and the learning rate it used; the loss
    and NLL are summed on the device (`_read_losses` reads them). A step whose gradients are not finite
    leaves the weights and Adam's state as they were (fused Adam's `found_inf`, as GradScaler uses it); the
    next read of the losses stops the run, before any checkpoint after it. Where the optimiser cannot skip
    on the device (DeepSpeed steps inside backward; a non-fused Adam), the check waits for the device
    before the update instead."""
    accelerator, model, world = run.accelerator, run.model, run.accelerator.num_processes
    model.train()
    counts, read_counts = _step_counts(run, sum(tokens for _, tokens in micro_batches))
    total_tokens = counts[0].float()
    if run.loss_sums is None:
        run.loss_sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss, nll, first bad step
    step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    for i, (batch, _) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with nullcontext() if last else accelerator.no_sync(model):  # all-reduce gradients once per step
            with accelerator.autocast():
                loss, nll = _loss(model, batch)
            if deepspeed:  # its engine steps inside backward: the guard comes first
                _stop_unless_finite(run, loss)
            # DDP averages gradients over processes; * world turns that average into a sum.
            accelerator.backward(loss * world / total_tokens)
        step_loss += loss.detach().double()
        run.loss_sums[1] += nll.double()
    run.loss_sums[0] += step_loss
    norm = None if deepspeed else accelerator.clip_grad_norm_(model.parameters(), run.args.max_grad_norm or math.inf)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
    bad = ~torch.isfinite(step_loss)
    skip = None if norm is None or accelerator.scaler is not None else ~torch.isfinite(norm)  # fp16's scaler skips
    if skip is not None:  # the gradients are all-reduced: every process decides alike
        bad |= skip
    run.loss_sums[2] = torch.where(bad & (run.loss_sums[2] == 0), run.step + 1, run.loss_sums[2])
    if skip is not None:
        _skip_on_device_if(run, skip)
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    total_tokens, elapsed_ms, stop_signal = read_counts()
    run.stop_signal = int(stop_signal)
    run.elapsed = elapsed_ms / 1000  # the main process's clock: every process decays its learning rate alike
    if not accelerator.optimizer_step_was_skipped:  # fp16 skips steps whose gradients overflowed
        run.scheduler.step()
        if run.average is not None:
            run.average.update(accelerator.unwrap_model(model))
    run.optimizer.zero_grad(set_to_none=True)
    return int(total_tokens), lr


def _skip_on_device_if(run: _Run, skip: torch.Tensor) -> None:
    """Have the optimiser leave the weights as they are when `skip` (a device bool, the same on every process:
    it comes from the all-reduced gradients) is true; without device support, check on the host now."""
    optimizer = run.optimizer.optimizer
    fsdp = run.accelerator.distributed_type == DistributedType.FSDP  # its parameters are DTensors: checked on the host
    if getattr(optimizer, "_step_supports_amp_scaling", False) and not fsdp:
        optimizer.found_inf = skip.float()
    elif skip.item():
        run.optimizer.zero_grad(set_to_none=True)
        _read_losses(run, reset=False)


def _stop_unless_finite(run: _Run, loss: torch.Tensor) -> None:
    """Stop every process, before any update, when this micro-batch's loss is not finite on any of them."""
    bad = run.accelerator.reduce((~torch.isfinite(loss.detach())).float().reshape(1), "sum")
    if bad.item():
        run.optimizer.zero_grad(set_to_none=True)
        run.loss_sums[2] = run.step + 1
        run.loss_sums[0] += loss.detach().double()
        _read_losses(run, reset=False)


def _read_losses(run: _Run, reset: bool = True) -> tuple[float, float]:
    """The label-smoothed loss and NLL per target token over all processes since the last read (the one wait
    for the device that logging costs), or FloatingPointError when a step since then was not finite."""
    accelerator = run.accelerator
    if run.loss_sums is None:
        return math.nan, math.nan
    sums = accelerator.gather(run.loss_sums.unsqueeze(0))  # (processes, 3)
    loss, nll = sums[:, :2].sum(0).tolist()
    bad_steps = [int(step) for step in sums[:, 2].tolist() if step]
    if bad_steps:
        good = latest_checkpoint(run.checkpoint_root)
        raise FloatingPointError(
            f"the training loss became {loss if not math.isfinite(loss) else 'finite but its gradients not'} at step "
            f"{min(bad_steps)}; that step left the weights as they were, and the run stopped at step {run.step} "
            f"before saving. The last good checkpoint is {good or '(none: no checkpoint was written yet)'}. Try a "
            "lower `lr_scale`, a longer `warmup_steps`, `max_grad_norm`, or mixed_precision 'no'/'bf16'."
        )
    tokens = max(run.window_tokens, 1)
    if reset:
        run.loss_sums.zero_()
        run.window_tokens = 0
    return loss / tokens, nll / tokens


def _record_step(run: _Run, progress, batches: int, total_tokens: int, lr: float) -> None:
    """Count the step, show it, log it every `log_steps` (reading its losses then) and validate every `eval_steps`."""
    args, state = run.args, run.state
    run.step += 1
    state["batches_done"] += batches
    state["train_tokens"] += total_tokens
    run.tokens_since_start += total_tokens
    run.window_tokens += total_tokens
    progress.update(1)
    if run.step % args.log_steps == 0:
        loss, nll = _read_losses(run)
        tokens_per_second = run.tokens_since_start / (time.perf_counter() - run.started)
        progress.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:.0f}")
        metrics = {"train/loss": loss, "train/nll": nll, "train/lr": lr, "train/tokens_per_second": tokens_per_second}
        run.accelerator.log(metrics, step=run.step)
    if run.step % args.eval_steps == 0:
        metrics = evaluate(run.accelerator, run.model, run.tokenizer, run.eval_splits["validation"], args, args.eval_samples)
        _report(run.accelerator, state, run.step, "validation", metrics)


def _checkpoint(run: _Run) -> None:
    _read_losses(run, reset=False)  # no checkpoint after a step that was not finite
    save_checkpoint(run.accelerator, run.checkpoint_root, run.step, run.state, keep=run.args.keep_checkpoints)
    run.last_saved = run.step


# --- finish ----------------------------------------------------------------------------------


def _finish(run: _Run) -> dict:
    """The model first: once training is done, §6.1's averaged weights, the config and the tokenizer are
    saved before anything else. Then the final scores (results.json), the model card and the upload,
    none of which can take the saved model with it. `resume` on a finished run comes here at once."""
    args, accelerator = run.args, run.accelerator
    elapsed = time.perf_counter() - run.started
    unwrapped, weights = _final_weights(run)
    unwrapped.generation_config = paper_generation_config(unwrapped.config)
    if accelerator.is_main_process:
        save_model_files(unwrapped, run.tokenizer, args.output_dir)
        logger.info(f"saved the model and tokenizer to {args.output_dir}")
    results = _final_results(run, unwrapped, weights, elapsed)
    if accelerator.is_main_process:
        write_results(args.output_dir, results)
        write_model_card(
            unwrapped,
            run.tokenizer,
            args.output_dir,
            results,
            dataset=args.dataset,
            source_lang=run.source_lang,
            target_lang=run.target_lang,
            hyperparameters=_card_hyperparameters(args, weights),
            example=_card_example(run),
        )
        logger.info(f"saved {RESULTS_FILE} and the model card to {args.output_dir}")
    end_training(run)  # frees the DDP wrapper before the process group (a gloo hang at exit otherwise)
    if accelerator.is_main_process and args.push_to_hub:  # after the barrier: no process waits on the upload
        _upload(args.output_dir, args.push_to_hub)
    return results


def _card_hyperparameters(args: TrainingArguments, weights: dict) -> dict:
    """The options as the card states them, `average_last` as many checkpoints as were averaged."""
    options = {k: v for k, v in asdict(args).items() if v is not None and k != "output_dir"}
    return {**options, "average_last": len(weights["averaged_checkpoints"])}


def _card_example(run: _Run) -> str | None:
    """The sentence whose attention the model card shows: the first validation source that the model
    reads whole (at most `max_length` tokens; a held-out split may start with a very long one)."""
    for row in islice(run.data["validation"], 200):
        text = (row["translation"] or {}).get(run.source_lang)
        if text and text.strip() and len(run.tokenizer(text)["input_ids"]) <= run.args.max_length:
            return text
    return None


def _upload(output_dir: str, repo_id: str) -> None:
    """`push_to_hub`: the saved folder goes up; if it cannot, the folder stays and the warning says how to retry."""
    from ..hub import push_folder

    try:
        logger.info(f"uploaded to {push_folder(output_dir, repo_id)}")
    except Exception as err:  # the network, the token, the Hub: the model is saved either way
        logger.warning(
            f"uploading to {repo_id} failed: {type(err).__name__}: {err}. The model is saved in {output_dir}; "
            f"upload it with `vanilla-transformer push --folder {output_dir} --repo-id {repo_id}`"
        )


def _final_weights(run: _Run):
    """§6.1: the final model averages the last `average_last` checkpoints; with `ema_decay`, the moving
    average replaces them when its validation perplexity is lower. Returns the unwrapped model and what
    its weights are: {"averaged_checkpoints": names, "weight_average": the comparison, or None}."""
    chosen = list_checkpoints(run.checkpoint_root)[-run.args.average_last :]
    if len(chosen) < run.args.average_last:
        logger.warning(f"`average_last` is {run.args.average_last}, but the run has {len(chosen)} checkpoint(s): the "
                       f"final weights average those {len(chosen)} (save more often with `save_steps`)")
    unwrapped = full_model(run.accelerator, run.model)  # every process: under FSDP they gather the weights together
    if len(chosen) > 1:
        _load_weights(unwrapped, average_checkpoints(chosen))
        logger.info(f"final weights: the average of {', '.join(p.name for p in chosen)}")
    compared = _compare_weight_average(run, unwrapped) if run.average is not None else None
    return unwrapped, {"averaged_checkpoints": [p.name for p in chosen], "weight_average": compared}


def _compare_weight_average(run: _Run, model) -> dict:
    """Validation perplexity of the weights as they are and of the moving average; the better one stays in `model`."""
    def perplexity() -> float:
        return evaluate(run.accelerator, model, run.tokenizer, run.eval_splits["validation"], run.args, 0)["perplexity"]

    kept = {name: p.detach().clone() for name, p in model.state_dict().items()}
    scores = {"checkpoint": perplexity()}
    run.average.copy_to(model)
    scores["moving_average"] = perplexity()
    use_average = scores["moving_average"] < scores["checkpoint"]
    if not use_average:
        model.load_state_dict(kept)
    logger.info(f"final weights: {'the moving average' if use_average else 'the last checkpoint'} (validation "
                f"perplexity {scores['moving_average']:.2f} averaged, {scores['checkpoint']:.2f} not; decay {run.average.decay})")
    return {"decay": run.average.decay, "used": use_average, "validation_perplexity": scores}


def _final_results(run: _Run, unwrapped, weights: dict, elapsed: float) -> dict:
    """Validation and test scores of the final weights, with the run's numbers, flat as results.json holds them."""
    args, state = run.args, run.state
    epoch_batches = max(len(run.sampler.local_batches(state["epoch"])), 1)
    results = {
        "steps": run.step,
        "epochs": state["epoch"] + state["batches_done"] / epoch_batches,
        "train_tokens": state["train_tokens"],
        "train_minutes_this_session": round(elapsed / 60, 2),
        "tokens_per_second": round(run.tokens_since_start / elapsed, 1) if elapsed else None,
        "mixed_precision": run.accelerator.mixed_precision,
        "attn_implementation": state.get("attn_implementation"),
        **weights,
        "source_lang": run.source_lang,
        "target_lang": run.target_lang,
        "dataset": args.dataset,
        "decoding": {"num_beams": args.num_beams, "length_penalty": args.length_penalty, "max_new_tokens": "input length + 50"},
    }
    for name, split in run.eval_splits.items():
        # Validation translates what it translated during training (`eval_samples`); the test split,
        # which the headline numbers come from, is translated whole unless `test_samples` says otherwise.
        samples = args.eval_samples if name == "validation" and "test" in run.eval_splits else args.test_samples
        results[name] = evaluate(run.accelerator, unwrapped, run.tokenizer, split, args, translate_samples=samples)
        _report(run.accelerator, state, run.step, name, results[name])
    results["history"] = state["history"]
    # The headline numbers, flat, as the model card reads them.
    final = results.get("test") or results["validation"]
    return {
        "split": "test" if "test" in results else "validation",
        "bleu": final["bleu"],
        "chrf": final["chrf"],
        "sacrebleu_signature": final["bleu_signature"],
        "chrf_signature": final["chrf_signature"],
        "validation_loss": results["validation"]["loss"],
        "validation_perplexity": results["validation"]["perplexity"],
        **results,
        "replica_checksums": _replica_checksums(run.accelerator, unwrapped),
    }


def _replica_checksums(accelerator, model) -> list[float]:
    """One number per process that changes with any weight: DDP must leave every replica identical."""
    checksum = sum(p.detach().double().abs().sum() + p.detach().double().sum() * 1e-3 for p in model.parameters())
    checksums = accelerator.gather(checksum.reshape(1).to(accelerator.device)).tolist()
    if len(set(checksums)) > 1:
        raise RuntimeError(f"the processes ended with different weights (checksums {checksums}); DDP is broken")
    return checksums


def _report(accelerator, state: dict, step: int, name: str, metrics: dict) -> None:
    logger.info(f"step {step} {name}: {_describe(metrics)}")
    if "bleu_signature" in metrics:
        logger.info(f"sacrebleu {metrics['bleu_signature']} | {metrics['chrf_signature']}")
    state["history"].append({"step": step, "split": name, **{k: v for k, v in metrics.items() if k != "examples"}})
    accelerator.log({f"{name}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
