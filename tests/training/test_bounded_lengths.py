"""Training within every length the model reads (#46): `--max-length` checked when `train` starts, and the
final scoring of a model with a bounded length decoding within it."""

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "vanilla_transformer.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=ENV, timeout=600)


def test_train_with_location_scores_ends_with_its_scores_and_card(small_task, small_run, tmp_path):
    overrides = small_run[small_run.index("--config-overrides") + 1] + ",attention_score=location,location_max_length=16"
    small_run[small_run.index("--config-overrides") + 1] = overrides
    output = tmp_path / "run"
    result = run_cli("train", "--dataset", small_task, "--output-dir", output, "--max-length", 16, "--max-steps", 2,
                     "--test-samples", 4, *small_run)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (output / "results.json").is_file() and (output / "README.md").is_file()
