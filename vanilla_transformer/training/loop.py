"""The training driver: `train(TrainArguments(...))`, on one CPU, one GPU or many, with Accelerate.

    vanilla-transformer train --output-dir runs/en-es --preset tiny --warmup-steps 400 --time-limit 15
    accelerate launch -m vanilla_transformer.cli train ...        # the same, on every process

`train` reads top to bottom: set up (setup.py), then for each step take its batches, step (§5, step.py),
log / evaluate (evaluation.py) / save (`save_run` below), then finish (finish.py: §6.1's averaged weights,
scores, model card, upload). Each optimiser step takes `gradient_accumulation_steps` batches of at most
`max_tokens` tokens on every process; a run with a budget (`max_steps`, `num_epochs`, `time_limit`) stops
at its first limit, or after the step under way when SIGINT or SIGTERM comes, saving it first.
"""

from __future__ import annotations

import logging
import time
from contextlib import closing
from itertools import islice
from pathlib import Path

import torch
from accelerate.logging import get_logger
from tqdm.auto import tqdm

from ..checks.files import read_json
from ..threads import CpuClock, load_average, oversubscription
from ..hub import RESULTS_FILE
from .arguments import TrainArguments
from .budget import Budget, TrainingInterrupted
from .checkpoints import save_checkpoint
from .compute import choose_attn_implementation, compile_timing, training_sdpa_backends
from .batches import PadCollator, PrefetchedBatches
from .distributed import default_mixed_precision, on_main, start_accelerator
from .evaluation import evaluate, report
from .finish import finish
from .resume import finished_step, restore_batch_plan
from .run_folder import RunLock, explain_disk_full, take_folder
from .run_state import RunState
from .setup import Components, set_up
from .step import StepDone, next_rate, train_step

__all__ = ["checkpoint_due", "save_if_due", "save_run", "train"]

logger = get_logger(__name__)  # logs on the main process only


def train(args: TrainArguments) -> dict:
    """Train (or fine-tune, or resume) as `args` says; returns the results written to results.json."""
    args.validate()
    accelerator = _start_accelerator(args)
    lock = RunLock(args.output_dir)  # one run per folder: taken by the main process for all of them
    on_main(accelerator, lambda: take_folder(lock))
    try:
        if args.resume:
            args = restore_batch_plan(args)  # on every process, before the main one sets damaged checkpoints aside
            if on_main(accelerator, lambda: finished_step(args)) is not None:
                return read_json(Path(args.output_dir) / RESULTS_FILE)  # the run is done: the folder stays as it is
        try:
            components, state, budget = set_up(args, accelerator, lock)
        except BaseException:
            lock.release(discard=True)  # a run that fails while being set up leaves no folder it made
            raise
        _train_part(components, state, budget)
        if budget.stop_signal:
            raise TrainingInterrupted(budget.stop_signal, args.output_dir, state.step)
        return finish(components, state, budget)
    except OSError as err:
        full = explain_disk_full(err, args.output_dir)
        if full is None:
            raise
        raise full from None
    finally:
        lock.release()


def _train_part(components: Components, state: RunState, budget: Budget) -> None:
    """This part of the run: its steps, validated and saved as the run's options say, until the budget is spent, patience
    runs out or a stop is requested; then a checkpoint of the last step (validated first under `best_metric`)."""
    args = components.args
    saved_step = state.step if args.resume else None  # the step of the newest checkpoint
    bar = _progress_bar(state, budget, components.accelerator.is_local_main_process)
    with (budget.stop_requests, closing(_steps(components, state, budget, args)) as steps,
          training_sdpa_backends(components.accelerator.device)):  # the timing of kernels and every evaluation too
        # Fine-tuning: the baseline, before any step.
        if args.model_name_or_path is not None and not args.resume:
            new_best = _validate(components, state, budget, args)
            saved_step = save_if_due(components, state, budget, saved_step, new_best=new_best)
        with bar:  # closed on the way out, so that a failure's one line comes after the bar, not before
            for micro_batches in steps:
                if first := state.step == budget.start_step:  # the first step of this part of the run
                    clock = CpuClock()
                    state.record_attn_implementation(choose_attn_implementation(
                        components.accelerator, components.model, args.attn_implementation or state.attn_implementation,
                        micro_batches[0][0], budget))
                with compile_timing(components.compiled, micro_batches, components.accelerator.device):
                    step_done = train_step(components, micro_batches, state.step, budget, args.max_grad_norm)
                _count_step(components, state, budget, len(micro_batches), step_done)
                if first:
                    _check_machine(components, clock)
                _advance(bar, budget)
                if state.step % args.log_steps == 0:
                    _log(components, state, budget, step_done.lr, bar)
                # The last step is validated too, so that the steps since the last validation can be the best.
                last = args.best_metric is not None and (budget.steps_done(state.step) or budget.out_of_time())
                new_best = (state.step % args.eval_steps == 0 or last) and _validate(components, state, budget, args)
                saved_step = save_if_due(components, state, budget, saved_step, new_best=new_best)
                if state.out_of_patience(args.patience):
                    logger.info(f"no better validation {args.best_metric} for {args.patience} evaluation(s): "
                                f"stopping at step {state.step}; the best was step {state.best[0]['step']}")
                    break
        if budget.out_of_time() and not budget.stop_signal:
            logger.info(f"time limit of {args.time_limit} min reached at step {state.step}")
        if args.best_metric is not None and not budget.stop_signal and not _validated(state):  # the last epoch's end
            _validate(components, state, budget, args)
            saved_step = None  # saved again, with the validation
        save_if_due(components, state, budget, saved_step, part_over=True)


