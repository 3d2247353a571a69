"""Resuming a run: the policy that continues a run as it was started.

`resume` continues the newest checkpoint that reads back whole (`resume_step`), with the
options the run was started with (`restore_options`), refusing one that would change what the run trains
(`check_same_run`); a run whose budget is spent and whose final folder is saved has nothing to do (`finished_step`).
A checkpoint's records are data, checked before they are used (`RunState.read`, `check_run_config`).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from accelerate.logging import get_logger

from ..choices import FOLDER_TRACKERS
from ..errors import BadInput
from ..checks.files import read_json
from ..hub import RESULTS_FILE
from .arguments import (
    BATCH_PLAN_OPTIONS,
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
    latest_checkpoint,
    list_checkpoints,
    newest_sound_checkpoint,
    read_state,
)
from .run_folder import CHECKPOINTS
from .run_state import RunState, options_recorded_in

__all__ = [
    "BUDGET_OPTIONS", "check_run_config", "check_same_run", "finished_step", "restore_batch_plan", "restore_options",
    "resume_budget", "resume_step",
]

logger = get_logger(__name__)


BUDGET_OPTIONS = ("max_steps", "num_epochs", "time_limit")  # the run's limits, which a resume may extend


def finished_step(args: TrainArguments) -> int | None:
    """`resume` of the run in `args.output_dir` whose budget is spent and whose final model and results.json are those
    of its newest checkpoint, with no option but its limits given otherwise: nothing to train, score or save. Says so
    in one line and returns the step; else None (a run whose final folder is not there yet is finished by `train`)."""
    output_dir, given = args.output_dir, args.recorded_options()
    checkpoint = latest_checkpoint(Path(output_dir) / CHECKPOINTS)
    try:
        state = RunState.read(checkpoint) if checkpoint is not None else None
        results = read_json(Path(output_dir) / RESULTS_FILE)
    except (OSError, ValueError, AttributeError):  # damaged or missing: `train` says what, or writes them
        return None
    if state is None or not isinstance(results, dict) or results.get("steps") != state.step:
        return None
    if results.get("not_scored"):  # the final scoring was stopped: `train` scores what is missing
        return None
    # Another option given with `resume` is refused, or applied, by `train`.
    if any(given.get(name) != value for name, value in (state.recorded_options or {}).items()
           if name not in BUDGET_OPTIONS and name not in NEVER_RESTORED):
        return None
    budget = Budget(**{name: given[name] for name in BUDGET_OPTIONS}, state=state,
                    earlier_seconds=sum(part["seconds"] for part in state.parts))
    stopped_early = state.out_of_patience(given["patience"])
    if not (budget.spent(state.step) or budget.epochs_done() or stopped_early):
        return None
    done = f"{budget.describe()}{'; stopped early by `patience`' * stopped_early}"
    logger.info(f"`resume`: the run in {output_dir} is done ({done}); its model and "
                f"{RESULTS_FILE} are saved. Nothing to do: give a larger `max_steps`, `time_limit` or `num_epochs` "
                "to train on")
    return state.step


def resume_budget(state: RunState, budget: Budget) -> None:
    """Say where a resumed run stands against its `budget`, and which of its limits, typed with `resume`, replace the
    recorded ones (every option typed with `resume` is recorded in turn: `RunState.record_options`)."""
    earlier = ", ".join(f"steps {p['steps'][0]}-{p['steps'][1]} in {p['seconds'] / 60:.2f} min" for p in state.parts[:-1])
    logger.info(f"part {len(state.parts)} of the run, from step {state.step}{f' (before: {earlier})' if earlier else ''}; "
                f"the budget counts every part: {budget.describe()}")
    recorded = state.recorded_options
    if recorded is None:  # a checkpoint from before runs recorded their options
        return
    for name in BUDGET_OPTIONS:
        if name in recorded and recorded[name] != getattr(budget, name):
            logger.info(f"`{name}` {getattr(budget, name)}, given with `resume`, replaces the run's {recorded[name]}")


def resume_step(checkpoint_root: Path, args: TrainArguments) -> int:
    """The step of the checkpoint `resume` continues from: the newest that reads back whole, of the same run (the
    options that define it, `TrainArguments.run_options`, unchanged)."""
    output_dir = args.output_dir
    if not list_checkpoints(checkpoint_root):
        raise FileNotFoundError(f"`resume`: no complete checkpoint in {checkpoint_root} to resume from")
    checkpoint, problems = newest_sound_checkpoint(checkpoint_root)
    for problem in problems:
        logger.warning(f"`resume`: {problem}")
    state = RunState.read(checkpoint)
    check_same_run(args.run_options(), state.run_options, output_dir)
    if problems:
        logger.warning(f"`resume`: continuing from {checkpoint.name}, the newest checkpoint that reads back whole; "
                       f"the steps after {state.step} are trained again")
    check_run_config(checkpoint_root / "config.json", checkpoint)  # the run's architecture, built by every process next
    _log_options(args.recorded_options(), state.recorded_options or {}, checkpoint / STATE_FILE, output_dir)
    return state.step


def check_run_config(config_file: Path, checkpoint: Path) -> None:
    """The run's config.json against the sizes of the checkpoint's weights, from their header, before a model of the
    config's size is built (an edited d_ff of millions would be allocated, then fail on loading)."""
    from ..checks.model_folder import check_config_sizes, weight_shapes
    from ..modeling.configuration_vanilla_transformer import VanillaTransformerConfig

    config = read_json(config_file)
    if not isinstance(config, dict):
        raise BadInput(f"{config_file} does not describe a model (a JSON object)")
    try:
        config = VanillaTransformerConfig.from_dict(config)
    except (TypeError, ValueError, KeyError) as err:
        raise BadInput(f"{config_file} does not describe a model: {err}") from None
    if checkpoint_layout(checkpoint) == "DDP":  # the other layouts are pickles, read by their engines' own checks
        check_config_sizes(config, config_file, weight_shapes([checkpoint / WEIGHTS_FILE]), checkpoint)


