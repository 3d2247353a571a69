"""Setting a run up: the data, the tokenizer, the model, Adam and its schedule, and the run's three records.

`set_up` does it on every process, in this order (the random streams depend on it): the checkpoint to
resume from, the data and tokenizer (task.py), the model (the resumed run's architecture, a saved model to fine-tune,
or a new one from a preset), Adam and §5.3's schedule, and the three records the run keeps: what is built
once (`Components`), what a checkpoint holds (`RunState`) and when the steps end (`Budget`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, set_seed
from torch.optim.lr_scheduler import LambdaLR

from ..corpora import recorded_name
from ..errors import BadInput
from ..checks.model_folder import CheckedFolder, check_model_folder
from ..modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from ..modeling.modeling_vanilla_transformer import (
    VanillaTransformerForConditionalGeneration,
)
from ..threads import use_threads
from .arguments import TrainArguments
from .checkpoints import WeightAverage, checkpoint_path, save_run_config
from .compute import Bf16Weights, CompiledLoss, bf16_weights, compiled_loss, set_attn_implementation
from .batches import TokenBatchSampler, size_batches, training_sampler
from .distributed import NonFiniteGuard, StepStrategy, configure_deepspeed, on_main
from .budget import Budget
from .finetuning import add_lora, freeze
from .logs import Losses, TrainingLog
from .resume import resume_budget, resume_step
from .run_folder import CHECKPOINTS, RunLock, check_new_folder
from .run_state import RunState
from .schedule import PAPER_WARMUP_STEPS, BudgetSchedule, make_optimizer, make_scheduler, peak_scale, schedule_summary
from .task import TaskInputs, prepare_data

__all__ = ["Components", "prepare", "set_up"]


logger = get_logger(__name__)

@dataclass
class Components:
    """What a run builds once: the accelerator, the model and what trains it, the options, the data and the tokenizer.
    Each field is set here, at construction; `finish` alone replaces the model by the unwrapped one (`unwrap_model`)."""

    accelerator: Accelerator
    model: torch.nn.Module  # as prepared by Accelerate (DDP-wrapped on several processes)
    optimizer: torch.optim.Optimizer  # Adam, as prepared by Accelerate
    scheduler: LambdaLR | BudgetSchedule  # Noam's, or one that asks the Budget for the steps left
    checkpoint_root: Path
    args: TrainArguments  # the options the run trains with: those given, with the batch plan
    average: WeightAverage | None = None  # `ema_decay`
    # `set_up` sets every field below; None stands where a test or a benchmark builds only what a step needs.
    task: TaskInputs | None = None  # the pairs, the language pair, the tokenizer, the tokenised splits
    sampler: TokenBatchSampler | None = None
    training_log: TrainingLog | None = None  # the run's training_log.jsonl
    lock: RunLock | None = None  # the folder's lock, held by the main process
    compiled: CompiledLoss | None = None  # the step's forward and loss compiled (compute.py); None: eager
    strategy: StepStrategy = field(init=False)  # what DeepSpeed, FSDP2 and fp16's scaler change in the step
    losses: Losses = field(init=False)  # the step's losses, summed on the device
    guard: NonFiniteGuard = field(init=False)  # what becomes of a step that is not finite
    bf16_weights: Bf16Weights | None = field(init=False)  # bf16 copies the step trains on; None: autocast

    def __post_init__(self):
        self.strategy = StepStrategy(self.accelerator, self.optimizer)
        self.losses = Losses(self.accelerator, self.checkpoint_root)
        self.guard = NonFiniteGuard(self.strategy, self.optimizer, self.losses)
        self.bf16_weights = bf16_weights(self.accelerator, self.accelerator.unwrap_model(self.model))
        if self.bf16_weights is not None:
            logger.info("bf16 weights: forward and backward on bf16 copies, Adam on the fp32 weights (no autocast)")

    def unwrap_model(self) -> None:
        """Keep the unwrapped model alone, so that the DDP wrapper can be freed while its process group exists."""
        self.model = self.accelerator.unwrap_model(self.model)


def set_up(args: TrainArguments, accelerator, lock: RunLock | None = None) -> tuple[Components, RunState, Budget]:
    """On every process: where to resume from, the data, tokenizer, model, optimiser and schedule, built once (in
    `Components`, with the options the run trains with: those given, with `size_batches`' plan); its state; its budget."""
    if accelerator.distributed_type == DistributedType.FSDP and args.ema_decay is not None:
        raise BadInput("`ema_decay` is not supported under FSDP: the moving average would hold each process's "
                       "shards of the weights; train without it, or with DDP")
    logger.info(use_threads(args.threads))  # before the data is read and tokenised: that computes too
    checkpoint_root = Path(args.output_dir) / CHECKPOINTS
    resume_from, base_folder = _starting_point(args, accelerator, checkpoint_root)
    set_seed(args.seed)  # the same initial weights on every process
    task = prepare_data(args, accelerator)
    languages = (task.source_lang, task.target_lang)
    model = _build_model(args, accelerator, task.tokenizer, resume_from, base_folder, languages)
    d_model = model.config.d_model
    resumed = RunState.read(resume_from) if resume_from is not None else None
    plan = size_batches(args, accelerator, model)  # a resume's args hold its run's plan (`restore_batch_plan`)
    args = replace(args, **plan._asdict())
    # Built before `prepare` moves the model there, over the parameters that train (freeze, add_lora).
    optimizer = make_optimizer(model, accelerator.device, (args.adam_beta1, args.adam_beta2), args.adam_epsilon,
                               args.weight_decay)
    configure_deepspeed(accelerator, args)  # the batch sizes DeepSpeed asks for; nothing without DeepSpeed
    model, prepared_optimizer = prepare(accelerator, model, optimizer)
    state = resumed if resumed is not None else RunState(run_options=args.run_options(), recorded_options=args.recorded_options())
    sampler = training_sampler(accelerator, task.train_split, state.epoch, args.max_tokens, args.seed,
                               shape_count=args.bucket_shapes, compiled=args.compile_asked())
    budget = Budget(max_steps=args.max_steps, num_epochs=args.num_epochs, time_limit=args.time_limit, state=state,
                    gradient_accumulation_steps=args.gradient_accumulation_steps, start_step=state.step,
                    epoch_batches=len(sampler.local_batches(state.epoch)), earlier_seconds=state.begin_part())  # a new part
    # The scheduler is not prepared: Accelerate would step it once per process, and the Noam schedule counts
    # optimiser steps. It is registered so that save_state/load_state keep it.
    scale = args.lr_scale if args.lr is None else peak_scale(args.lr, d_model, args.warmup_steps)
    scheduler = make_scheduler(optimizer, d_model, args.warmup_steps, scale, args.lr_schedule,
                               remaining_steps=budget.remaining_steps)
    accelerator.register_for_checkpointing(scheduler)
    average = _weight_average(accelerator, model, args.ema_decay)
    _log_recipe(args, accelerator, d_model, scale)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))  # weights, optimiser, scheduler, RNG states
        logger.info(f"resumed from {resume_from} (step {state.step})")
        resume_budget(state, budget)
        state.record_options(args.recorded_options())  # those typed with `resume`, for the next one
    else:
        set_seed(args.seed, device_specific=True)  # different dropout masks on each process
    if accelerator.is_main_process:
        accelerator.init_trackers("train", config={k: v for k, v in asdict(args).items() if not isinstance(v, dict)})
    components = Components(accelerator=accelerator, model=model, optimizer=prepared_optimizer, scheduler=scheduler,
                            checkpoint_root=checkpoint_root, args=args, average=average, task=task, sampler=sampler,
                            training_log=_training_log(args, accelerator, state),
                            lock=lock, compiled=compiled_loss(args, accelerator, sampler.shapes))
    return components, state, budget


