"""The neuron view's numbers are the model's own: q and k from the block's projections, the score from its
score function, the weight from `output_attentions`, and normalising the scores gives those weights."""

import math

import pytest
import torch

from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import (
    ATTENTION_NORMALIZATIONS,
    VanillaTransformerForConditionalGeneration,
)
from vanilla_transformer.visualize.neuron_view import neuron_view


def make_model(**overrides):
    torch.manual_seed(0)
    return VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.tiny(vocab_size=40, **overrides))


def batch():
    """Two sources of 9 (the second padded by 3) and two decoder inputs of 7."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 40, (2, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    return input_ids, attention_mask, torch.randint(3, 40, (2, 7), generator=g)


@pytest.mark.parametrize("kind, query", [("encoder", 4), ("decoder", 5), ("cross", 3)])
@pytest.mark.parametrize("normalization", ["softmax", "relu"])
def test_scores_are_q_dot_k_and_normalise_to_the_models_weights(kind, query, normalization):
    model = make_model(attention_normalization=normalization)
    input_ids, attention_mask, decoder_input_ids = batch()
    view = neuron_view(model, input_ids, attention_mask, decoder_input_ids, kind, layer=1, head=2, query=query, row=1)
    dh = model.config.head_dim
    assert view.query.shape == (dh,) and view.keys.shape == view.products.shape
    torch.testing.assert_close(view.products, view.query * view.keys)
    torch.testing.assert_close(view.scores, view.products.sum(-1) / math.sqrt(dh))  # scaled_dot, §3.2.1
    # the second source is padded; decoder self-attention has the look-ahead mask of §3.2.3 instead
    allowed = torch.arange(view.scores.numel()) <= query if kind == "decoder" else attention_mask[1].bool()
    scores = view.scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    expected = ATTENTION_NORMALIZATIONS[normalization](scores).masked_fill(~allowed, 0)
    torch.testing.assert_close(view.weights, expected, rtol=1e-5, atol=1e-6)


def test_location_scores_have_no_keys_and_still_give_the_weights():
    model = make_model(attention_score="location", location_max_length=16)
    input_ids, attention_mask, decoder_input_ids = batch()
    view = neuron_view(model, input_ids, attention_mask, decoder_input_ids, "cross", layer=0, head=0, query=2)
    assert view.keys is None and view.products is None
    torch.testing.assert_close(view.weights, view.scores.softmax(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arguments, message", [
    (dict(kind="self", layer=0, head=0, query=0), "`kind` must be one of"),
    (dict(kind="cross", layer=5, head=0, query=0), "`layer` must be in"),
    (dict(kind="cross", layer=0, head=4, query=0), "`head` must be in"),
    (dict(kind="cross", layer=0, head=0, query=99), "`query` must be in"),
])
def test_bad_choices_are_refused_in_one_line(arguments, message):
    input_ids, attention_mask, decoder_input_ids = batch()
    with pytest.raises(ValueError, match=message):
        neuron_view(make_model(), input_ids, attention_mask, decoder_input_ids, **arguments)
