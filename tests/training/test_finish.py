"""Finishing a run through the real `train` command, in a process of its own: the time limit counts the steps
and validation is timed beside them, `--test-samples 0` skips the test, the final validation keeps its size and
never scores the same weights twice, and SIGINT during the final scoring stops it with the model saved."""

import json
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from accelerate import PartialState

from commands import ENV, run_cli
from vanilla_transformer.training.arguments import TrainArguments
from vanilla_transformer.training.checkpoints import STATE_FILE, checkpoint_path
from vanilla_transformer.training.finish import _chosen_checkpoints
from vanilla_transformer.training.logs import LOG_FILE, read_log
from vanilla_transformer.training.run_state import RunState


def _train(*args) -> subprocess.CompletedProcess:
    return run_cli("train", *args, timeout=300)


@pytest.mark.parametrize("saved, average_last, averaged", [
    ((0, 2, 4), 5, (2, 4)),  # a fine-tuning's baseline is not averaged into what it was fine-tuned to
    ((0, 2, 4), 2, (2, 4)),
    ((2, 4, 6), 2, (4, 6)),
    ((0,), 3, (0,)),  # nothing trained was saved: the baseline is all there is
])
def test_the_last_checkpoints_averaged_are_trained_ones(tmp_path, saved, average_last, averaged):
    PartialState()  # the run's logger (accelerate's) warns when fewer than `average_last` are there
    for step in saved:
        checkpoint_path(tmp_path, step).mkdir()
        (checkpoint_path(tmp_path, step) / STATE_FILE).write_text("{}")
    args = TrainArguments(output_dir=str(tmp_path), average_last=average_last)
    chosen = _chosen_checkpoints(SimpleNamespace(checkpoint_root=tmp_path), RunState(), args)
    assert chosen == [checkpoint_path(tmp_path, step) for step in averaged]


@pytest.mark.slow
def test_test_samples_0_skips_the_test_and_the_final_validation_keeps_its_size_scored_once(
    tmp_path, small_task, small_run
):
    # `--test-samples` had to be at least 1, and `--test-samples 1` shrank the final validation to one sentence;
    # a run whose last step was validated validated it again, with the same numbers.
    out = tmp_path / "run"
    result = _train("--dataset", small_task, "--output-dir", out, *small_run, "--max-steps", 3, "--eval-steps", 3,
                    "--eval-samples", 4, "--test-samples", 0)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert "test" not in results and results["split"] == "validation"
    assert results["validation"]["translated"] == results["scored_pairs"] == 4
    validations = [r for r in read_log(out / LOG_FILE) if r.get("split") == "validation"]
    assert [r["step"] for r in validations] == [3]  # scored once: the final weights are step 3's, as validated
    assert "as validated during training, the same weights on the same pairs" in result.stderr
    assert "step 3 test" not in result.stderr


@pytest.mark.slow
def test_the_time_limit_counts_the_steps_and_validation_is_timed_beside_them(tmp_path, small_task, small_run):
    # Validation and the final scores were booked as training: the card said "Trained for 13.13 minutes" where
    # about 8.9 were training.
    out = tmp_path / "run"
    started = time.perf_counter()
    result = _train("--dataset", small_task, "--output-dir", out, *small_run, "--max-steps", 4, "--eval-steps", 1,
                    "--eval-samples", 12, "--num-beams", 4, "--test-samples", 4, "--log-steps", 1)
    wall = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    validations = [r for r in read_log(out / LOG_FILE) if r.get("split") == "validation" and "final_weights" not in r]
    assert [r["step"] for r in validations] == [1, 2, 3, 4] and all(r["seconds"] > 0 for r in validations)
    [part] = results["parts"]
    assert part["scoring_seconds"] == pytest.approx(sum(r["seconds"] for r in validations), abs=0.05)
    assert part["seconds"] + part["scoring_seconds"] + results["final_scoring_seconds"] < wall
    assert results["train_minutes"] == round(part["seconds"] / 60, 2)
    scoring = results["scoring_minutes"]
    assert scoring == pytest.approx((part["scoring_seconds"] + results["final_scoring_seconds"]) / 60, abs=0.011)
    assert f"validating and scoring took {scoring:g} minutes besides" in (out / "README.md").read_text()
    # The step records' clock is the training's: it moves less than the validations between them took.
    steps = [r for r in read_log(out / LOG_FILE) if "split" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and steps[-1]["elapsed"] <= part["seconds"] + 0.01


SCORING = "translating for the scores"
# The run with each scoring's translation held for 10 s after it says so: a signal sent then arrives mid-scoring on any
# machine, however fast it scores a tiny model.
SLOW_SCORING = f"""
import sys, time
from vanilla_transformer import cli
from vanilla_transformer.training import evaluation

translate_split = evaluation.translate_split


def slowly(*args, **kwargs):
    print("{SCORING}", file=sys.stderr, flush=True)
    time.sleep(10)
    return translate_split(*args, **kwargs)


evaluation.translate_split = slowly
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigint_during_the_final_scoring_stops_it_and_keeps_the_trained_model(tmp_path, write_synthetic_task, small_run):
    # A SIGINT during the final scoring was not acted on; the run went on to score the whole test split.
    data = write_synthetic_task(tmp_path / "data", n_train=300, n_eval=400, reverse=True)
    out = tmp_path / "run"
    script = tmp_path / "slow_scoring.py"
    script.write_text(SLOW_SCORING)
    process = subprocess.Popen([sys.executable, str(script), "train", "--dataset", str(data), "--output-dir", str(out),
                                *small_run, "--max-steps", "2", "--num-beams", "4"],
                               stderr=subprocess.PIPE, text=True, env=ENV)
    lines, saved = [], False
    for line in process.stderr:  # the model is saved, then the final scoring translates: the signal comes then
        lines.append(line)
        saved = saved or "saved the model and tokenizer" in line
        if saved and line.startswith(SCORING):
            process.send_signal(signal.SIGINT)
            break
    try:
        lines += process.stderr.readlines()
        process.wait(timeout=120)
    finally:
        process.kill()
    err = "".join(lines)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"vanilla-transformer train: stopped by SIGINT during the final scoring; "
                                           f"the trained model is saved in {out}, not scored: ")
    results = json.loads((out / "results.json").read_text())
    assert "test" in results["not_scored"] and (out / "model.safetensors").exists()
    assert "not scored." in (out / "README.md").read_text()
