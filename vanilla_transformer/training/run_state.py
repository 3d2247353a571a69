"""The run's record: what a checkpoint holds besides the weights (`RunState`), changed by its own methods alone.

A checkpoint's trainer_state.json is data: `RunState.read` checks it (`check_state`) before anything uses it, so
that an edited record is refused in one line naming the file.

Model selection by validation lives in the record it changes (fairseq's checkpoint_best, --patience). Not in the
paper, which averages the last checkpoints (§6.1). With `best_metric`, each validation's score is compared with the
best so far (`record_validation`): `best` lists the best evaluations, best first (one, or `average_last` with
`average_best`), whose checkpoints pruning never deletes (`best_steps`), and `evaluations_without_improvement`
counts towards `patience` (`out_of_patience`). Both are checkpointed, so a resumed run keeps knowing its best and
its count. BLEU and chrF compare only on as many validation sentences (`eval_samples`): a resume that changes their
number starts a new comparison.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from accelerate.logging import get_logger

from ..choices import ATTENTION_IMPLEMENTATIONS, BEST_METRICS
from ..errors import BadInput
from .checkpoints import STATE_FILE, read_state

__all__ = ["MAX_PART_SECONDS", "RunState", "check_state", "options_recorded_in", "part_problem"]

logger = get_logger(__name__)


@dataclass
class RunState:
    """What a checkpoint holds besides the weights, optimiser, schedule and RNG states (its trainer_state.json)."""

    step: int = 0  # optimiser steps done
    epoch: int = 0
    batches_done: int = 0  # batches of `epoch` done on each process
    train_tokens: int = 0  # target tokens trained on, over all processes
    history: list = field(default_factory=list)  # every evaluation's scores
    attn_implementation: str | None = None  # the kernel chosen on the first batch: a resumed run computes alike
    # TrainArguments' two views of the options, `run_options()` and `recorded_options()`:
    run_options: dict | None = None  # those that define the run (`check_same_run`)
    recorded_options: dict | None = None  # every option, as typed at the start and each resume: restored by `resume`
    best: list = field(default_factory=list)  # model selection's best validations, best first (`record_validation`)
    evaluations_without_improvement: int = 0  # towards `patience`
    # The run's parts up to this step, the first and each resume: {"steps": [first, last], "seconds"} of
    # training (the steps and their saving), and "scoring_seconds" of validation beside them.
    parts: list = field(default_factory=list)

    def count_step(self, batches: int, tokens: int) -> None:
        """One more optimiser step, of `batches` batches on each process and `tokens` target tokens in all."""
        self.step += 1
        self.batches_done += batches
        self.train_tokens += tokens

    def end_epoch(self) -> None:
        """The epoch's batches are all done: the next epoch starts from its first batch."""
        self.epoch += 1
        self.batches_done = 0

    def record_attn_implementation(self, implementation: str) -> None:
        """The attention implementation the first batch was trained with, which a resumed run computes with too."""
        self.attn_implementation = implementation

    def record_validation(self, metrics: dict, best_metric: str | None, eval_samples: int | None, kept: int) -> bool:
        """Compare the validation `metrics` of this step (on `eval_samples` sentences) with the best so far by
        `best_metric`, keeping the `kept` best; whether they are a new best."""
        if best_metric is None:
            return False
        value, better = metrics[best_metric], BEST_METRICS[best_metric]
        self._start_anew_on_other_samples(best_metric, eval_samples)
        improved = not self.best or (value != self.best[0]["value"] and better(value, self.best[0]["value"]) == value)
        # Sorted best first; an earlier step wins a tie (it was there first).
        candidates = self.best + [{"step": self.step, "metric": best_metric, "value": value, "eval_samples": eval_samples}]
        self.best = sorted(candidates, key=lambda r: r["value"], reverse=better is max)[:kept]
        self.evaluations_without_improvement = 0 if improved else self.evaluations_without_improvement + 1
        return improved

    def _start_anew_on_other_samples(self, best_metric: str, eval_samples: int | None) -> None:
        """BLEU or chrF on another number of validation sentences is another measure: the best so far are forgotten
        (the loss is on the whole split, whatever `eval_samples` is). Records from before the count was kept compare."""
        if best_metric == "loss" or not self.best:
            return
        before = self.best[0].get("eval_samples", eval_samples)
        if before != eval_samples:
            logger.info(f"`eval_samples` is {eval_samples}, the best validation {best_metric} so far (step "
                        f"{self.best[0]['step']}) was on {before}: model selection starts a new comparison at step "
                        f"{self.step}")
            self.best, self.evaluations_without_improvement = [], 0

    def best_steps(self) -> list[int]:
        """The steps whose checkpoints model selection keeps."""
        return [record["step"] for record in self.best]

    def out_of_patience(self, patience: int | None) -> bool:
        return patience is not None and self.evaluations_without_improvement >= patience

    def record_options(self, typed: dict) -> None:
        """The options typed with `resume` over the recorded ones, so that the next `resume` keeps them (a checkpoint
        from before runs recorded their options keeps none)."""
        if self.recorded_options is not None:
            self.recorded_options = {**self.recorded_options, **typed}

    def begin_part(self) -> float:
        """A new part of the run from this step (its first, or a resume); the seconds of the parts before."""
        before = sum(part["seconds"] for part in self.parts)
        self.parts.append({"steps": [self.step, self.step], "seconds": 0.0, "scoring_seconds": 0.0})
        return before

    def record_part(self, seconds: float, scoring_seconds: float = 0.0) -> None:
        """The current part as of this step: `seconds` of training so far, and `scoring_seconds` of validation."""
        self.parts[-1] = {"steps": [self.parts[-1]["steps"][0], self.step], "seconds": round(seconds, 2),
                          "scoring_seconds": round(scoring_seconds, 2)}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict) -> RunState:
        """From a checkpoint's state, older ones included (they may lack the newer keys: defaults stand in, and
        their `options` are the recorded options)."""
        state = {"recorded_options": state.get("options"), **state}
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})

    @classmethod
    def read(cls, checkpoint: Path) -> RunState:
        """The state a checkpoint holds, checked first (`check_state`): a record is data, never trusted."""
        state = read_state(checkpoint)
        check_state(state, checkpoint / STATE_FILE)
        return cls.from_dict(state)



