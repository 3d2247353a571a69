"""Weights between this model and transformers' `MarianMTModel`, which is the same architecture.

    ours = from_marian(marian_model)
    marian_model = to_marian(ours)   # e.g. for CTranslate2, which converts MarianMTModel folders

Both directions give the same logits (1e-5, fp32). Marian, like the paper, is post-LN with
sinusoidal positions and scaled, tied embeddings, relu (or gelu) and scaled dot-product
attention; a configuration outside that set has no Marian equivalent and raises ValueError.
What differs, and how it is mapped:

- Positions: the paper interleaves sin and cos (dimension 2i is sin, 2i+1 is cos); Marian puts all
  sines in the first half and all cosines in the second. The two are the same encoding up to a
  permutation P of the d_model dimensions. Every part of the residual stream is equivariant under
  P (LayerNorm only averages over dimensions), so every weight that touches the residual stream is
  permuted: embedding columns, the input columns of Q, K, V and W_1, the output rows and biases of
  W^O and W_2, and LayerNorm gains and biases. Logits are unchanged by P.
- Projections: both name them q_proj, k_proj, v_proj and out_proj, the same matrices.
- Marian adds `final_logits_bias` (a buffer, zeros unless a converted Marian checkpoint set it); we
  have none, so a non-zero one cannot be converted.
"""

from __future__ import annotations

import torch
from transformers import MarianConfig, MarianMTModel

from ..errors import BadInput
from ..modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from ..modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration

__all__ = ["from_marian", "marian_config", "to_marian"]

# Which dimension of a tensor runs along the residual stream (and so is permuted), if any.
COLUMNS, ROWS, NEITHER = 1, 0, None


