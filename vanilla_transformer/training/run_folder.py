"""The run's folder and its record: one run per folder, and what a checkpoint holds besides the weights.

`output_dir` holds the finished model (a Hub folder, hub.py) and `output_dir/checkpoints/`, the run's
checkpoints (checkpoints.py). A run takes the folder's lock and sweeps what a run killed while saving
left behind (`take_folder`). A checkpoint holds a `RunState`, which only its own methods change. A run that
fills the disk says what it kept (`explain_disk_full`). What a folder's records say and whether a run resumes or
starts there is resume.py's, when the steps end budget.py's, the stop signals signals.py's.
"""

from __future__ import annotations

import errno
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from ..staging import DiskFull, sweep_staging
from .checkpoints import latest_checkpoint, read_state
from .lock import RunLock

__all__ = [
    "ADAPTER_DIR", "CHECKPOINTS", "MODEL_FILES", "RunState", "TOKENIZER_OPTIONS", "explain_disk_full", "on_main",
    "take_folder",
]

CHECKPOINTS = "checkpoints"  # sub-folder of output_dir; the rest of output_dir is the Hub folder (hub.py)
ADAPTER_DIR = "adapter"  # where a LoRA run keeps PEFT's adapter, beside the merged model
TOKENIZER_OPTIONS = "tokenizer_options.json"  # in CHECKPOINTS: what the run's own tokenizer was trained from
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")  # a saved model


@dataclass
class RunState:
    """What a checkpoint holds besides the weights, optimiser, schedule and RNG states (its trainer_state.json)."""

    step: int = 0  # optimiser steps done
    epoch: int = 0
    batches_done: int = 0  # batches of `epoch` done on each process
    train_tokens: int = 0  # target tokens trained on, over all processes
    history: list = field(default_factory=list)  # every evaluation's scores
    attn_implementation: str | None = None  # the kernel chosen on the first batch: a resumed run computes alike
    run_options: dict | None = None  # the options that define the run (`check_same_run`)
    options: dict | None = None  # every option the run was started with: `resume` alone restores them
    best: list = field(default_factory=list)  # model selection's best validations, best first (selection.py)
    evaluations_without_improvement: int = 0  # towards `patience`
    # The run's parts up to this step, the first session and each resume: {"steps": [first, last], "seconds"} of
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

    def record_attention(self, implementation: str) -> None:
        """The attention implementation the first batch was trained with, which a resumed run computes with too."""
        self.attn_implementation = implementation

    def record_selection(self, best: list, evaluations_without_improvement: int) -> None:
        """Model selection's best validations, best first, and its count towards `patience` (selection.py)."""
        self.best, self.evaluations_without_improvement = best, evaluations_without_improvement

    def record_options(self, typed: dict) -> None:
        """The options typed with `resume` over the recorded ones, so that the next `resume` keeps them (a checkpoint
        from before runs recorded their options keeps none)."""
        if self.options is not None:
            self.options = {**self.options, **typed}

    def begin_part(self) -> float:
        """A new part of the run from this step (its first session, or a resume); the seconds of the parts before."""
        before = sum(part["seconds"] for part in self.parts)
        self.parts.append({"steps": [self.step, self.step], "seconds": 0.0, "scoring_seconds": 0.0})
        return before

    def end_part(self, seconds: float, scoring: float = 0.0) -> None:
        """The current part as of this step: `seconds` of training so far, and `scoring` of validation."""
        self.parts[-1] = {"steps": [self.parts[-1]["steps"][0], self.step], "seconds": round(seconds, 2),
                          "scoring_seconds": round(scoring, 2)}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict) -> RunState:
        """From a checkpoint's state, older ones included (they may lack the newer keys: defaults stand in)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


def take_folder(lock: RunLock) -> None:
    """Lock the run's folder, then remove what a run killed while saving left in it."""
    lock.acquire()
    for folder in (lock.folder, lock.folder / CHECKPOINTS):
        sweep_staging(folder)


def on_main(accelerator, decide) -> int | None:
    """Run `decide()`, which returns an int or None, on the main process only, before the other processes
    can race it; every process gets the answer, or stops with the main process's error."""
    answer, error = None, None
    if accelerator.is_main_process:
        try:
            answer = decide()
        except Exception as err:
            error = err
    # [failed, answer] as a tensor reduction, as the step's own (torch's broadcast_object_list left the gloo
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


def explain_disk_full(err: OSError, output_dir: str) -> DiskFull | None:
    """A full disk or quota as one DiskFull that says what the run kept and how to go on; None for another error."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    named = str(err) if isinstance(err, DiskFull) else f"could not write {err.filename or 'a file'}: {os.strerror(err.errno).lower()}"
    return DiskFull(f"{named}; {_what_was_saved(output_dir)}", err.errno)


def _what_was_saved(output_dir: str) -> str:
    """What a run that could not save has kept, and how to go on."""
    checkpoint = latest_checkpoint(Path(output_dir) / CHECKPOINTS)
    if checkpoint is None:
        return "no checkpoint was saved; free some space, then run the same command again"
    return (f"the newest complete checkpoint is {checkpoint} (step {read_state(checkpoint)['step']}); free some "
            "space, then run the same command with --resume to continue")
