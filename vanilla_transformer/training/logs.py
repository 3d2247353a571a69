"""The run's log that lasts: one JSON record a line in `output_dir/training_log.jsonl`, across resumes.

Every `log_steps` the training numbers ({"step", "loss", "nll", "lr", "tokens_per_second", "elapsed"}) and
every evaluation's scores ({"step", "split", ...}) are appended, each line in one write, so a killed run
leaves whole lines only (a torn last line is dropped when the log is opened again). A resumed run
trains again the steps after its checkpoint: their records go, so that every step is logged once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..staging import STAGING_PREFIX

__all__ = ["LOG_FILE", "TrainingLog", "read_log"]

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
            staging = self.path.with_name(STAGING_PREFIX + self.path.name)
            staging.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            os.replace(staging, self.path)

    def append(self, record: dict) -> None:
        if not self.enabled:
            return
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write of one line: readers see it whole or not at all
        finally:
            os.close(fd)
