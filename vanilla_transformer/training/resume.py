"""Resuming a run or starting one: what a run's folder records, and the policy that continues a run as it was started.

A new run refuses a folder that holds an earlier run, a finished model, a card or a file it would write over
(`check_new_folder`). `resume` continues the newest checkpoint that reads back whole (`resume_step`), with the
options the run was started with (`restore_options`), refusing one that would change what the run trains
(`check_same_run`); a run whose budget is spent and whose final folder is saved has nothing to do (`finished_step`).
A checkpoint's records are data, checked before they are used (`check_state`, `check_run_config`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, fields
from pathlib import Path

from accelerate.logging import get_logger

from ..file_checks import read_json
from ..hub import DESCRIPTION_FILES, RESULTS_FILE
from .arguments import (
    ATTENTION_IMPLEMENTATIONS,
    FOLDER_TRACKERS,
    NEVER_RESTORED,
    RUN_OPTIONS,
    TrainArguments,
    check_option,
)
from .budget import Budget
from .checkpoints import (
    STATE_FILE,
    WEIGHTS_FILE,
    checkpoint_layout,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    newest_sound_checkpoint,
    read_state,
)
from .run_folder import ADAPTER_DIR, CHECKPOINTS, MODEL_FILES, TOKENIZER_OPTIONS, RunState

__all__ = [
    "BUDGET_OPTIONS", "check_new_folder", "check_nothing_to_replace", "check_run_config", "check_same_run", "check_state",
    "finished_step", "recorded_options", "restore_options", "resume_budget", "resume_step", "run_options",
]

logger = get_logger(__name__)


BUDGET_OPTIONS = ("max_steps", "num_epochs", "time_limit")  # the run's limits, which a resume may extend


def finished_step(args: TrainArguments) -> int | None:
    """`resume` of a run whose budget is spent and whose final model and results.json are those of its newest
    checkpoint, with no option but its limits given otherwise: nothing to train, score or save. Says so in one
    line and returns the step; else None (a run whose final folder is not there yet is finished by `train`)."""
    checkpoint = latest_checkpoint(Path(args.output_dir) / CHECKPOINTS)
    try:
        recorded = read_state(checkpoint) if checkpoint is not None else None
        results = read_json(Path(args.output_dir) / RESULTS_FILE)
        if recorded is not None:
            check_state(recorded, checkpoint / STATE_FILE)  # else `resume_step` names what is wrong
        state = RunState.from_dict(recorded) if recorded is not None else None
    except (OSError, ValueError, AttributeError):  # damaged or missing: `train` says what, or writes them
        return None
    if state is None or not isinstance(results, dict) or results.get("steps") != state.step:
        return None
    if results.get("not_scored"):  # the final scoring was stopped: `train` scores what is missing
        return None
    given = recorded_options(args)  # another option given with `resume` is refused, or applied, by `train`
    if any(given.get(name) != value for name, value in (state.options or {}).items()
           if name not in BUDGET_OPTIONS and name not in NEVER_RESTORED):
        return None
    budget = Budget(args.max_steps, args.num_epochs, args.time_limit, progress=state,
                    before=sum(part["seconds"] for part in state.parts))
    stopped_early = args.patience is not None and state.evaluations_without_improvement >= args.patience
    if not (budget.spent(state.step) or budget.epochs_done() or stopped_early):
        return None
    done = f"{budget.describe()}{'; stopped early by `patience`' * stopped_early}"
    logger.info(f"`resume`: the run in {args.output_dir} is done ({done}); its model and "
                f"{RESULTS_FILE} are saved. Nothing to do: give a larger `max_steps`, `time_limit` or `num_epochs` "
                "to train on")
    return state.step


def resume_budget(args: TrainArguments, state: RunState, budget: Budget) -> None:
    """Say where a resumed run stands against its budget, and which limits typed with `resume` replace the
    recorded ones (every option typed with `resume` is recorded in turn: `RunState.record_options`)."""
    earlier = ", ".join(f"steps {p['steps'][0]}-{p['steps'][1]} in {p['seconds'] / 60:.2f} min" for p in state.parts[:-1])
    logger.info(f"part {len(state.parts)} of the run, from step {state.step}{f' (before: {earlier})' if earlier else ''}; "
                f"the budget counts every part: {budget.describe()}")
    recorded = state.options
    if recorded is None:  # a checkpoint from before runs recorded their options
        return
    for name in BUDGET_OPTIONS:
        if name in recorded and recorded[name] != getattr(args, name):
            logger.info(f"`{name}` {getattr(args, name)}, given with `resume`, replaces the run's {recorded[name]}")


def resume_step(args: TrainArguments, checkpoint_root: Path) -> int | None:
    """The step of the checkpoint `resume` continues from; without `resume`, refuse a folder that holds an earlier run."""
    if args.resume:
        if not list_checkpoints(checkpoint_root):
            raise FileNotFoundError(f"`resume`: no complete checkpoint in {checkpoint_root} to resume from")
        checkpoint, problems = newest_sound_checkpoint(checkpoint_root)
        for problem in problems:
            logger.warning(f"`resume`: {problem}")
        state = read_state(checkpoint)
        check_state(state, checkpoint / STATE_FILE)
        check_same_run(args, state.get("run_options"))
        step = state["step"]
        if problems:
            logger.warning(f"`resume`: continuing from {checkpoint.name}, the newest checkpoint that reads back whole; "
                           f"the steps after {step} are trained again")
        check_run_config(checkpoint_root / "config.json", checkpoint)  # the run's architecture, built by every process next
        recorded = state.get("options")
        _log_options(args, recorded if isinstance(recorded, dict) else {}, checkpoint / STATE_FILE)
        return step
    check_new_folder(args, checkpoint_root)
    return None


def check_new_folder(args: TrainArguments, checkpoint_root: Path) -> None:
    """Without `resume`: refuse a folder that holds an earlier run, a finished model, a card or a file the run would
    write over."""
    if list_checkpoints(checkpoint_root):
        raise ValueError(
            f"{args.output_dir} holds checkpoints of an earlier run; pass `resume` to continue it, or pick a new `output_dir`"
        )
    model_files = [name for name in MODEL_FILES if (Path(args.output_dir) / name).exists()]
    if model_files:  # a finished model (from the Hub, or a run whose checkpoints were removed): never replaced
        raise ValueError(
            f"{args.output_dir} holds a model ({', '.join(model_files)}) that a new run would replace; pass `resume` "
            f"to continue its run (it needs its {CHECKPOINTS}/ folder), `model_name_or_path {args.output_dir}` "
            "to fine-tune it into another `output_dir`, or pick another `output_dir`"
        )
    cards = [name for name in DESCRIPTION_FILES if (Path(args.output_dir) / name).exists()]
    if cards:  # not this run's: the finished model's card and scores would replace them
        raise ValueError(f"{args.output_dir} holds {', '.join(cards)}, which the finished model's card and scores would "
                         "replace; pick another `output_dir`, or move them")
    check_nothing_to_replace(args)


def check_nothing_to_replace(args: TrainArguments) -> None:
    """A new run refuses a folder holding a path it would write over or delete: the model's code and settings, its
    log, the weights of another layout, a LoRA run's `adapter/`, a tokenizer's settings without its tokenizer.json,
    in `checkpoints/` a checkpoint's name or records other than those of a run that stopped before its first
    checkpoint (whose tokenizer and log are this folder's own, used or kept)."""
    from ..hub import STALE_WEIGHTS
    from ..modeling.saving import CODE_FILES
    from .logs import LOG_FILE

    folder = Path(args.output_dir)
    started = _run_record(folder / CHECKPOINTS / "config.json")  # a run of this folder got as far as its model
    written = [*CODE_FILES, "generation_config.json", *([] if started else [LOG_FILE]),
               *([ADAPTER_DIR] if args.lora_rank is not None else []),
               *([] if (folder / "tokenizer.json").is_file() else ["tokenizer_config.json", "special_tokens_map.json"])]
    found = [name for name in written if (folder / name).exists() or (folder / name).is_symlink()]
    found += sorted(entry.name for entry in folder.iterdir() if STALE_WEIGHTS.match(entry.name))
    found += _not_run_records(folder / CHECKPOINTS)
    found = [f"{name}/" if (folder / name).is_dir() else name for name in found]
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise ValueError(f"{folder} holds {', '.join(found[:3])}{more}, which a new run would write over or delete; "
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


def check_state(state: dict, source: Path) -> None:
    """A ValueError naming `source` unless a checkpoint's state holds what `RunState` holds: counts, lists, and one
    of ATTENTION_IMPLEMENTATIONS (transformers takes another name for a Hub kernel, which it downloads and runs)."""
    if not isinstance(state, dict):
        raise ValueError(f"`resume`: {source} is damaged: it is not a JSON object")
    kinds = {"step": int, "epoch": int, "batches_done": int, "train_tokens": int, "evaluations_without_improvement": int,
             "history": list, "best": list, "parts": list, "run_options": (dict, type(None)),
             "options": (dict, type(None))}
    for name, kind in kinds.items():
        value = state.get(name)
        if name in state and (not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0)):
            raise ValueError(f"`resume`: {source} is damaged: its {name} is {value!r}")
    if not isinstance(state.get("step"), int):
        raise ValueError(f"`resume`: {source} is damaged: it records no step")
    if state.get("attn_implementation") not in (None, *ATTENTION_IMPLEMENTATIONS):
        raise ValueError(f"`resume`: {source} records the attention implementation {state['attn_implementation']!r}, "
                         f"not one of {', '.join(ATTENTION_IMPLEMENTATIONS)}; it is not used")
    for number, part in enumerate(state.get("parts", []), 1):
        problem = part_problem(part, state["step"])
        if problem:
            raise ValueError(f"`resume`: {source} is damaged: part {number} of its parts {problem}; got {part!r}")
    for name in ("history", "best"):  # each an evaluation: its step, and for model selection its score
        for record in state.get(name, []):
            if not isinstance(record, dict) or not _is_count(record.get("step")) or (
                    name == "best" and not _is_number(record.get("value"))):
                raise ValueError(f"`resume`: {source} is damaged: its {name} holds {record!r}, not the record of an "
                                 "evaluation")


# A part of a run longer than this is an edited record, not a session: a year.
MAX_PART_SECONDS = 366 * 24 * 3600


def part_problem(part, step: int) -> str | None:
    """What is wrong with one part of a run as its checkpoint records it ({"steps": [first, last], "seconds"}), or
    None: the steps are counts up to the checkpoint's `step`, the seconds a finite, non-negative time."""
    if not isinstance(part, dict):
        return "is not a JSON object with steps and seconds"
    steps, seconds = part.get("steps"), part.get("seconds")
    if not (isinstance(steps, list) and len(steps) == 2 and all(map(_is_count, steps)) and steps[0] <= steps[1] <= step):
        return f"must have steps [first, last], counts with first <= last <= the checkpoint's step {step}"
    if not (_is_number(seconds) and 0 <= seconds <= MAX_PART_SECONDS):
        return f"must have seconds, a number from 0 to {MAX_PART_SECONDS:,}"
    return None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_run_config(config_file: Path, checkpoint: Path) -> None:
    """The run's config.json against the sizes of the checkpoint's weights, from their header, before a model of the
    config's size is built (an edited d_ff of millions would be allocated, then fail on loading)."""
    from ..model_folder import check_config_sizes, weight_shapes
    from ..modeling.configuration_vanilla_transformer import VanillaTransformerConfig

    config = read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} does not describe a model (a JSON object)")
    try:
        config = VanillaTransformerConfig.from_dict(config)
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"{config_file} does not describe a model: {err}") from None
    if checkpoint_layout(checkpoint) == "DDP":  # the other layouts are pickles, read by their engines' own checks
        check_config_sizes(config, config_file, weight_shapes([checkpoint / WEIGHTS_FILE]), checkpoint)


