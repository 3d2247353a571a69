"""`TrainArguments`: every option of `train`, declared once.

Each field carries its help, its group of `train --help` and, where it has them, its choices and the
bound it must keep (`positive`, `non-negative`, `fraction`), as transformers' `TrainingArguments` carries
them in `field(metadata=...)`. `train`'s command line is generated from the fields (cli/train.py's `add_arguments`), so a
default, choice or bound is written nowhere else: the command line refuses a value beyond its bound as it is
read (cli/options.py's `BoundedOption`, the form every command's numeric options share, with the bounds of
checks/bounds.py), and `validate` checks the bounds and choices from the same metadata, and the rules between
options by hand. This module imports neither torch nor transformers, so
that `vanilla-transformer train --help` stays instant: `validate` imports the model's checks when it runs.
"""

import dataclasses
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path

from ..choices import (
    ATTENTION_IMPLEMENTATIONS,
    BEST_METRICS,
    DEFAULT_VOCAB_SIZE,
    PAPER_WARMUP_STEPS,
    PRESET_NAMES,
    PRESET_SHAPES,
    TOKENIZER_MODELS,
    TRACKERS,
)
from ..errors import BadInput, MissingPackage, as_bad_input
from ..checks.files import check_repo_id
from ..checks.bounds import BOUNDS, field_kind, max_num_beams, within_bound
from .schedule import SCHEDULES, check_schedule, schedule_summary

__all__ = ["BATCH_PLAN_OPTIONS", "CPU_MAX_TOKENS", "DEFAULT_DDP_TIMEOUT", "DEFAULT_VOCAB_SIZE", "NEVER_RESTORED",
           "PAPER_WARMUP_STEPS", "SCHEDULES", "TrainArguments", "check_option"]

CPU_MAX_TOKENS = 4096  # `max_tokens` off a GPU, where the paper's batch would make every step long
# Seconds a process waits in a collective for the others: the main process learns the vocabulary and
# tokenises a WMT-size corpus meanwhile, which outlasts NCCL's default of 10 minutes.
DEFAULT_DDP_TIMEOUT = 3 * 60 * 60
COMPILE_BACKENDS = ("inductor", "aot_eager")  # torch.compile's: kernels generated, or torch's own on the same graphs
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # inductor's

LORA_TARGETS = "q_proj,k_proj,v_proj,out_proj"  # the attention projections, self and cross
TOKENIZER_FIELDS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")  # the config takes them from the tokenizer
DATA_FIELDS = ("source_lang", "target_lang", "dataset_name", "dataset_config", "dataset_columns")  # ... and these from the data
# What a resumed run must share with the run it continues; its limits, evaluation and checkpoints may change.
RUN_OPTIONS = ("dataset", "dataset_config", "columns", "source_lang", "target_lang", "max_length", "truncate", "tokenizer",
               "preset", "config_overrides", "model_name_or_path", "max_tokens", "gradient_accumulation_steps", "seed",
               "bucket_shapes",
               "lr_schedule", "ema_decay",  # these two: their state in a checkpoint fits only themselves
               # ... and these: the parameters the optimiser holds, and how they are grouped
               "weight_decay", "freeze_encoder", "freeze_embeddings", "lora_rank", "lora_alpha", "lora_dropout",
               "lora_target_modules")
# Left unset (None), these are chosen by the batch plan (batches.size_batches), and a resumed run keeps its own.
BATCH_PLAN_OPTIONS = ("max_tokens", "gradient_accumulation_steps")
# What acts outside the run's folder (an upload, a tracker) or names it: `resume` takes these from the command line
# alone, never from a record in the folder, which anyone who can write there could have edited.
# (A tracker of choices.py's FOLDER_TRACKERS, which writes only in the folder, is restored all the same.)
NEVER_RESTORED = ("output_dir", "resume", "push_to_hub", "report_to")

