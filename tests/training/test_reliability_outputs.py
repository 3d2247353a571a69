"""A command never overwrites what it did not make (the model folder of a new run, its own inputs)."""

import errno
import os

import pytest

from vanilla_transformer.cli import main
from vanilla_transformer.staging import write_file_whole


def test_train_refuses_a_finished_model_folder_as_a_new_output_dir(tmp_path, small_task, small_run, capsys):
    model = tmp_path / "downloaded"  # as from the Hub: a model and no checkpoints/
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "vanilla-transformer"}')
    (model / "model.safetensors").write_bytes(b"weights")
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    with pytest.raises(SystemExit) as stop:
        main(["train", "--dataset", str(small_task), "--output-dir", str(model), *small_run, "--max-steps", "2"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert f"{model} holds a model (config.json, model.safetensors) that a new run would replace" in error
    assert "`resume`" in error and f"`model_name_or_path {model}`" in error and "another `output_dir`" in error
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_train_refuses_an_output_dir_holding_a_card_or_scores_it_did_not_write(tmp_path, small_task, small_run, capsys):
    folder = tmp_path / "notes"  # a user's own folder: a README and notes, no model and no run
    folder.mkdir()
    (folder / "README.md").write_text("my notes on this experiment\n")
    (folder / "notes.txt").write_text("lr 2e-3\n")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(SystemExit) as stop:
        main(["train", "--dataset", str(small_task), "--output-dir", str(folder), *small_run, "--max-steps", "2"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert error.strip().splitlines() == [f"vanilla-transformer train: error: {folder} holds README.md, which the "
                                          "finished model's card and scores would replace; pick another `output_dir`, "
                                          "or move them"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_run_that_fails_while_being_set_up_leaves_no_folder_it_made(tmp_path, small_task, small_run, capsys):
    # The tokenizer is trained and written before LoRA finds no layer of that name: once left behind.
    output_dir = tmp_path / "runs" / "lora"
    with pytest.raises(SystemExit) as stop:
        main(["train", "--dataset", str(small_task), "--output-dir", str(output_dir), *small_run, "--max-steps", "2",
              "--lora-rank", "4", "--lora-target-modules", "no_such_layer"])
    assert stop.value.code == 2
    assert "no_such_layer" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not output_dir.exists() and (tmp_path / "runs").is_dir()


@pytest.mark.parametrize("where", ["output_dir", "tokenizer"])
def test_train_names_a_tokenizer_file_it_cannot_read_in_one_line(tmp_path, small_task, small_run, where, capsys):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"hello": 1}')  # valid JSON, not a tokenizer: once a KeyError traceback
    output_dir = folder if where == "output_dir" else tmp_path / "run"
    extra = [] if where == "output_dir" else ["--tokenizer", str(folder)]
    with pytest.raises(SystemExit) as stop:
        main(["train", "--dataset", str(small_task), "--output-dir", str(output_dir), *small_run, "--max-steps", "2", *extra])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"vanilla-transformer train: error: {folder / 'tokenizer.json'} is not a tokenizer file this version can read: "
        "it lacks the key 'added_tokens'")
    assert [p.name for p in folder.iterdir()] == ["tokenizer.json"]


def test_an_output_file_is_replaced_whole_or_left_as_it_was(tmp_path, monkeypatch):
    target = tmp_path / "hyp.txt"
    write_file_whole(target, "old\n")
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # the user's umask, not mkstemp's 0600
    real_fdopen = os.fdopen

    class FullDisk:  # a writer that fails as a full disk does, after the file was opened
        def __init__(self, *args, **kwargs):
            self.file = real_fdopen(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, text):
            self.file.write(text[:3])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdopen", FullDisk)
    with pytest.raises(OSError, match=rf"could not write {target}: no space left on device") as full:
        write_file_whole(target, "new and longer\n")
    assert full.value.errno == errno.ENOSPC  # a full disk, not a usage error: the command exits with 1, not 2
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["hyp.txt"]


def _train_then_signal(tmp_path, data, small_run, signum):
    """A real `vanilla-transformer train` process, sent `signum` once it has finished a step."""
    import re
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    log = tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "vanilla_transformer.cli", "train", "--dataset", str(data),
               "--output-dir", str(out), *small_run, "--max-steps", "100000", "--save-steps", "100000"]
    with open(log, "wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            deadline = time.monotonic() + 240
            while not re.search(r"\| *[1-9]\d*/100000", log.read_text(errors="replace")):
                assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
                time.sleep(0.2)
            process.send_signal(signum)
            code = process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    return out, code, log.read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_during_training_saves_a_checkpoint_and_exits_with_one_line(tmp_path, small_task, small_run, name):
    import re
    import signal

    from vanilla_transformer.training.checkpoints import latest_checkpoint, read_state, verify_checkpoint
    from vanilla_transformer.training.run_folder import LOCK_FILE

    signum = getattr(signal, name)
    out, code, stderr = _train_then_signal(tmp_path, small_task, small_run, signum)
    assert code == 128 + signum  # 130 for SIGINT, 143 for SIGTERM
    last = stderr.strip().splitlines()[-1]
    match = re.fullmatch(rf"vanilla-transformer train: stopped by {name} after step (\d+), saved in "
                         rf"{re.escape(str(out / 'checkpoints'))}; run the same command with --resume to continue", last)
    assert match, stderr[-2000:]
    assert "Traceback" not in stderr
    checkpoint = latest_checkpoint(out / "checkpoints")
    verify_checkpoint(checkpoint)
    assert read_state(checkpoint)["step"] == int(match.group(1)) >= 1
    assert not (out / LOCK_FILE).exists() and not list((out / "checkpoints").glob(".vanilla-transformer-staging-*"))