def run_options(args: TrainArguments) -> dict:
    """The options that define a run (RUN_OPTIONS), local paths made absolute, as its checkpoints record them."""
    options = {name: getattr(args, name) for name in RUN_OPTIONS}
    for name in ("dataset", "tokenizer", "model_name_or_path"):
        if options[name] is not None and Path(options[name]).expanduser().exists():
            options[name] = str(Path(options[name]).expanduser().resolve())
    return options


def recorded_options(args: TrainArguments) -> dict:
    """Every option of the run as its checkpoints record them, for `resume` alone to restore (`restore_options`)."""
    return {name: value for name, value in asdict(args).items() if name not in ("output_dir", "resume")}


def restore_options(output_dir: str, given: dict) -> dict:
    """`resume` without the options: those the newest checkpoint of the run in `output_dir` records, the `given`
    ones (typed on the command line) over them; `check_same_run` then refuses a changed one that defines the run.
    A record is data: each value restored is checked as a typed one is, and NEVER_RESTORED ones are left out
    (`resume_step` prints the run's options once the run is found the same)."""
    recorded, source = {}, None
    for checkpoint in reversed(list_checkpoints(Path(output_dir) / CHECKPOINTS)):
        try:  # the newest that reads; `train` says what is damaged, and sets it aside, under the folder's lock
            recorded = read_state(checkpoint).get("options") or {}
            source = checkpoint / STATE_FILE
            break
        except (OSError, ValueError, AttributeError):
            continue
    if not isinstance(recorded, dict):
        raise ValueError(f"`resume`: {source} is damaged: its options are not a JSON object")
    known = {f.name for f in fields(TrainArguments)}  # an option since removed is dropped
    restored = {name: value for name, value in recorded.items()
                if name in known and name not in NEVER_RESTORED and name not in given}
    if "report_to" not in given and recorded.get("report_to") in FOLDER_TRACKERS:  # it writes in the folder alone
        restored["report_to"] = recorded["report_to"]
    for name, value in restored.items():
        try:
            check_option(name, value)
        except ValueError as err:
            raise ValueError(f"`resume`: {source} records an option that is refused: {err}") from None
    return {**restored, **given}