# The groups of `train --help`, in order, each with what it says beyond its options.
DATA_GROUP = "data"
TOKENIZER_GROUP = "tokenizer"
MODEL_GROUP = "model"
STEPS_GROUP = "batches and steps (training stops at the first limit reached)"
OPTIMISATION_GROUP = "optimisation and schedule (§5.3, §5.4)"
CHECKPOINTS_GROUP = "checkpoints"
EVALUATION_GROUP = "evaluation (validation perplexity, then beam-search BLEU/chrF)"
SELECTION_GROUP = "model selection (the best checkpoint by validation, early stopping)"
OUTPUT_GROUP = "output and logging"
GROUPS = {
    DATA_GROUP:
        "A validation, valid or dev split validates; without one, 2% of train (at most 1000 pairs) is held out.",
    TOKENIZER_GROUP: "Default: the one in --output-dir, else the fine-tuned model's, else a new joint BPE learnt "
                     "on the train split and saved to --output-dir.",
    MODEL_GROUP: "A preset trained from scratch, or a saved model to fine-tune.",
    STEPS_GROUP: None,
    OPTIMISATION_GROUP: None,
    CHECKPOINTS_GROUP: "§6.1 averages the last 5 of a base model.",
    EVALUATION_GROUP: "§6.1: beam 4, length penalty 0.6, at most input length + 50 tokens.",
    SELECTION_GROUP:
        "Not in the paper, which averages the last checkpoints (§6.1); fairseq's checkpoint_best and --patience.",
    OUTPUT_GROUP: None,
}

def option(default=dataclasses.MISSING, *, group: str, help: str, **metadata):
    """A field of `TrainArguments` with what its command-line option needs: its group, help and any of
    `choices`, `bound` (a name in BOUNDS: "positive", "non-negative", "fraction", "cpus", "seed"), an upper bound
    besides (`high`, a number or a function, and `why`, what it is: BoundedOption's) and `metavar`."""
    return field(default=default, metadata=dict(group=group, help=help, **metadata))