def _weight_average(accelerator, model, ema_decay: float | None) -> WeightAverage | None:
    """The moving average of the weights that `ema_decay` asks for, registered so that checkpoints keep it."""
    if ema_decay is None:
        return None
    average = WeightAverage(accelerator.unwrap_model(model), ema_decay)
    accelerator.register_for_checkpointing(average)
    return average


def _training_log(args: TrainArguments, accelerator, state: RunState) -> TrainingLog:
    """The run's training_log.jsonl, written by the main process; a resumed run's records after its step go."""
    return TrainingLog(args.output_dir, state.step if args.resume else None, accelerator.is_main_process)


def _starting_point(args: TrainArguments, accelerator, checkpoint_root: Path) -> tuple[Path | None, CheckedFolder | None]:
    """The checkpoint the run resumes from, or None; and the model folder it fine-tunes, past the gate, or None: the
    gate checks that folder first, before its tokenizer or any data is read, and once."""
    if args.resume:
        step = on_main(accelerator, lambda: resume_step(checkpoint_root, args))
        return checkpoint_path(checkpoint_root, step), None
    on_main(accelerator, lambda: check_new_folder(args.output_dir, checkpoint_root, args.lora_rank))  # a new run
    if args.model_name_or_path is None:
        return None, None
    folder = Path(args.model_name_or_path)
    if not folder.is_dir():
        raise FileNotFoundError(f"`model_name_or_path`: no saved model folder at {args.model_name_or_path}")
    if args.tokenizer is None and not (folder / "tokenizer.json").is_file():  # a new tokenizer's ids are not the model's
        raise BadInput(f"`model_name_or_path` {args.model_name_or_path} holds no tokenizer.json: give the `tokenizer` "
                       "the model was trained with")
    return None, check_model_folder(folder, needs_tokenizer=False)


