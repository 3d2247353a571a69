"""A run folder turned against its owner: what `train --resume` restores from a record is checked as a
typed option is, options acting outside the folder are never taken from it, the run's config is checked against
its checkpoint's weights before it is built, sizes are checked before anything is allocated, and a checkpoint
linked in from elsewhere is never followed to delete. Each drives the real command in a process of its own.
"""

import json
import os
import shutil
from functools import partial

import pytest

import commands
from conftest import SMALL_RUN

MEMORY_CAP = 3 * 1024**3  # bytes of address space: the small run needs about 1.6 GB of it

run_cli = partial(commands.run_cli, timeout=300, memory=MEMORY_CAP)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, write_synthetic_task):
    """A small run of 2 steps with a checkpoint at each, as `train` leaves it."""
    root = tmp_path_factory.mktemp("records")
    data = write_synthetic_task(root / "data", n_train=300, n_eval=12, reverse=True)
    result = run_cli("train", "--dataset", data, "--output-dir", root / "run", *SMALL_RUN, "--max-steps", 2,
                     "--save-steps", 1)
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "run"


@pytest.fixture
def run(finished_run, tmp_path):
    return shutil.copytree(finished_run, tmp_path / "run", symlinks=True)


def _edit_state(run, edit):
    path = run / "checkpoints" / "checkpoint-00000002" / "trainer_state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    return path


def _refused_in_one_line(result, *expected):
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.splitlines()[-1]
    assert error.startswith("vanilla-transformer train: error: ") and "Traceback" not in result.stderr, result.stderr[-2000:]
    for text in expected:
        assert text in error, error


@pytest.mark.slow
@pytest.mark.parametrize("name, value", [("push_to_hub", "someone/else"), ("report_to", "wandb")])
def test_resume_never_takes_an_option_acting_outside_the_folder_from_a_record(name, value, run):
    # A recorded push_to_hub was trusted as a typed one: nothing was said at start, an upload was tried at
    # the end. A recorded tracker was started likewise.
    _edit_state(run, lambda state: state["recorded_options"].update({name: value}))
    result = run_cli("train", "--resume", "--output-dir", run, "--max-steps", 3)
    assert result.returncode == 0, result.stderr[-2000:]
    start = result.stderr.index("resume: the options of the run")
    block = result.stderr[start:].splitlines()[:4]
    assert block[0] == f"resume: the options of the run, from {run}/checkpoints/checkpoint-00000002/trainer_state.json:"
    assert "seed=0" in block[1] and f"{name}=None" in block[1]
    assert block[2] == "  typed in place of the recorded ones, and recorded for the next resume: max_steps 2 -> 3"
    assert block[3].endswith(f"give them on the command line): {name}={value!r}")
    assert "uploading" not in result.stderr and "wandb" not in result.stderr[:start]
    assert json.loads((run / "results.json").read_text())  # the run finished, its folder complete


@pytest.mark.slow
def test_a_recorded_option_of_the_wrong_type_is_refused_in_one_line(run):
    # A seed edited to "abc" (in both records, so that they agree) ended in numpy's TypeError traceback.
    def edit(state):
        state["recorded_options"]["seed"] = state["run_options"]["seed"] = "abc"

    path = _edit_state(run, edit)
    result = run_cli("train", "--resume", "--output-dir", run, "--max-steps", 3)
    _refused_in_one_line(result, f"`resume`: {path} records an option that is refused: `seed` must be an integer in "
                                 "[0, 2**32); got 'abc'.")
    assert not (run / "checkpoints" / "checkpoint-00000003").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name, value, expected", [
    ("attn_implementation", "kernels-community/flash-attn", "records the attention implementation "
     "'kernels-community/flash-attn', not one of eager, sdpa, flex_attention, flash_attention_2; it is not used"),
    ("epoch", "abc", "is damaged: its epoch is 'abc'"),
    ("history", [{"step": 1}], "is damaged: its history holds {'step': 1}, not the record of an evaluation"),
])
def test_a_recorded_state_outside_what_a_run_records_is_refused_in_one_line(name, value, expected, run):
    # The attention implementation a checkpoint records was handed to transformers, which takes a name of this form
    # for a Hub kernel to download and run (here it stopped only for want of the kernels package); an epoch that is
    # no count failed in numpy's seeding ("unrecognized seed string"); an evaluation without its split, in a KeyError
    # once the run was validated.
    def edit(state):
        state.update({name: value})
        state["recorded_options"]["attn_implementation"] = None  # the run's own choice, then: the recorded one is used

    path = _edit_state(run, edit)
    result = run_cli("train", "--resume", "--output-dir", run, "--max-steps", 3)
    _refused_in_one_line(result, f"`resume`: {path} {expected}")


