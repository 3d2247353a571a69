import errno
import logging
import os
import struct
import zipfile
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from vanilla_transformer.staging import STAGING_PREFIX
from vanilla_transformer.training.checkpoints import (
    WeightAverage,
    average_checkpoints,
    checkpoint_layout,
    latest_checkpoint,
    list_checkpoints,
    newest_sound_checkpoint,
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


class SecondProcess:
    """The second of two processes, whose own part of a save fails (its disk errs) while the main one's goes on."""

    is_main_process, num_processes, device = False, 2, torch.device("cpu")

    def reduce(self, tensor, reduction):  # the main process, which made the staging folder, sent nothing
        return tensor

    def register_save_state_pre_hook(self, hook):
        return SimpleNamespace(remove=lambda: None)

    def save_state(self, folder):
        raise OSError(errno.EIO, os.strerror(errno.EIO), f"{folder}/random_states_1.pkl")

    def wait_for_everyone(self):
        pass


def test_a_process_whose_save_fails_leaves_the_main_processs_staging_folder_alone(tmp_path):
    # The main process made the folder and may still be writing into it: it alone removes it.
    staging = tmp_path / f"{STAGING_PREFIX}checkpoint-00000001"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"the main process's, being written")
    with pytest.raises(OSError, match="random_states_1.pkl"):
        save_checkpoint(SecondProcess(), tmp_path, 1, {})
    assert (staging / "model.safetensors").read_bytes() == b"the main process's, being written"


def test_save_keeps_the_last_k_and_finds_the_newest_complete_one(tmp_path, accelerated):
    accelerator, model = accelerated
    for step in (1, 2, 3):
        path = save_checkpoint(accelerator, tmp_path, step, {"epoch": 0, "note": step}, keep_checkpoints=2)
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


def test_average_refuses_checkpoints_whose_weights_differ_in_shape(tmp_path):
    # Same names, a shape that would broadcast: refused, naming the checkpoint, never a silently wrong mean.
    from safetensors.torch import save_file

    paths = []
    for step, weight in ((1, torch.ones(2, 3)), (2, torch.ones(1, 3))):
        path = tmp_path / f"checkpoint-{step:08d}"
        path.mkdir()
        save_file({"weight": weight}, str(path / "model.safetensors"))
        paths.append(path)
    with pytest.raises(ValueError, match="checkpoint-00000002 holds different weights"):
        average_checkpoints(paths)


class LossScaler:
    """Stands for DeepSpeed's class of that name, which its optimiser states pickle (DeepSpeed is not installed here)."""

    def __init__(self, scale):
        self.cur_scale = scale


def in_module(cls, module: str, monkeypatch):
    """`cls` as if it were defined in `module` (and its packages, for as long as the test runs): what a pickle
    of its instances names."""
    import sys
    import types

    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    setattr(sys.modules[module], cls.__name__, cls)
    monkeypatch.setattr(cls, "__module__", module)
    return cls


