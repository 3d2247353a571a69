"""A budget that belongs to the run (--max-steps and --time-limit count every part of it, resumes included) and
the final weights scored before selection, through real short runs of the tiny preset."""

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from vanilla_transformer.cli import main
from vanilla_transformer.training.logs import LOG_FILE, read_log
from vanilla_transformer.training.budget import Budget
from vanilla_transformer.training.run_state import RunState


def _train(task, out, run, *extra):
    return main(["train", "--dataset", str(task), "--output-dir", str(out), *run, *map(str, extra)])


def _resume(out, *extra):
    return main(["train", "--output-dir", str(out), "--resume", *map(str, extra)])


def _signal_at_step(out: Path, step: int, signum: int) -> threading.Thread:
    """Send `signum` to this process (a real signal, as a user's Ctrl-C) once the run's log has a record of `step`."""
    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(r.get("step", 0) >= step and "split" not in r for r in read_log(out / LOG_FILE)):
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _snapshot(folder: Path) -> dict:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_run_stopped_twice_and_resumed_counts_one_budget_in_its_bar_log_results_and_card(
    tmp_path, small_task, small_run, capsys, caplog
):
    caplog.set_level(logging.INFO)  # the log lines (the bar, on stderr, is capsys's)
    out = tmp_path / "run"
    # Part 1: Ctrl-C (a real SIGINT) once step 2 is logged; the step under way is saved.
    watcher = _signal_at_step(out, 2, signal.SIGINT)
    assert _train(small_task, out, small_run, "--max-steps", 100000, "--time-limit", 5, "--log-steps", 1,
                  "--save-steps", 1000) == 130
    watcher.join()
    first = json.loads(next((out / "checkpoints").glob("checkpoint-*/trainer_state.json")).read_text())
    stopped = first["step"]
    assert [part["steps"] for part in first["parts"]] == [[0, stopped]]
    # Part 2: a budget typed with --resume replaces the recorded one, and says so; it ends the run at its step.
    capsys.readouterr()
    caplog.clear()
    assert _resume(out, "--max-steps", stopped + 3) == 0
    assert f"`max_steps` {stopped + 3}, given with `resume`, replaces the run's 100000" in caplog.text
    assert f"part 2 of the run, from step {stopped} (before: steps 0-{stopped} in " in caplog.text
    assert "training (part 2)" in capsys.readouterr().err
    # Resumed past its budget, with its final folder saved: one line, exit 0, nothing touched. A time limit below
    # the minutes the run has spent is spent too: the earlier parts count.
    before = _snapshot(out)
    for extra in (["--max-steps", stopped + 1], [], ["--max-steps", stopped + 9, "--time-limit", 0.001]):
        capsys.readouterr()
        caplog.clear()
        assert _resume(out, *extra) == 0
        lines = [r.getMessage() for r in caplog.records if "distributed:" not in r.getMessage()]
        assert len(lines) == 1 and " is done (" in lines[0] and "Nothing to do" in lines[0], lines
        assert "training" not in capsys.readouterr().err
    assert _snapshot(out) == before
    assert "of `time_limit` 0.001 min" in lines[0]
    # Part 3: extended again (the time limit recorded by part 1 comes back, the steps recorded by part 2 grow).
    capsys.readouterr()
    assert _resume(out, "--max-steps", stopped + 5) == 0
    err = capsys.readouterr().err
    assert "training (part 3)" in err and "/5.0 min" in err

    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == stopped + 5
    assert [part["steps"] for part in results["parts"]] == [[0, stopped], [stopped, stopped + 3], [stopped + 3, stopped + 5]]
    seconds = [part["seconds"] for part in results["parts"]]
    assert results["train_minutes"] == round(sum(seconds) / 60, 2) and all(s > 0 for s in seconds)
    records = [r for r in read_log(out / LOG_FILE) if "split" not in r]
    assert [r["step"] for r in records] == list(range(1, stopped + 6))
    assert [r["part"] for r in records] == [1] * stopped + [2] * 3 + [3] * 2
    # `elapsed` is the run's: it never goes back at a resume, and each part's share adds up to it.
    elapsed = [r["elapsed"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[-1] <= sum(seconds) + 0.01
    for r in records:
        earlier = sum(seconds[: r["part"] - 1])
        assert r["elapsed"] == pytest.approx(earlier + r["part_elapsed"], abs=0.02)
    card = (out / "README.md").read_text()
    assert f"Trained for {results['train_minutes']:g} minutes ({stopped + 5} steps), in 3 parts" in card


def test_the_time_limit_counts_the_earlier_parts_of_the_run():
    state = RunState(step=10, parts=[{"steps": [0, 6], "seconds": 40.0}, {"steps": [6, 10], "seconds": 15.0}])
    budget = Budget(time_limit=1.0, state=state, start_step=10, earlier_seconds=state.begin_part())
    assert budget.earlier_seconds == 55.0 and state.parts[-1] == {"steps": [10, 10], "seconds": 0.0, "scoring_seconds": 0.0}
    budget.elapsed_seconds = 4.0
    assert not budget.out_of_time() and not budget.spent(10)
    assert budget.remaining_steps(13) == pytest.approx((60 - 55 - 4) / (4 / 2) - 1)
    budget.elapsed_seconds = 5.5
    assert budget.out_of_time() and budget.spent(13)
    state.step = 13
    state.record_part(5.5, 2.25)
    assert state.parts[-1] == {"steps": [10, 13], "seconds": 5.5, "scoring_seconds": 2.25}
    assert "1.01 of `time_limit` 1 min" in budget.describe()


@pytest.mark.slow
def test_the_last_steps_are_validated_and_can_win_in_the_precision_reported(tmp_path, small_task, small_run):
    # bf16 autocast trains; validation, the choice of the best and the final scores are all fp32.
    small_run[small_run.index("--mixed-precision") + 1] = "bf16"
    out = tmp_path / "run"
    assert _train(small_task, out, small_run, "--max-steps", 7, "--eval-steps", 4, "--save-steps", 100,
                  "--best-metric", "loss") == 0
    results = json.loads((out / "results.json").read_text())
    validations = [r for r in results["history"] if r["split"] == "validation" and "final_weights" not in r]
    assert [r["step"] for r in validations] == [4, 7]  # the 3 steps after the last validation were scored
    assert validations[1]["loss"] < validations[0]["loss"]
    assert results["best_checkpoint"]["step"] == 7 and results["averaged_checkpoints"] == ["checkpoint-00000007"]
    # The best was chosen on the very number reported for its weights.
    assert results["validation"]["loss"] == pytest.approx(results["best_checkpoint"]["value"], rel=1e-6)


@pytest.mark.slow
def test_the_final_scores_name_the_step_of_the_weights_they_score(tmp_path, small_task, small_run, caplog):
    small_run[small_run.index("--mixed-precision") + 1] = "bf16"  # as above: selection and scores in fp32
    assert _train(small_task, tmp_path / "base", small_run, "--max-steps", 4, "--save-steps", 4, "--lr-scale", 4) == 0
    # A learning rate far too high: the baseline, validated before the first step, stays the best.
    out = tmp_path / "tuned"
    caplog.set_level(logging.INFO)
    caplog.clear()
    assert _train(small_task, out, small_run, "--model-name-or-path", tmp_path / "base", "--max-steps", 5,
                  "--eval-steps", 4, "--save-steps", 100, "--lr-scale", 200, "--warmup-steps", 1,
                  "--best-metric", "loss") == 0
    err = caplog.text
    results = json.loads((out / "results.json").read_text())
    assert [r["step"] for r in results["history"] if r["split"] == "validation" and "final_weights" not in r] == [0, 4, 5]
    assert results["best_checkpoint"]["step"] == 0 and results["averaged_checkpoints"] == ["checkpoint-00000000"]
    final = [r for r in results["history"] if "final_weights" in r]
    # The baseline's validation stands for the final one: the same weights, on the same pairs, are not scored twice.
    assert [(r["step"], r["split"], r["final_weights"]) for r in final] == [(0, "test", "checkpoint-00000000")]
    assert ("step 0 validation (final weights: checkpoint-00000000): as validated during training, the same weights "
            "on the same pairs") in err
    assert "step 0 test (final weights: checkpoint-00000000): " in err and "step 5 test" not in err
    assert results["validation"]["loss"] == pytest.approx(results["best_checkpoint"]["value"], rel=1e-6)


def test_the_card_shows_the_runs_training_time_and_each_parts_share():
    from vanilla_transformer import VanillaTransformerConfig
    from vanilla_transformer.model_card import build_model_card

    config = VanillaTransformerConfig.from_preset("tiny")
    parts = [{"steps": [0, 40], "seconds": 30.0}, {"steps": [40, 90], "seconds": 45.0}]
    card = build_model_card(config, results={"steps": 90, "train_minutes": 1.25, "parts": parts}).text
    assert ("Trained for 1.25 minutes (90 steps), in 2 parts (the first session, then 1 resume(s): steps 0-40: "
            "0.50 min; steps 40-90: 0.75 min).") in card
    one = build_model_card(config, results={"steps": 40, "train_minutes": 0.5, "parts": parts[:1]}).text
    assert "Trained for 0.5 minutes (40 steps)." in one
    assert "Trained for" not in build_model_card(config, results={"bleu": 1.0}).text
