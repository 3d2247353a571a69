"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), written from scratch.

Read it top to bottom in the paper's order: attention (§3.2), the feed-forward network (§3.3), the
residual connections and layers (§3.1), embeddings and positions (§3.4, §3.5), the stacks (§3.1),
then the models transformers loads, with the output projection and the loss (§3.4, §5.4). Section
numbers (§) refer to the paper. Shapes: B batch, T target length, S source length, H heads,
Dh = d_model / H. Masks are made by transformers' mask functions, in the form the model's
attention function takes (`attn_implementation`).

What is not the paper lives in the files beside this one, each named here in one line (every file that ships with
it; a test keeps the list whole):

    configuration_vanilla_transformer.py  the hyperparameters and the paper's presets
    attention.py                          §3.2's attention, the paper's own
    attention_variants.py                 attention beyond the paper, chosen when a layer is built
    input_checks.py                       the checks of the models' forward inputs; the cache's two names
    value_checks.py                       the checks of the decoding options and of finite numbers
    saving.py                             what a saved folder needs to load anywhere
    fast_modeling.py                      the speed-ups it is built with (`fast_paths`): the loss with its
                                          gradient in closed form, attention's projections fused in training
    generation.py                         decoding (§6.1): the options the model adds, the source-length cap,
                                          which loop serves a call
    search.py                             the loops generation.py runs: greedy search and the paper's beam search,
                                          done sentences leaving the batch
    pipeline_vanilla_transformer.py       the `translation` pipeline a saved folder records in its config.json

The files import one another in one direction, this one on top: none of them imports it.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports
only the standard library, torch, the public API of transformers and the files beside it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)

from .input_checks import (
    CACHE_NAME,
    check_cache_and_checkpointing,
    check_decoder_inputs,
    check_encoder_inputs,
    check_fits_in_memory,
    check_labels,
    check_learned_positions,
    resolve_cache_argument,
    use_return_dict,
)
from .attention import MultiHeadAttention  # §3.2
from .attention_variants import (
    LocalAttentionMasks,
    check_attn_implementation,
    explicit_attention,
    variant_attention_class,
)
from .configuration_vanilla_transformer import VanillaTransformerConfig
from .fast_modeling import ClosedFormCrossEntropy, FusedMultiHeadAttention  # speed-ups (`fast_paths`)
from .generation import generate_with_added_options  # decoding (§6.1)
from .saving import CustomCodeMixin


# --------------------------------------------------------------------------------------
# §3.2: attention (attention.py) and §3.3: the position-wise feed-forward network
# --------------------------------------------------------------------------------------


def attention_class(config: VanillaTransformerConfig):
    """§3.2.2's MultiHeadAttention (with `fast_paths`, its twin that projects one input in one product), or the
    attention beyond the paper that the config names (chosen once, when a layer is built)."""
    return variant_attention_class(config) or (FusedMultiHeadAttention if config.fast_paths else MultiHeadAttention)


def local_attention_masks(config: VanillaTransformerConfig):
    """Luong's local attention, None for the paper's: mask functions that hide keys beyond ±D."""
    return LocalAttentionMasks(config) if config.local_attention != "none" else None


class FeedForward(nn.Module):
    """§3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position separately."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(config.d_model, config.d_ff), nn.Linear(config.d_ff, config.d_model)  # W_1, W_2
        self.activation = F.relu if config.activation == "relu" else F.gelu

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x)))


# --------------------------------------------------------------------------------------
# §3.1: residual connections and the encoder and decoder layers
# --------------------------------------------------------------------------------------


class Residual(nn.Module):
    """§3.1 and §5.4: LayerNorm(x + Dropout(Sublayer(x))) ("post", the paper); "pre", only when the config
    asks for it, computes x + Dropout(Sublayer(LayerNorm(x))) instead (Wang et al. 2019)."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.pre_norm = config.norm_position == "pre"

    def forward(self, x, sublayer):
        """`sublayer` maps a (B, T, d_model) tensor to (output, extra); extra is passed through."""
        out, extra = sublayer(self.norm(x) if self.pre_norm else x)
        if self.training:  # dropout is the identity in evaluation: not called at every decoding step
            out = self.dropout(out)
        return (x + out if self.pre_norm else self.norm(x + out)), extra


