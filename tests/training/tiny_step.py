"""A tiny model and one batch of it, for the tests of a run's precision and of its attention implementation."""

import torch

from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration


def model(**overrides):
    torch.manual_seed(0)
    settings = dict(vocab_size=40, d_model=32, d_ff=64, num_heads=2, encoder_layers=1, decoder_layers=2, dropout=0.1,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = VanillaTransformerConfig.from_preset("tiny", **{**settings, **overrides})
    return VanillaTransformerForConditionalGeneration(config)


def batch():
    torch.manual_seed(1)
    input_ids, labels = torch.randint(3, 40, (4, 9)), torch.randint(3, 40, (4, 7))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    input_ids[1, 6:] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def loss(net, b):
    return net(**b).loss
