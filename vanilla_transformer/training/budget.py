"""When the steps end: the `Budget` across the parts of a run (the first and each resume).

A run stops at its first limit, `max_steps`, `num_epochs` or `time_limit` (minutes), or after the step under way
when SIGINT or SIGTERM comes (signals.py). The limits are the run's: the steps and the minutes of every part count.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from .run_state import RunState
from .signals import StopRequests

__all__ = ["Budget"]


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

    def add_step(self, tokens: int, elapsed: float, stop_signal: int) -> None:
        """A step done: its target tokens, and the main process's clock as it began and its stop signal (alike on
        every process)."""
        self.part_tokens += tokens
        self.elapsed_seconds, self.stop_signal = elapsed, stop_signal

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
