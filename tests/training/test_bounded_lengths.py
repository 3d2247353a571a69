"""Training within every length the model reads: `--max-length` checked when `train` starts, and the
final scoring of a model with a bounded length decoding within it."""

from functools import partial

import pytest

import commands

run_cli = partial(commands.run_cli, timeout=600)


def test_train_with_location_scores_ends_with_its_scores_and_card(small_task, small_run, tmp_path):
    overrides = small_run[small_run.index("--config-overrides") + 1] + ",attention_score=location,location_max_length=16"
    small_run[small_run.index("--config-overrides") + 1] = overrides
    output = tmp_path / "run"
    result = run_cli("train", "--dataset", small_task, "--output-dir", output, "--max-length", 16, "--max-steps", 2,
                     "--test-samples", 4, *small_run)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (output / "results.json").is_file() and (output / "README.md").is_file()


# --- --max-length is within every length the model reads, checked when train starts ---


@pytest.mark.parametrize("overrides, field", [
    ("attention_score=location,location_max_length=16", "location_max_length"),
    ("position_encoding=learned,max_position_embeddings=16", "max_position_embeddings"),
])
def test_train_refuses_a_max_length_the_model_cannot_read(small_task, small_run, tmp_path, overrides, field):
    small_run[small_run.index("--config-overrides") + 1] += "," + overrides
    result = run_cli("train", "--dataset", small_task, "--output-dir", tmp_path / "run", "--max-length", 32,
                     "--max-steps", 2, *small_run)
    assert result.returncode == 2
    assert f"`max_length` (32) is over the model's {field} (16)" in result.stderr
    assert "Traceback" not in result.stderr and "training:" not in result.stderr




# --- The card's average_last says what happened ---


def test_the_card_says_how_many_checkpoints_were_averaged(small_task, small_run, tmp_path):
    import json

    output = tmp_path / "run"
    result = run_cli("train", "--dataset", small_task, "--output-dir", output, "--max-steps", 2, "--average-last", 3,
                     "--keep-checkpoints", 3, "--test-samples", 2, *small_run)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "`average_last` is 3, but the run has 1 checkpoint(s)" in result.stderr
    assert len(json.loads((output / "results.json").read_text())["averaged_checkpoints"]) == 1
    assert "average of the last 3" not in (output / "README.md").read_text()