class EncoderLayer(GradientCheckpointingLayer):
    """§3.1: self-attention, then the feed-forward network, each wrapped in a residual connection.
    (A GradientCheckpointingLayer: `gradient_checkpointing_enable()` recomputes it in the backward pass.)"""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.self_attn = attention_class(config)(config)
        self.self_attn_residual = Residual(config)
        self.feed_forward = FeedForward(config)
        self.feed_forward_residual = Residual(config)

    def forward(self, x, mask, output_attentions=False):
        x, weights = self.self_attn_residual(x, lambda h: self.self_attn(h, attention_mask=mask,
                                                                         output_attentions=output_attentions))
        x, _ = self.feed_forward_residual(x, lambda h: (self.feed_forward(h), None))
        return x, weights


class DecoderLayer(GradientCheckpointingLayer):
    """§3.1: masked self-attention, attention over the encoder output (§3.2.3's "memory",
    `encoder_hidden_states` as transformers names it), feed-forward network."""

    def __init__(self, config: VanillaTransformerConfig, layer_idx: int):
        super().__init__()
        attention = attention_class(config)
        self.self_attn = attention(config, layer_idx=layer_idx, is_causal=True)
        self.self_attn_residual = Residual(config)
        self.cross_attn = attention(config, layer_idx=layer_idx, is_cross_attention=True)
        self.cross_attn_residual = Residual(config)
        self.feed_forward = FeedForward(config)
        self.feed_forward_residual = Residual(config)

    def forward(self, x, encoder_hidden_states, self_mask, cross_mask, cache=None, output_attentions=False):
        x, self_weights = self.self_attn_residual(x, lambda h: self.self_attn(
            h, attention_mask=self_mask, cache=cache, output_attentions=output_attentions))
        x, cross_weights = self.cross_attn_residual(x, lambda h: self.cross_attn(
            h, key_value_states=encoder_hidden_states, attention_mask=cross_mask, cache=cache,
            output_attentions=output_attentions))
        x, _ = self.feed_forward_residual(x, lambda h: (self.feed_forward(h), None))
        return x, self_weights, cross_weights


# --------------------------------------------------------------------------------------
# §3.4 and §3.5: embeddings and positional encodings
# --------------------------------------------------------------------------------------


def sinusoidal_encoding(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)),
    computed from the positions themselves, so any length works. (T,) -> (T, d_model)."""
    inverse_frequency = torch.exp(
        torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32) * (-math.log(10000.0) / d_model)
    )
    angles = positions.float().unsqueeze(-1) * inverse_frequency  # (T, d_model / 2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # interleaved: sin, cos, sin, ...


class Embeddings(nn.Module):
    """§3.4 and §3.5: token embedding · sqrt(d_model) + positional encoding, then dropout (§5.4)."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)  # tied by transformers (§3.4)
        self.scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.d_model = config.d_model
        # Table 3 row (E): learned positions do about as well as sinusoids, but have a fixed size.
        learned = config.position_encoding == "learned"
        self.learned_positions = nn.Embedding(config.max_position_embeddings, config.d_model) if learned else None
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids=None, inputs_embeds=None, past_length=0):
        """`inputs_embeds` (B, L, d_model), what `embed_tokens(input_ids)` returns, may replace the ids. `past_length`
        (an int, or a 0-d tensor for a static cache) is the position of the first token."""
        tokens = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, L, d_model)
        positions = torch.arange(tokens.size(1), device=tokens.device) + past_length  # (L,)
        if self.learned_positions is None:
            position_encoding = sinusoidal_encoding(positions, self.d_model)
        else:
            check_learned_positions(tokens.size(1), past_length, self.learned_positions.num_embeddings)
            position_encoding = self.learned_positions(positions)
        x = tokens * self.scale + position_encoding.to(tokens.dtype)  # (B, L, d_model)
        return self.dropout(x) if self.training else x  # dropout is the identity in evaluation: not called


