"""Checkpoints: written whole or not at all, the last K kept, the newest found, the last k averaged; and the moving
average of the weights that a run keeps beside them (`WeightAverage`).

A checkpoint is a folder `checkpoint-<step>` holding Accelerate's `save_state` output
(model weights, optimiser, scheduler, gradient scaler, every process's RNG state) plus
`trainer_state.json` (step, epoch, position in the epoch, ...). It is written under a
staging name (`.vanilla-transformer-staging-checkpoint-<step>`, swept by the next run) and renamed
when complete, so a process that dies while writing leaves nothing that is taken for a checkpoint.
A full disk is raised as `DiskFull` naming the file that did not fit, with nothing half written left.

A checkpoint is verified before it is read (`verify_checkpoint`): a file damaged after it was
written (a copy cut short, a full disk elsewhere, a bad sector) is named, and `newest_sound_checkpoint`
lets a resumed run fall back to the newest checkpoint that is whole. Accelerate unpickles the
`custom_checkpoint_*.pkl` files of registered objects (the schedule, the weight average) with
`weights_only=False`, which runs whatever code a crafted file holds, and the others (optimiser, RNG
states, ...) with `weights_only=True`, which refuses a crafted one with a traceback; `verify_checkpoint`
reads every pickle-bearing file first with `weights_only=True`, so a checkpoint someone hands you is
refused in one line and set aside, never executed.

`save_state` writes the model and optimiser in the layout of the engine that trained them, and each is
read (verified, resumed from, averaged) in its own layout (`LAYOUTS`):

- DDP or one process: `model.safetensors` and `optimizer.bin`;
- FSDP with FULL_STATE_DICT (accelerate_configs/fsdp_8gpu.yaml): `pytorch_model_fsdp.bin` (the whole
  model, gathered by the main process) and `optimizer.bin`;
- DeepSpeed: `pytorch_model/` holding `mp_rank_00_model_states.pt` (the model under `module`) and each
  process's `*optim_states.pt`, with the file `latest` naming the folder. DeepSpeed reads them with
  `weights_only=False`; each is read first with `weights_only=True` allowing only DeepSpeed's own
  data classes (`DEEPSPEED_CLASSES`, read as an inert `_StandIn`), so a crafted file is refused here
  too. Torch's safe reader takes the pickle protocol torch.save writes (2): a file of another protocol
  cannot be checked, and is refused as unreadable.

FSDP's SHARDED_STATE_DICT (`pytorch_model_fsdp_0/`, torch.distributed.checkpoint) is refused: torch
reads its `.metadata` with `pickle.load`, which would run code from a checkpoint someone hands you.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from accelerate.logging import get_logger
from safetensors.torch import load_file

from ..errors import BadInput
from ..checks.files import check_plain_pickle, check_weights_file, read_json
from ..staging import STAGING_PREFIX, disk_full_error, publish_files, publish_folder, set_aside, write_file_whole
from .distributed import on_main

__all__ = [
    "STATE_FILE",
    "WeightAverage",
    "average_checkpoints",
    "checkpoint_layout",
    "checkpoint_step",
    "checkpoint_path",
    "checkpoint_weights",
    "drop_tied_copies",
    "latest_checkpoint",
    "list_checkpoints",
    "newest_sound_checkpoint",
    "read_state",
    "save_checkpoint",
    "save_run_config",
    "verify_checkpoint",
]

RUN_CONFIG = "config.json"  # checkpoints/config.json: the architecture a resumed run is built from
STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"  # what Accelerate's save_state names the (first) model
OPTIMIZER_FILE = "optimizer.bin"
FSDP_WEIGHTS_FILE = "pytorch_model_fsdp.bin"  # FSDP's FULL_STATE_DICT
FSDP_SHARDED_FOLDER = "pytorch_model_fsdp_0"  # FSDP's SHARDED_STATE_DICT (torch.distributed.checkpoint)
DEEPSPEED_FOLDER = "pytorch_model"  # DeepSpeed's checkpoint tag under Accelerate; the file `latest` names it
DEEPSPEED_WEIGHTS_FILE = f"{DEEPSPEED_FOLDER}/mp_rank_00_model_states.pt"
# What each layout's model weights and optimiser state are (the optimiser's, under DeepSpeed, are in its folder).
LAYOUTS = {
    "DDP": (WEIGHTS_FILE, OPTIMIZER_FILE),
    "FSDP": (FSDP_WEIGHTS_FILE, OPTIMIZER_FILE),
    "DEEPSPEED": (DEEPSPEED_WEIGHTS_FILE, "latest"),
}
# The classes DeepSpeed's checkpoint files hold besides tensors and plain values: data, no code of the file's.
DEEPSPEED_CLASSES = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
})
CUSTOM_STATE_PREFIX = "custom_checkpoint_"  # Accelerate's pickles of objects given to register_for_checkpointing
DAMAGED_PREFIX = "damaged-"  # a checkpoint set aside by `newest_sound_checkpoint`
_NAME = re.compile(r"^checkpoint-(\d+)$")

logger = get_logger(__name__)


def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"checkpoint-{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step a checkpoint's folder name gives (checkpoint-00000042: 42), or None for another name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


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
    return read_json(Path(checkpoint) / STATE_FILE)


def checkpoint_layout(checkpoint: str | os.PathLike) -> str:
    """Which engine's layout the checkpoint's model is saved in: a key of LAYOUTS; ValueError when none."""
    checkpoint = Path(checkpoint)
    if (checkpoint / FSDP_SHARDED_FOLDER).is_dir():
        raise BadInput(
            f"{checkpoint / FSDP_SHARDED_FOLDER} is an FSDP SHARDED_STATE_DICT checkpoint, which is not read: torch reads "
            "its .metadata with pickle, which could run code from the file. Train FSDP with fsdp_state_dict_type "
            "FULL_STATE_DICT (accelerate_configs/fsdp_8gpu.yaml)"
        )
    for layout, (weights, _) in LAYOUTS.items():
        if (checkpoint / weights).is_file():
            return layout
    raise BadInput(f"{checkpoint} holds no model weights ({', '.join(weights for weights, _ in LAYOUTS.values())} are missing)")


def verify_checkpoint(checkpoint: str | os.PathLike) -> None:
    """Raise ValueError naming the file unless every file of the checkpoint reads back whole: the state
    (JSON, with the step of the folder's name), the weights and optimiser in their engine's layout
    (LAYOUTS), and every torch.save file (optimiser, scheduler, RNG states: zip archives whose CRCs are
    checked, read as tensors and plain values without running anything from them)."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / STATE_FILE).is_file():
        raise BadInput(f"{checkpoint / STATE_FILE} is missing")
    layout = checkpoint_layout(checkpoint)
    for name in LAYOUTS[layout]:
        if not (checkpoint / name).is_file():
            raise BadInput(f"{checkpoint / name} is missing")
    state = read_state(checkpoint)
    step = int(_NAME.match(checkpoint.name).group(1))
    if not isinstance(state, dict) or state.get("step") != step:
        raise BadInput(f"{checkpoint / STATE_FILE} is damaged: it does not hold the state of step {step}")
    for path in sorted(checkpoint.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".pkl", ".pt"):
            check_weights_file(path)
        if path.name.startswith(CUSTOM_STATE_PREFIX) and path.suffix == ".pkl":
            check_plain_pickle(path)  # Accelerate reads these with weights_only=False: plain values alone
        elif path.suffix in (".bin", ".pkl", ".pt"):
            check_plain_pickle(path, accelerate_safe_globals())  # what Accelerate's own reading allows
    if layout == "DEEPSPEED":
        _verify_deepspeed_files(checkpoint)


def accelerate_safe_globals() -> list:
    """The classes Accelerate reads besides tensors and plain values (numpy arrays, in the RNG states)."""
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    return list(TORCH_SAFE_GLOBALS)


class _StandIn:
    """What a DeepSpeed data class is read as while its file is checked: it takes any state and runs nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


DEEPSPEED_STAND_INS = [(_StandIn, name) for name in sorted(DEEPSPEED_CLASSES)]  # for torch's safe_globals


def _verify_deepspeed_files(checkpoint: Path) -> None:
    """DeepSpeed's folder: `latest` names it, and each of its files is whole and holds only tensors, plain values
    and DEEPSPEED_CLASSES (DeepSpeed unpickles them with weights_only=False)."""
    tag = (checkpoint / "latest").read_text().strip()
    if tag != DEEPSPEED_FOLDER:
        raise BadInput(f"{checkpoint / 'latest'} names {tag!r}, not this checkpoint's {DEEPSPEED_FOLDER!r}")
    files = sorted((checkpoint / DEEPSPEED_FOLDER).glob("*.pt"))
    if not any(path.name.endswith("optim_states.pt") for path in files):
        raise BadInput(f"{checkpoint / DEEPSPEED_FOLDER} holds no optimiser states (*optim_states.pt)")
    for path in files:
        check_weights_file(path)
        check_plain_pickle(path, DEEPSPEED_STAND_INS)


def newest_sound_checkpoint(root: str | os.PathLike) -> tuple[Path, list[str]]:
    """The newest checkpoint that verifies, and what is wrong with each newer one. Those are renamed
    `damaged-checkpoint-<step>` (kept for a look; never read, pruned or averaged). A ValueError lists
    every problem when no checkpoint verifies, and then nothing is renamed."""
    problems = []
    for checkpoint in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(checkpoint)
        except ValueError as err:
            problems.append((checkpoint, str(err)))
            continue
        messages = []
        for damaged, problem in problems:
            aside = set_aside(damaged, DAMAGED_PREFIX + damaged.name)
            messages.append(f"{problem}; the checkpoint is set aside as {aside.name}")
        return checkpoint, messages
    raise BadInput(
        f"no checkpoint in {root} can be read: {'; '.join(problem for _, problem in problems) or 'there are none'}. "
        "Restore the checkpoints from a copy, or train from the start in a new output folder."
    )


def drop_tied_copies(models, weights: list[dict], output_dir=None) -> None:
    """Accelerate's save_state pre-hook: each model's state dict without the copies of tied weights (the
    embeddings and output projection that share the source embeddings, §3.4), which transformers ties again on
    loading. safetensors then has no alias to remove, and Accelerate no "Removed shared tensor" to warn of;
    a weight shared by hand, which nothing ties again, is still removed with the warning. Under PEFT
    (a LoRA run) the names carry its prefix ("base_model.model."), found by their tied names' ends."""
    for model, state_dict in zip(models, weights):
        unwrapped = getattr(model, "module", model)  # DDP's wrapper; FSDP and DeepSpeed save no state dict here
        base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
        for copy, source in dict(getattr(base, "all_tied_weights_keys", None) or {}).items():
            for name in [name for name in state_dict if name == copy or name.endswith("." + copy)]:
                kept = state_dict.get(name[: len(name) - len(copy)] + source)
                if kept is not None and kept.data_ptr() == state_dict[name].data_ptr():
                    del state_dict[name]


def save_run_config(config, root: str | os.PathLike) -> None:
    """The run's model config in `root` (its checkpoints/), written whole: a resumed run is built from it."""
    write_file_whole(Path(root) / RUN_CONFIG, config.to_json_string())


def save_checkpoint(accelerator, root: str | os.PathLike, step: int, state: dict,
                    keep_checkpoints: int | None = None, protect=()) -> Path:
    """Save the full training state of every process as `root/checkpoint-<step>`, then keep the newest
    `keep_checkpoints` and those of the steps in `protect`.

    Call on every process (each saves its own RNG state); the main process renames and prunes, and where that fails
    (a full disk, the folder's lock lost) every process stops with it (`on_main`), none left waiting for it.
    """
    root = Path(root)
    final = checkpoint_path(root, step)
    staging = root / f"{STAGING_PREFIX}{final.name}"

    def make_staging():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left over from a run that died while saving
        staging.mkdir()

    def publish():
        (staging / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
        publish_files(staging)
        # by one rename: the checkpoint appears complete or not at all (the same step saved before goes first)
        publish_folder(staging, final)
        if keep_checkpoints is not None:
            _prune(root, keep_checkpoints, {checkpoint_path(root, s) for s in protect})

    hook = accelerator.register_save_state_pre_hook(drop_tied_copies)
    try:
        on_main(accelerator, make_staging, f"save {final.name}")
        accelerator.save_state(str(staging))
        accelerator.wait_for_everyone()  # every process's files are in the folder before it is published
        on_main(accelerator, publish, f"save {final.name}")
    except Exception as err:
        full = disk_full_error(err, staging, final)
        if accelerator.is_main_process:  # the staging folder is the main process's: the others never remove it
            shutil.rmtree(staging, ignore_errors=True)
        if full is None:
            raise
        raise full from None
    finally:
        hook.remove()
    return final


def _prune(root: Path, keep_checkpoints: int, kept: set[Path]) -> None:
    """Remove all but the newest `keep_checkpoints` checkpoints in `root`, and those `kept`."""
    for old in list_checkpoints(root)[:-keep_checkpoints]:
        if old.is_symlink():  # a copy elsewhere, linked in: not this run's to delete
            logger.warning(f"{old} is a link to {old.resolve()}: not pruned, left alone")
        elif old not in kept:
            shutil.rmtree(old)


def average_checkpoints(checkpoints: list[str | os.PathLike]) -> dict[str, torch.Tensor]:
    """§6.1: the element-wise mean of the model weights of `checkpoints` (the paper averages the last 5).

    Sums in float64 so that the mean does not depend on the order; returns the weights'
    own dtypes.
    """
    if not checkpoints:
        raise BadInput("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for path in checkpoints:
        weights = checkpoint_weights(path)
        # Shapes too: a sum of tensors of other shapes would broadcast, not fail.
        if total and {n: t.shape for n, t in weights.items()} != {n: t.shape for n, t in total.items()}:
            raise BadInput(f"{path} holds different weights (names or shapes) from the other checkpoints; cannot "
                           "average them")
        for name, tensor in weights.items():
            total[name] = total.get(name, 0) + tensor.double()
    return {name: (tensor / len(checkpoints)).to(weights[name].dtype) for name, tensor in total.items()}


def checkpoint_weights(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint, in whichever layout it was saved (LAYOUTS), as one state dict."""
    layout = checkpoint_layout(checkpoint)
    path = Path(checkpoint) / LAYOUTS[layout][0]
    check_weights_file(path)
    if layout == "DDP":
        return load_file(str(path))
    weights = check_plain_pickle(path, DEEPSPEED_STAND_INS if layout == "DEEPSPEED" else ())
    return weights["module"] if layout == "DEEPSPEED" else weights



class WeightAverage:
    """An exponential moving average of the weights (Polyak averaging), kept beside training: the average of a model's
    floating-point parameters, in float32, updated after each optimiser step.

    Not in the paper, whose §6.1 averages the last checkpoints of a 100k-step run instead. A run of a few minutes has
    no good old checkpoints to average; the average of every step, old steps weighing less, smooths the last updates'
    noise the same way. `decay` says how fast old steps are forgotten (0.999: over about 1,000 steps); early on it is
    lowered to (1 + n) / (10 + n) after n updates, so that the random initial weights are forgotten fast
    (tensor2tensor's and TensorFlow's rule). The averaged weights become the final model only when they score better
    on validation (finish.py's `_compare_weight_average`).

    It holds no module, only tensors: `state_dict` and `load_state_dict` let Accelerate checkpoint it,
    and `copy_to(model)` puts the averaged weights into a model of the same shape.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0 < decay < 1:
            raise BadInput(f"`decay` must be in (0, 1), e.g. 0.999; got {decay!r}.")
        self.decay = decay
        self.updates = 0
        self.names = [name for name, _ in self._parameters(model)]
        self.average = [p.detach().float().clone() for _, p in self._parameters(model)]

    @staticmethod
    def _parameters(model: torch.nn.Module):
        return [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]  # in self.names' order

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        """average += (1 - decay) * (weights - average); named as torch's `AveragedModel` names it."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for (_, p), average in zip(self._parameters(model), self.average):
            average.lerp_(p.detach().float(), 1.0 - decay)

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        for (_, p), average in zip(self._parameters(model), self.average):
            p.copy_(average.to(p.dtype))

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "average": dict(zip(self.names, self.average))}

    def load_state_dict(self, state: dict) -> None:
        saved = [(name, tuple(tensor.shape)) for name, tensor in state["average"].items()]
        if saved != [(name, tuple(average.shape)) for name, average in zip(self.names, self.average)]:
            # Shapes too: copying a tensor of another shape would broadcast, not fail.
            raise BadInput("the saved weight average does not fit this model: its parameters differ")
        self.updates = state["updates"]
        for average, saved in zip(self.average, state["average"].values()):
            average.copy_(saved)
