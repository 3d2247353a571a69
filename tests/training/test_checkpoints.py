import struct
import zipfile

import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.training.checkpoints import (
    average_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    read_state,
    save_checkpoint,
    verify_checkpoint,
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
    assert not list(tmp_path.glob(".vanilla-transformer-staging-*"))
    # A save that died half way (staging folder left behind, or a folder without the state file)
    # is never the newest.
    (tmp_path / ".vanilla-transformer-staging-checkpoint-00000004").mkdir()
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


def test_verify_names_the_damaged_file_of_a_checkpoint(tmp_path, accelerated):
    accelerator, model = accelerated
    path = save_checkpoint(accelerator, tmp_path, 7, {"epoch": 0})
    verify_checkpoint(path)
    optimizer = path / "optimizer.bin"
    good = optimizer.read_bytes()
    with zipfile.ZipFile(optimizer) as archive:  # torch.save writes a zip archive: find a member's data
        member = next(info for info in archive.infolist() if info.file_size)
    name_length, extra_length = struct.unpack("<HH", good[member.header_offset + 26 : member.header_offset + 30])
    flipped = bytearray(good)
    flipped[member.header_offset + 30 + name_length + extra_length] ^= 0xFF  # a bad sector: same size, one byte off
    optimizer.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=r"optimizer.bin is damaged \(truncated or corrupt; [\d,]+ bytes\): the CRC of"):
        verify_checkpoint(path)
    optimizer.write_bytes(good)
    (path / "trainer_state.json").write_text('{"epoch": 0, "step": 6}')
    with pytest.raises(ValueError, match="trainer_state.json is damaged: it does not hold the state of step 7"):
        verify_checkpoint(path)
    (path / "trainer_state.json").unlink()
    (path / "trainer_state.json").mkdir()  # not a file: as if it were missing
    with pytest.raises(ValueError, match="trainer_state.json is missing"):
        verify_checkpoint(path)


def test_average_names_a_truncated_weights_file(tmp_path, accelerated):
    accelerator, model = accelerated
    paths = [save_checkpoint(accelerator, tmp_path, step, {}) for step in (1, 2)]
    weights = paths[0] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(ValueError, match="checkpoint-00000001/model.safetensors is damaged"):
        average_checkpoints(paths)