# --------------------------------------------------------------------------------------
# §3.1: the encoder and decoder stacks
# --------------------------------------------------------------------------------------


class Stack(nn.Module):
    """§3.1: "a stack of N identical layers", the encoder's and the decoder's alike: the embeddings, the
    layers and, with pre-norm, a last LayerNorm. Each layer returns its output, then its attention
    weights, which the stack's output names as `attention_outputs` says."""

    attention_outputs = ("attentions",)

    def __init__(self, config: VanillaTransformerConfig, layers):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(layers)
        # Pre-norm leaves the residual stream unnormalised; the stack's output needs one more LayerNorm.
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_position == "pre" else None
        self.local_windows = local_attention_masks(config)  # Luong's local attention: None for the paper's

    def get_input_embeddings(self):
        return self.embeddings.embed_tokens

    def set_input_embeddings(self, value):
        self.embeddings.embed_tokens = value

    def run_layers(self, x, layers, *args, output_attentions=False, output_hidden_states=False, **kwargs):
        """x (B, L, d_model) through each layer, called as layer(x, *args, **kwargs) (tensors positionally, as
        gradient checkpointing needs), then the final LayerNorm. Returns the output, the hidden states (each
        layer's input, then the output) and the attention weights, a tuple of one per layer under each name of
        `attention_outputs`; None for what was not asked for."""
        hidden_states, weights = [], []
        for layer in layers:
            if output_hidden_states:
                hidden_states.append(x)
            x, *layer_weights = layer(x, *args, output_attentions=output_attentions, **kwargs)
            weights.append(layer_weights)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if output_hidden_states:
            hidden_states.append(x)
        attentions = {name: tuple(layer_weights[i] for layer_weights in weights) if output_attentions else None
                      for i, name in enumerate(self.attention_outputs)}
        return x, (tuple(hidden_states) if output_hidden_states else None), attentions


class VanillaTransformerEncoder(Stack):
    """§3.1: a stack of N identical layers over the embedded source."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config, (EncoderLayer(config) for _ in range(config.encoder_layers)))

    def forward(
        self, input_ids=None, attention_mask=None, output_attentions=False, output_hidden_states=False, return_dict=None,
        inputs_embeds=None,
    ) -> BaseModelOutput:
        """`return_dict=False` returns the output's `to_tuple()`, as transformers' encoders do."""
        x = self.embeddings(input_ids, inputs_embeds)  # (B, S, d_model)
        # Padding hidden (B, 1, S, S), in the form the attention function takes; local attention: ±D only.
        window = None if self.local_windows is None else self.local_windows.self_attention()
        mask = create_bidirectional_mask(self.config, x, attention_mask, and_mask_function=window)
        x, hidden_states, attentions = self.run_layers(
            x, self.layers, mask, output_attentions=output_attentions, output_hidden_states=output_hidden_states
        )
        output = BaseModelOutput(last_hidden_state=x, hidden_states=hidden_states, **attentions)
        return output.to_tuple() if return_dict is False else output


class VanillaTransformerDecoder(Stack):
    """§3.1: a stack of N identical layers; position i sees only outputs before i and the whole source."""

    attention_outputs = ("attentions", "cross_attentions")

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config, (DecoderLayer(config, layer_idx=i) for i in range(config.decoder_layers)))

    def forward(
        self, input_ids, encoder_hidden_states, encoder_attention_mask=None, attention_mask=None,
        cache: EncoderDecoderCache | None = None, output_attentions=False, output_hidden_states=False, inputs_embeds=None,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        check_cache_and_checkpointing(cache, self.training and torch.is_grad_enabled() and self.layers[0].gradient_checkpointing)
        past_length = cache.get_seq_length() if cache is not None else 0
        x = self.embeddings(input_ids, inputs_embeds, past_length)  # (B, T, d_model)
        self_window, cross_window = (None, None) if self.local_windows is None else self.local_windows.decoder_windows(
            encoder_attention_mask, encoder_hidden_states, past_length)
        self_cache = None if cache is None else cache.self_attention_cache
        # §3.2.3: query t (position past_length + t) sees the keys up to its own position (B, 1, T, keys), as one
        # new query without padding does unmasked (a decoding step). The mask functions take the cache 4th.
        one_query = x.size(1) == 1 and attention_mask is None and not getattr(self_cache, "is_compileable", False)
        self_mask = None if one_query and self_window is None else create_causal_mask(
            self.config, x, attention_mask, self_cache, None, None, self_window)
        cross_mask = create_bidirectional_mask(  # the source's padding hidden (B, 1, T, S)
            self.config, x, encoder_attention_mask, encoder_hidden_states, and_mask_function=cross_window
        )
        # The first config.decoder_layers (num_hidden_layers): assistant_early_exit lowers it for its draft
        layers = itertools.islice(self.layers, self.config.decoder_layers)  # a ModuleList slice builds a module each step
        x, hidden_states, attentions = self.run_layers(
            x, layers, encoder_hidden_states, self_mask, cross_mask, cache=cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        )
        return BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=x, **{CACHE_NAME: cache}, hidden_states=hidden_states, **attentions
        )


# --------------------------------------------------------------------------------------
# §3.4 and §5.4: the output side, teacher forcing and the label-smoothed loss
# --------------------------------------------------------------------------------------


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher forcing: the decoder reads <start> y_1 ... y_{n-1} and predicts y_1 ... y_n."""
    shifted = labels.new_full(labels.shape, pad_token_id)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)  # -100 marks ignored label positions


