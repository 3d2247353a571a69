"""Model selection (--best-metric, --patience), logs that last (the log line, training_log.jsonl), and resume
that remembers (--resume alone), through real short runs of the tiny preset."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from vanilla_transformer.choices import TRACKERS
from vanilla_transformer.cli import main
from vanilla_transformer.training.checkpoints import list_checkpoints
from vanilla_transformer.training.logs import LOG_FILE, Losses, TrainingLog, read_log

REPO = Path(__file__).resolve().parents[2]
MISSING_TRACKER = next((name for name, package in TRACKERS.items() if importlib.util.find_spec(package) is None), None)


def _train(task, out, run, *extra):
    assert main(["train", "--dataset", str(task), "--output-dir", str(out), *run, *map(str, extra)]) == 0
    return json.loads((out / "results.json").read_text())


def _cli(*args, log=None):
    """The real command in a subprocess, its output (stdout and stderr) into `log` when given."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "vanilla_transformer.cli", *map(str, args)]
    if log is None:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    with open(log, "w") as file:
        return subprocess.run(command, env=env, stdout=file, stderr=subprocess.STDOUT, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_patience_stops_fine_tuning_and_the_best_checkpoint_is_the_final_model(tmp_path, small_task, small_run):
    _train(small_task, tmp_path / "base", small_run, "--max-steps", "30", "--save-steps", "30", "--lr-scale", "4")
    # Fine-tuning with a learning rate far too high: the baseline, validated before the first step, stays the best.
    out = tmp_path / "tuned"
    results = _train(small_task, out, small_run, "--model-name-or-path", tmp_path / "base", "--max-steps", "40",
                     "--eval-steps", "2", "--save-steps", "4", "--keep-checkpoints", "1", "--lr-scale", "200",
                     "--warmup-steps", "1", "--best-metric", "loss", "--patience", "2")
    best = results["best_checkpoint"]
    validations = [r for r in results["history"] if r["split"] == "validation" and r["step"] < results["steps"]]
    assert validations[0]["step"] == 0  # the baseline
    assert best["metric"] == "loss" and best["value"] == min(r["loss"] for r in validations)
    # Stopped after two evaluations without improvement, long before --max-steps.
    assert results["steps"] == best["step"] + 2 * 2 < 40
    # The best checkpoint outlived --keep-checkpoints 1, and it is the final model.
    names = [p.name for p in list_checkpoints(out / "checkpoints")]
    assert best["checkpoint"] in names and names[-1] == f"checkpoint-{results['steps']:08d}"
    assert results["averaged_checkpoints"] == [best["checkpoint"]]
    final, kept = load_file(out / "model.safetensors"), load_file(out / "checkpoints" / best["checkpoint"] / "model.safetensors")
    for name in final:
        assert torch.equal(final[name], kept[name]), name
    assert results["validation"]["loss"] == pytest.approx(best["value"], rel=1e-4)


@pytest.mark.slow
def test_log_lines_and_records_last_and_resume_alone_restores_the_run(tmp_path, small_task, small_run):
    out, log = tmp_path / "run", tmp_path / "train.log"
    # A time limit that does not bind: the bar counts minutes towards it; --max-steps ends the run.
    done = _cli("train", "--dataset", small_task, "--output-dir", out, *small_run, "--max-steps", "4", "--save-steps", "4",
                "--log-steps", "2", "--eval-steps", "2", "--time-limit", "5", log=log)
    text = log.read_text()
    assert done.returncode == 0, text[-2000:]
    assert "/5.0 min" in text
    lines = re.findall(r"step (\d+): loss [\d.]+, nll [\d.]+, lr [\d.e+-]+, \d+ tokens/s, [\d.]+ min", text)
    assert lines == ["2", "4"]
    # Resumed with no option but the folder and a longer budget: the recorded options (data, model, batches) return.
    done = _cli("train", "--output-dir", out, "--resume", "--max-steps", "8", "--time-limit", "5", log=log)
    assert done.returncode == 0, log.read_text()[-2000:]
    records = read_log(out / LOG_FILE)
    assert [r["step"] for r in records if "split" not in r] == [2, 4, 6, 8]
    assert {"loss", "nll", "lr", "tokens_per_second", "elapsed"} <= set(records[0])
    # Every validation of both sessions, each step's once: the final weights are those validated at the last step.
    assert [r["step"] for r in records if r.get("split") == "validation"] == [2, 4, 6, 8]
    results = json.loads((out / "results.json").read_text())
    assert [r["step"] for r in results["history"] if r["split"] == "validation"] == [2, 4, 6, 8]
    assert results["steps"] == 8
    # An option that defines the run, changed, is refused in one line.
    refused = _cli("train", "--output-dir", out, "--resume", "--max-tokens", "512")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith("vanilla-transformer train: error: `resume`: ")
    assert "max_tokens 256 -> 512" in refused.stderr


def test_a_torn_last_line_is_dropped_and_a_resume_drops_the_steps_trained_again(tmp_path):
    path = tmp_path / LOG_FILE
    path.write_text('{"step": 2, "loss": 1.0}\n{"step": 4, "loss": 0.5}\n{"step": 6, "lo')
    assert read_log(path) == [{"step": 2, "loss": 1.0}, {"step": 4, "loss": 0.5}]
    log = TrainingLog(tmp_path, resumed_step=2)
    log.append({"step": 4, "loss": 0.4})
    assert read_log(path) == [{"step": 2, "loss": 1.0}, {"step": 4, "loss": 0.4}]
    assert path.read_text().endswith("\n") and not list(tmp_path.glob(".vanilla-transformer-staging*"))


def test_the_check_before_a_checkpoint_raises_after_a_step_that_was_not_finite_and_keeps_the_sums(tmp_path):
    one_process = SimpleNamespace(device=torch.device("cpu"), gather=lambda sums: sums)
    losses = Losses(one_process, tmp_path / "checkpoints")
    losses.add(torch.tensor(6.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64))
    losses.add_tokens(2)
    losses.check_finite(1)  # a finite step: nothing to say, and the next log line still reads its losses
    assert losses.read(1) == (3.0, 2.0)
    losses.mark_bad(torch.tensor(True), 1)
    with pytest.raises(FloatingPointError, match="at step 2; that step left the weights as they were, and the run "
                                                 "stopped at step 2 before saving"):
        losses.check_finite(2)


@pytest.mark.slow
def test_final_test_scores_are_bounded_by_test_samples_and_equal_evaluates(tmp_path, write_synthetic_task, small_run):
    task = write_synthetic_task(tmp_path / "data", n_train=600, n_eval=20)  # copying: a model that scores above 0
    small_run[small_run.index("--eval-samples") + 1] = "50"
    small_run[small_run.index("--config-overrides") + 1] = \
        "d_model=64,d_ff=128,num_heads=2,encoder_layers=1,decoder_layers=1,dropout=0"
    out = tmp_path / "run"
    results = _train(task, out, small_run, "--max-steps", "150", "--lr-scale", "1", "--label-smoothing", "0",
                     "--test-samples", "8")
    # The test on its 8; the validation on as many as each validation translated (its 20 of `eval_samples` 50).
    assert results["test"]["translated"] == 8 and results["validation"]["translated"] == 20
    assert results["scored_precision"] == "fp32" and results["split"] == "test" and results["bleu"] > 0
    # The same model, pairs and decoding (the run's greedy --num-beams 1) through the real command.
    done = _cli("evaluate", "--model", out, "--dataset", task, "--split", "test", "--max-samples", "8", "--num-beams", "1")
    assert done.returncode == 0, done.stderr
    assert float(re.search(r"BLEU = ([\d.]+)", done.stdout).group(1)) == pytest.approx(results["bleu"], abs=0.005)
    assert float(re.search(r"chrF2 = ([\d.]+)", done.stdout).group(1)) == pytest.approx(results["chrf"], abs=0.005)
    assert f"{results['bleu']:.2f}" in (out / "README.md").read_text()


def test_validation_bounds_every_final_split_without_a_test_split(tmp_path, small_task, small_run):
    (small_task / "test.jsonl").unlink()
    small_run[small_run.index("--eval-samples") + 1] = "0"
    results = _train(small_task, tmp_path / "run", small_run, "--max-steps", "2", "--test-samples", "3")
    assert results["split"] == "validation" and results["validation"]["translated"] == 3


@pytest.mark.parametrize(("extra", "expected"), [
    (["--report-to", MISSING_TRACKER or "every-tracker-is-installed"],
     r"`report_to` \w+ needs the \w+ package: pip install 'vanilla-transformer\[\w+\]'"),
    (["--patience", "3"], r"`patience` needs `best_metric`"),
    (["--average-best"], r"`average_best` needs `best_metric`"),
    (["--best-metric", "bleu"], r"`best_metric` bleu needs validation translations"),
    (["--best-metric", "accuracy"], r"--best-metric: invalid choice"),
    (["--patience", "0"], r"--patience must be a positive integer; got 0"),
], ids=["missing-tracker", "patience", "average-best", "bleu-untranslated", "unknown-metric", "patience-0"])
def test_selection_and_tracker_mistakes_are_one_line_errors(tmp_path, small_task, small_run, capsys, extra, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--dataset", str(small_task), "--output-dir", str(tmp_path / "run"), *small_run, *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(expected, err[-1]) and not (tmp_path / "run").exists()


def test_the_best_checkpoints_outlive_pruning_and_average_best_keeps_as_many_as_it_averages(tmp_path):
    from accelerate import Accelerator

    from vanilla_transformer.training.arguments import TrainArguments
    from vanilla_transformer.training.checkpoints import save_checkpoint
    from vanilla_transformer.training.run_state import RunState

    model = torch.nn.Linear(3, 2)
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model, torch.optim.Adam(model.parameters()))
    args = TrainArguments(output_dir=str(tmp_path), best_metric="bleu", average_best=True, average_last=2, patience=2)
    state = RunState()
    for step, bleu in [(1, 10.0), (2, 30.0), (3, 20.0), (4, 20.0), (5, 5.0)]:
        state.step = step
        state.record_validation({"bleu": bleu}, args.best_metric, args.eval_samples, kept=args.average_last)
        save_checkpoint(accelerator, tmp_path / "checkpoints", step, state.to_dict(), keep_checkpoints=1,
                        protect=state.best_steps())
    assert state.best_steps() == [2, 3]  # the best two, best first; step 4 ties step 3 and comes later
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [
        "checkpoint-00000002", "checkpoint-00000003", "checkpoint-00000005"]
    assert state.evaluations_without_improvement == 3 and state.out_of_patience(args.patience)
    # Resumed from a checkpoint, the run knows its best and its count.
    resumed = RunState.from_dict(json.loads((tmp_path / "checkpoints" / "checkpoint-00000005" / "trainer_state.json").read_text()))
    assert resumed.best_steps() == [2, 3] and resumed.evaluations_without_improvement == 3
