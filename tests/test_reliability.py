"""Issue #40: nothing from a file the user was handed is executed, nothing they made is overwritten."""

import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.training.checkpoints import newest_sound_checkpoint, save_checkpoint, verify_checkpoint
from vanilla_transformer.training.schedule import make_scheduler


class _Payload:
    """What a crafted pickle holds: unpickling it calls `open(marker, "w")`, i.e. runs the file's code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


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
    torch.save(_Payload(marker), custom)  # a valid zip archive with correct CRCs: only its content is hostile
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
    torch.save(_Payload(marker), newer / "custom_checkpoint_0.pkl")
    chosen, problems = newest_sound_checkpoint(root)
    assert chosen == older and len(problems) == 1 and "custom_checkpoint_0.pkl holds more" in problems[0]
    assert not marker.exists() and (root / "damaged-checkpoint-00000004").is_dir()


@pytest.mark.slow
def test_a_model_folder_with_another_tokenizer_is_refused_in_one_line(hub_tiny_folder, tiny_corpus, tmp_path, capsys):
    import shutil

    from vanilla_transformer.cli import main
    from vanilla_transformer.inference import load_model
    from vanilla_transformer.tokenizer import train_tokenizer

    load_model(hub_tiny_folder, "cpu")  # its own tokenizer fits
    folder = tmp_path / "mixed"
    shutil.copytree(hub_tiny_folder, folder)
    _, pairs = tiny_corpus
    other = train_tokenizer([text for pair in pairs[:500] for text in pair], vocab_size=300)
    other.save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "tokenizer.json", folder / "tokenizer.json")
    rows = load_model(hub_tiny_folder, "cpu")[0].config.vocab_size
    with pytest.raises(ValueError, match=rf"the tokenizer in {folder} is not the model's: its tokenizer has "
                                         rf"{len(other)} tokens and the model {rows} embedding rows"):
        load_model(folder, "cpu")
    with pytest.raises(SystemExit) as stop:
        main(["translate", "--model", str(folder), "--device", "cpu", "In the beginning."])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert error.strip().splitlines()[-1].startswith(f"vanilla-transformer translate: error: the tokenizer in {folder} is not")
