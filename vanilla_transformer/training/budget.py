"""When the run stops: the `Budget` across the parts of a run (the first and each resume), and the stop signals.

A run stops at its first limit, `max_steps`, `num_epochs` or `time_limit` (minutes), or after the step under way
when SIGINT or SIGTERM comes. The limits are the run's: the steps and the minutes of every part count.

Stop signals: SIGINT or SIGTERM ends a run after the step under way, saved first (`StopRequests`), or stops its
final scoring at once (`StopScoring`); the run then exits with 128 + the signal (`TrainingInterrupted`).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from accelerate.logging import get_logger

from .run_folder import CHECKPOINTS
from .run_state import RunState

__all__ = ["Budget", "ScoringInterrupted", "StopRequests", "StopScoring", "TrainingInterrupted"]

logger = get_logger(__name__)


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

    def disarm(self) -> None:
        """From now on a stop is recorded, not raised: what follows the scores is written whole."""
        self.armed = False

    def __exit__(self, *exc) -> None:
        self.armed = False
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


@dataclass
class Budget:
    """When the steps end (`max_steps`, `num_epochs`, `time_limit` in minutes, a stop signal), and the clock of this
    part of the run. The limits are the run's: the steps and the minutes of every part count (`earlier_seconds`: the
    earlier parts')."""

    max_steps: int | None = None
    num_epochs: int | None = None
    time_limit: float | None = None
    gradient_accumulation_steps: int = 1  # batches per optimiser step
    epoch_batches: int = 0  # batches per epoch on each process
    state: RunState = field(default_factory=RunState)  # the run's, read (never written) for its step and epochs done
    start_step: int = 0  # where this part of the run began
    started: float = field(default_factory=time.perf_counter)
    # trained since `started` on the main process, as of the current step (alike on every process)
    elapsed_seconds: float = 0.0
    scoring_seconds: float = 0.0  # of this part spent validating: timed beside the budget, never counted in it
    part_tokens: int = 0  # target tokens trained on in this part, for tokens per second
    earlier_seconds: float = 0.0  # of the run's earlier parts (RunState.parts), which the time limit counts too
    stop_requests: StopRequests = field(default_factory=StopRequests)  # entered by the loop while it trains
    stop_signal: int = 0  # SIGINT or SIGTERM received by the main process (alike on every process)

    def add_step(self, tokens: int, elapsed_seconds: float, stop_signal: int) -> None:
        """A step done: its target tokens, and the main process's clock as it began and its stop signal (alike on
        every process)."""
        self.part_tokens += tokens
        self.elapsed_seconds, self.stop_signal = elapsed_seconds, stop_signal

    def add_scoring(self, seconds: float) -> None:
        """Seconds spent validating, which the time limit does not count."""
        self.scoring_seconds += seconds

    def remaining_steps(self, step: int) -> float:
        """The optimiser steps left after `step`, to the first limit (the time limit at the mean time of a step so
        far in this part). What a `BudgetSchedule` decays over."""
        left = [math.inf]
        if self.max_steps is not None:
            left.append(self.max_steps - step)
        if self.num_epochs is not None:
            batches = (self.num_epochs - self.state.epoch) * self.epoch_batches - self.state.batches_done
            left.append(batches / self.gradient_accumulation_steps)
        timed = step - 1 - self.start_step  # steps whose time `elapsed_seconds` (measured as step `step` began) covers
        if self.time_limit is not None and timed > 0:
            seconds_left = self.time_limit * 60 - self.earlier_seconds - self.elapsed_seconds
            left.append(seconds_left / (self.elapsed_seconds / timed) - 1)
        return min(left)

    def seconds_left(self, step_seconds: float) -> float:
        """What is left of the run at its first step, in seconds, from the seconds of one step: its minutes or its
        steps, whichever ends first."""
        left = self.remaining_steps(self.start_step) * step_seconds
        if self.time_limit is not None:
            left = min(left, self.time_limit * 60 - self.earlier_seconds - (time.perf_counter() - self.started))
        return left

    def steps_done(self, step: int) -> bool:
        return self.max_steps is not None and step >= self.max_steps

    def epochs_done(self) -> bool:
        return self.num_epochs is not None and self.state.epoch >= self.num_epochs

    def out_of_time(self) -> bool:
        return self.time_limit is not None and self.earlier_seconds + self.elapsed_seconds > self.time_limit * 60

    def training_seconds(self) -> float:
        """Seconds of this part so far that the time limit counts: all but validating."""
        return time.perf_counter() - self.started - self.scoring_seconds

    def describe(self) -> str:
        """The run's budget, its limits and what is spent of each: "step 6 of `max_steps` 8; 0.4 of `time_limit` 5 min"."""
        spent = []
        if self.max_steps is not None:
            spent.append(f"step {self.state.step} of `max_steps` {self.max_steps}")
        if self.num_epochs is not None:
            spent.append(f"epoch {self.state.epoch} of `num_epochs` {self.num_epochs}")
        if self.time_limit is not None:
            minutes = (self.earlier_seconds + self.elapsed_seconds) / 60
            spent.append(f"{minutes:.2f} of `time_limit` {self.time_limit:g} min")
        return "; ".join(spent)

    def spent(self, step: int) -> bool:
        """Whether no step follows `step`: `max_steps` reached, the time limit passed, or a stop signal came."""
        return self.steps_done(step) or self.out_of_time() or bool(self.stop_signal)

    def requested_signal(self) -> int:
        """The stop signal this process received (0: none), which the step sends to every process."""
        return self.stop_requests.signum
