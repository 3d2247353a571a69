"""Differential test against a peer: transformers' MarianMTModel is the same architecture.

Marian, like the paper, is post-LN with sinusoidal positions and scaled, tied embeddings. We
build one with a matching configuration, copy its weights into ours with
`vanilla_transformer.export.marian.from_marian` and require the same logits (1e-5, fp32) and the
same beam-search output. The details that differ and how they are mapped (see vanilla_transformer/export/marian.py):

- Positions: the paper interleaves sin and cos (dimension 2i is sin, 2i+1 is cos); Marian puts all
  sines in the first half and all cosines in the second. The two are the same encoding up to a
  permutation P of the d_model dimensions. Every part of the residual stream is equivariant under
  P (LayerNorm only averages over dimensions), so we permute every weight that touches the
  residual stream: embedding columns, the input columns of Q, K, V and W_1, the output rows and
  biases of W^O and W_2, and LayerNorm gains and biases. Logits are unchanged by P.
- Projections: both name them q_proj, k_proj, v_proj and out_proj, the same matrices.
- Marian adds `final_logits_bias` (zeros, not trained here) and uses its own pad-index embedding
  row; neither changes the logits.
- Marian's activation defaults to swish; we set relu, the paper's.
"""

import pytest
import torch
from transformers import MarianConfig, MarianMTModel

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.export.marian import from_marian, parameter_map, to_marian

D_MODEL, VOCAB = 32, 60


def build_pair():
    torch.manual_seed(0)
    marian = MarianMTModel(
        MarianConfig(
            vocab_size=VOCAB, d_model=D_MODEL, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, activation_function="relu",
            scale_embedding=True, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, forced_eos_token_id=None,
            max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
        )
    ).eval()
    with torch.no_grad():  # larger weights than the 0.02 default, so that outputs vary by position
        for name, p in marian.named_parameters():
            if p.dim() == 2 and "embed_positions" not in name:
                p.normal_(0, 0.3)
    return marian, from_marian(marian).eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (3, 11), generator=g)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, 7:], attention_mask[1, 7:] = 0, 0
    input_ids[2, 4:], attention_mask[2, 4:] = 0, 0
    return input_ids, attention_mask


def test_same_logits_as_marian():
    marian, ours = build_pair()
    input_ids, attention_mask = inputs()
    decoder_input_ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    decoder_input_ids[:, 0] = 0
    args = dict(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    expected = marian(input_ids, **args).logits
    torch.testing.assert_close(ours(input_ids, **args).logits, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours(input_ids, output_attentions=True, **args).logits, expected, rtol=0, atol=1e-5)


def test_same_beam_search_output_as_marian():
    marian, ours = build_pair()
    input_ids, attention_mask = inputs()
    args = dict(attention_mask=attention_mask, num_beams=4, max_new_tokens=12, length_penalty=0.6,
                early_stopping=True, do_sample=False)
    expected = marian.generate(input_ids, **args)
    assert expected.size(1) > 5 and len(set(expected[0].tolist())) > 2  # not a trivial output
    assert torch.equal(ours.generate(input_ids, **args), expected)
    greedy = dict(attention_mask=attention_mask, num_beams=1, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours.generate(input_ids, **greedy), marian.generate(input_ids, **greedy))


def _logits(model, input_ids, attention_mask):
    decoder_input_ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    decoder_input_ids[:, 0] = 0
    return model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits


def test_mapping_covers_every_parameter():
    marian, ours = build_pair()
    mapped_ours = {name for name, _, _ in parameter_map(ours.config)}
    mapped_marian = {name for _, name, _ in parameter_map(ours.config)}
    assert mapped_ours == {name for name, _ in ours.named_parameters()}  # tied weights count once
    assert mapped_marian == {name for name, _ in marian.named_parameters() if "embed_positions" not in name}


def test_round_trip_ours_to_marian_to_ours():
    torch.manual_seed(3)
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, d_model=D_MODEL, dropout=0.0)
    ours = VanillaTransformerForConditionalGeneration(config).eval()
    marian = to_marian(ours)
    assert isinstance(marian, MarianMTModel) and not marian.training
    back = from_marian(marian)
    input_ids, attention_mask = inputs()
    expected = _logits(ours, input_ids, attention_mask)
    torch.testing.assert_close(_logits(marian, input_ids, attention_mask), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(back, input_ids, attention_mask), expected, rtol=0, atol=1e-6)
    for name, parameter in ours.named_parameters():  # the permutation and the K/V split invert exactly
        assert torch.equal(back.get_parameter(name), parameter), name


@pytest.mark.parametrize(
    "override, named",
    [
        (dict(norm_position="pre"), "norm_position"),
        (dict(position_encoding="learned"), "position_encoding"),
        (dict(attention_score="additive"), "attention_score"),
        (dict(tie_word_embeddings=False), "tie_word_embeddings"),
    ],
)
def test_configurations_marian_cannot_express_raise(override, named):
    ours = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, **override))
    with pytest.raises(ValueError, match=named):
        to_marian(ours)


def test_marian_with_a_logits_bias_raises():
    marian, _ = build_pair()
    marian.final_logits_bias.fill_(0.5)
    with pytest.raises(ValueError, match="final_logits_bias"):
        from_marian(marian)