class LabelSmoothedCrossEntropy(nn.Module):
    """§5.4: cross-entropy against the smoothed target q = (1 - ε)·onehot(y) + ε/V (Szegedy et al. 2016), summed
    over the target tokens whose label is not -100, and beside it the plain negative log-likelihood, summed
    over the same tokens without gradient (perplexity is made from it). logits (B, T, V), labels (B, T)."""

    def forward(self, logits, labels, epsilon: float):
        log_probs = logits.log_softmax(dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # at least fp32
        kept = labels != -100  # (B, T)
        nll = -log_probs.gather(-1, labels.masked_fill(~kept, 0).unsqueeze(-1)).squeeze(-1)  # -log p(y_t)
        smoothed = (1.0 - epsilon) * nll - epsilon * log_probs.mean(dim=-1)  # -sum_v q(v) log p(v)
        return smoothed.masked_fill(~kept, 0.0).sum(), nll.detach().masked_fill(~kept, 0.0).sum()


# --------------------------------------------------------------------------------------
# The models transformers loads: AutoModel (encoder and decoder) and AutoModelForSeq2SeqLM
# --------------------------------------------------------------------------------------

@dataclass
class Seq2SeqLMOutputWithNLL(Seq2SeqLMOutput):
    """transformers' Seq2SeqLMOutput and, given `labels`, `nll`: the negative log-likelihood without label
    smoothing, normalised as `loss` is (per target token, or by `num_items_in_batch`)."""

    nll: torch.FloatTensor | None = None


class VanillaTransformerPreTrainedModel(CustomCodeMixin, PreTrainedModel):  # saving: the code files go with the weights
    config_class = VanillaTransformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EncoderLayer", "DecoderLayer"]
    # The paper's attention runs on each of transformers' attention functions; attention beyond the paper
    # only on its own explicit one (get_correct_attn_implementation).
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True

    def __init__(self, config: VanillaTransformerConfig, *args, **kwargs):
        check_fits_in_memory(config)  # before any tensor: each path that builds a model from a config passes here
        super().__init__(config, *args, **kwargs)

    def _resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of=None, mean_resizing=True):
        """transformers resizes the encoder's embeddings and the output projection; untied, the decoder's
        embeddings are a third matrix over the same vocabulary, resized alike so that every one keeps
        `config.vocab_size` rows."""
        embeddings = super()._resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        if not self.config.tie_word_embeddings:
            old = self.base_model.get_decoder_input_embeddings()
            new = self._get_resized_embeddings(old, embeddings.num_embeddings, mean_resizing=mean_resizing)
            new.requires_grad_(old.weight.requires_grad)
            self.base_model.set_decoder_input_embeddings(new)
        return embeddings

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        check_attn_implementation(self.config, requested_attention)
        if explicit_attention(self.config):
            return "eager"
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    @torch.no_grad()
    def _init_weights(self, module):
        """Xavier-uniform projections (as tensor2tensor and fairseq), W^Q, W^K and W^V with fairseq's gain of
        1/sqrt(2): the bound of the three as one (3·d_model × d_model) matrix, as fairseq holds them (the full
        bound learned measurably slower: docs/tuning.md). Embeddings N(0, d_model^-0.5): unit variance after
        the sqrt(d_model) scaling of §3.4."""
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight, gain=2**-0.5 if getattr(module, "is_attention_input", False) else 1.0)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.d_model**-0.5)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()  # weight 1, bias 0
        elif hasattr(module, "init_score_parameters"):  # attention beyond the paper: its own parameters
            module.init_score_parameters()


