"""Checking a model folder's config against its weights reads each safetensors header once, for the sizes
and the full check alike."""

import safetensors
from safetensors.torch import save_model

from vanilla_transformer.inference import check_config_fits_weights
from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration


def test_each_weights_file_is_opened_once(tmp_path, monkeypatch):
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=64)
    config.save_pretrained(tmp_path)
    save_model(VanillaTransformerForConditionalGeneration(config), str(tmp_path / "model.safetensors"))
    opened = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda path, *args, **kwargs: opened.append(path) or
                        real_open(path, *args, **kwargs))

    check_config_fits_weights(tmp_path)

    assert opened == [str(tmp_path / "model.safetensors")]
