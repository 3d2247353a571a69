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