def restore_batch_plan(args: TrainArguments) -> TrainArguments:
    """`args` of a resume with the batch plan its run records where they leave it unset (BATCH_PLAN_OPTIONS: None
    is "sized for this machine"), as the command line restores every option not typed (`restore_options`): the
    steps go on with the same batches on any machine, and the run's records compare plainly with `args`."""
    if all(getattr(args, name) is not None for name in BATCH_PLAN_OPTIONS):
        return args  # given, or restored with the other options the command line's user did not type
    # The Python API cannot say what was typed: every option is, but a batch plan left unset.
    given = {f.name: getattr(args, f.name) for f in fields(TrainArguments)
             if not (f.name in BATCH_PLAN_OPTIONS and getattr(args, f.name) is None)}
    return TrainArguments(**restore_options(args.output_dir, given))


def restore_options(output_dir: str, given: dict) -> dict:
    """`resume` without the options: those the newest checkpoint of the run in `output_dir` records, the `given`
    ones (typed on the command line) over them; `check_same_run` then refuses a changed one that defines the run.
    A record is data: each value restored is checked as a typed one is, and NEVER_RESTORED ones are left out
    (`resume_step` prints the run's options once the run is found the same)."""
    recorded, source = {}, None
    for checkpoint in reversed(list_checkpoints(Path(output_dir) / CHECKPOINTS)):
        try:  # the newest that reads; `train` says what is damaged, and sets it aside, under the folder's lock
            recorded = options_recorded_in(read_state(checkpoint))
            source = checkpoint / STATE_FILE
            break
        except (OSError, ValueError, AttributeError):
            continue
    if not isinstance(recorded, dict):
        raise BadInput(f"`resume`: {source} is damaged: its options are not a JSON object")
    known = {f.name for f in fields(TrainArguments)}  # an option since removed is dropped
    restored = {name: value for name, value in recorded.items()
                if name in known and name not in NEVER_RESTORED and name not in given}
    if "report_to" not in given and recorded.get("report_to") in FOLDER_TRACKERS:  # it writes in the folder alone
        restored["report_to"] = recorded["report_to"]
    for name, value in restored.items():
        try:
            check_option(name, value)
        except ValueError as err:
            raise BadInput(f"`resume`: {source} records an option that is refused: {err}") from None
    return {**restored, **given}


def _log_options(options: dict, recorded: dict, source: Path, output_dir: str) -> None:
    """The options of the resumed run in `output_dir` in one block, as fairseq prints its namespace: those `source`
    records, those typed in their place (`options`, as recorded), and those it records that are never restored
    (NEVER_RESTORED)."""
    changed = [f"{name} {recorded[name]!r} -> {value!r}" for name, value in options.items()
               if name in recorded and recorded[name] != value and name not in NEVER_RESTORED]
    left_out = [f"{name}={recorded[name]!r}" for name in NEVER_RESTORED
                if recorded.get(name) is not None and recorded[name] != options.get(name)]
    lines = [f"resume: the options of the run, from {source}:",
             "  " + ", ".join(f"{name}={value!r}" for name, value in sorted(options.items()))]
    if changed:
        lines.append(f"  typed in place of the recorded ones, and recorded for the next resume: {'; '.join(changed)}")
    report_to = options["report_to"]
    if report_to is not None and recorded.get("report_to") == report_to:
        lines.append(f"  report_to={report_to!r} as recorded: the tracker goes on logging under "
                     f"{Path(output_dir) / 'runs'}")
    if left_out:
        lines.append(f"  recorded but not restored (they act outside the run's folder; give them on the command line): "
                     f"{', '.join(left_out)}")
    logger.info("\n".join(lines))


def check_same_run(now: dict, started_with: dict | None, output_dir: str) -> None:
    """`resume` continues the run in `output_dir` as it was started: its options `now` (`TrainArguments.run_options`)
    against those it `started_with`, for other data, tokenizer, model or batches would silently be ignored or change
    what was being trained. (Checkpoints from before runs recorded their options have nothing to compare with.)"""
    if started_with is None:
        return
    defaults = TrainArguments(output_dir="")  # options newer than the checkpoint had their default
    before = {name: started_with.get(name, getattr(defaults, name)) for name in RUN_OPTIONS}
    changed = [f"{name} {before[name]!r} -> {now[name]!r}" for name in RUN_OPTIONS if before[name] != now[name]]
    if changed:
        raise BadInput(
            f"`resume`: the run in {output_dir} was started with other options: {'; '.join(changed)}. "
            "Resume it with the options it was started with, or train into a new `output_dir`."
        )