def _build_model(args: TrainArguments, accelerator, tokenizer, resume_from: Path | None, base_folder,
                 langs: tuple[str, str]):
    """The model to train, its objective and attention set, its language pair recorded, its config saved. `base_folder`:
    the model folder it fine-tunes, past the gate (`_starting_point`), or None."""
    model = _load_model(args, tokenizer, resume_from, base_folder)
    model.config.label_smoothing = args.label_smoothing  # the model's own loss is the run's objective (§5.4)
    if args.attn_implementation:  # refused before the first step (a missing kernel package, for one)
        set_attn_implementation(model, args.attn_implementation)
    _check_max_length(args.max_length, model.config)
    _record_language_pair(model.config, *langs, args.dataset)
    model.config.update({"dataset_config": args.dataset_config, "dataset_columns": args.columns})  # to read it again
    checkpoint_root = Path(args.output_dir) / CHECKPOINTS
    if accelerator.is_main_process and resume_from is None:
        checkpoint_root.mkdir(parents=True, exist_ok=True)
        save_run_config(model.config, checkpoint_root)
    logger.info(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; {model.config.to_diff_dict()}")
    freeze(model, encoder=args.freeze_encoder, embeddings=args.freeze_embeddings)
    if args.lora_rank is not None:
        model = add_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_target_modules.split(","))
    return model


def _load_model(args: TrainArguments, tokenizer, resume_from: Path | None, base_folder: CheckedFolder | None):
    config_file = Path(args.output_dir) / CHECKPOINTS / "config.json"
    if resume_from is not None:  # the architecture of the run being resumed; its weights come with load_state
        return VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_json_file(config_file))
    if base_folder is not None:
        model = base_folder.load(**args.config_overrides)
        if len(tokenizer) > model.config.vocab_size:
            raise BadInput(
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


def _check_max_length(max_length: int, config) -> None:
    """`max_length` within every length the model reads: a longer pair would fail at its batch, on every resume."""
    for name, bound in config.sequence_bounds().items():
        if max_length > bound:
            raise BadInput(f"`max_length` ({max_length}) is over the model's {name} ({bound}), the longest "
                           f"sequence it reads: give a `max_length` of at most {bound}.")


def _record_language_pair(config, source_lang: str, target_lang: str, dataset: str) -> None:
    """Saved with the model, so that evaluating or translating another pair is warned about."""
    if (config.source_lang, config.target_lang) not in ((None, None), (source_lang, target_lang)):
        logger.warning(f"fine-tuning a model trained on {config.source_lang}->{config.target_lang} "
                       f"to translate {source_lang}->{target_lang}")
    config.update({"source_lang": source_lang, "target_lang": target_lang, "dataset_name": recorded_name(dataset)})


def _log_recipe(args: TrainArguments, accelerator, d_model: int, scale: float) -> None:
    """The optimiser, schedule, objective and batches the run trains with: most of its options, in one line."""
    peak = d_model**-0.5 * args.warmup_steps**-0.5 * scale
    if args.lr_schedule == "noam":
        schedule = f"lr = {scale:.4g} * {d_model}^-0.5 * min(step^-0.5, step * {args.warmup_steps}^-1.5)"
    else:
        schedule = f"lr: {schedule_summary(args.lr_schedule)} (not the paper's)"
    average = f"; moving average of the weights, decay {args.ema_decay}" if args.ema_decay is not None else ""
    adam = f"Adam({args.adam_beta1}, {args.adam_beta2}, {args.adam_epsilon})"
    if args.weight_decay:
        adam = f"AdamW({args.adam_beta1}, {args.adam_beta2}, {args.adam_epsilon}, weight decay {args.weight_decay})"
    logger.info(
        f"{adam}, {schedule} "
        f"(peak {peak:.2e} at step {args.warmup_steps}; the paper warms up for {PAPER_WARMUP_STEPS}){average}; "
        f"label smoothing {args.label_smoothing}; {accelerator.num_processes} process(es), "
        f"{args.gradient_accumulation_steps} batch(es) of <= {args.max_tokens} tokens each per step; "
        f"mixed precision {accelerator.mixed_precision}"
    )


def prepare(accelerator, model, optimizer):
    """`accelerator.prepare(model, optimizer)`, without Accelerate's wrapper of `forward`, which returns every
    output in fp32: a copy of the (batch, length, vocabulary) logits. Training, evaluation and decoding enter
    `accelerator.autocast()` themselves instead."""
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    return model, optimizer