@pytest.mark.slow
def test_a_run_config_wider_than_its_checkpoint_is_refused_before_it_is_built(run):
    # A d_ff of 7,000,000 would take gigabytes to build: the config is checked against the weights first.
    config = run / "checkpoints" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "d_ff": 7_000_000}))
    result = run_cli("train", "--resume", "--output-dir", run, "--max-steps", 3)
    _refused_in_one_line(result, f"{config} does not fit the weights in {run / 'checkpoints' / 'checkpoint-00000002'}: ",
                         "feed_forward.fc2.weight is [32, 64] in model.safetensors and [32, 7000000] by the config")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["preset", "fine-tuned"])
def test_a_lora_rank_wider_than_the_layers_is_refused_before_anything_is_allocated(model, finished_run, tmp_path):
    # A rank of 300,000 was accepted; 4.4 GB, then an allocation traceback.
    pytest.importorskip("peft")
    data = finished_run.parent / "data"
    source = ["--model-name-or-path", finished_run] if model == "fine-tuned" else ["--config-overrides", "d_model=32"]
    result = run_cli("train", "--dataset", data, "--output-dir", tmp_path / "out", *source, "--lora-rank", 300_000,
                     "--max-steps", 1, "--max-tokens", 256, "--eval-samples", 0)
    expected = ("`lora_rank` must be at most d_model (32), the width of the layers it adapts; got 300000." if model == "preset"
                else "`lora_rank` must be at most 32, the width of model.encoder.layers.0.self_attn.q_proj; got 300000.")
    _refused_in_one_line(result, expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_linked_checkpoint_is_named_and_never_followed_to_prune(run, tmp_path):
    # Case 11: "error: Cannot call rmtree on a symbolic link" (no path) after saving, and on every later resume.
    outside = tmp_path / "copy-of-checkpoint-1"
    shutil.move(run / "checkpoints" / "checkpoint-00000001", outside)
    (run / "checkpoints" / "checkpoint-00000001").symlink_to(outside)
    kept = sorted(path.name for path in outside.iterdir())
    result = run_cli("train", "--resume", "--output-dir", run, "--max-steps", 4, "--save-steps", 1,
                     "--keep-checkpoints", 2)
    assert result.returncode == 0, result.stderr[-2000:]
    link = run / "checkpoints" / "checkpoint-00000001"
    assert f"{link} is a link to {outside}: not pruned, left alone" in result.stderr
    assert link.is_symlink() and sorted(path.name for path in outside.iterdir()) == kept
    names = sorted(path.name for path in (run / "checkpoints").glob("checkpoint-*"))
    assert names == ["checkpoint-00000001", "checkpoint-00000003", "checkpoint-00000004"]  # the newest 2, and the link


@pytest.mark.slow
@pytest.mark.parametrize("parts, expected", [
    ([{"steps": [0, 2], "seconds": -1e9}], "part 1 of its parts must have seconds, a number from 0 to 31,622,400; "
                                           "got {'steps': [0, 2], 'seconds': -1000000000.0}"),
    ([{"steps": [0, 2], "seconds": float("nan")}], "part 1 of its parts must have seconds, a number from 0 to"),
    ("abc", "is damaged: its parts is 'abc'"),
    ([{"seconds": 5}], "part 1 of its parts must have steps [first, last], counts with first <= last <= the "
                       "checkpoint's step 2; got {'seconds': 5}"),
])
def test_edited_parts_of_a_run_are_refused_in_one_line_naming_the_file(parts, expected, run):
    # Negative seconds made --time-limit count backwards (training went on past it, the bar at "-4761904593%");
    # "abc" was a TypeError traceback, a part without steps a KeyError, NaN seconds an error naming no file.
    path = _edit_state(run, lambda state: state.update(parts=parts))
    result = run_cli("train", "--resume", "--output-dir", run, "--time-limit", 0.35)
    _refused_in_one_line(result, f"`resume`: {path} is damaged: ", expected)
    assert not (run / "checkpoints" / "checkpoint-00000003").exists()


@pytest.mark.slow
def test_a_recorded_thread_count_beyond_the_machines_cpus_is_refused_in_one_line(run):
    # 100,000 threads were restored, then a MemoryError traceback.
    path = _edit_state(run, lambda state: state["recorded_options"].update(threads=100000))
    result = run_cli("train", "--resume", "--output-dir", run, "--max-steps", 3)
    _refused_in_one_line(result, f"`resume`: {path} records an option that is refused: `threads` must be a positive "
                                 f"integer up to {os.cpu_count()} (this machine's CPUs) or None; got 100000.")
