"""The run's record: what a checkpoint holds (`RunState`, against the files the code before it wrote), changed by
its own methods alone."""

import json
import re

import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.training.checkpoints import read_state, save_checkpoint
from vanilla_transformer.training.run_state import RunState, options_recorded_in

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
    assert read_state(saved) == {**WRITTEN_BEFORE, "recorded_options": None, "best": [], "evaluations_without_improvement": 0,
                                 "parts": []}


def test_a_checkpoint_from_before_runs_recorded_their_options_and_kernel_reads_with_defaults():
    older = {key: WRITTEN_BEFORE[key] for key in ("epoch", "batches_done", "train_tokens", "history", "step")}
    state = RunState.from_dict(older)
    assert state.run_options is None and state.attn_implementation is None and state.batches_done == 7
    assert RunState.from_dict({**older, "options": {"seed": 1}}).recorded_options == {"seed": 1}  # the older name


def test_the_options_a_record_holds_are_its_recorded_ones_else_those_of_older_names():
    assert options_recorded_in({"recorded_options": {"seed": 1}, "run_options": {"seed": 2}}) == {"seed": 1}
    assert options_recorded_in({"options": {"seed": 3}, "run_options": {"seed": 2}}) == {"seed": 3}
    assert options_recorded_in({"run_options": {"seed": 2}}) == {"seed": 2}
    assert options_recorded_in({"step": 4}) == {}


def test_counting_a_step_moves_the_step_the_batches_and_the_tokens():
    state = RunState(step=3, batches_done=6, train_tokens=100)
    state.count_step(batches=2, tokens=50)
    assert (state.step, state.batches_done, state.train_tokens) == (4, 8, 150)


def test_an_epoch_ends_and_the_kernel_the_options_typed_at_a_resume_and_the_best_are_recorded_by_the_state_itself():
    state = RunState(epoch=1, batches_done=7, recorded_options={"max_steps": 4, "eval_samples": 2})
    state.end_epoch()
    state.record_attn_implementation("sdpa")
    state.record_options({"max_steps": 8})
    state.step = 4
    assert state.record_validation({"loss": 1.5}, "loss", None, kept=1)
    state.step = 5
    assert not state.record_validation({"loss": 1.6}, "loss", None, kept=1)
    assert (state.epoch, state.batches_done, state.attn_implementation) == (2, 0, "sdpa")
    assert state.recorded_options == {"max_steps": 8, "eval_samples": 2}
    assert state.best == [{"step": 4, "metric": "loss", "value": 1.5, "eval_samples": None}]
    assert (state.best_steps(), state.evaluations_without_improvement, state.out_of_patience(1)) == ([4], 1, True)
    older = RunState()  # a checkpoint from before runs recorded their options: nothing to add to
    older.record_options({"max_steps": 8})
    assert older.recorded_options is None


def test_read_refuses_a_damaged_state_naming_its_file(tmp_path):
    checkpoint = tmp_path / "checkpoint-00000004"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({**WRITTEN_BEFORE, "epoch": -1}))
    with pytest.raises(ValueError, match=r"trainer_state\.json is damaged: its epoch is -1"):
        RunState.read(checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps(WRITTEN_BEFORE))
    assert RunState.read(checkpoint).step == 12


PART = {"steps": [0, 12], "seconds": 30.0, "scoring_seconds": 4.0}
EVALUATION = {"step": 12, "split": "validation", "loss": 3.2, "perplexity": float("inf"), "bleu": 1.5, "translated": 4,
              "bleu_signature": "nrefs:1|case:mixed"}
BEST = {"step": 12, "metric": "bleu", "value": 1.5, "eval_samples": None}


@pytest.mark.parametrize("edit, expected", [
    ({"history": [{"step": 12}]}, "its history holds {'step': 12}, not the record of an evaluation"),
    ({"history": [{**EVALUATION, "loss": "abc"}]}, "its history holds"),
    ({"history": [{**EVALUATION, "final_weights": 3}]}, "its history holds"),
    ({"best": [{**BEST, "metric": ["bleu"]}]}, "its best holds"),
    ({"best": [{**BEST, "eval_samples": -1}]}, "its best holds"),
    ({"parts": [{**PART, "scoring_seconds": "x"}]}, "part 1 of its parts must have scoring_seconds, a number from 0"),
])
def test_every_field_the_run_reads_of_a_records_evaluations_and_parts_is_checked(tmp_path, edit, expected):
    # Each was accepted, then failed late: a history without its split raised a KeyError when the run was validated
    # or finished, scoring seconds that are text a TypeError summing the run's parts after all its training.
    checkpoint = tmp_path / "checkpoint-00000012"
    checkpoint.mkdir()
    sound = {**WRITTEN_BEFORE, "history": [EVALUATION], "best": [BEST], "parts": [PART]}
    (checkpoint / "trainer_state.json").write_text(json.dumps(sound))
    assert RunState.read(checkpoint).best == [BEST]  # older records without the optional fields read too
    (checkpoint / "trainer_state.json").write_text(json.dumps({**sound, **edit}))
    with pytest.raises(ValueError, match=r"trainer_state\.json is damaged: " + re.escape(expected)):
        RunState.read(checkpoint)
