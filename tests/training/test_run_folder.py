"""The run's records: what a checkpoint holds (`RunState`, against the files the code before it wrote) and
when the steps end (`Budget`)."""

import json
import math

import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.training.checkpoints import read_state, save_checkpoint
from vanilla_transformer.training.run_folder import Budget, RunState

# trainer_state.json as `train` wrote it before RunState: its dict, with "step" added by save_checkpoint.
WRITTEN_BEFORE = {
    "epoch": 1, "batches_done": 7, "train_tokens": 12345, "history": [{"step": 4, "split": "validation", "loss": 3.5}],
    "run_options": {"dataset": "bible-en-es", "seed": 0}, "attn_implementation": "sdpa", "step": 12,
}


@pytest.fixture
def accelerator():
    model = torch.nn.Linear(3, 2)
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model, torch.optim.Adam(model.parameters()))
    return accelerator


def test_a_checkpoint_written_before_reads_back_and_is_written_again_alike(tmp_path, accelerator):
    checkpoint = tmp_path / "before"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps(WRITTEN_BEFORE))
    state = RunState.from_dict(read_state(checkpoint))
    assert (state.step, state.epoch, state.batches_done, state.train_tokens) == (12, 1, 7, 12345)
    assert state.attn_implementation == "sdpa" and state.run_options == WRITTEN_BEFORE["run_options"]
    saved = save_checkpoint(accelerator, tmp_path / "checkpoints", state.step, state.to_dict())
    # What it held is written again alike; model selection's records, newer, start empty.
    assert read_state(saved) == {**WRITTEN_BEFORE, "options": None, "best": [], "evaluations_without_improvement": 0,
                                 "parts": []}


def test_a_checkpoint_from_before_runs_recorded_their_options_and_kernel_reads_with_defaults():
    older = {key: WRITTEN_BEFORE[key] for key in ("epoch", "batches_done", "train_tokens", "history", "step")}
    state = RunState.from_dict(older)
    assert state.run_options is None and state.attn_implementation is None and state.batches_done == 7


def test_counting_a_step_moves_the_step_the_batches_and_the_tokens():
    state = RunState(step=3, batches_done=6, train_tokens=100)
    state.count_step(batches=2, tokens=50)
    assert (state.step, state.batches_done, state.train_tokens) == (4, 8, 150)


def test_the_steps_left_are_those_of_the_first_limit():
    assert Budget().remaining_steps(10) == math.inf and not Budget().spent(10)
    assert Budget(max_steps=100).remaining_steps(40) == 60
    progress = RunState(epoch=1, batches_done=4)
    # Two epochs of 10 batches, 2 per step: the second epoch has 6 batches left, 3 steps.
    epochs = Budget(num_epochs=2, accumulation=2, epoch_batches=10, progress=progress)
    assert epochs.remaining_steps(7) == 3 and not epochs.epochs_done()
    progress.epoch = 2
    assert epochs.epochs_done()
    # 10 steps timed in 60 s of a 5-minute limit: 6 s a step, 240 s left, 40 steps, less the one under way.
    timed = Budget(time_limit=5, start_step=0, elapsed=60.0)
    assert timed.remaining_steps(11) == pytest.approx(39)
    assert Budget(max_steps=100, num_epochs=2, epoch_batches=10, progress=RunState()).remaining_steps(0) == 20


def test_the_budget_is_spent_at_max_steps_past_the_time_limit_or_on_a_stop_signal():
    assert Budget(max_steps=5).spent(5) and not Budget(max_steps=5).spent(4)
    assert Budget(time_limit=1, elapsed=61.0).spent(0) and not Budget(time_limit=1, elapsed=59.0).spent(0)
    assert Budget(stop_signal=15).spent(0)
