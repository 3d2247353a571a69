"""When the steps end (`Budget`): the first limit, a stop signal, and what the loop adds to it after each step."""

import math

import pytest

from vanilla_transformer.training.budget import Budget
from vanilla_transformer.training.run_state import RunState


def test_the_steps_left_are_those_of_the_first_limit():
    assert Budget().remaining_steps(10) == math.inf and not Budget().spent(10)
    assert Budget(max_steps=100).remaining_steps(40) == 60
    state = RunState(epoch=1, batches_done=4)
    # Two epochs of 10 batches, 2 per step: the second epoch has 6 batches left, 3 steps.
    epochs = Budget(num_epochs=2, gradient_accumulation_steps=2, epoch_batches=10, state=state)
    assert epochs.remaining_steps(7) == 3 and not epochs.epochs_done()
    state.epoch = 2
    assert epochs.epochs_done()
    # 10 steps timed in 60 s of a 5-minute limit: 6 s a step, 240 s left, 40 steps, less the one under way.
    timed = Budget(time_limit=5, start_step=0, elapsed_seconds=60.0)
    assert timed.remaining_steps(11) == pytest.approx(39)
    assert Budget(max_steps=100, num_epochs=2, epoch_batches=10, state=RunState()).remaining_steps(0) == 20


def test_the_budget_is_spent_at_max_steps_past_the_time_limit_or_on_a_stop_signal():
    assert Budget(max_steps=5).spent(5) and not Budget(max_steps=5).spent(4)
    assert Budget(time_limit=1, elapsed_seconds=61.0).spent(0) and not Budget(time_limit=1, elapsed_seconds=59.0).spent(0)
    assert Budget(stop_signal=15).spent(0)


def test_the_loop_adds_each_step_and_each_validation_to_the_budget():
    budget = Budget(time_limit=1)
    budget.add_step(tokens=100, elapsed_seconds=30.0, stop_signal=0)
    budget.add_step(tokens=50, elapsed_seconds=61.0, stop_signal=15)
    budget.add_scoring(2.5)
    budget.add_scoring(1.0)
    assert (budget.part_tokens, budget.elapsed_seconds, budget.stop_signal, budget.scoring_seconds) == (150, 61.0, 15, 3.5)
    assert budget.out_of_time() and budget.spent(0)


def test_the_seconds_left_at_the_first_step_are_those_of_the_first_limit(monkeypatch):
    # Steps' time against the time limit: whichever leaves less is what is left.
    assert Budget(max_steps=100, start_step=0).seconds_left(2.0) == 200
    monkeypatch.setattr("time.perf_counter", lambda: 1000.0)
    timed = Budget(max_steps=1000, time_limit=10, start_step=0, earlier_seconds=300.0, started=1000.0)
    assert timed.seconds_left(2.0) == pytest.approx(300)
