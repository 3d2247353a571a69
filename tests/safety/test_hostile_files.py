"""Crafted files: every refusal is one line naming the file, never a traceback or torch's advice
to trust the file; a checkpoint that fails is set aside and a resumed run falls back to the one before.

Each crafted pickle would open a marker file if it were unpickled: the marker must never appear.
"""

import shutil
import zipfile

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from commands import run_cli
from crafted import Payload
from vanilla_transformer.training.checkpoints import (
    newest_sound_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from vanilla_transformer.training.schedule import make_scheduler

TRUST_ADVICE = "weights_only"  # torch's refusal ends in advice to load with weights_only=False


@pytest.fixture
def run_root(tmp_path):
    """Two real checkpoints (steps 1 and 2) of a run with an Adam optimiser, as `train` writes them."""
    model = torch.nn.Linear(3, 2)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters()))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    root = tmp_path / "checkpoints"
    older = save_checkpoint(accelerator, root, 1, {"epoch": 0})
    return accelerator, root, older, save_checkpoint(accelerator, root, 2, {"epoch": 0})


def _assert_set_aside(root, older, file_name, message):
    chosen, problems = newest_sound_checkpoint(root)
    assert chosen == older and len(problems) == 1
    assert file_name in problems[0] and message in problems[0] and TRUST_ADVICE not in problems[0]
    assert "\n" not in problems[0] and (root / "damaged-checkpoint-00000002").is_dir()



@pytest.mark.parametrize("file_name", ["model.safetensors", "optimizer.bin"])
def test_a_file_the_machine_cannot_read_now_sets_no_checkpoint_aside(run_root, monkeypatch, file_name):
    # A permission or a failing disk says nothing of the file: the error goes up as it is and every checkpoint stays.
    import errno
    import os

    _, root, older, newer = run_root
    real_open = open

    def open_that_fails(path, *args, **kwargs):
        if str(path) == str(newer / file_name):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", open_that_fails)
    monkeypatch.setattr("safetensors.safe_open", lambda path, **kwargs: open_that_fails(path, "rb"))
    with pytest.raises(PermissionError):
        newest_sound_checkpoint(root)
    assert sorted(path.name for path in root.iterdir()) == ["checkpoint-00000001", "checkpoint-00000002"]

def test_a_crafted_optimizer_state_is_refused_and_resume_falls_back(tmp_path, run_root):
    accelerator, root, older, newer = run_root
    marker = tmp_path / "ran"
    torch.save({"state": {}, "param_groups": [], "hook": Payload(marker)}, newer / "optimizer.bin")
    with pytest.raises(ValueError, match=r"optimizer.bin holds more than tensors and plain values.*it is not read"):
        verify_checkpoint(newer)
    _assert_set_aside(root, older, "optimizer.bin", "holds more than tensors")
    accelerator.load_state(str(older))  # the one fallen back to reads as Accelerate reads it
    assert not marker.exists()


def test_a_crafted_fsdp_weights_file_is_refused_and_resume_falls_back(tmp_path, run_root):
    _, root, older, newer = run_root
    for checkpoint in (older, newer):  # FSDP's FULL_STATE_DICT layout: the whole model in pytorch_model_fsdp.bin
        weights = load_file(str(checkpoint / "model.safetensors"))
        (checkpoint / "model.safetensors").unlink()
        torch.save(weights, checkpoint / "pytorch_model_fsdp.bin")
    marker = tmp_path / "ran"
    torch.save({**weights, "hook": Payload(marker)}, newer / "pytorch_model_fsdp.bin")
    _assert_set_aside(root, older, "pytorch_model_fsdp.bin", "holds more than tensors")
    assert not marker.exists()


def test_a_deepspeed_file_of_pickle_protocol_4_is_named_in_one_line_and_set_aside(tmp_path, run_root):
    _, root, older, newer = run_root
    for checkpoint in (older, newer):  # DeepSpeed's layout, as tests/training/test_checkpoints.py builds it
        weights = load_file(str(checkpoint / "model.safetensors"))
        (checkpoint / "model.safetensors").unlink()
        (checkpoint / "pytorch_model").mkdir()
        torch.save({"module": weights}, checkpoint / "pytorch_model/mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": {}}, checkpoint / "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (checkpoint / "latest").write_text("pytorch_model")
    verify_checkpoint(older)
    torch.save({"module": weights}, newer / "pytorch_model/mp_rank_00_model_states.pt", pickle_protocol=4)
    _assert_set_aside(root, older, "mp_rank_00_model_states.pt", "it is not read")


