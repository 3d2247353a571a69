"""Checkpoints: written whole or not at all, the last K kept, the newest found, the last k averaged.

A checkpoint is a folder `checkpoint-<step>` holding Accelerate's `save_state` output
(model weights, optimiser, scheduler, gradient scaler, every process's RNG state) plus
`trainer_state.json` (step, epoch, position in the epoch, ...). It is written under a
temporary name and renamed when complete, so a process that dies while writing leaves
a `.tmp-*` folder that is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

__all__ = [
    "STATE_FILE",
    "average_checkpoints",
    "checkpoint_path",
    "list_checkpoints",
    "latest_checkpoint",
    "read_state",
    "save_checkpoint",
]

STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"  # what Accelerate's save_state names the (first) model
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"checkpoint-{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def read_state(checkpoint: str | os.PathLike) -> dict:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def save_checkpoint(accelerator, root: str | os.PathLike, step: int, state: dict, keep: int | None = None) -> Path:
    """Save the full training state of every process as `root/checkpoint-<step>`, then keep the newest `keep`.

    Call on every process (each saves its own RNG state); the main process renames and prunes.
    """
    root = Path(root)
    final = checkpoint_path(root, step)
    staging = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)  # left over from a run that died while saving
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (staging / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
        if final.exists():  # the same step saved again (e.g. a resumed run that was already finished)
            shutil.rmtree(final)
        os.rename(staging, final)  # atomic: the checkpoint appears complete or not at all
        if keep is not None:
            for old in list_checkpoints(root)[:-keep]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def average_checkpoints(checkpoints: list[str | os.PathLike]) -> dict[str, torch.Tensor]:
    """§6.1: the element-wise mean of the model weights of `checkpoints` (the paper averages the last 5).

    Sums in float64 so that the mean does not depend on the order; returns the weights'
    own dtypes.
    """
    if not checkpoints:
        raise ValueError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for path in checkpoints:
        weights = load_file(str(Path(path) / WEIGHTS_FILE))
        if total and weights.keys() != total.keys():
            raise ValueError(f"{path} holds different weights from the other checkpoints; cannot average them")
        for name, tensor in weights.items():
            total[name] = total.get(name, 0) + tensor.double()
    reference = load_file(str(Path(checkpoints[-1]) / WEIGHTS_FILE))
    return {name: (tensor / len(checkpoints)).to(reference[name].dtype) for name, tensor in total.items()}