def options_recorded_in(state: dict) -> dict:
    """Every option a checkpoint's state (as read, unchecked) records, for `resume` to restore: its recorded
    options (`options` in older checkpoints, and only the `run_options` that define the run in older ones still)."""
    for key in ("recorded_options", "options", "run_options"):
        if state.get(key) is not None:
            return state[key]
    return {}


def check_state(state: dict, source: Path) -> None:
    """A ValueError naming `source` unless a checkpoint's state holds what `RunState` holds: counts, lists, one
    of ATTENTION_IMPLEMENTATIONS (transformers takes another name for a Hub kernel, which it downloads and runs),
    parts of a run (`part_problem`) and evaluations (RECORD_FIELDS) with every field the run reads of them."""
    if not isinstance(state, dict):
        raise BadInput(f"`resume`: {source} is damaged: it is not a JSON object")
    kinds = {"step": int, "epoch": int, "batches_done": int, "train_tokens": int, "evaluations_without_improvement": int,
             "history": list, "best": list, "parts": list, "run_options": (dict, type(None)),
             "recorded_options": (dict, type(None)), "options": (dict, type(None))}
    for name, kind in kinds.items():
        value = state.get(name)
        if name in state and (not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0)):
            raise BadInput(f"`resume`: {source} is damaged: its {name} is {value!r}")
    if not isinstance(state.get("step"), int):
        raise BadInput(f"`resume`: {source} is damaged: it records no step")
    if state.get("attn_implementation") not in (None, *ATTENTION_IMPLEMENTATIONS):
        raise BadInput(f"`resume`: {source} records the attention implementation {state['attn_implementation']!r}, "
                       f"not one of {', '.join(ATTENTION_IMPLEMENTATIONS)}; it is not used")
    for number, part in enumerate(state.get("parts", []), 1):
        problem = part_problem(part, state["step"])
        if problem:
            raise BadInput(f"`resume`: {source} is damaged: part {number} of its parts {problem}; got {part!r}")
    for name, record_fields in RECORD_FIELDS.items():
        for record in state.get(name, []):
            if not isinstance(record, dict) or any(
                    not holds(record[field]) if field in record else required
                    for field, (holds, required) in record_fields.items()):
                raise BadInput(f"`resume`: {source} is damaged: its {name} holds {record!r}, not the record of an "
                               "evaluation")


# A part of a run longer than this is an edited record, not one that trained: a year.
MAX_PART_SECONDS = 366 * 24 * 3600


def part_problem(part, step: int) -> str | None:
    """What is wrong with one part of a run as its checkpoint records it ({"steps": [first, last], "seconds"}), or
    None: the steps are counts up to the checkpoint's `step`, the seconds a finite, non-negative time."""
    if not isinstance(part, dict):
        return "is not a JSON object with steps and seconds"
    steps, seconds = part.get("steps"), part.get("seconds")
    if not (isinstance(steps, list) and len(steps) == 2 and all(map(_is_count, steps)) and steps[0] <= steps[1] <= step):
        return f"must have steps [first, last], counts with first <= last <= the checkpoint's step {step}"
    if not _is_time(seconds):
        return f"must have seconds, a number from 0 to {MAX_PART_SECONDS:,}"
    if "scoring_seconds" in part and not _is_time(part["scoring_seconds"]):  # older parts have none
        return f"must have scoring_seconds, a number from 0 to {MAX_PART_SECONDS:,}"
    return None


def _is_time(value) -> bool:
    return _is_number(value) and 0 <= value <= MAX_PART_SECONDS


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_text(value) -> bool:
    return isinstance(value, str)


def _is_score(value) -> bool:
    """A number as evaluation writes one: a perplexity may overflow to inf."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# What the run reads of each record in a checkpoint's lists of evaluations, as (test, whether every record has it):
# the fields that evaluation (`report`) and model selection (`record_validation`) write, read again at the end.
SCORES = ("loss", "nll", "perplexity", "bleu", "chrf", "repeating", "references_repeating", "seconds")
RECORD_FIELDS = {
    "history": {"step": (_is_count, True), "split": (_is_text, True), "final_weights": (_is_text, False),
                "translated": (_is_count, False), "pairs": (_is_count, False), "bleu_signature": (_is_text, False),
                "chrf_signature": (_is_text, False), **{name: (_is_score, False) for name in SCORES}},
    "best": {"step": (_is_count, True), "value": (_is_number, True), "metric": (lambda value: _is_text(value) and value in BEST_METRICS, False),
             "eval_samples": (lambda value: value is None or _is_count(value), False)},
}