def save_if_due(components: Components, state: RunState, budget: Budget, saved_step: int | None, *,
                new_best: bool = False, part_over: bool = False) -> int | None:
    """Checkpoint the run where `checkpoint_due` says (`saved_step`: the step of its newest checkpoint, or None);
    returns the step of its newest checkpoint then."""
    if not checkpoint_due(state.step, saved_step, components.args.save_steps, new_best=new_best, part_over=part_over):
        return saved_step
    state.record_part(budget.training_seconds(), budget.scoring_seconds)  # the checkpoint records the run's time up to it
    save_run(components, state, components.args.keep_checkpoints)
    return state.step


def checkpoint_due(step: int, saved_step: int | None, save_steps: int, *, new_best: bool, part_over: bool) -> bool:
    """Whether the loop checkpoints the run at `step` (`saved_step`: the step of its newest checkpoint, or None): at a
    new best by validation, whose checkpoint model selection keeps; every `save_steps` steps trained; and where this
    part of the run ends, so that its last step is kept. Never twice for one step."""
    already_saved = step == saved_step
    periodic = step > 0 and step % save_steps == 0  # step 0 (a fine-tuned model's baseline) trained nothing
    return not already_saved and (new_best or periodic or part_over)


def _count_step(components: Components, state: RunState, budget: Budget, batches: int, done: StepDone) -> None:
    """The step counted by the run's state and its budget, then the next step's rate (§5.3), which a schedule that
    decays over the budget reads from both: the steps, epochs and minutes left after this one."""
    state.count_step(batches, done.tokens)
    budget.add_step(done.tokens, done.elapsed_seconds, done.stop_signal)
    next_rate(components, done)


def _check_machine(components: Components, clock: CpuClock) -> None:
    """One line when the first step (with the attention timing) found the CPUs oversubscribed; a GPU's host waits
    for the device, so its CPU time says nothing of the machine."""
    if components.accelerator.device.type == "cpu":
        line = oversubscription(torch.get_num_threads(), clock.cpus(), load_average())
        if line:
            logger.info(line)


def save_run(components: Components, state: RunState, keep_checkpoints: int | None) -> None:
    """Checkpoint the run as of `state.step`, on every process; never after a step that was not finite.
    The best checkpoints of model selection outlive the newest `keep_checkpoints`."""
    components.losses.check_finite(state.step)
    if components.lock is not None:  # a run that lost the folder to another writes nothing more there
        on_main(components.accelerator, components.lock.check)
    save_checkpoint(components.accelerator, components.checkpoint_root, state.step, state.to_dict(),
                    keep_checkpoints=keep_checkpoints, protect=state.best_steps())


