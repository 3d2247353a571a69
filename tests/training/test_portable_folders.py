"""A trained folder travels: `evaluate --model FOLDER` finds the local data set it was trained on from any
directory, and says in one line how to give it where that data set is not; its card says how many test
sentences its scores cover."""

import json
import os
import random
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


@pytest.mark.slow
def test_evaluate_reads_the_headerless_tsv_a_folder_was_trained_on_without_retyping_its_columns(tmp_path, small_run):
    # The folder recorded the data's path but not its columns: a colleague's `evaluate --model FOLDER` stopped
    # with "the first row (...) does not name the languages".
    data, rng = tmp_path / "data", random.Random(0)
    data.mkdir()
    for split, n in (("train", 300), ("validation", 12), ("test", 12)):
        rows = [" ".join(rng.choice("abcdefghijkl") for _ in range(rng.randint(3, 8))) for _ in range(n)]
        (data / f"{split}.tsv").write_text("".join(f"{row}\t{row[::-1]}\n" for row in rows), encoding="utf-8")
    trained = _cli(tmp_path, "train", "--dataset", "data", "--columns", "en,fr", "--output-dir", "run", *small_run,
                   "--max-steps", "2", "--test-samples", "2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["dataset_columns"] == "en,fr"
    (tmp_path / "elsewhere").mkdir()
    result = _cli(tmp_path / "elsewhere", "evaluate", "--model", str(tmp_path / "run"), "--max-samples", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"{data.resolve()} test en->fr: 3 segments translated"), result.stdout