@dataclass
class TrainArguments:
    """Every option of `train`; its command line is generated from these fields, one `--kebab-case` option each."""

    output_dir: str = option(
        group=OUTPUT_GROUP, help="the run's folder: checkpoints/ while training, then a Hub repository")
    # Data
    dataset: str = option(
        "bible-en-es", group=DATA_GROUP,
        help="embedded corpus (bible-en-es, bible-en-fr), local .json/.jsonl/.csv/.tsv/.parquet file (optionally .gz) "
        "or folder of split files ({'translation': {lang: text}} rows or one column per language; a .csv/.tsv has a "
        "header row naming the languages), folder of plain parallel text (train.SRC + train.TGT, valid.* or dev.*, "
        "test.*, one sentence a line) or the prefix of one such pair (DIR/train), save_to_disk folder, or Hub data "
        "set name",
    )
    dataset_config: str | None = option(None, group=DATA_GROUP, help="Hub data set configuration, e.g. de-en")
    columns: str | None = option(
        None, group=DATA_GROUP, metavar="NAME,...",
        help="names of the columns of .tsv/.csv files without a header row, in order, e.g. en,de or id,en,de "
        "(default: the header row's)",
    )
    source_lang: str | None = option(
        None, group=DATA_GROUP, help="source language key (default: the corpus pair, or the two keys there are)")
    target_lang: str | None = option(None, group=DATA_GROUP, help="target language key")
    max_length: int = option(256, group=DATA_GROUP, bound="positive", help="tokens per side, </s> included")
    truncate: bool = option(
        False, group=DATA_GROUP, help="cut longer training pairs to --max-length instead of dropping them")
    # Tokenizer
    tokenizer: str | None = option(None, group=TOKENIZER_GROUP, help="tokenizer folder")
    vocab_size: int = option(
        DEFAULT_VOCAB_SIZE, group=TOKENIZER_GROUP, bound="positive",
        help="size of a new joint vocabulary. The paper's 37k was for 4.5M pairs; on the ~29k-pair Bible corpora "
        "larger vocabularies shorten sequences little while many entries are too rare to train (docs/tokenizer.md)",
    )
    tokenizer_model: str = option(
        "bpe", group=TOKENIZER_GROUP, choices=TOKENIZER_MODELS,
        help="model of a new tokenizer: byte-level BPE, or SentencePiece's unigram over the same bytes",
    )
    # Model
    preset: str = option(
        "tiny", group=MODEL_GROUP, choices=PRESET_NAMES,
        help=f"architecture trained from scratch, a preset of the model's configuration: {PRESET_SHAPES}",
    )
    config_overrides: dict = field(default_factory=dict, metadata=dict(
        group=MODEL_GROUP, metavar="KEY=VALUE,...",
        help="config fields to change, e.g. 'd_model=256,encoder_layers=3,decoder_layers=3,d_ff=1024,dropout=0.1'",
    ))
    model_name_or_path: str | None = option(
        None, group=MODEL_GROUP, help="saved model folder to fine-tune instead of a preset")
    freeze_encoder: bool = option(
        False, group=MODEL_GROUP, help="train the encoder's layers no more (the token embeddings, shared, still train)")
    freeze_embeddings: bool = option(False, group=MODEL_GROUP, help="train the token and position embeddings no more")
    lora_rank: int | None = option(
        None, group=MODEL_GROUP, bound="positive", metavar="RANK",
        help="train low-rank adapters of this rank (LoRA, with PEFT) instead of the weights; the saved model has "
        "them merged in, and OUTPUT_DIR/adapter keeps them as PEFT loads them (default: off)",
    )
    lora_alpha: float = option(
        16.0, group=MODEL_GROUP, bound="positive", help="LoRA's scaling: updates are alpha / rank")
    lora_dropout: float = option(0.0, group=MODEL_GROUP, bound="fraction", help="dropout on LoRA's input")
    lora_target_modules: str = option(
        LORA_TARGETS, group=MODEL_GROUP, metavar="NAME,...", help="linear layers given adapters, by name")
    # Batches and steps (§5.1, §5.2)
    max_tokens: int | None = option(
        None, group=STEPS_GROUP, bound="positive",
        help="tokens per batch and process, per side, padding included (default: on a GPU, what fits its memory "
        "for the paper's ~25000 per optimiser step over accumulation and processes; elsewhere 4096)",
    )
    gradient_accumulation_steps: int | None = option(None, group=STEPS_GROUP, bound="positive", help=(
        "batches per optimiser step (default: on a GPU without --max-tokens, what the paper's ~25000 tokens need; else 1)"))
    bucket_shapes: int | None = option(
        None, group=STEPS_GROUP, bound="non-negative", metavar="N",
        help="pad training batches to at most N shapes (rows x length) chosen from the data's lengths, so that a "
        "compiled step compiles N times (default: 16 on a GPU or with --torch-compile; 0, each batch as long as its "
        "longest pair, elsewhere)",
    )
    max_steps: int | None = option(
        100_000, group=STEPS_GROUP, bound="positive", help="optimiser steps (the paper's base model's)")
    num_epochs: int | None = option(None, group=STEPS_GROUP, bound="positive", help="passes over the training data")
    time_limit: float | None = option(
        None, group=STEPS_GROUP, bound="positive", metavar="MINUTES",
        help="stop (with a checkpoint) after this long, the minutes of every part of a resumed run counted")
    seed: int = option(0, group=STEPS_GROUP, bound="seed", help="seeds weights, data order and dropout")
    # Optimisation (§5.3, §5.4); warmup_steps, lr_scale and lr_schedule are checked by schedule.py's check_schedule too
    warmup_steps: int = option(
        PAPER_WARMUP_STEPS, group=OPTIMISATION_GROUP, bound="positive",
        help="linear warm-up steps (the paper's 4000; a short CPU run wants a few hundred)",
    )
    lr: float | None = option(
        None, group=OPTIMISATION_GROUP, bound="positive",
        help="peak learning rate, reached at the end of the warm-up; the schedule keeps its shape (default: the "
        "paper's d_model^-0.5 * warmup_steps^-0.5)",
    )
    lr_scale: float = option(1.0, group=OPTIMISATION_GROUP, bound="positive", help="factor on d_model^-0.5 * min(...); or give --lr")
    adam_beta1: float = option(0.9, group=OPTIMISATION_GROUP, bound="fraction", help="Adam's beta1 (§5.3)")
    adam_beta2: float = option(0.98, group=OPTIMISATION_GROUP, bound="fraction", help="Adam's beta2 (§5.3)")
    adam_epsilon: float = option(1e-9, group=OPTIMISATION_GROUP, bound="positive", help="Adam's epsilon (§5.3)")
    weight_decay: float = option(
        0.0, group=OPTIMISATION_GROUP, bound="non-negative",
        help="decoupled weight decay (AdamW), not on biases and LayerNorm weights (not in the paper)",
    )
    lr_schedule: str = option(
        "noam", group=OPTIMISATION_GROUP, choices=tuple(SCHEDULES),
        help="; ".join(f"{name}: {schedule_summary(name)}" for name in SCHEDULES)
        + " (the budget: --max-steps, --time-limit or --num-epochs, whichever ends first)",
    )
    ema_decay: float | None = option(
        None, group=OPTIMISATION_GROUP, metavar="DECAY",
        help="keep a moving average of the weights (e.g. 0.999); it becomes the final model if its validation "
        "perplexity is lower (not in the paper; default: off)",
    )
    label_smoothing: float = option(0.1, group=OPTIMISATION_GROUP, bound="fraction", help="epsilon_ls (§5.4), in [0, 1)")
    max_grad_norm: float | None = option(
        None, group=OPTIMISATION_GROUP, bound="positive",
        help="clip the gradient norm (not in the paper; default: off)")
    mixed_precision: str | None = option(
        None, group=OPTIMISATION_GROUP, choices=("no", "fp16", "bf16"),
        help="default: what `accelerate launch`/`accelerate config` say, else bf16 where the GPU or CPU computes it "
        "(fp16 on a GPU without it), else no",
    )
    threads: int | None = option(
        None, group=OPTIMISATION_GROUP, bound="cpus", metavar="N",
        help="CPU threads torch computes with (default: OMP_NUM_THREADS where set, else the CPUs this process may "
        "use: its affinity, within its cgroup's CPU quota, shared by a launch's processes on this machine)",
    )
    attn_implementation: str | None = option(
        None, group=OPTIMISATION_GROUP, choices=ATTENTION_IMPLEMENTATIONS,
        help="transformers' attention implementation to train with (default: sdpa or eager, whichever trains the "
        "first batch faster here)",
    )
    torch_compile: bool | None = option(
        None, group=OPTIMISATION_GROUP,
        help="train on the step compiled with torch.compile: the forward and loss, and so the backward, one graph per "
        "batch shape (16 --bucket-shapes unless given); each shape's first step compiles (slowly on a CPU), which "
        "--time-limit counts (default: off, the eager step)",
    )
    torch_compile_backend: str | None = option(
        None, group=OPTIMISATION_GROUP, choices=COMPILE_BACKENDS,
        help="torch.compile's backend: inductor generates the step's kernels; aot_eager captures the same graphs, "
        "forward and backward, and runs them with torch's own kernels, a quick check that the step compiles "
        "(default: inductor; giving it implies --torch-compile)",
    )
    torch_compile_mode: str | None = option(
        None, group=OPTIMISATION_GROUP, choices=COMPILE_MODES,
        help="inductor's mode; reduce-overhead replays CUDA graphs (default: default; giving it implies --torch-compile)",
    )
    # Checkpoints
    save_steps: int = option(1000, group=CHECKPOINTS_GROUP, bound="positive", help="checkpoint every N steps")
    keep_checkpoints: int = option(5, group=CHECKPOINTS_GROUP, bound="positive", help="newest checkpoints kept")
    average_last: int = option(
        1, group=CHECKPOINTS_GROUP, bound="positive",
        help="final weights = mean of the last K checkpoints (the paper: 5 for base models)",
    )
    resume: bool = option(
        False, group=CHECKPOINTS_GROUP,
        help="continue from the newest checkpoint in --output-dir, with the options it records; an option given "
        "other than its default replaces the recorded one, or is refused where it would change the run",
    )
    # Evaluation; num_beams's upper bound and length_penalty are checked by the model's check_decoding_options
    eval_steps: int = option(1000, group=EVALUATION_GROUP, bound="positive", help="validate every N steps")
    eval_samples: int | None = option(
        500, group=EVALUATION_GROUP, bound="non-negative",
        help="validation pairs translated for BLEU/chrF at each evaluation, and at the end when there is a test "
        "split; 0 for none",
    )
    test_samples: int | None = option(
        None, group=EVALUATION_GROUP, bound="non-negative",
        help="test pairs translated for the final BLEU/chrF; 0 skips the test, and the validation split (its "
        "--eval-samples) gives the final scores (default: the whole test split)",
    )
    num_beams: int = option(4, group=EVALUATION_GROUP, bound="positive", high=max_num_beams,
                            why=" (each beam holds a copy of the search's state)", help="beam size (the paper: 4, §6.1)")
    length_penalty: float = option(0.6, group=EVALUATION_GROUP, help="beam length penalty alpha (the paper: 0.6)")
    # Model selection
    best_metric: str | None = option(
        None, group=SELECTION_GROUP, choices=tuple(BEST_METRICS),
        help="keep the checkpoint with the best validation score (bleu and chrf need --eval-samples); it is the "
        "final model unless --average-last averages others",
    )
    patience: int | None = option(
        None, group=SELECTION_GROUP, bound="positive", metavar="N",
        help="with --best-metric: stop after N evaluations without improvement",
    )
    average_best: bool = option(
        False, group=SELECTION_GROUP,
        help="with --best-metric: average the best --average-last checkpoints, not the last")
    # Output and logging
    ddp_timeout: int = option(
        DEFAULT_DDP_TIMEOUT, group=OUTPUT_GROUP, bound="positive", metavar="SECONDS",
        help="how long a process waits for the others in a collective, e.g. while the main process learns the "
        "vocabulary and tokenises",
    )
    log_steps: int = option(
        50, group=OUTPUT_GROUP, bound="positive",
        help="log a line (loss, NLL, learning rate, tokens/s) every N steps, also appended to OUTPUT_DIR/training_log.jsonl")
    report_to: str | None = option(
        None, group=OUTPUT_GROUP, choices=tuple(TRACKERS), help="tracker, logging under OUTPUT_DIR/runs")
    push_to_hub: str | None = option(
        None, group=OUTPUT_GROUP, metavar="USER/NAME",
        help="upload the finished folder to this Hub model repository (token from HF_TOKEN or `hf auth login`)",
    )

    def validate(self) -> None:
        """Fail early, naming the option and what it accepts."""
        from ..modeling.value_checks import check_decoding_options, is_finite_number
        from ..modeling.configuration_vanilla_transformer import check_probability
        from ..tokenizer import MIN_VOCAB_SIZE

        for f in dataclasses.fields(self):
            _check_field(type(self), f, getattr(self, f.name))
        if self.vocab_size < MIN_VOCAB_SIZE:  # before the data is read, not after the tokenizer's training starts
            raise BadInput(f"`vocab_size` must be at least {MIN_VOCAB_SIZE} (the 256 bytes every vocabulary starts "
                           f"with, and the special tokens); got {self.vocab_size}.")
        self._validate_config_overrides()
        if self.max_steps is None and self.num_epochs is None and self.time_limit is None:
            raise BadInput("give at least one of `max_steps`, `num_epochs` and `time_limit`, or training never ends.")
        if self.average_last > self.keep_checkpoints:
            raise BadInput(
                f"`average_last` ({self.average_last}) cannot exceed `keep_checkpoints` ({self.keep_checkpoints}): "
                "older checkpoints are deleted."
            )
        max_tokens = self.max_tokens or CPU_MAX_TOKENS  # a GPU's default is never below `max_length`
        if max_tokens < self.max_length:
            raise BadInput(f"`max_tokens` ({max_tokens}) must be at least `max_length` ({self.max_length}).")
        check_schedule(self.warmup_steps, self.lr_scale, self.lr_schedule, names=("warmup_steps", "lr_scale", "lr_schedule"))
        if self.lr is not None and self.lr_scale != 1.0:
            raise BadInput("`lr` and `lr_scale` both set the peak learning rate: give one of them.")
        if self.model_name_or_path is not None and self.preset != type(self).preset:  # the class holds the default
            raise BadInput(f"`preset` {self.preset!r} builds a new model, and `model_name_or_path` fine-tunes a saved "
                           "one with its own architecture: give one of them.")
        if self.lora_rank is not None:
            self._validate_lora()
        if self.ema_decay is not None and not (is_finite_number(self.ema_decay) and 0 < self.ema_decay < 1):
            raise BadInput(f"`ema_decay` must be a number in (0, 1), e.g. 0.999, or None; got {self.ema_decay!r}.")
        self._validate_selection()
        self._validate_compile()
        if self.report_to is not None and importlib.util.find_spec(TRACKERS[self.report_to]) is None:
            raise MissingPackage(f"`report_to` {self.report_to} needs the {TRACKERS[self.report_to]} package: "
                           f"pip install 'vanilla-transformer[{self.report_to}]'")
        if self.push_to_hub is not None:
            check_repo_id(self.push_to_hub)  # before hours of training, not after
        with as_bad_input():  # the model's own checks
            check_probability("label_smoothing", self.label_smoothing)
            check_decoding_options(num_beams=self.num_beams, length_penalty=self.length_penalty)

    def _validate_lora(self) -> None:
        if importlib.util.find_spec("peft") is None:
            raise MissingPackage("`lora_rank` needs the peft package: pip install 'vanilla-transformer[peft]'")
        if self.freeze_encoder or self.freeze_embeddings:
            raise BadInput("`lora_rank` already trains the adapters alone: leave out `freeze_encoder` and "
                           "`freeze_embeddings`.")
        if not all(name.strip() for name in self.lora_target_modules.split(",")):
            raise BadInput(f"`lora_target_modules` must be layer names separated by commas, e.g. {LORA_TARGETS}; "
                           f"got {self.lora_target_modules!r}.")

    def run_options(self) -> dict:
        """The options that define the run (RUN_OPTIONS), local paths made absolute, as its checkpoints record them: a
        `resume` that changes one is refused (`check_same_run`)."""
        options = {name: getattr(self, name) for name in RUN_OPTIONS}
        for name in ("dataset", "tokenizer", "model_name_or_path"):
            if options[name] is not None and Path(options[name]).expanduser().exists():
                options[name] = str(Path(options[name]).expanduser().resolve())
        return options

    def recorded_options(self) -> dict:
        """Every option of the run (all but `output_dir` and `resume`) as its checkpoints record them, for `resume`
        alone to restore (`restore_options`)."""
        return {name: value for name, value in dataclasses.asdict(self).items() if name not in ("output_dir", "resume")}

    def compile_asked(self) -> bool:
        """Whether the step is to be compiled: `torch_compile`, or left out and implied by a backend or mode."""
        implied = self.torch_compile_backend is not None or self.torch_compile_mode is not None
        return self.torch_compile if self.torch_compile is not None else implied

    def _validate_compile(self) -> None:
        if self.torch_compile is False and (self.torch_compile_backend or self.torch_compile_mode):
            raise BadInput("`torch_compile_backend` and `torch_compile_mode` are for a compiled step, and "
                           "`torch_compile` false leaves it eager: give one or the other.")
        if self.torch_compile_mode is not None and self.torch_compile_backend == "aot_eager":
            raise BadInput("`torch_compile_mode` is inductor's: leave it out with `torch_compile_backend` aot_eager.")
        if self.compile_asked() and self.bucket_shapes == 0:
            raise BadInput("`torch_compile` needs bucket shapes: without them a compiled step compiles again for "
                           "every batch length; give `bucket_shapes` a positive number, or leave it out (16).")

    def _validate_selection(self) -> None:
        """The model-selection options need a score to select by."""
        for name in ("patience", "average_best"):
            if getattr(self, name) and self.best_metric is None:
                raise BadInput(f"`{name}` needs `best_metric` (bleu, chrf or loss) to tell better from worse.")
        if self.best_metric in ("bleu", "chrf") and not self.eval_samples:
            raise BadInput(f"`best_metric` {self.best_metric} needs validation translations: give `eval_samples` "
                           "a positive number, or choose `best_metric` loss.")

    def _validate_config_overrides(self) -> None:
        """Before hours of data preparation: known fields with values the config accepts."""
        from ..modeling.attention_variants import check_attn_implementation
        from ..modeling.configuration_vanilla_transformer import VanillaTransformerConfig

        known = [name for name in inspect.signature(VanillaTransformerConfig).parameters
                 if name not in ("kwargs", *TOKENIZER_FIELDS, *DATA_FIELDS)]
        from_tokenizer = sorted(set(self.config_overrides) & set(TOKENIZER_FIELDS))
        if from_tokenizer:
            raise BadInput(
                f"`config_overrides`: {', '.join(from_tokenizer)} come(s) from the tokenizer (its size and special "
                "tokens); choose the size of a new tokenizer with `vocab_size` (--vocab-size), or give a `tokenizer`"
            )
        from_data = sorted(set(self.config_overrides) & set(DATA_FIELDS))
        if from_data:
            raise BadInput(f"`config_overrides`: {', '.join(from_data)} come(s) from the data: set `dataset`, "
                           "`source_lang` and `target_lang` instead")
        unknown = sorted(set(self.config_overrides) - set(known))
        if unknown:
            raise BadInput(f"`config_overrides`: unknown config fields {unknown}; the fields are {', '.join(known)}")
        if self.model_name_or_path is None:
            with as_bad_input("`config_overrides`: "):
                config = VanillaTransformerConfig.from_preset(self.preset, **self.config_overrides)
            with as_bad_input():
                check_attn_implementation(config, self.attn_implementation)
            if self.lora_rank is not None and self.lora_rank > config.d_model:  # each layer adapted has d_model on a side
                raise BadInput(f"`lora_rank` must be at most d_model ({config.d_model}), the width of the layers it "
                               f"adapts; got {self.lora_rank}.")


