"""The run's folder and its policy: one run per folder, what a checkpoint holds, resuming, when to stop.

`output_dir` holds the finished model (a Hub folder, hub.py) and `output_dir/checkpoints/`, the run's
checkpoints (checkpoints.py). A run takes the folder's lock and sweeps what a run killed while saving
left behind (`take_folder`); a new run refuses a folder that holds an earlier run, a finished model or a card it did not write,
and `resume` continues the newest checkpoint that reads back whole, with the options it was started
with (`resume_step`). A checkpoint holds a `RunState`; the `Budget` says when the steps end: `max_steps`,
`num_epochs`, `time_limit` or SIGINT / SIGTERM, which finish the step under way and save it first.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from accelerate.logging import get_logger

from ..file_checks import read_json
from ..hub import DESCRIPTION_FILES, RESULTS_FILE
from ..staging import DiskFull, sweep_staging
from .arguments import (
    ATTENTION_IMPLEMENTATIONS,
    FOLDER_TRACKERS,
    NEVER_RESTORED,
    RUN_OPTIONS,
    TrainArguments,
    check_option,
)
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
from .lock import RunLock

__all__ = [
    "ADAPTER_DIR", "CHECKPOINTS", "Budget", "RunState", "StopRequests", "TrainingInterrupted", "check_same_run", "disk_full",
    "check_run_config", "check_state", "finished_step", "on_main", "recorded_options", "restore_options",
    "resume_budget", "resume_step", "run_options", "ScoringInterrupted", "StopScoring", "take_folder",
    "check_nothing_to_replace",
]

logger = get_logger(__name__)

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


@dataclass
class Budget:
    """When the steps end (`max_steps`, `num_epochs`, `time_limit` in minutes, a stop signal) and this session's clock.
    The limits are the run's: the steps and the minutes of every part of it count (`before`: the earlier parts')."""

    max_steps: int | None = None
    num_epochs: int | None = None
    time_limit: float | None = None
    accumulation: int = 1  # batches per optimiser step
    epoch_batches: int = 0  # batches per epoch on each process
    progress: RunState = field(default_factory=RunState)  # the epoch and its batches done, for `num_epochs`
    start_step: int = 0  # where this session began
    started: float = field(default_factory=time.perf_counter)
    elapsed: float = 0.0  # seconds trained since `started` on the main process, as of the current step (alike on every process)
    scoring: float = 0.0  # seconds of this session spent validating: timed beside the budget, never counted in it
    session_tokens: int = 0  # target tokens trained on in this session, for tokens per second
    before: float = 0.0  # seconds of the run's earlier parts (RunState.parts), which the time limit counts too
    stop_requests: StopRequests | None = None
    stop_signal: int = 0  # SIGINT or SIGTERM received by the main process (alike on every process)

    def remaining_steps(self, step: int) -> float:
        """The optimiser steps left after `step`, to the first limit (the time limit at the mean time of a step so
        far in this session). What a `BudgetSchedule` decays over."""
        left = [math.inf]
        if self.max_steps is not None:
            left.append(self.max_steps - step)
        if self.num_epochs is not None:
            batches = (self.num_epochs - self.progress.epoch) * self.epoch_batches - self.progress.batches_done
            left.append(batches / self.accumulation)
        timed = step - 1 - self.start_step  # steps whose time `elapsed` (measured as step `step` began) covers
        if self.time_limit is not None and timed > 0:
            left.append((self.time_limit * 60 - self.before - self.elapsed) / (self.elapsed / timed) - 1)
        return min(left)

    def steps_done(self, step: int) -> bool:
        return self.max_steps is not None and step >= self.max_steps

    def epochs_done(self) -> bool:
        return self.num_epochs is not None and self.progress.epoch >= self.num_epochs

    def out_of_time(self) -> bool:
        return self.time_limit is not None and self.before + self.elapsed > self.time_limit * 60

    def training_seconds(self) -> float:
        """Seconds of this session so far that the time limit counts: all but validating."""
        return time.perf_counter() - self.started - self.scoring

    def end_part(self) -> None:
        """Record this session's part of the run as of now (before a checkpoint, and at the end)."""
        self.progress.end_part(self.training_seconds(), self.scoring)

    def describe(self) -> str:
        """The run's budget, its limits and what is spent of each: "step 6 of `max_steps` 8; 0.4 of `time_limit` 5 min"."""
        spent = []
        if self.max_steps is not None:
            spent.append(f"step {self.progress.step} of `max_steps` {self.max_steps}")
        if self.num_epochs is not None:
            spent.append(f"epoch {self.progress.epoch} of `num_epochs` {self.num_epochs}")
        if self.time_limit is not None:
            spent.append(f"{(self.before + self.elapsed) / 60:.2f} of `time_limit` {self.time_limit:g} min")
        return "; ".join(spent)

    def spent(self, step: int) -> bool:
        """Whether no step follows `step`: `max_steps` reached, the time limit passed, or a stop signal came."""
        return self.steps_done(step) or self.out_of_time() or bool(self.stop_signal)

    def requested_signal(self) -> int:
        """The stop signal this process received (0: none), which the step sends to every process."""
        return self.stop_requests.signum if self.stop_requests is not None else 0