def paper_from_marian_permutation(d_model: int) -> torch.Tensor:
    """ours[2i] = marian[i] (sin), ours[2i + 1] = marian[d/2 + i] (cos)."""
    half = torch.arange(d_model // 2)
    return torch.stack((half, half + d_model // 2), dim=1).flatten()


def parameter_map(config: VanillaTransformerConfig):
    """(our parameter, the Marian parameter, its stream dimension) for every parameter."""
    entries = [("model.shared.weight", "model.shared.weight", COLUMNS)]

    def linear(ours, marian, stream_dim):
        entries.append((f"{ours}.weight", f"{marian}.weight", stream_dim))
        # A bias follows the stream only where the output rows do.
        entries.append((f"{ours}.bias", f"{marian}.bias", ROWS if stream_dim == ROWS else NEITHER))

    def attention(ours, marian):
        for name in ("q_proj", "k_proj", "v_proj"):
            linear(f"{ours}.{name}", f"{marian}.{name}", COLUMNS)
        linear(f"{ours}.out_proj", f"{marian}.out_proj", ROWS)

    def norm(ours, marian):
        entries.append((f"{ours}.weight", f"{marian}.weight", ROWS))
        entries.append((f"{ours}.bias", f"{marian}.bias", ROWS))

    for side, count in (("encoder", config.encoder_layers), ("decoder", config.decoder_layers)):
        for i in range(count):
            ours, marian = f"model.{side}.layers.{i}", f"model.{side}.layers.{i}"
            attention(f"{ours}.self_attn", f"{marian}.self_attn")
            norm(f"{ours}.self_attn_residual.norm", f"{marian}.self_attn_layer_norm")
            if side == "decoder":
                attention(f"{ours}.cross_attn", f"{marian}.encoder_attn")
                norm(f"{ours}.cross_attn_residual.norm", f"{marian}.encoder_attn_layer_norm")
            linear(f"{ours}.feed_forward.fc1", f"{marian}.fc1", COLUMNS)
            linear(f"{ours}.feed_forward.fc2", f"{marian}.fc2", ROWS)
            norm(f"{ours}.feed_forward_residual.norm", f"{marian}.final_layer_norm")
    return entries


def _permute(tensor: torch.Tensor, stream_dim, permutation: torch.Tensor) -> torch.Tensor:
    return tensor if stream_dim is NEITHER else tensor.index_select(stream_dim, permutation)


def _check_convertible(config: VanillaTransformerConfig) -> None:
    """Marian expresses exactly the paper's model; name the first setting that is not."""
    required = {
        "norm_position": "post",
        "position_encoding": "sinusoidal",
        "attention_score": "scaled_dot",
        "tie_word_embeddings": True,
        "layer_norm_eps": 1e-5,
    }
    for name, value in required.items():
        if getattr(config, name) != value:
            raise BadInput(
                f"MarianMTModel cannot express `{name}`={getattr(config, name)!r}; only {value!r} converts."
            )
    if config.activation not in ("relu", "gelu"):
        raise BadInput(f"MarianMTModel cannot express `activation`={config.activation!r}; use 'relu' or 'gelu'.")


def marian_config(config: VanillaTransformerConfig) -> MarianConfig:
    """The `MarianConfig` of the same architecture as `config`."""
    _check_convertible(config)
    return MarianConfig(
        vocab_size=config.vocab_size,
        decoder_vocab_size=config.vocab_size,
        d_model=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.num_heads,
        decoder_attention_heads=config.num_heads,
        encoder_ffn_dim=config.d_ff,
        decoder_ffn_dim=config.d_ff,
        activation_function=config.activation,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=0.0,
        max_position_embeddings=config.max_position_embeddings,
        scale_embedding=config.scale_embedding,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )


def to_marian(model: VanillaTransformerForConditionalGeneration) -> MarianMTModel:
    """A `MarianMTModel` computing the same function as `model` (fp32, eval mode)."""
    if not isinstance(model, VanillaTransformerForConditionalGeneration):
        raise BadInput(f"`model` must be a VanillaTransformerForConditionalGeneration; got {type(model).__name__}.")
    config = model.config
    marian = MarianMTModel(marian_config(config))
    marian_from_paper = paper_from_marian_permutation(config.d_model).argsort()
    with torch.no_grad():
        for ours_name, marian_name, stream_dim in parameter_map(config):
            value = _permute(model.get_parameter(ours_name).float(), stream_dim, marian_from_paper)
            marian.get_parameter(marian_name).copy_(value)
    return marian.train(model.training)


def from_marian(marian: MarianMTModel) -> VanillaTransformerForConditionalGeneration:
    """Our model computing the same function as `marian` (fp32, eval mode)."""
    if not isinstance(marian, MarianMTModel):
        raise BadInput(f"`marian` must be a MarianMTModel; got {type(marian).__name__}.")
    mc = marian.config
    checks = {
        "encoder_attention_heads == decoder_attention_heads": mc.encoder_attention_heads == mc.decoder_attention_heads,
        "encoder_ffn_dim == decoder_ffn_dim": mc.encoder_ffn_dim == mc.decoder_ffn_dim,
        "activation_function in ('relu', 'gelu')": mc.activation_function in ("relu", "gelu"),
        "activation_dropout == 0": not mc.activation_dropout,
        "tied (share_encoder_decoder_embeddings and tie_word_embeddings)": bool(
            mc.share_encoder_decoder_embeddings and mc.tie_word_embeddings
        ),
        "final_logits_bias all zero": not marian.final_logits_bias.any(),
    }
    for condition, holds in checks.items():
        if not holds:
            raise BadInput(f"This MarianMTModel has no equivalent here: it needs {condition}.")
    config = VanillaTransformerConfig(
        vocab_size=mc.vocab_size,
        d_model=mc.d_model,
        encoder_layers=mc.encoder_layers,
        decoder_layers=mc.decoder_layers,
        num_heads=mc.encoder_attention_heads,
        d_ff=mc.encoder_ffn_dim,
        dropout=mc.dropout,
        attention_dropout=mc.attention_dropout,
        activation=mc.activation_function,
        max_position_embeddings=mc.max_position_embeddings,
        scale_embedding=mc.scale_embedding,
        pad_token_id=mc.pad_token_id,
        bos_token_id=mc.bos_token_id,
        eos_token_id=mc.eos_token_id,
        decoder_start_token_id=mc.decoder_start_token_id,
    )
    ours = VanillaTransformerForConditionalGeneration(config)
    paper_from_marian = paper_from_marian_permutation(config.d_model)
    with torch.no_grad():
        for ours_name, marian_name, stream_dim in parameter_map(config):
            value = marian.get_parameter(marian_name).float()
            ours.get_parameter(ours_name).copy_(_permute(value, stream_dim, paper_from_marian))
    return ours.train(marian.training)