def check_option(name: str, value) -> None:
    """The value of one option of `TrainArguments` (say, one a checkpoint records): its type, choices and bound."""
    f = next(f for f in dataclasses.fields(TrainArguments) if f.name == name)
    _check_field(TrainArguments, f, value)


# What an error calls each type of option, and the test of a value (an int stands for a float).
OPTION_TYPES = {
    int: ("an integer", lambda value: isinstance(value, int) and not isinstance(value, bool)),
    float: ("a number", lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)),
    str: ("a string", lambda value: isinstance(value, str)),
    bool: ("true or false", lambda value: isinstance(value, bool)),
    dict: ("KEY=VALUE pairs", lambda value: isinstance(value, dict)),
}


def _check_field(arguments: type, f: dataclasses.Field, value) -> None:
    """A field's type, choices and bound, from its metadata: "`name` must be <what> [or None]; got <value>."."""
    kind, optional = field_kind(arguments, f)
    if value is None and optional:
        return
    choices, bound = f.metadata.get("choices"), f.metadata.get("bound")
    what, holds = OPTION_TYPES.get(kind, (None, lambda value: True))
    if choices is None and bound is None and not holds(value):  # choices and bounds say what they take themselves
        raise BadInput(f"`{f.name}` must be {what}{' or None' * optional}; got {value!r}.")
    if choices is not None and value not in choices:
        raise BadInput(f"`{f.name}` must be one of {', '.join(map(repr, choices))}{' or None' * optional}; "
                       f"got {value!r}.")
    if bound is not None and not within_bound(bound, kind, value):
        raise BadInput(f"`{f.name}` must be {BOUNDS[bound, kind][0]}{' or None' * optional}; got {value!r}.")