class VanillaTransformerModel(VanillaTransformerPreTrainedModel):
    """Encoder and decoder without the output projection (for `AutoModel`)."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        if config.tie_word_embeddings:  # §3.4: one matrix for the source and the target, tied by transformers
            self.shared = nn.Embedding(config.vocab_size, config.d_model)
            self._tied_weights_keys = {
                "encoder.embeddings.embed_tokens.weight": "shared.weight",
                "decoder.embeddings.embed_tokens.weight": "shared.weight",
            }
        self.encoder = VanillaTransformerEncoder(config)
        self.decoder = VanillaTransformerDecoder(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.shared if self.config.tie_word_embeddings else self.encoder.get_input_embeddings()

    def set_input_embeddings(self, value):
        if self.config.tie_word_embeddings:
            self.shared = value
            self.decoder.set_input_embeddings(value)
        self.encoder.set_input_embeddings(value)

    def get_decoder_input_embeddings(self):
        return self.decoder.get_input_embeddings()

    def set_decoder_input_embeddings(self, value):
        """The decoder's own embeddings (untied, as Marian's without `share_encoder_decoder_embeddings`); tied,
        one matrix is set for all with `set_input_embeddings`."""
        if self.config.tie_word_embeddings:
            raise ValueError("the decoder's embeddings are tied to the encoder's: set both with `set_input_embeddings`")
        self.decoder.set_input_embeddings(value)

    def forward(
        self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
        encoder_outputs=None, cache=None, inputs_embeds=None, decoder_inputs_embeds=None, use_cache=None,
        output_attentions=None, output_hidden_states=None, return_dict=None, past_key_values=None,
    ) -> Seq2SeqModelOutput | tuple:
        """The source through the encoder, the target so far through the decoder, as in transformers' models:
        `inputs_embeds` and `decoder_inputs_embeds` (unscaled) can replace the ids; the cache is `cache` or
        `past_key_values` (its name before transformers 5.24); a cache passed is read and extended, in training
        too (PEFT's prefix tuning), positions continuing from its length; `return_dict=False` returns a tuple."""
        config = self.config
        cache = resolve_cache_argument(cache, past_key_values)
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        use_cache = (config.use_cache and not self.training) if use_cache is None else use_cache

        if encoder_outputs is None:
            check_encoder_inputs(input_ids, inputs_embeds, attention_mask, config.vocab_size)
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, output_attentions=output_attentions,
                output_hidden_states=output_hidden_states, inputs_embeds=inputs_embeds,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        encoder_last_hidden_state = encoder_outputs.last_hidden_state  # (B, S, d_model)

        check_decoder_inputs(decoder_input_ids, decoder_inputs_embeds, cache, encoder_last_hidden_state.size(0),
                             config.vocab_size)
        if use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, encoder_hidden_states=encoder_last_hidden_state,
            encoder_attention_mask=attention_mask, attention_mask=decoder_attention_mask, cache=cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            inputs_embeds=decoder_inputs_embeds,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,  # (B, T, d_model)
            **{CACHE_NAME: cache},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return output if use_return_dict(return_dict, config) else output.to_tuple()


class VanillaTransformerForConditionalGeneration(VanillaTransformerPreTrainedModel, GenerationMixin):
    """The full translation model: encoder, decoder and the pre-softmax projection (§3.4), for
    `AutoModelForSeq2SeqLM`. Given `labels`, returns the (optionally label-smoothed, §5.4) loss."""

    accepts_loss_kwargs = True  # `Trainer` passes `num_items_in_batch`
    # None, or the context search.py's loops run each call in, called with the model and the rows the call decodes:
    # the package's load_model sets it where it times oneDNN's kernels faster than torch's (onednn_decoding.py there).
    # Set when a model is loaded, never saved.
    decoding_context = None

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.model = VanillaTransformerModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # §5.4's loss, or with `fast_paths` its twin of the same numbers (gradient in closed form)
        self.criterion = ClosedFormCrossEntropy() if config.fast_paths else LabelSmoothedCrossEntropy()
        if config.tie_word_embeddings:  # §3.4: one matrix for both embeddings and the pre-softmax projection
            self._tied_weights_keys = {
                "lm_head.weight": "model.shared.weight",
                "model.encoder.embeddings.embed_tokens.weight": "model.shared.weight",
                "model.decoder.embeddings.embed_tokens.weight": "model.shared.weight",
            }
        self.post_init()

    def generate(self, inputs=None, generation_config=None, logits_processor=None, **kwargs):
        """transformers' `generate`, with the paper's decoding (§6.1) available: GNMT length penalty
        (`length_penalty_style="gnmt"`) and outputs capped at source length + `max_length_offset`."""
        return generate_with_added_options(self, super().generate, inputs, generation_config, logits_processor, **kwargs)

    def prepare_inputs_for_generation(self, *args, tokenizer=None, assistant_tokenizer=None, assistant_model=None,
                                      **kwargs):
        """transformers' own loops keep some of `generate`'s arguments among the model's inputs (tokenizers, an
        assistant that beam search ignores); `forward` takes none of them."""
        return super().prepare_inputs_for_generation(*args, **kwargs)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def forward(
        self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
        encoder_outputs=None, cache=None, inputs_embeds=None, decoder_inputs_embeds=None, labels=None, use_cache=None,
        output_attentions=None, output_hidden_states=None, return_dict=None, past_key_values=None,
        num_items_in_batch=None,
    ) -> Seq2SeqLMOutputWithNLL | tuple:
        """As `VanillaTransformerModel.forward`, then the logits and, given `labels`, the loss: summed over the
        target tokens and divided by their number, or by `num_items_in_batch` when one step spans several
        batches or processes (as transformers' `Trainer` passes it)."""
        if labels is not None:
            check_labels(labels, decoder_input_ids, decoder_inputs_embeds, self.config.vocab_size)
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
            use_cache = False  # as transformers' seq2seq models: scoring makes no cache (a passed one is still read)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs, cache=cache,
            inputs_embeds=inputs_embeds, decoder_inputs_embeds=decoder_inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            past_key_values=past_key_values,
        )
        logits = self.lm_head(outputs.last_hidden_state)  # §3.4: the pre-softmax projection, (B, T, vocab)
        passed_on = {name: value for name, value in outputs.items() if name != "last_hidden_state"}  # cache, attentions
        if labels is None:
            output = Seq2SeqLMOutput(logits=logits, **passed_on)
        else:  # §5.4
            loss, nll = self.criterion(logits, labels, self.config.label_smoothing)
            tokens = (labels != -100).sum() if num_items_in_batch is None else num_items_in_batch
            output = Seq2SeqLMOutputWithNLL(loss=loss / tokens, logits=logits, **passed_on, nll=nll / tokens)
        return output if use_return_dict(return_dict, self.config) else output.to_tuple()


__all__ = ["VanillaTransformerForConditionalGeneration", "VanillaTransformerModel", "VanillaTransformerPreTrainedModel"]
