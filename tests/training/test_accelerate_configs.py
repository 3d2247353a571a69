"""The ready-made Accelerate config files parse with Accelerate's own loader and say what their names say."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

CONFIGS = Path(__file__).resolve().parents[2] / "accelerate_configs"
SCALING = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"  # the launch lines live there, linked from the README

EXPECTED = {  # file: (distributed_type, num_machines, num_processes, mixed_precision)
    "one_gpu_bf16.yaml": ("NO", 1, 1, "bf16"),
    "ddp_8gpu.yaml": ("MULTI_GPU", 1, 8, "bf16"),
    "fsdp_8gpu.yaml": ("FSDP", 1, 8, "bf16"),
    "deepspeed_zero2_8gpu.yaml": ("DEEPSPEED", 1, 8, "bf16"),
    "two_machines_ddp.yaml": ("MULTI_GPU", 2, 16, "bf16"),
}


def test_every_config_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_parses_with_accelerates_loader(name):
    config = load_config_from_file(str(CONFIGS / name))
    assert isinstance(config, ClusterConfig)
    kind, machines, processes, precision = EXPECTED[name]
    assert (str(config.distributed_type).split(".")[-1], config.num_machines, config.num_processes,
            str(config.mixed_precision).split(".")[-1].lower()) == (kind, machines, processes, precision)
    assert config.use_cpu is False
    assert f"accelerate_configs/{name}" in SCALING.read_text(), f"docs/scaling.md has no launch line for {name}"


def test_fsdp_config_is_fsdp2_wrapping_the_models_layers():
    from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerPreTrainedModel

    fsdp = load_config_from_file(str(CONFIGS / "fsdp_8gpu.yaml")).fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",") == VanillaTransformerPreTrainedModel._no_split_modules


def test_deepspeed_config_is_zero2():
    deepspeed = load_config_from_file(str(CONFIGS / "deepspeed_zero2_8gpu.yaml")).deepspeed_config
    assert deepspeed["zero_stage"] == 2
