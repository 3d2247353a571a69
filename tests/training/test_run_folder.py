"""The run's records: what a checkpoint holds (`RunState`, against the files the code before it wrote) and
when the steps end (`Budget`)."""

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.training.checkpoints import read_state, save_checkpoint
from vanilla_transformer.training.logs import LOG_FILE, read_log
from vanilla_transformer.training.budget import Budget
from vanilla_transformer.training.run_folder import RunState

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


# Through the real command, in a process of its own: what `train --resume` keeps of a run.
CLI = [sys.executable, "-m", "vanilla_transformer.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _train_cli(*args) -> subprocess.CompletedProcess:
    result = subprocess.run([*CLI, "train", *map(str, args)], capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_options_typed_at_a_resume_stay_the_runs_and_a_new_validation_size_starts_a_new_comparison(
    tmp_path, small_task, small_run
):
    # A resume's typed eval_steps and eval_samples reverted at the next bare resume, which then validated
    # nothing; the best was chosen among BLEUs on different numbers of sentences; a recorded tensorboard was
    # left out; the card listed the last command's options (resume True) and a recipe of 100,000 steps.
    out = tmp_path / "run"
    run = [*small_run, "--eval-steps", 2, "--eval-samples", 2, "--best-metric", "bleu", "--report-to", "tensorboard"]
    _train_cli("--dataset", small_task, "--output-dir", out, *run, "--max-steps", 2)
    second = _train_cli("--output-dir", out, "--resume", "--max-steps", 4, "--eval-samples", 3, "--eval-steps", 1)
    assert "typed in place of the recorded ones, and recorded for the next resume: " in second.stderr
    assert ("`eval_samples` is 3, the best validation bleu so far (step 2) was on 2: model selection starts a new "
            "comparison at step 3") in second.stderr
    third = _train_cli("--output-dir", out, "--resume", "--max-steps", 6)
    assert "new comparison" not in third.stderr and "recorded but not restored" not in third.stderr
    assert f"report_to='tensorboard' as recorded: the tracker goes on logging under {out / 'runs'}" in third.stderr
    validations = [r for r in read_log(out / LOG_FILE) if r.get("split") == "validation" and "final_weights" not in r]
    assert [(r["step"], r["translated"]) for r in validations] == [(2, 2), (3, 3), (4, 3), (5, 3), (6, 3)]
    state = json.loads((out / "checkpoints" / "checkpoint-00000006" / "trainer_state.json").read_text())
    assert {record["eval_samples"] for record in state["best"]} == {3}
    assert (state["options"]["eval_samples"], state["options"]["eval_steps"]) == (3, 1)
    events = sorted((out / "runs").rglob("events.out.tfevents.*"))
    assert len({p.parent for p in events}) >= 3, events  # a tracker's log for every part, the third's included
    card = (out / "README.md").read_text()
    assert "| eval_steps | 1 |" in card and "| eval_samples | 3 |" in card and "| resume |" not in card
    assert "; 6 steps;" in card and "100,000" not in card


@pytest.mark.slow
@pytest.mark.parametrize("how", ["patience", "report_to"])
def test_a_bare_resume_of_a_finished_run_is_one_line_and_leaves_the_folder_byte_identical(
    tmp_path, small_task, small_run, how
):
    # A run stopped early by `patience`, or one with a tracker or an upload recorded, was trained, scored and
    # written again by a bare `--resume`.
    out = tmp_path / "run"
    if how == "patience":  # BLEU 0 at the first two validations of an untrained model: no improvement
        extra = ["--max-steps", 50, "--eval-steps", 1, "--eval-samples", 2, "--best-metric", "bleu", "--patience", 1]
    else:
        extra = ["--max-steps", 2, "--report-to", "tensorboard"]
    _train_cli("--dataset", small_task, "--output-dir", out, *small_run, *extra)
    before = _hashes(out)
    result = _train_cli("--output-dir", out, "--resume")
    lines = [line for line in result.stderr.splitlines() if line.strip() and "distributed:" not in line]
    assert len(lines) == 1 and "Nothing to do" in lines[0], result.stderr[-3000:]
    assert ("stopped early by `patience`" in lines[0]) == (how == "patience")
    assert _hashes(out) == before
