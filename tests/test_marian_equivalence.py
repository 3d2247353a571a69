"""Differential test against a peer: transformers' MarianMTModel is the same architecture.

Marian, like the paper, is post-LN with sinusoidal positions and scaled, tied embeddings. We
build one with a matching configuration, copy its weights into ours and require the same logits
(1e-5, fp32) and the same beam-search output. The details that differ and how they are mapped:

- Positions: the paper interleaves sin and cos (dimension 2i is sin, 2i+1 is cos); Marian puts all
  sines in the first half and all cosines in the second. The two are the same encoding up to a
  permutation P of the d_model dimensions. Every part of the residual stream is equivariant under
  P (LayerNorm only averages over dimensions), so we permute every weight that touches the
  residual stream: embedding columns, the input columns of Q, K, V and W_1, the output rows and
  biases of W^O and W_2, and LayerNorm gains and biases. Logits are unchanged by P.
- Projections: Marian has separate k_proj and v_proj; ours are one kv_proj, their concatenation.
- Marian adds `final_logits_bias` (zeros, not trained here) and uses its own pad-index embedding
  row; neither changes the logits.
- Marian's activation defaults to swish; we set relu, the paper's.
"""

import torch
from transformers import MarianConfig, MarianMTModel

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

D_MODEL, VOCAB = 32, 60


def paper_from_marian_permutation(d_model: int) -> torch.Tensor:
    """ours[2i] = marian[i] (sin), ours[2i + 1] = marian[d/2 + i] (cos)."""
    half = torch.arange(d_model // 2)
    return torch.stack((half, half + d_model // 2), dim=1).flatten()


def copy_marian_into_ours(marian: MarianMTModel, ours: VanillaTransformerForConditionalGeneration) -> None:
    P = paper_from_marian_permutation(D_MODEL)
    source = marian.model

    def reads_stream(linear):  # input columns follow the residual stream
        return linear.weight[:, P], linear.bias

    def writes_stream(linear):  # output rows follow the residual stream
        return linear.weight[P], linear.bias[P]

    def set_linear(target, weight_bias):
        target.weight.copy_(weight_bias[0])
        target.bias.copy_(weight_bias[1])

    def set_norm(target, norm):
        target.weight.copy_(norm.weight[P])
        target.bias.copy_(norm.bias[P])

    def set_attention(target, attn):
        set_linear(target.q_proj, reads_stream(attn.q_proj))
        (k_w, k_b), (v_w, v_b) = reads_stream(attn.k_proj), reads_stream(attn.v_proj)
        set_linear(target.kv_proj, (torch.cat([k_w, v_w]), torch.cat([k_b, v_b])))
        set_linear(target.out_proj, writes_stream(attn.out_proj))

    def set_feed_forward(target, layer):
        set_linear(target.fc1, reads_stream(layer.fc1))
        set_linear(target.fc2, writes_stream(layer.fc2))

    with torch.no_grad():
        ours.model.shared.weight.copy_(source.shared.weight[:, P])
        for ours_layer, layer in zip(ours.model.encoder.layers, source.encoder.layers):
            set_attention(ours_layer.self_attn, layer.self_attn)
            set_norm(ours_layer.self_attn_residual.norm, layer.self_attn_layer_norm)
            set_feed_forward(ours_layer.feed_forward, layer)
            set_norm(ours_layer.feed_forward_residual.norm, layer.final_layer_norm)
        for ours_layer, layer in zip(ours.model.decoder.layers, source.decoder.layers):
            set_attention(ours_layer.self_attn, layer.self_attn)
            set_norm(ours_layer.self_attn_residual.norm, layer.self_attn_layer_norm)
            set_attention(ours_layer.cross_attn, layer.encoder_attn)
            set_norm(ours_layer.cross_attn_residual.norm, layer.encoder_attn_layer_norm)
            set_feed_forward(ours_layer.feed_forward, layer)
            set_norm(ours_layer.feed_forward_residual.norm, layer.final_layer_norm)


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
    ours = VanillaTransformerForConditionalGeneration(
        VanillaTransformerConfig(vocab_size=VOCAB, d_model=D_MODEL, encoder_layers=2, decoder_layers=2, num_heads=4,
                                 d_ff=64, dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ).eval()
    copy_marian_into_ours(marian, ours)
    return marian, ours


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