def _steps(components: Components, state: RunState, budget: Budget, args: TrainArguments):
    """The micro-batches of each step, epoch after epoch from where `state` is, until the budget is spent.

    Batches come ready (PrefetchedBatches): the host never waits for the device to make them."""
    collate = PadCollator(components.task.tokenizer.pad_token_id, components.sampler.shapes)
    while not budget.spent(state.step) and not budget.epochs_done():
        components.sampler.set_epoch(state.epoch, state.batches_done)
        with PrefetchedBatches(components.task.train_split, components.sampler, collate,
                               components.accelerator.device) as batches:
            while micro_batches := list(islice(batches, args.gradient_accumulation_steps)):
                yield micro_batches
                if budget.spent(state.step):
                    return  # the budget ends within this epoch
        state.end_epoch()
        logger.info(f"epoch {state.epoch} finished at step {state.step}")


def _progress_bar(state: RunState, budget: Budget, enabled: bool):
    """The run's steps towards `max_steps`; under `time_limit`, the run's minutes towards it, so that the time left
    reads true. The count includes the earlier parts of a resumed run; the bar's own clock is this part's."""
    desc = "training" if len(state.parts) < 2 else f"training (part {len(state.parts)})"
    if budget.time_limit is not None:
        return tqdm(total=budget.time_limit, initial=min(budget.earlier_seconds / 60, budget.time_limit), unit="min",
                    disable=not enabled, desc=desc,
                    bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} min [{elapsed}<{remaining}{postfix}]")
    return tqdm(total=budget.max_steps, initial=state.step, disable=not enabled, desc=desc)


def _advance(bar, budget: Budget) -> None:
    if budget.time_limit is None:
        bar.update(1)
    else:  # the run's minutes, as the step measured them
        bar.update(min((budget.earlier_seconds + budget.elapsed_seconds) / 60, budget.time_limit) - bar.n)


def _log(components: Components, state: RunState, budget: Budget, lr: float, bar) -> None:
    """The losses since the last log (the one wait for the device that logging costs): a plain line, a record in
    the training log, the trackers and the bar."""
    loss, nll = components.losses.read(state.step)
    elapsed = budget.training_seconds()  # this part's
    run_seconds = budget.earlier_seconds + elapsed  # the run's: every part
    tokens_per_second = budget.part_tokens / elapsed
    part = len(state.parts)
    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:.0f}")
    logger.info(f"step {state.step}: loss {loss:.4f}, nll {nll:.4f}, lr {lr:.3e}, {tokens_per_second:.0f} tokens/s, "
                f"{run_seconds / 60:.1f} min" + (f" (part {part}: {elapsed / 60:.1f})" if part > 1 else ""))
    components.training_log.append({"step": state.step, "loss": loss, "nll": nll, "lr": lr,
                                    "tokens_per_second": round(tokens_per_second, 1), "elapsed": round(run_seconds, 2),
                                    "part": part, "part_elapsed": round(elapsed, 2)})
    metrics = {"train/loss": loss, "train/nll": nll, "train/lr": lr, "train/tokens_per_second": tokens_per_second}
    components.accelerator.log(metrics, step=state.step)


def _validate(components: Components, state: RunState, budget: Budget, args: TrainArguments) -> bool:
    """Score the validation split; whether the model is the best so far by `best_metric` (its checkpoint is then saved).
    Its time is the budget's `scoring`, beside the training time that the time limit counts."""
    start = time.perf_counter()
    # In fp32, as the final scores: the best is chosen on the numbers reported for it.
    metrics = evaluate(components.accelerator, components.model, components.task.tokenizer,
                       components.task.eval_splits["validation"], args, args.eval_samples, full_precision=True)
    metrics["seconds"] = round(time.perf_counter() - start, 2)
    budget.add_scoring(metrics["seconds"])
    report(components.accelerator, state.history, state.step, "validation", metrics, components.training_log)
    kept = args.average_last if args.average_best else 1
    improved = state.record_validation(metrics, args.best_metric, args.eval_samples, kept)
    if improved:
        logger.info(f"step {state.step}: best validation {args.best_metric} so far ({metrics[args.best_metric]:.4f})")
    return state.step in state.best_steps()


def _validated(state: RunState) -> bool:
    return any(record["step"] == state.step and record["split"] == "validation" for record in state.history)


def _start_accelerator(args: TrainArguments):
    """Logging set up, then Accelerate started: it refuses a launch whose processes would train alone, and logs what runs."""
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # one line per file saved is noise
    return start_accelerator(
        ddp_timeout=args.ddp_timeout,
        mixed_precision=args.mixed_precision or default_mixed_precision(),
        log_with=args.report_to,
        project_dir=str(Path(args.output_dir) / "runs") if args.report_to else None,
    )