BUDGET_OPTIONS = ("max_steps", "num_epochs", "time_limit")  # the run's limits, which a resume may extend


def finished_step(args: TrainArguments) -> int | None:
    """`resume` of a run whose budget is spent and whose final model and results.json are those of its newest
    checkpoint, with no option but its limits given otherwise: nothing to train, score or save. Says so in one
    line and returns the step; else None (a run whose final folder is not there yet is finished by `train`)."""
    checkpoint = latest_checkpoint(Path(args.output_dir) / CHECKPOINTS)
    try:
        recorded = read_state(checkpoint) if checkpoint is not None else None
        if recorded is not None:
            check_state(recorded, checkpoint / STATE_FILE)  # else `resume_step` names what is wrong
        state = RunState.from_dict(recorded) if recorded is not None else None
        results = read_json(Path(args.output_dir) / RESULTS_FILE)
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
    recorded ones. Every option typed with `resume` is recorded in turn, so that the next `resume` keeps it."""
    earlier = ", ".join(f"steps {p['steps'][0]}-{p['steps'][1]} in {p['seconds'] / 60:.2f} min" for p in state.parts[:-1])
    logger.info(f"part {len(state.parts)} of the run, from step {state.step}{f' (before: {earlier})' if earlier else ''}; "
                f"the budget counts every part: {budget.describe()}")
    recorded = state.options
    if recorded is None:  # a checkpoint from before runs recorded their options
        return
    for name in BUDGET_OPTIONS:
        if name in recorded and recorded[name] != getattr(args, name):
            logger.info(f"`{name}` {getattr(args, name)}, given with `resume`, replaces the run's {recorded[name]}")
    state.options = {**recorded, **recorded_options(args)}


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
    return None


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


def disk_full(err: OSError, output_dir: str) -> DiskFull | None:
    """A full disk or quota as one DiskFull saying what was kept and how to go on; None for another error."""
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


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM stopped the run after its current step, saved as a checkpoint; `exit_code` is 128 + signal."""

    def __init__(self, signum: int, output_dir: str, step: int):
        self.exit_code = 128 + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}, saved in {Path(output_dir) / CHECKPOINTS}; "
            "run the same command with --resume to continue"
        )


class StopRequests:
    """While training: SIGINT and SIGTERM are recorded (the step under way finishes, then a checkpoint is
    written) instead of killing the run and losing every step since the last checkpoint. A second signal
    acts at once, as it would without this."""

    def __init__(self):
        self.signum, self._previous = 0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.signum = signum
        for number, handler in self._previous.items():  # the next one interrupts for real
            signal.signal(number, handler)
        logger.warning(f"{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
                       "(send it again to stop at once, unsaved)")

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class ScoringInterrupted(TrainingInterrupted):
    """SIGINT or SIGTERM during the final scoring, which stops at once: the model is saved by then, and `not_scored`
    names the splits left unscored."""

    def __init__(self, signum: int, output_dir: str = "", not_scored=()):
        self.exit_code = 128 + signum
        Exception.__init__(
            self, f"stopped by {signal.Signals(signum).name} during the final scoring; the trained model is saved in "
            f"{output_dir}, not scored: {', '.join(not_scored) or 'nothing'}; run the same command with --resume to "
            "score it"
        )


class StopScoring:
    """While the final scores are computed: SIGINT and SIGTERM stop them at once (`armed`), or, outside the
    scoring itself, once the card is written. `pending`: a stop asked for after the last step, which stops them
    before they start."""

    def __init__(self, pending: int = 0):
        self.signum, self.armed, self._previous = pending, False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._stop)
        return self

    def _stop(self, signum, frame) -> None:
        self.signum = signum
        logger.warning(f"{signal.Signals(signum).name}: stopping the final scoring; the model is saved")
        if self.armed:
            raise ScoringInterrupted(signum)

    def check(self) -> None:
        """Raise ScoringInterrupted if a stop came; from now on, one stops at once."""
        self.armed = True
        if self.signum:
            raise ScoringInterrupted(self.signum)

    def __exit__(self, *exc) -> None:
        self.armed = False
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
