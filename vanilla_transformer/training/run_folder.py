"""The run's folder: one run per folder, what a new run may write there, and what a run that filled the disk kept.

`output_dir` holds the finished model (a Hub folder, hub.py) and `output_dir/checkpoints/`, the run's
checkpoints (checkpoints.py). A run takes the folder's lock and sweeps what a run killed while saving
left behind (`take_folder`). A new run refuses a folder that holds an earlier run, a finished model, a card or a
file it would write over (`check_new_folder`); resuming one is resume.py's. A run that fills the disk says what it
kept (`explain_disk_full`).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from ..checks.files import read_json
from ..hub import DESCRIPTION_FILES
from ..staging import FULL_DISK_ERRNOS, DiskFull, sweep_staging
from .checkpoints import checkpoint_name, latest_checkpoint, list_checkpoints, read_state
from .lock import RunLock

__all__ = [
    "ADAPTER_DIR", "CHECKPOINTS", "MODEL_FILES", "TOKENIZER_OPTIONS", "check_new_folder", "explain_disk_full",
    "take_folder",
]

CHECKPOINTS = "checkpoints"  # sub-folder of output_dir; the rest of output_dir is the Hub folder (hub.py)
ADAPTER_DIR = "adapter"  # where a LoRA run keeps PEFT's adapter, beside the merged model
TOKENIZER_OPTIONS = "tokenizer_options.json"  # in CHECKPOINTS: what the run's own tokenizer was trained from
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")  # a saved model


def take_folder(lock: RunLock) -> None:
    """Lock the run's folder, then remove what a run killed while saving left in it."""
    lock.acquire()
    for folder in (lock.folder, lock.folder / CHECKPOINTS):
        sweep_staging(folder)


def check_new_folder(output_dir: str, checkpoint_root: Path, lora_rank: int | None) -> None:
    """Without `resume`: refuse an `output_dir` that holds an earlier run, a finished model, a card or a file the run
    would write over (a LoRA run, of `lora_rank`, writes its adapter too)."""
    if list_checkpoints(checkpoint_root):
        raise BadInput(
            f"{output_dir} holds checkpoints of an earlier run; pass `resume` to continue it, or pick a new `output_dir`"
        )
    model_files = [name for name in MODEL_FILES if (Path(output_dir) / name).exists()]
    if model_files:  # a finished model (from the Hub, or a run whose checkpoints were removed): never replaced
        raise BadInput(
            f"{output_dir} holds a model ({', '.join(model_files)}) that a new run would replace; pass `resume` "
            f"to continue its run (it needs its {CHECKPOINTS}/ folder), `model_name_or_path {output_dir}` "
            "to fine-tune it into another `output_dir`, or pick another `output_dir`"
        )
    cards = [name for name in DESCRIPTION_FILES if (Path(output_dir) / name).exists()]
    if cards:  # not this run's: the finished model's card and scores would replace them
        raise BadInput(f"{output_dir} holds {', '.join(cards)}, which the finished model's card and scores would "
                       "replace; pick another `output_dir`, or move them")
    check_nothing_to_replace(Path(output_dir), lora_rank)


def check_nothing_to_replace(folder: Path, lora_rank: int | None) -> None:
    """A new run refuses a folder holding a path it would write over or delete: the model's code and settings, its
    log, the weights of another layout, a LoRA run's `adapter/`, a tokenizer's settings without its tokenizer.json,
    in `checkpoints/` a checkpoint's name or records other than those of a run that stopped before its first
    checkpoint (whose tokenizer and log are this folder's own, used or kept)."""
    from ..hub import STALE_WEIGHTS
    from ..modeling.saving import CODE_FILES
    from .logs import LOG_FILE

    started = _run_record(folder / CHECKPOINTS / "config.json")  # a run of this folder got as far as its model
    written = [*CODE_FILES, "generation_config.json", *([] if started else [LOG_FILE]),
               *([ADAPTER_DIR] if lora_rank is not None else []),
               *([] if (folder / "tokenizer.json").is_file() else ["tokenizer_config.json", "special_tokens_map.json"])]
    found = [name for name in written if (folder / name).exists() or (folder / name).is_symlink()]
    found += sorted(entry.name for entry in folder.iterdir() if STALE_WEIGHTS.match(entry.name))
    found += _not_run_records(folder / CHECKPOINTS)
    found = [f"{name}/" if (folder / name).is_dir() else name for name in found]
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise BadInput(f"{folder} holds {', '.join(found[:3])}{more}, which a new run would write over or delete; "
                       "pick another `output_dir`, or move them")


def _not_run_records(checkpoints: Path) -> list[str]:
    """What in `checkpoints/` a run would write over and did not write: a folder named as a checkpoint (an incomplete
    one: complete ones are an earlier run's), or a config or tokenizer record that is not a run's. Other names a
    run never touches."""
    if not checkpoints.is_dir():
        return []
    return sorted(f"{CHECKPOINTS}/{entry.name}" for entry in checkpoints.iterdir()
                  if checkpoint_name(entry.name) is not None
                  or (entry.name in ("config.json", TOKENIZER_OPTIONS) and not _run_record(entry)))


def _run_record(path: Path) -> bool:
    """Whether `path` is a JSON object a run wrote (a model's config names its `model_type`)."""
    try:
        record = read_json(path) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and (path.name != "config.json" or "model_type" in record)


def explain_disk_full(err: OSError, output_dir: str) -> DiskFull | None:
    """A full disk or quota as one DiskFull that says what the run kept and how to go on; None for another error."""
    if err.errno not in FULL_DISK_ERRNOS:
        return None
    named = str(err) if isinstance(err, DiskFull) else f"could not write {err.filename or 'a file'}: {FULL_DISK_ERRNOS[err.errno]}"
    return DiskFull(f"{named}; {_what_was_saved(output_dir)}", err.errno)


def _what_was_saved(output_dir: str) -> str:
    """What a run that could not save has kept, and how to go on."""
    checkpoint = latest_checkpoint(Path(output_dir) / CHECKPOINTS)
    if checkpoint is None:
        return "no checkpoint was saved; free some space, then run the same command again"
    return (f"the newest complete checkpoint is {checkpoint} (step {read_state(checkpoint)['step']}); free some "
            "space, then run the same command with --resume to continue")
