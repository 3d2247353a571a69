import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.training.checkpoints import (
    average_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    read_state,
    save_checkpoint,
)


@pytest.fixture
def accelerated():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model


def test_save_keeps_the_last_k_and_finds_the_newest_complete_one(tmp_path, accelerated):
    accelerator, model = accelerated
    for step in (1, 2, 3):
        path = save_checkpoint(accelerator, tmp_path, step, {"epoch": 0, "note": step}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-00000002", "checkpoint-00000003"]
    assert latest_checkpoint(tmp_path) == path and read_state(path) == {"epoch": 0, "note": 3, "step": 3}
    assert not list(tmp_path.glob(".tmp-*"))
    # A save that died half way (staging folder left behind, or a folder without the state file)
    # is never the newest.
    (tmp_path / ".tmp-checkpoint-00000004").mkdir()
    (tmp_path / "checkpoint-00000005").mkdir()
    assert latest_checkpoint(tmp_path) == path
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_average_is_the_elementwise_mean(tmp_path, accelerated):
    accelerator, model = accelerated
    values = []
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(float(step))
            model.bias.copy_(torch.tensor([step, -step], dtype=torch.float32))
        save_checkpoint(accelerator, tmp_path, step, {})
    average = average_checkpoints(list_checkpoints(tmp_path)[-2:])
    assert torch.equal(average["weight"], torch.full((2, 3), 2.5))
    assert torch.equal(average["bias"], torch.tensor([2.5, -2.5]))
    with pytest.raises(ValueError, match="no checkpoints"):
        average_checkpoints([])
