"""Resuming a run through the real command, in a process of its own: what `train --resume` keeps of a run, and a
finished run that it leaves alone; and the batch plan a resume through the Python API takes from the record."""

import hashlib
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from commands import ENV, run_cli
from vanilla_transformer.training.arguments import TrainArguments
from vanilla_transformer.training.checkpoints import latest_checkpoint, read_state
from vanilla_transformer.training.logs import LOG_FILE, read_log
from vanilla_transformer.training.resume import restore_batch_plan


def _train_cli(*args) -> subprocess.CompletedProcess:
    result = run_cli("train", *args, timeout=300)
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
    assert (state["recorded_options"]["eval_samples"], state["recorded_options"]["eval_steps"]) == (3, 1)
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


# A user's own script: the Python API, where options left out are None rather than restored from the record.
API_RESUME = """
import json, sys
from dataclasses import replace
from vanilla_transformer.training.arguments import TrainArguments
from vanilla_transformer.training.loop import train
args = TrainArguments(output_dir=sys.argv[1], dataset=sys.argv[2], vocab_size=300, preset="tiny",
                      config_overrides=dict(d_model=32, d_ff=64, num_heads=2, encoder_layers=1, decoder_layers=1),
                      warmup_steps=10, eval_steps=1000, eval_samples=0, num_beams=1, mixed_precision="no",
                      attn_implementation="eager", max_steps=2)
train(replace(args, max_tokens=256))
print(json.dumps(train(replace(args, resume=True, max_steps=4))))
train(replace(args, resume=True, max_steps=4))  # done: nothing to train, score or save
"""


@pytest.mark.slow
def test_a_resume_through_the_python_api_goes_on_with_the_batches_the_run_started_with(small_task, tmp_path):
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", API_RESUME, str(run), str(small_task)], capture_output=True,
                            text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]  # not "started with other options: max_tokens 256 -> None"
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps"] == 4
    assert result.stderr.count("is done") == 1 and "Nothing to do" in result.stderr
    state = read_state(latest_checkpoint(run / "checkpoints"))
    assert latest_checkpoint(run / "checkpoints").name.endswith("4")
    assert state["run_options"]["max_tokens"] == state["recorded_options"]["max_tokens"] == 256  # not the CPU's default plan


def _recorded(tmp_path, options: dict, key: str = "recorded_options") -> Path:
    """A run folder whose one checkpoint records `options` under `key`, as `train` writes them."""
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-00000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2, key: options}))
    return checkpoint / "trainer_state.json"


def test_a_resume_through_the_python_api_takes_the_recorded_batch_plan_alone_where_it_leaves_it_unset(tmp_path):
    _recorded(tmp_path, {"max_tokens": 256, "gradient_accumulation_steps": 2, "seed": 7, "threads": 100000})
    args = TrainArguments(output_dir=str(tmp_path / "run"), resume=True, max_steps=4)
    restored = restore_batch_plan(args)
    assert (restored.max_tokens, restored.gradient_accumulation_steps) == (256, 2)
    assert restored == replace(args, max_tokens=256, gradient_accumulation_steps=2)  # the script's own seed, threads
    assert restore_batch_plan(replace(args, max_tokens=512)).max_tokens == 512  # typed: `check_same_run` compares it


@pytest.mark.parametrize("key", ["options", "run_options"])
def test_an_older_checkpoints_record_restores_its_batch_plan_too(tmp_path, key):
    # Older checkpoints wrote every option as `options`, and older ones still only the `run_options` that define
    # the run: a resume that leaves the plan unset goes on with theirs, not "max_tokens 256 -> None".
    _recorded(tmp_path, {"max_tokens": 256, "gradient_accumulation_steps": 2}, key)
    restored = restore_batch_plan(TrainArguments(output_dir=str(tmp_path / "run"), resume=True, max_steps=4))
    assert (restored.max_tokens, restored.gradient_accumulation_steps) == (256, 2)


def test_a_damaged_batch_plan_in_the_record_is_refused_in_one_line_naming_the_file(tmp_path):
    path = _recorded(tmp_path, {"max_tokens": "abc"})
    expected = f"`resume`: {path} records an option that is refused: `max_tokens` "
    with pytest.raises(ValueError, match="^" + re.escape(expected)):
        restore_batch_plan(TrainArguments(output_dir=str(tmp_path / "run"), resume=True))
    # A plan given whole (typed, or restored by the command line with every option not typed) reads no record.
    whole = TrainArguments(output_dir=str(tmp_path / "run"), resume=True, max_tokens=512, gradient_accumulation_steps=1)
    assert restore_batch_plan(whole) is whole
