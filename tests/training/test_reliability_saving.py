"""Issue #40: saving on unlucky machines (a read-only parent, a killed run's leftovers, a shared folder)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate import Accelerator

from vanilla_transformer.cli import main
from vanilla_transformer.hub import check_hub_folder, save_model_files
from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.staging import STAGING_PREFIX
from vanilla_transformer.tokenizer import train_tokenizer
from vanilla_transformer.training.checkpoints import save_checkpoint

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
    config = VanillaTransformerConfig.tiny(vocab_size=len(tokenizer), d_model=16, d_ff=32, num_heads=2,
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
