"""`python -m benchmarks.attention_study`: the notes' table on the reversal task, as a table and one figure written
where the user says, with the scaled dot beating chance."""

import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _study(*args, cwd=ROOT, timeout=900):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "benchmarks.attention_study", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_every_score_function_and_attention_kind_is_a_row():
    from benchmarks.attention_study import OPTIONS
    from vanilla_transformer.modeling.configuration_vanilla_transformer import ATTENTION_SCORES

    assert list(OPTIONS)[: len(ATTENTION_SCORES)] == list(ATTENTION_SCORES)
    assert {"local-m", "local-p", "hard", "relu", "sparsemax"} <= set(OPTIONS)


def test_the_figure_labels_decoder_rows_by_the_token_read_as_every_picture_does(tmp_path, monkeypatch):
    import torch
    from matplotlib.figure import Figure

    from benchmarks.attention_study import example, plot
    from vanilla_transformer.visualize.attention_maps import AXIS_LABELS, DECODER_ROWS

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, path, **kwargs: saved.append(figure))
    length = example(0)["labels"].shape[1]
    row = {"option": "scaled_dot", "accuracy": 1.0, "exact_match": 1.0, "steps": 1,
           "attention": torch.full((length, example(0)["input_ids"].shape[1]), 0.5)}
    plot([row], tmp_path / "study.png")
    axes = saved[0].axes[0]
    rows = [label.get_text() for label in axes.get_yticklabels()]
    assert rows[0] == "<start>" and axes.get_ylabel() == AXIS_LABELS["cross"][0]  # the first row read is the start
    assert DECODER_ROWS in saved[0].get_suptitle()


@pytest.mark.slow
def test_the_study_writes_its_table_and_figure_where_told_and_the_scaled_dot_beats_chance(tmp_path):
    out = tmp_path / "study"
    completed = _study("--options", "scaled_dot,local-m", "--steps", "60", "--output-dir", str(out), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["attention-study.md", "attention-study.png"]
    table = (out / "attention-study.md").read_text()
    assert "Chance token accuracy: 0.034" in table
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "option" not in line]
    assert [row[0].strip() for row in rows] == ["scaled_dot", "local-m"]
    accuracy = {row[0].strip(): float(row[2]) for row in rows}
    assert accuracy["scaled_dot"] > 5 * 0.034, table
    assert all(row[4].strip() == "60" and float(row[5]) > 0 for row in rows)
    assert "`local_attention='local-m', attention_window=2`" in table
    image = matplotlib.image.imread(out / "attention-study.png")
    assert image.shape[0] > 300 and image.shape[1] > 500 and image[..., :3].std() > 0.05
    assert not any(p.name.startswith("attention-study") for p in (ROOT / "docs").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--output-dir", "x", "--options", "scaled_dot,nope"], "--options: takes a comma-separated subset of"),
    (["--output-dir", "x", "--steps", "0"], "--steps: must be a positive integer"),
    ([], "the following arguments are required: --output-dir"),
    (["--output-dir", "afile"], "--output-dir afile is a file; expected a folder"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "afile").write_text("mine\n")
    completed = _study(*args, cwd=tmp_path, timeout=300)
    assert completed.returncode == 2 and message in completed.stderr.splitlines()[-1]
    assert "Traceback" not in completed.stderr and (tmp_path / "afile").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