def _log_options(args: TrainArguments, recorded: dict, source: Path) -> None:
    """The options of the resumed run in one block, as fairseq prints its namespace: those `source` records, those
    typed in their place, and those it records that are never restored (NEVER_RESTORED)."""
    options = recorded_options(args)
    changed = [f"{name} {recorded[name]!r} -> {value!r}" for name, value in options.items()
               if name in recorded and recorded[name] != value and name not in NEVER_RESTORED]
    left_out = [f"{name}={recorded[name]!r}" for name in NEVER_RESTORED
                if recorded.get(name) is not None and recorded[name] != getattr(args, name)]
    lines = [f"resume: the options of the run, from {source}:",
             "  " + ", ".join(f"{name}={value!r}" for name, value in sorted(options.items()))]
    if changed:
        lines.append(f"  typed in place of the recorded ones, and recorded for the next resume: {'; '.join(changed)}")
    if args.report_to is not None and recorded.get("report_to") == args.report_to:
        lines.append(f"  report_to={args.report_to!r} as recorded: the tracker goes on logging under "
                     f"{Path(args.output_dir) / 'runs'}")
    if left_out:
        lines.append(f"  recorded but not restored (they act outside the run's folder; give them on the command line): "
                     f"{', '.join(left_out)}")
    logger.info("\n".join(lines))


def check_same_run(args: TrainArguments, started_with: dict | None) -> None:
    """`resume` continues the run in `output_dir` as it was started: other data, tokenizer, model or batches
    would silently be ignored or change what was being trained. (Checkpoints from before runs recorded
    their options have nothing to compare with.)"""
    if started_with is None:
        return
    now = run_options(args)
    defaults = TrainArguments(output_dir="")  # options newer than the checkpoint had their default
    before = {name: started_with.get(name, getattr(defaults, name)) for name in RUN_OPTIONS}
    changed = [f"{name} {before[name]!r} -> {now[name]!r}" for name in RUN_OPTIONS if before[name] != now[name]]
    if changed:
        raise ValueError(
            f"`resume`: the run in {args.output_dir} was started with other options: {'; '.join(changed)}. "
            "Resume it with the options it was started with, or train into a new `output_dir`."
        )
