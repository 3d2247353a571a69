"""Saving on unlucky machines (a read-only parent, a full disk, a killed run's leftovers, a
shared folder) and a restarted run that must not reuse a stale tokenizer."""

import errno
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from accelerate import Accelerator

from vanilla_transformer.cli import main
from vanilla_transformer.hub import check_hub_folder, save_model_files
from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.staging import STAGING_PREFIX, DiskFull
from vanilla_transformer.tokenizer import save_tokenizer, train_tokenizer
from vanilla_transformer.training.checkpoints import latest_checkpoint, read_state, save_checkpoint, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def _staging_left(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob(f"{STAGING_PREFIX}*")]


def _mount_namespace_or_skip():
    """A test that mounts needs root and `unshare -m` (a private mount namespace)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only parent or a small tmpfs needs root (run as root, e.g. in a container)")
    if shutil.which("unshare") is None:
        pytest.skip("mounting needs `unshare` (util-linux), which is not installed")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here (`unshare -m` failed: {probe.stderr.strip()})")


def _train_command(data, out, small_run, *extra) -> str:
    return " ".join([sys.executable, "-m", "vanilla_transformer.cli", "train", "--dataset", str(data), "--output-dir",
                     str(out), *(f"'{a}'" for a in small_run), *extra])


def _tiny_model_and_tokenizer():
    tokenizer = train_tokenizer(["hello world", "hola mundo"] * 5, vocab_size=270)
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), d_model=16, d_ff=32, num_heads=2,
                                           encoder_layers=1, decoder_layers=1)
    return VanillaTransformerForConditionalGeneration(config), tokenizer


@pytest.mark.slow
def test_a_run_and_an_export_into_folders_whose_parent_is_read_only(tmp_path, small_task, small_run):
    _mount_namespace_or_skip()
    parent = tmp_path / "volume"  # read-only, as a container's volume mount; its sub-folders out/ and ct2/ writable
    for name in ("out", "ct2"):
        (parent / name).mkdir(parents=True)
    out, ct2 = parent / "out", parent / "ct2"
    export = f"{sys.executable} -m vanilla_transformer.cli export --model {out} --format ctranslate2 --output-dir {ct2}"
    script = f"""
        set -e
        mount --bind {parent} {parent} && mount -o remount,bind,ro {parent}
        for sub in {out} {ct2}; do mount --bind $sub $sub && mount -o remount,bind,rw $sub; done
        if touch {parent}/probe 2>/dev/null; then echo "the parent is writable"; exit 3; fi
        {_train_command(small_task, out, small_run, "--max-steps", "2")}
        {export}
    """
    result = subprocess.run(["unshare", "-m", "bash", "-c", script], env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    check_hub_folder(out)
    assert (ct2 / "model.bin").is_file() and (ct2 / "tokenizer.json").is_file()
    assert sorted(p.name for p in parent.iterdir()) == ["ct2", "out"] and not _staging_left(parent)


@pytest.mark.slow
def test_a_full_disk_names_the_file_keeps_the_newest_checkpoint_and_resume_continues(tmp_path, small_task, small_run):
    _mount_namespace_or_skip()
    disk = tmp_path / "disk"  # a 2 MB tmpfs: the tokenizer and a few checkpoints fit, then the disk is full
    disk.mkdir()
    out = disk / "out"
    script = f"""
        mount -t tmpfs -o size=2m tmpfs {disk}
        {_train_command(small_task, out, small_run, "--max-steps", "12", "--save-steps", "1", "--keep-checkpoints", "100")}
        echo "exit $?" >&2
        cp -a {out} {tmp_path}/full
        mount -o remount,size=64m {disk}
        {_train_command(small_task, out, small_run, "--max-steps", "12", "--save-steps", "1", "--keep-checkpoints", "100",
                        "--resume")}
        echo "exit $?" >&2
        cp -a {out} {tmp_path}/resumed
    """
    result = subprocess.run(["unshare", "-m", "bash", "-c", script], env=ENV, capture_output=True, text=True, timeout=600)
    first, second = result.stderr.split("\nexit ")[:2]
    assert second.startswith("1\n") and result.stderr.rstrip().endswith("exit 0"), result.stderr[-4000:]
    assert "Traceback" not in first and "enforce fail" not in first and "SafetensorError" not in first
    full = tmp_path / "full"
    newest = latest_checkpoint(full / "checkpoints")
    verify_checkpoint(newest)
    step = read_state(newest)["step"]
    pattern = (rf"vanilla-transformer train: error: could not write {re.escape(str(out))}/checkpoints/"
               rf"checkpoint-{step + 1:08d}/\S+: no space left on device; the newest complete checkpoint is "
               rf"{re.escape(str(out / 'checkpoints' / newest.name))} \(step {step}\); free some space, then run the "
               r"same command with --resume to continue")
    assert re.fullmatch(pattern, first.strip().splitlines()[-1]), first[-2000:]
    assert 1 <= step < 12 and not _staging_left(full)  # nothing half written left
    resumed = tmp_path / "resumed"
    check_hub_folder(resumed)
    assert read_state(latest_checkpoint(resumed / "checkpoints"))["step"] == 12


def test_a_full_disk_while_saving_the_model_or_tokenizer_names_the_file_and_leaves_the_folder_as_it_was(
    tmp_path, monkeypatch
):
    model, tokenizer = _tiny_model_and_tokenizer()
    folder = tmp_path / "model"
    save_model_files(model, tokenizer, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def fill_the_disk(self, staging, **kwargs):  # half a weights file, then what a full disk raises
        (Path(staging) / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(type(model), "save_pretrained", fill_the_disk)
    with pytest.raises(DiskFull, match=rf"^could not write {re.escape(str(folder))}/model.safetensors: no space left"):
        save_model_files(model, tokenizer, folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    monkeypatch.setattr(type(tokenizer), "save_pretrained", fill_the_disk)
    with pytest.raises(DiskFull, match=r"could not write .*/new/model.safetensors: no space left on device"):
        save_tokenizer(tokenizer, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the folder made for it is gone too


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_weights_are_written_with_the_users_umask(tmp_path, umask):
    model, tokenizer = _tiny_model_and_tokenizer()
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model)
    previous = os.umask(umask)
    try:
        checkpoint = save_checkpoint(accelerator, tmp_path / "checkpoints", 1, {"epoch": 0})
        save_model_files(model, tokenizer, tmp_path / "model")
    finally:
        os.umask(previous)
    expected = 0o666 & ~umask  # 0644 or 0600, as `open` gives: not safetensors' or mkstemp's 0600 for all
    for path in (tmp_path / "model" / "model.safetensors", tmp_path / "model" / "tokenizer.json",
                 checkpoint / "trainer_state.json", *checkpoint.glob("*.safetensors"), *checkpoint.glob("*.bin")):
        assert path.stat().st_mode & 0o777 == expected, path


@pytest.mark.slow
def test_leftovers_of_a_killed_save_are_swept_and_nothing_else(tmp_path, small_task, small_run):
    out = tmp_path / "out"
    ours = [out / f"{STAGING_PREFIX}model", out / f"{STAGING_PREFIX}results.json",
            out / "checkpoints" / f"{STAGING_PREFIX}checkpoint-00000009"]
    for folder in (ours[0], ours[2]):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half written")
    ours[1].write_text("{")
    foreign = [out / ".vanilla-transformer-notes", out / "notes.txt", out / ".staging-mine",
               out / "checkpoints" / ".keep", out / "checkpoints" / f"x{STAGING_PREFIX}y"]
    for path in foreign:
        path.write_text("mine")
    assert main(["train", "--dataset", str(small_task), "--output-dir", str(out), *small_run, "--max-steps", "2"]) == 0
    assert not [path for path in ours if path.exists()] and not _staging_left(out)
    assert all(path.read_text() == "mine" for path in foreign)
    check_hub_folder(out)


def _kill_before_the_first_checkpoint(tmp_path, data, out, small_run, *extra) -> None:
    """A real `train` process killed (SIGKILL) once it trains, before it saved any checkpoint."""
    log = tmp_path / "killed.txt"
    command = [sys.executable, "-m", "vanilla_transformer.cli", "train", "--dataset", str(data), "--output-dir", str(out),
               *small_run, "--max-steps", "100000", "--save-steps", "100000", *extra]
    with open(log, "wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=ENV)
        try:
            deadline = time.monotonic() + 240
            while not re.search(r"\| *[1-9]\d*/100000", log.read_text(errors="replace")):
                assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
                time.sleep(0.2)
        finally:
            process.kill()
            process.wait()
    assert (out / "tokenizer.json").is_file() and latest_checkpoint(out / "checkpoints") is None


def _words_task(folder: Path) -> Path:
    """Pairs of made-up words (longer than the letters of `small_task`), so that BPE has merges to learn."""
    import json
    import random

    rng = random.Random(1)
    folder.mkdir()
    for split, n in (("train", 300), ("validation", 12), ("test", 12)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                words = ["".join(rng.choice("mnoprstu") for _ in range(rng.randint(2, 5))) for _ in range(4)]
                f.write(json.dumps({"translation": {"src": " ".join(words), "tgt": " ".join(words[::-1])}}) + "\n")
    return folder


@pytest.mark.slow
def test_a_restarted_run_with_other_data_and_vocab_size_trains_a_new_tokenizer(
    tmp_path, small_task, small_run, caplog, capsys
):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    _kill_before_the_first_checkpoint(tmp_path, small_task, out, small_run)
    old = AutoTokenizer.from_pretrained(out)
    words = _words_task(tmp_path / "words")
    run = [*small_run, "--max-steps", "2"]
    run[run.index("--vocab-size") + 1] = "320"
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--dataset", str(words), "--output-dir", str(out), *run]) == 0
    warning = next(r.getMessage() for r in caplog.records if "was trained with other options" in r.getMessage())
    assert f"dataset '{small_task}' -> '{words}'" in warning and "vocab_size 300 -> 320" in warning
    assert "training a new one" in warning
    new = AutoTokenizer.from_pretrained(out)
    assert len(new) == 320 != len(old)
    assert new.tokenize("mnop stur") != old.tokenize("mnop stur")
    # A resumed run keeps its tokenizer: another --vocab-size is refused, not ignored.
    run[run.index("--vocab-size") + 1] = "300"
    with pytest.raises(SystemExit) as stop:
        main(["train", "--dataset", str(words), "--output-dir", str(out), *run, "--resume"])
    assert stop.value.code == 2
    assert (f"`resume`: the tokenizer of the run in {out} was trained with other options: vocab_size 320 -> 300"
            in capsys.readouterr().err)
