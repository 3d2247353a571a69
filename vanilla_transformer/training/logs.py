"""What a run logs: the losses summed on the device between two log lines (`Losses`), and the log that
lasts, one JSON record a line in `output_dir/training_log.jsonl` across resumes (`TrainingLog`).

Every `log_steps` the training numbers ({"step", "loss", "nll", "lr", "tokens_per_second", "elapsed"}) and
every evaluation's scores ({"step", "split", ...}) are appended, each line in one write, so a killed run
leaves whole lines only (a torn last line is dropped when the log is opened again). A resumed run
trains again the steps after its checkpoint: their records go, so that every step is logged once.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ..staging import write_file_whole
from .checkpoints import latest_checkpoint

__all__ = ["LOG_FILE", "Losses", "TrainingLog", "read_log"]

LOG_FILE = "training_log.jsonl"


def read_log(path: str | os.PathLike) -> list[dict]:
    """The whole records of a log (a torn last line, from a run killed while writing it, is left out)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.endswith("\n"):
            records.append(json.loads(line))
    return records


class TrainingLog:
    """Appends records to `folder/training_log.jsonl`; `enabled` False (the processes other than the main one) does nothing."""

    def __init__(self, folder: str | os.PathLike, resumed_step: int | None, enabled: bool = True):
        self.path = Path(folder) / LOG_FILE
        self.enabled = enabled
        if not enabled:
            return
        kept = [r for r in read_log(self.path) if resumed_step is not None and r.get("step", 0) <= resumed_step]
        if self.path.exists() or kept:  # rewritten whole under another name, then renamed: never half written
            write_file_whole(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def append(self, record: dict) -> None:
        if not self.enabled:
            return
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write of one line: readers see it whole or not at all
        finally:
            os.close(fd)


class Losses:
    """The label-smoothed loss and the NLL summed on the device since the last read, with the target tokens they
    cover and the first step that was not finite (`NonFiniteGuard` records it)."""

    def __init__(self, accelerator, checkpoint_root: Path):
        self.accelerator, self.checkpoint_root = accelerator, Path(checkpoint_root)
        self.sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss, nll, first bad step
        self.tokens = 0

    def add(self, loss: torch.Tensor, nll: torch.Tensor | None = None) -> None:
        """Sum a step's loss and NLL on the device (a micro-batch's loss alone, when it stops the run)."""
        self.sums[0] += loss
        if nll is not None:
            self.sums[1] += nll

    def add_tokens(self, tokens: int) -> None:
        """Count a step's target tokens over all processes, once the host has them (after the update)."""
        self.tokens += tokens

    def mark_bad(self, bad: torch.Tensor, step: int) -> None:
        """Record step `step + 1` as not finite where `bad` (a device bool) is true and no earlier step was."""
        self.sums[2] = torch.where(bad & (self.sums[2] == 0), step + 1, self.sums[2])

    def check_finite(self, step: int) -> None:
        """FloatingPointError when a step since the last read was not finite (`step` is the run's); the sums stay for
        the next read. Before every checkpoint, so that none holds the weights after such a step."""
        self._gathered(step)

    def read(self, step: int) -> tuple[float, float]:
        """The loss and NLL per target token over all processes since the last read (the one wait for the device
        that logging costs), or FloatingPointError when a step since then was not finite; `step` is the run's."""
        loss, nll = self._gathered(step)
        tokens = max(self.tokens, 1)
        self.sums.zero_()
        self.tokens = 0
        return loss / tokens, nll / tokens

    def _gathered(self, step: int) -> tuple[float, float]:
        """The loss and NLL summed over all processes since the last read; FloatingPointError after a step that was
        not finite."""
        sums = self.accelerator.gather(self.sums.unsqueeze(0))  # (processes, 3)
        loss, nll = sums[:, :2].sum(0).tolist()
        bad_steps = [int(bad) for bad in sums[:, 2].tolist() if bad]
        if bad_steps:
            good = latest_checkpoint(self.checkpoint_root)
            raise FloatingPointError(
                f"the training loss became {loss if not math.isfinite(loss) else 'finite but its gradients not'} at "
                f"step {min(bad_steps)}; that step left the weights as they were, and the run stopped at step {step} "
                f"before saving. The last good checkpoint is {good or '(none: no checkpoint was written yet)'}. Try a "
                "lower `lr_scale`, a longer `warmup_steps`, `max_grad_norm`, or mixed_precision 'no'/'bf16'."
            )
        return loss, nll