def test_a_custom_state_that_is_a_zip_but_no_torch_file_is_named_in_one_line_and_set_aside(run_root):
    _, root, older, newer = run_root
    with zipfile.ZipFile(newer / "custom_checkpoint_0.pkl", "w") as archive:
        archive.writestr("notes.txt", "a zip archive, not a torch.save file")
    _assert_set_aside(root, older, "custom_checkpoint_0.pkl", "is not a torch.save file that can be read")


@pytest.fixture
def crafted_folder(hub_tiny_folder, tmp_path):
    """A model folder whose weights are a pytorch_model.bin holding the model's tensors and a payload."""
    folder = tmp_path / "crafted"
    shutil.copytree(hub_tiny_folder, folder)
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save({**weights, "hook": Payload(tmp_path / "ran")}, folder / "pytorch_model.bin")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("command", ["translate", "export"])
def test_a_model_folder_with_crafted_pickled_weights_is_refused_in_one_line(command, crafted_folder, tmp_path):
    arguments = ["Jesus wept."] if command == "translate" else ["--format", "ctranslate2", "--output-dir", tmp_path / "out"]
    result = run_cli(command, "--model", crafted_folder, *arguments, timeout=600)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "pytorch_model.bin holds more than tensors and plain values" in result.stderr
    assert TRUST_ADVICE not in result.stderr and not (tmp_path / "ran").exists()


def test_train_from_a_model_folder_with_crafted_pickled_weights_is_refused_by_the_loader_it_uses(crafted_folder, tmp_path):
    from vanilla_transformer.checks.model_folder import check_model_folder  # `train --model-name-or-path` loads through it

    with pytest.raises(ValueError, match="pytorch_model.bin holds more than tensors and plain values") as refused:
        check_model_folder(crafted_folder, needs_tokenizer=False).load()
    assert TRUST_ADVICE not in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "ran").exists()


@pytest.fixture
def checkpointed(tmp_path):
    """A real checkpoint with a registered schedule, as `train` writes it (custom_checkpoint_0.pkl)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = make_scheduler(optimizer, 8, 4, 1.0, "noam", remaining_steps=lambda step: 10)
    accelerator.register_for_checkpointing(scheduler)
    root = tmp_path / "checkpoints"
    return accelerator, root, save_checkpoint(accelerator, root, 3, {"epoch": 0})


def test_a_crafted_custom_checkpoint_is_refused_and_never_run(tmp_path, checkpointed):
    accelerator, root, checkpoint = checkpointed
    custom = checkpoint / "custom_checkpoint_0.pkl"
    verify_checkpoint(checkpoint)  # the genuine file: tensors and plain values
    accelerator.load_state(str(checkpoint))
    marker = tmp_path / "ran"
    torch.save(Payload(marker), custom)  # a valid zip archive with correct CRCs: only its content is hostile
    with pytest.raises(ValueError, match=r"custom_checkpoint_0.pkl holds more than tensors and plain values"):
        verify_checkpoint(checkpoint)
    assert not marker.exists()
    # `train --resume` reads only a checkpoint that verifies: with no other one, it stops before loading.
    with pytest.raises(ValueError, match="no checkpoint in .* can be read: .*custom_checkpoint_0.pkl holds more"):
        newest_sound_checkpoint(root)
    assert not marker.exists()


def test_resume_falls_back_past_a_crafted_checkpoint(tmp_path, checkpointed):
    accelerator, root, older = checkpointed
    newer = save_checkpoint(accelerator, root, 4, {"epoch": 0})
    marker = tmp_path / "ran"
    torch.save(Payload(marker), newer / "custom_checkpoint_0.pkl")
    chosen, problems = newest_sound_checkpoint(root)
    assert chosen == older and len(problems) == 1 and "custom_checkpoint_0.pkl holds more" in problems[0]
    assert not marker.exists() and (root / "damaged-checkpoint-00000004").is_dir()
