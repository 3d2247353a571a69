"""`TrainingArguments`: every option of `train`, declared once."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

from ..inference import MAX_LENGTH_PENALTY, MAX_NUM_BEAMS
from ..modeling.arguments_vanilla_transformer import check_attn_implementation
from ..modeling.configuration_vanilla_transformer import PRESETS, VanillaTransformerConfig
from ..tokenizer import DEFAULT_VOCAB_SIZE
from .distributed import DEFAULT_DDP_TIMEOUT
from .kernels import ATTENTION_IMPLEMENTATIONS
from .schedule import PAPER_WARMUP_STEPS, check_schedule

__all__ = ["TrainingArguments"]

TOKENIZER_FIELDS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")  # the config takes them from the tokenizer
DATA_FIELDS = ("source_lang", "target_lang", "dataset_name")  # ... and these from the data
# What a resumed run must share with the run it continues (its data, tokenizer, model and batches);
# the limits, schedule, evaluation and checkpoint options may change.
RUN_OPTIONS = ("dataset", "dataset_config", "source_lang", "target_lang", "max_length", "truncate", "tokenizer",
               "preset", "config_overrides", "model_name_or_path", "max_tokens", "gradient_accumulation_steps", "seed",
               "lr_schedule", "ema_decay")  # these two: their state in a checkpoint fits only themselves


@dataclass
class TrainingArguments:
    """Every option of `train`; the command line mirrors these one to one."""

    output_dir: str
    # Data
    dataset: str = "bible-en-es"  # embedded corpus, local file or folder, or Hub data set
    dataset_config: str | None = None
    source_lang: str | None = None  # default: the corpus pair, or the data set's two keys
    target_lang: str | None = None
    max_length: int = 256  # tokens per side, </s> included; longer training pairs are dropped ...
    truncate: bool = False  # ... or cut to max_length
    # Tokenizer: a folder; default the one in output_dir (resuming), the model's (fine-tuning), or a new one
    tokenizer: str | None = None
    vocab_size: int = DEFAULT_VOCAB_SIZE  # for a new tokenizer
    # Model: a preset trained from scratch, or a saved model to fine-tune
    preset: str = "tiny"
    config_overrides: dict = field(default_factory=dict)  # e.g. {"d_model": 256, "dropout": 0.0}
    model_name_or_path: str | None = None
    # Batches and steps (§5.1, §5.2)
    max_tokens: int = 4096  # per batch and process, per side, padding included
    gradient_accumulation_steps: int = 1
    max_steps: int | None = 100_000  # the paper's base model; at least one of the three limits is needed
    num_epochs: int | None = None
    time_limit: float | None = None  # minutes
    seed: int = 0
    # Optimisation (§5.3, §5.4)
    lr_schedule: str = "noam"  # the paper's; "linear" / "cosine": the same warm-up and peak, then zero at the budget's end
    warmup_steps: int = PAPER_WARMUP_STEPS
    lr_scale: float = 1.0
    ema_decay: float | None = None  # keep an exponential moving average of the weights (not in the paper)
    label_smoothing: float = 0.1
    max_grad_norm: float | None = None  # not in the paper
    mixed_precision: str | None = None  # "no", "fp16", "bf16"; None: the launcher's, else bf16 where the device has it
    attn_implementation: str | None = None  # transformers' name; None: the fastest on the first batch (kernels.py)
    # Checkpoints (§6.1 averages the last 5 of a base model)
    save_steps: int = 1000
    keep_checkpoints: int = 5
    average_last: int = 1
    resume: bool = False
    # Evaluation (§6.1: beam 4, length penalty 0.6, at most input length + 50 tokens)
    eval_steps: int = 1000
    eval_samples: int | None = 500  # validation pairs translated for BLEU during training (0: none, None: all)
    test_samples: int | None = None  # test pairs translated at the end (None: all, the headline numbers)
    num_beams: int = 4
    length_penalty: float = 0.6
    # Processes: how long one waits in a collective (seconds) while the main process prepares the data
    ddp_timeout: int = DEFAULT_DDP_TIMEOUT
    # Logging
    log_steps: int = 50
    report_to: str | None = None  # "tensorboard": logs under output_dir/runs
    # Publishing: upload the finished output folder to this Hub model repository ("user/name")
    push_to_hub: str | None = None

    def validate(self) -> None:
        """Fail early, naming the option and what it accepts."""
        positive = ("max_length", "vocab_size", "max_tokens", "gradient_accumulation_steps", "save_steps",
                    "keep_checkpoints", "average_last", "eval_steps", "num_beams", "log_steps", "ddp_timeout")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
        for name in ("max_steps", "num_epochs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be a positive integer or None; got {value!r}.")
        if self.eval_samples is not None and (not isinstance(self.eval_samples, int) or self.eval_samples < 0):
            raise ValueError(f"`eval_samples` must be a non-negative integer or None; got {self.eval_samples!r}.")
        if self.test_samples is not None and (not isinstance(self.test_samples, int) or self.test_samples < 1):
            raise ValueError(f"`test_samples` must be a positive integer or None; got {self.test_samples!r}.")
        self._validate_config_overrides()
        if self.max_steps is None and self.num_epochs is None and self.time_limit is None:
            raise ValueError("give at least one of `max_steps`, `num_epochs` and `time_limit`, or training never ends.")
        if self.model_name_or_path is None and self.preset not in PRESETS:
            raise ValueError(f"`preset` must be one of {', '.join(map(repr, PRESETS))}; got {self.preset!r}.")
        if self.average_last > self.keep_checkpoints:
            raise ValueError(
                f"`average_last` ({self.average_last}) cannot exceed `keep_checkpoints` ({self.keep_checkpoints}): "
                "older checkpoints are deleted."
            )
        if self.max_tokens < self.max_length:
            raise ValueError(f"`max_tokens` ({self.max_tokens}) must be at least `max_length` ({self.max_length}).")
        check_schedule(self.warmup_steps, self.lr_scale, self.lr_schedule, names=("warmup_steps", "lr_scale", "lr_schedule"))
        if self.ema_decay is not None and not (_is_finite(self.ema_decay) and 0 < self.ema_decay < 1):
            raise ValueError(f"`ema_decay` must be a number in (0, 1), e.g. 0.999, or None; got {self.ema_decay!r}.")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"`label_smoothing` must be in [0, 1); got {self.label_smoothing!r}.")
        for name in ("max_grad_norm", "time_limit"):
            value = getattr(self, name)  # a negative norm would flip every gradient: training would ascend
            if value is not None and not (_is_finite(value) and value > 0):
                raise ValueError(f"`{name}` must be a positive number or None; got {value!r}.")
        if self.num_beams > MAX_NUM_BEAMS:
            raise ValueError(f"`num_beams` must be at most {MAX_NUM_BEAMS} (the paper's: 4); got {self.num_beams}.")
        if not (_is_finite(self.length_penalty) and abs(self.length_penalty) <= MAX_LENGTH_PENALTY):
            raise ValueError(f"`length_penalty` must be between -{MAX_LENGTH_PENALTY} and {MAX_LENGTH_PENALTY} (the paper's: "
                             f"0.6; larger ones overflow the beam scores); got {self.length_penalty!r}.")
        if self.mixed_precision not in (None, "no", "fp16", "bf16"):
            raise ValueError(f"`mixed_precision` must be 'no', 'fp16' or 'bf16'; got {self.mixed_precision!r}.")
        if self.attn_implementation not in (None, *ATTENTION_IMPLEMENTATIONS):
            raise ValueError(f"`attn_implementation` must be one of {', '.join(map(repr, ATTENTION_IMPLEMENTATIONS))} or "
                             f"None (the fastest here); got {self.attn_implementation!r}.")
        if self.report_to not in (None, "tensorboard"):
            raise ValueError(f"`report_to` must be 'tensorboard' or None; got {self.report_to!r}.")
        if self.report_to == "tensorboard":
            from accelerate.utils import is_tensorboard_available

            if not is_tensorboard_available():
                raise ValueError("`report_to` tensorboard needs the tensorboard package: "
                                 "pip install 'vanilla-transformer[tensorboard]'")
        if self.push_to_hub is not None:
            from ..hub import check_repo_id

            check_repo_id(self.push_to_hub)  # before hours of training, not after


    def _validate_config_overrides(self) -> None:
        """Before hours of data preparation: known fields with values the config accepts."""
        known = [name for name in inspect.signature(VanillaTransformerConfig).parameters
                 if name not in ("kwargs", *TOKENIZER_FIELDS, *DATA_FIELDS)]
        from_tokenizer = sorted(set(self.config_overrides) & set(TOKENIZER_FIELDS))
        if from_tokenizer:
            raise ValueError(
                f"`config_overrides`: {', '.join(from_tokenizer)} come(s) from the tokenizer (its size and special "
                "tokens); choose the size of a new tokenizer with `vocab_size` (--vocab-size), or give a `tokenizer`"
            )
        from_data = sorted(set(self.config_overrides) & set(DATA_FIELDS))
        if from_data:
            raise ValueError(f"`config_overrides`: {', '.join(from_data)} come(s) from the data: set `dataset`, "
                             "`source_lang` and `target_lang` instead")
        unknown = sorted(set(self.config_overrides) - set(known))
        if unknown:
            raise ValueError(f"`config_overrides`: unknown config fields {unknown}; the fields are {', '.join(known)}")
        if self.model_name_or_path is None and self.preset in PRESETS:
            try:
                config = VanillaTransformerConfig.from_preset(self.preset, **self.config_overrides)
            except ValueError as err:
                raise ValueError(f"`config_overrides`: {err}") from None
            check_attn_implementation(config, self.attn_implementation)


def _is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