def as_engine_layout(checkpoint, layout: str, monkeypatch, optimizer_extra=None) -> None:
    """Rewrite a checkpoint that save_state wrote under DDP in the layout FSDP (FULL_STATE_DICT) or DeepSpeed
    (ZeRO-2) save_state writes on GPUs: the same weights in their files and folders."""
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "model.safetensors"))
    (checkpoint / "model.safetensors").unlink()
    if layout == "FSDP":
        torch.save(weights, checkpoint / "pytorch_model_fsdp.bin")
        return
    (checkpoint / "optimizer.bin").unlink()
    folder = checkpoint / "pytorch_model"
    folder.mkdir()
    from collections import OrderedDict

    torch.save({"module": weights, "buffer_names": [], "param_shapes": [OrderedDict((k, v.shape) for k, v in weights.items())],
                "global_steps": 3, "ds_version": "0.18.0", "dp_world_size": 2}, folder / "mp_rank_00_model_states.pt")
    scaler = in_module(LossScaler, "deepspeed.runtime.fp16.loss_scaler", monkeypatch)(1.0)
    for rank in (0, 1):
        optimizer = {"loss_scaler": scaler, "single_partition_of_fp32_groups": [torch.zeros(4)], **(optimizer_extra or {})}
        torch.save({"optimizer_state_dict": optimizer, "ds_version": "0.18.0"},
                   folder / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (checkpoint / "latest").write_text("pytorch_model")
    (checkpoint / "zero_to_fp32.py").write_text("raise SystemExit('never run')\n")  # DeepSpeed copies its script in


@pytest.mark.parametrize("layout", ["FSDP", "DEEPSPEED"])
def test_fsdp_and_deepspeed_checkpoints_are_verified_resumed_from_and_averaged(tmp_path, accelerated, layout, monkeypatch):
    # Proves: checkpoints in the layout FSDP (whole state) and DeepSpeed save are found sound, so that --resume
    # picks the newest, and --average-last averages their weights; a damaged one is set aside as DDP's are.
    accelerator, model = accelerated
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(float(step))
        as_engine_layout(save_checkpoint(accelerator, tmp_path, step, {}), layout, monkeypatch)
    checkpoints = list_checkpoints(tmp_path)
    for checkpoint in checkpoints:
        verify_checkpoint(checkpoint)
        assert checkpoint_layout(checkpoint) == layout
    assert torch.equal(average_checkpoints(checkpoints[-2:])["weight"], torch.full((2, 3), 2.5))
    newest = checkpoints[-1] / ("pytorch_model_fsdp.bin" if layout == "FSDP" else "pytorch_model/mp_rank_00_model_states.pt")
    newest.write_bytes(newest.read_bytes()[:-100])
    sound, problems = newest_sound_checkpoint(tmp_path)
    assert sound == checkpoints[1] and "is damaged" in problems[0]


def test_a_deepspeed_file_that_would_run_code_and_a_sharded_fsdp_checkpoint_are_refused(tmp_path, accelerated, monkeypatch):
    import os

    accelerator, model = accelerated
    crafted = save_checkpoint(accelerator, tmp_path, 1, {})
    as_engine_layout(crafted, "DEEPSPEED", monkeypatch, optimizer_extra={"hook": os.getcwd})  # a function: unpickling calls into code
    with pytest.raises(ValueError, match=r"optim_states.pt holds more than tensors.*it is not read.*getcwd"):
        verify_checkpoint(crafted)
    sharded = save_checkpoint(accelerator, tmp_path, 2, {})
    (sharded / "pytorch_model_fsdp_0").mkdir()
    (sharded / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="SHARDED_STATE_DICT checkpoint, which is not read: torch reads its .metadata with pickle"):
        verify_checkpoint(sharded)


def warnings_naming(caplog, *names) -> list[str]:
    """The warnings that name one of `names` (held to the tensors named, not to Accelerate's wording)."""
    messages = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    return [message for message in messages if any(name in message for name in names)]


def test_saving_tied_embeddings_prints_no_warning_but_other_shared_tensors_still_do(tmp_path, caplog):
    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=300)))
    with caplog.at_level("WARNING"):
        save_checkpoint(accelerator, tmp_path / "tied", 1, {})
    assert not warnings_naming(caplog, "embed_tokens", "lm_head")  # transformers ties them again on loading: moot
    shared = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    shared[1].weight = shared[0].weight  # tied by hand: nothing ties it again on loading
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(shared)
    with caplog.at_level("WARNING"):
        save_checkpoint(accelerator, tmp_path / "shared", 1, {})
    assert warnings_naming(caplog, "1.weight")  # a tensor tied by hand is still warned about


def test_a_lora_models_tied_embeddings_are_saved_once_without_a_warning(tmp_path, caplog):
    """PEFT's prefixed copies of the tied embeddings are not saved, so no warning says they were dropped."""
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open

    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=300))
    model = get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=4, target_modules=["q_proj", "v_proj"]))
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model)
    with caplog.at_level("WARNING"):
        path = save_checkpoint(accelerator, tmp_path, 1, {})
    assert not warnings_naming(caplog, "embed_tokens", "lm_head")
    with safe_open(str(path / "model.safetensors"), "pt") as saved:
        names = set(saved.keys())
    copies = {"base_model.model." + name for name in model.get_base_model().all_tied_weights_keys}
    assert copies and not names & copies and names == set(model.state_dict()) - copies  # each tensor once


# The exponential moving average of the weights (`WeightAverage`): it follows the weights, and checkpoints keep it.


def test_the_moving_average_follows_the_weights_and_round_trips_through_its_state():
    model = torch.nn.Linear(3, 3)
    average = WeightAverage(model, decay=0.9)
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    average.update_parameters(model)  # first update: decay min(0.9, 2/11), so mostly the new weights
    expected = [s + 1.0 - 2 / 11 for s in start]
    copy = torch.nn.Linear(3, 3)
    average.copy_to(copy)
    for p, e in zip(copy.parameters(), expected):
        torch.testing.assert_close(p, e)
    restored = WeightAverage(torch.nn.Linear(3, 3), decay=0.9)
    restored.load_state_dict(average.state_dict())
    assert restored.updates == 1 and all(torch.equal(a, b) for a, b in zip(restored.average, average.average))
    with pytest.raises(ValueError, match="does not fit"):
        WeightAverage(torch.nn.Linear(3, 3, bias=False), 0.9).load_state_dict(average.state_dict())
    narrow = average.state_dict()
    narrow["average"] = {**narrow["average"], "bias": torch.zeros(1)}  # would broadcast into the bias of 3
    with pytest.raises(ValueError, match="does not fit"):
        WeightAverage(torch.nn.Linear(3, 3), 0.9).load_state_dict(narrow)
    with pytest.raises(ValueError, match="`decay` must be in"):
        WeightAverage(model, decay=1.0)
