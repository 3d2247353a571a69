"""A trained folder travels: `evaluate --model FOLDER` finds the local data set it was trained on from any
directory, and says in one line how to give it where that data set is not; its card says how many test
sentences its scores cover."""

import json
import os
import subprocess
import sys

import pytest


def _cli(cwd, *argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_evaluate_finds_a_relative_dataset_from_another_directory(tmp_path, write_synthetic_task, small_run):
    write_synthetic_task(tmp_path / "work" / "data", n_train=300, n_eval=6, reverse=True)
    trained = _cli(tmp_path / "work", "train", "--dataset", "data", "--output-dir", "run", *small_run,
                   "--max-steps", "2", "--warmup-steps", "4", "--test-samples", "2")
    assert trained.returncode == 0, trained.stderr
    recorded = json.loads((tmp_path / "work" / "run" / "config.json").read_text())["dataset_name"]
    assert recorded == str((tmp_path / "work" / "data").resolve())
    # The card's scores say they cover 2 of the 6 test pairs (--test-samples 2), as results.json counts them.
    results = json.loads((tmp_path / "work" / "run" / "results.json").read_text())
    assert (results["scored_pairs"], results["split_pairs"]) == (2, 6)
    assert "Scored on the first 2 of the 6 sentences of the test split only" in (tmp_path / "work" / "run" / "README.md").read_text()

    (tmp_path / "elsewhere").mkdir()
    scored = _cli(tmp_path / "elsewhere", "evaluate", "--model", "../work/run", "--num-beams", "1", "--max-new-tokens", "8")
    assert scored.returncode == 0, scored.stderr
    assert scored.stdout.startswith(f"{recorded} test src->tgt: 6 segments translated")

    # The data set gone (the folder copied to another machine): one line saying how to give it.
    (tmp_path / "work" / "data").rename(tmp_path / "work" / "moved")
    refused = _cli(tmp_path / "elsewhere", "evaluate", "--model", "../work/run", "--num-beams", "1")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        f"vanilla-transformer evaluate: error: --dataset: ../work/run records the data set {recorded}, which is not "
        "on this machine; give its path here with --dataset, or give --source-file and --reference-file")
    moved = _cli(tmp_path / "elsewhere", "evaluate", "--model", "../work/run", "--dataset", "../work/moved",
                 "--source-lang", "src", "--target-lang", "tgt", "--num-beams", "1", "--max-new-tokens", "8")
    assert moved.returncode == 0, moved.stderr
