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


def test_longest_token_scans_the_vocabulary_once_per_tokenizer(hub_tiny_model, monkeypatch):
    # translate_texts scanned the vocabulary for every batch of a file, a tenth of the CLI's time on a trained model.
    from vanilla_transformer import inference

    _, tokenizer = hub_tiny_model
    tokenizer = __import__("copy").deepcopy(tokenizer)  # a tokenizer no other test has asked about
    scans = []
    scan = tokenizer.convert_tokens_to_string
    monkeypatch.setattr(tokenizer, "convert_tokens_to_string", lambda tokens: scans.append(1) or scan(tokens))
    first = inference.longest_token(tokenizer)
    assert len(scans) == len(tokenizer)
    assert [inference.longest_token(tokenizer) for _ in range(3)] == [first] * 3 and len(scans) == len(tokenizer)
    tokenizer.add_tokens(["<a-much-longer-token-than-any>"])
    assert inference.longest_token(tokenizer) > first  # a grown vocabulary is scanned again
