"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), written from scratch.

Read it top to bottom in the paper's order: attention (§3.2), the feed-forward network (§3.3), the
residual connections and layers (§3.1), embeddings and positions (§3.4, §3.5), the stacks (§3.1),
then the models transformers loads, with the output projection and the loss (§3.4, §5.4). Section
numbers (§) refer to the paper. Shapes: B batch, T target length, S source length, H heads,
Dh = d_model / H. Masks are boolean, True where attention is allowed.

What is not the paper lives in the files beside this one, each called here in one line:

    configuration_vanilla_transformer.py        the hyperparameters and the paper's presets
    attention_variants_vanilla_transformer.py   attention beyond the paper: other score functions,
                                                ReLU and sparsemax, hard and local attention
    arguments_vanilla_transformer.py            the checks of the models' arguments (an error naming
                                                the argument); the cache's two names
    saving_vanilla_transformer.py               what a saved folder needs to load anywhere
    fast_modeling_vanilla_transformer.py        drop-ins with the same numbers and less work, installed
                                                in `post_init` unless `config.fast_paths` is False
    generation_vanilla_transformer.py           decoding (§6.1)

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports
only the standard library, torch and the public API of transformers.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)

from .arguments_vanilla_transformer import (
    CACHE_NAME,
    check_attn_implementation,
    check_cache_and_checkpointing,
    check_decoder_inputs,
    check_encoder_inputs,
    check_labels,
    one_cache,
    wants_dict,
)
from .attention_variants_vanilla_transformer import (
    CLASSIC_SCORES,
    OTHER_NORMALIZATIONS,
    add_score_parameters,
    hard_attention,
    local_m_mask,
    local_p_window,
    local_self_attention_mask,
    local_window,
    reset_score_parameters,
)
from .configuration_vanilla_transformer import VanillaTransformerConfig
from .saving_vanilla_transformer import copy_code, name_the_code


# --------------------------------------------------------------------------------------
# §3.2.1: scaled dot-product attention. A score function compares queries (B, H, T, Dh) with keys
# (B, H, S, Dh) and returns scores (B, H, T, S); a normalization turns them into weights (B, H, T, S).
# --------------------------------------------------------------------------------------


def scaled_dot_score(module, q, k):
    """Vaswani et al. 2017: q·k / sqrt(d_k), which keeps softmax out of its flat regions."""
    return q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))


def softmax_normalization(scores):
    """§3.2.1: exp(s_j) / sum_i exp(s_i). Computed in fp32, as fp16 exp overflows."""
    return scores.softmax(dim=-1, dtype=torch.float32)


# `config.attention_score` and `config.attention_normalization`: the paper's first, then those that
# attention_variants_vanilla_transformer.py adds for comparison. `module` holds any learned parameters.
ATTENTION_SCORES = {"scaled_dot": scaled_dot_score, **CLASSIC_SCORES}
ATTENTION_NORMALIZATIONS = {"softmax": softmax_normalization, **OTHER_NORMALIZATIONS}

# Scores that are a plain dot product up to a constant run on torch's fused kernel
# (`scaled_dot_product_attention`); the value is its `scale` argument (None = 1/sqrt(Dh)). The
# others (learned, cosine or location scores) always take the explicit path.
SDPA_SCALES = {"scaled_dot": None, "dot": 1.0}


def attend(module, q, k, v, mask, dropout, need_weights, causal=False):
    """Normalise(score(q, k)) · v. Returns the output (B, H, T, Dh) and the weights (B, H, T, S) or None.

    Dot-product scores with softmax run on torch's fused kernel unless the weights are asked for or the
    model was loaded with `attn_implementation="eager"`; the explicit path computes the same numbers
    (tested to 1e-5 in fp32). A local window (Luong's local-m) is part of `mask`, which the fused kernel
    takes too. `causal` (with no `mask`, T == S) is the look-ahead mask of §3.2.3 without building it:
    the fused kernel then skips the masked half and, on a GPU, can run flash attention, which takes no
    explicit mask. ReLU, hard attention and local-p take the explicit path.
    """
    fused = module.fusable and module.score_name in SDPA_SCALES and module.config._attn_implementation != "eager"
    if fused and not need_weights:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=SDPA_SCALES[module.score_name]
        )
        return out, None
    if causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if module.predicts_position:  # local-p: only keys near each query's predicted position p_t (Luong §3.2)
        mask, favour = local_p_window(module, q, k.size(-2), mask)  # (B, H, T, S) each
    scores = ATTENTION_SCORES[module.score_name](module, q, k)
    if mask is not None:
        # The dtype's own minimum, not -inf: exp() of it is exactly 0 in fp32, fp16 and bf16, and
        # a row with every key masked stays finite instead of becoming NaN.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if module.hard:  # one key per query (Xu et al. 2015)
        weights = hard_attention(module, scores)
    else:
        weights = ATTENTION_NORMALIZATIONS[module.config.attention_normalization](scores)
    if module.predicts_position:  # Luong eq. 10: favour keys near p_t
        weights = weights * favour
    weights = weights.to(v.dtype)
    if mask is not None:
        # A fully masked row (a sequence that is all padding) would otherwise spread its weight
        # evenly over padding; it gets zeros, and every masked position gets exactly 0.
        weights = weights.masked_fill(~mask, 0.0)
    out = F.dropout(weights, p=dropout, training=dropout > 0) @ v
    return out, weights


# --------------------------------------------------------------------------------------
# §3.2.2 and §3.3: multi-head attention and the position-wise feed-forward network
# --------------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """§3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The h per-head projections of each of Q, K and V are one d_model × d_model matrix (one matmul
    instead of h), named as in transformers' seq2seq models (`q_proj`, `k_proj`, `v_proj`,
    `out_proj`), so that PEFT's usual targets find them. Like fairseq, tensor2tensor and Marian, the
    projections have biases. Used three ways (§3.2.3): encoder self-attention, masked decoder
    self-attention, and encoder-decoder (cross) attention whose keys and values come from the encoder output.
    """

    def __init__(self, config: VanillaTransformerConfig, is_cross_attention: bool = False, layer_idx: int | None = None):
        super().__init__()
        self.config = config  # `attn_implementation` is read from it
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.is_cross_attention = is_cross_attention
        self.layer_idx = layer_idx
        self.attention_dropout = config.attention_dropout
        self.score_name = config.attention_score
        self.hard = config.attention_hardness == "hard"
        # local-p predicts where to look in the source; in self-attention the aligned position is the query's own.
        self.predicts_position = is_cross_attention and config.local_attention == "local-p"
        self.fusable = config.attention_normalization == "softmax" and not self.hard and not self.predicts_position
        d_model = config.d_model
        self.q_proj = nn.Linear(d_model, d_model)  # W^Q of all heads
        # W^K; location-based scores compare no keys, so that model has no key projection.
        self.k_proj = nn.Linear(d_model, d_model) if self.score_name != "location" else None
        self.v_proj = nn.Linear(d_model, d_model)  # W^V
        self.out_proj = nn.Linear(d_model, d_model)  # W^O
        for projection in filter(None, (self.q_proj, self.k_proj, self.v_proj)):
            projection.is_attention_input = True  # initialised as fairseq does (see _init_weights)
        add_score_parameters(self, config)  # the score function's and local-p's own, if any

    def _heads(self, projection: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return projection(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)

    def forward(self, hidden_states, key_value_states=None, mask=None, cache=None, output_attentions=False,
                causal=False):
        batch, length, d_model = hidden_states.shape
        q = self._heads(self.q_proj, hidden_states)  # (B, H, T, Dh)
        if self.is_cross_attention and cache is not None and cache.is_updated.get(self.layer_idx):
            # The encoder output does not change while decoding: project it once, reuse it every step.
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            k, v = layer.keys, layer.values
        else:
            source = key_value_states if self.is_cross_attention else hidden_states
            v = self._heads(self.v_proj, source)  # (B, H, S, Dh)
            # Location-based scores read no keys; the cache, which holds keys beside values, gets the values.
            k = v if self.k_proj is None else self._heads(self.k_proj, source)  # (B, H, S, Dh)
            if cache is not None:
                if self.is_cross_attention:
                    k, v = cache.cross_attention_cache.update(k, v, self.layer_idx)
                    cache.is_updated[self.layer_idx] = True
                else:
                    k, v = cache.self_attention_cache.update(k, v, self.layer_idx)
        dropout = self.attention_dropout if self.training else 0.0
        out, weights = attend(self, q, k, v, mask, dropout, output_attentions, causal)
        out = out.transpose(1, 2).reshape(batch, length, d_model)  # concatenate heads: (B, T, d_model)
        return self.out_proj(out), weights


class FeedForward(nn.Module):
    """§3.3: FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position separately."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.d_ff)
        self.fc2 = nn.Linear(config.d_ff, config.d_model)
        self.activation = F.relu if config.activation == "relu" else F.gelu

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x)))


# --------------------------------------------------------------------------------------
# §3.1: residual connections and the encoder and decoder layers
# --------------------------------------------------------------------------------------


class Residual(nn.Module):
    """§3.1 and §5.4: LayerNorm(x + Dropout(Sublayer(x))) ("post", the paper).

    "pre" computes x + Dropout(Sublayer(LayerNorm(x))) instead (Wang et al. 2019), a deviation
    from the paper that is only taken when the config asks for it.
    """

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


class EncoderLayer(nn.Module):
    """§3.1: self-attention, then the feed-forward network, each wrapped in a residual connection."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(config)
        self.self_attn_residual = Residual(config)
        self.feed_forward = FeedForward(config)
        self.feed_forward_residual = Residual(config)

    def forward(self, x, mask, output_attentions=False):
        x, weights = self.self_attn_residual(x, lambda h: self.self_attn(h, mask=mask, output_attentions=output_attentions))
        x, _ = self.feed_forward_residual(x, lambda h: (self.feed_forward(h), None))
        return x, weights


class DecoderLayer(nn.Module):
    """§3.1: masked self-attention, attention over the encoder output, feed-forward network."""

    def __init__(self, config: VanillaTransformerConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MultiHeadAttention(config, layer_idx=layer_idx)
        self.self_attn_residual = Residual(config)
        self.cross_attn = MultiHeadAttention(config, is_cross_attention=True, layer_idx=layer_idx)
        self.cross_attn_residual = Residual(config)
        self.feed_forward = FeedForward(config)
        self.feed_forward_residual = Residual(config)

    def forward(self, x, memory, self_mask, memory_mask, cache=None, causal=False, output_attentions=False):
        x, self_weights = self.self_attn_residual(
            x,
            lambda h: self.self_attn(h, mask=self_mask, cache=cache, output_attentions=output_attentions, causal=causal),
        )
        x, cross_weights = self.cross_attn_residual(
            x,
            lambda h: self.cross_attn(
                h, key_value_states=memory, mask=memory_mask, cache=cache, output_attentions=output_attentions
            ),
        )
        x, _ = self.feed_forward_residual(x, lambda h: (self.feed_forward(h), None))
        return x, self_weights, cross_weights


# --------------------------------------------------------------------------------------
# §3.4 and §3.5: embeddings and positional encodings
# --------------------------------------------------------------------------------------


def sinusoidal_encoding(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)).

    Computed from the positions themselves, so any length works. (T,) -> (T, d_model).
    """
    inverse_frequency = torch.exp(
        torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32) * (-math.log(10000.0) / d_model)
    )
    angles = positions.float().unsqueeze(-1) * inverse_frequency  # (T, d_model / 2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # interleaved: sin, cos, sin, ...


class SinusoidalEncoding(nn.Module):
    """§3.5: the fixed sinusoids of positions past_length .. past_length + length - 1: (T, d_model). No weights."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model

    def forward(self, past_length, length: int, device) -> torch.Tensor:
        return sinusoidal_encoding(torch.arange(length, device=device) + past_length, self.d_model)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}"


class Embeddings(nn.Module):
    """§3.4 and §3.5: token embedding · sqrt(d_model) + positional encoding, then dropout (§5.4)."""

    def __init__(self, config: VanillaTransformerConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        sinusoidal = config.position_encoding == "sinusoidal"
        self.sinusoids = SinusoidalEncoding(config.d_model) if sinusoidal else None
        # Table 3 row (E): learned positions do about as well as sinusoids, but have a fixed size.
        self.learned_positions = None if sinusoidal else nn.Embedding(config.max_position_embeddings, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids=None, inputs_embeds=None, past_length=0):
        """`inputs_embeds` (B, L, d_model), if given, replaces the lookup of `input_ids`: it is what
        `embed_tokens(input_ids)` returns, before the sqrt(d_model) scaling. `past_length` (an int, or a
        0-d tensor for a static cache) is the position of the first token."""
        tokens = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, L, d_model)
        length = tokens.size(1)
        if self.sinusoids is not None:
            position_encoding = self.sinusoids(past_length, length, tokens.device)  # (L, d_model)
        else:
            table_size = self.learned_positions.num_embeddings
            if past_length + length > table_size:
                raise ValueError(
                    f"Sequence of {past_length + length} positions is longer than the learned position table "
                    f"(`max_position_embeddings`={table_size}). Use shorter inputs, a larger table, or "
                    f'position_encoding="sinusoidal", which has no limit.'
                )
            position_encoding = self.learned_positions(torch.arange(length, device=tokens.device) + past_length)
        x = tokens * self.scale + position_encoding.to(tokens.dtype)
        return self.dropout(x) if self.training else x  # dropout is the identity in evaluation: not called


# --------------------------------------------------------------------------------------
# §3.1: the encoder and decoder stacks
# --------------------------------------------------------------------------------------


class Stack(nn.Module):
    """§3.1: "a stack of N identical layers", the encoder's and the decoder's alike: the embeddings, the
    layers and, with pre-norm, a last LayerNorm. Each layer returns its output, then its attention
    weights, which the stack's output names as `attention_outputs` says."""

    attention_outputs = ("attentions",)

    def __init__(self, config: VanillaTransformerConfig, embed_tokens: nn.Embedding, layers):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config, embed_tokens)
        self.layers = nn.ModuleList(layers)
        # Pre-norm leaves the residual stream unnormalised; the stack's output needs one more LayerNorm.
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_position == "pre" else None
        self.window = None if config.local_attention == "none" else config.attention_window  # local attention's D
        self.gradient_checkpointing = False

    def get_input_embeddings(self):
        return self.embeddings.embed_tokens

    def run_layers(self, x, layers, *args, output_attentions=False, output_hidden_states=False):
        """x (B, L, d_model) through each layer, called as layer(x, *args), then the final LayerNorm. Returns
        the output, the hidden states (each layer's input, then the output) and the attention weights, a
        tuple of one per layer under each name of `attention_outputs`; None for what was not asked for."""
        hidden_states, weights = [], []
        for layer in layers:
            if output_hidden_states:
                hidden_states.append(x)
            if self.gradient_checkpointing and self.training:  # recompute the layer's activations in backward
                x, *layer_weights = checkpoint(layer, x, *args, output_attentions=output_attentions, use_reentrant=False)
            else:
                x, *layer_weights = layer(x, *args, output_attentions=output_attentions)
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

    def __init__(self, config: VanillaTransformerConfig, embed_tokens: nn.Embedding):
        super().__init__(config, embed_tokens, (EncoderLayer(config) for _ in range(config.encoder_layers)))

    def forward(
        self, input_ids=None, attention_mask=None, output_attentions=False, output_hidden_states=False, return_dict=None,
        inputs_embeds=None,
    ) -> BaseModelOutput:
        """`return_dict=False` returns the output's `to_tuple()`, as transformers' encoders do."""
        x = self.embeddings(input_ids, inputs_embeds)  # (B, S, d_model)
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
        if self.window is not None:  # local attention: each position sees ±D around itself
            mask = local_self_attention_mask(mask, x.size(1), self.window, x.device)  # (B, 1, S, S)
        x, hidden_states, attentions = self.run_layers(
            x, self.layers, mask, output_attentions=output_attentions, output_hidden_states=output_hidden_states
        )
        output = BaseModelOutput(last_hidden_state=x, hidden_states=hidden_states, **attentions)
        return output.to_tuple() if return_dict is False else output


class VanillaTransformerDecoder(Stack):
    """§3.1: a stack of N identical layers; position i sees only outputs before i and the whole source."""

    attention_outputs = ("attentions", "cross_attentions")

    def __init__(self, config: VanillaTransformerConfig, embed_tokens: nn.Embedding):
        super().__init__(config, embed_tokens, (DecoderLayer(config, layer_idx=i) for i in range(config.decoder_layers)))
        self.local_m = config.local_attention == "local-m"  # local-p places its cross-attention window itself

    @staticmethod
    def _self_attention_mask(length, past_length, cache, attention_mask, device, window=None):
        """§3.2.3 look-ahead mask: query t, at position past_length + t, sees keys 0..past_length + t.

        Returns (mask, causal). Without decoder padding, that is plain causality, which the attention
        kernel applies itself (a first pass: training, or the start of decoding), or nothing at all
        (one new token sees every cached one): no mask is built, per step or per batch. A static cache
        returns all its slots, written or not: the mask then also hides those past the current position.
        `attention_mask` is (B, past_length + T) with 0 at padding, or a 4-D boolean (B, 1, T, keys) as
        `generate` builds for a static cache. `window` (local attention) also hides keys more than D back.
        """
        static = cache is not None and cache.is_compileable  # a static cache: fixed slots, written or not
        if attention_mask is None and not static and window is None:
            if past_length == 0:
                return None, True
            if length == 1:
                return None, False
        # The number of keys the cache returns: all the slots of a static cache, past_length + T otherwise
        # (what transformers' own masks are sized by).
        keys = cache.get_mask_sizes(length, 0)[0] if static else past_length + length
        positions = torch.arange(length, device=device) + past_length  # (T,)
        mask = torch.arange(keys, device=device) <= positions[:, None]  # (T, keys)
        if window is not None:
            mask = mask & local_window(positions, keys, window)
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = mask & attention_mask.bool()
        elif attention_mask is not None:  # -> (B, 1, T, keys); only needed for left-padded decoder inputs
            padding = F.pad(attention_mask.bool(), (0, keys - attention_mask.size(1)))[:, -keys:]
            mask = mask & padding[:, None, None, :]
        return mask, False

    def forward(
        self, input_ids, encoder_hidden_states, encoder_attention_mask=None, attention_mask=None,
        cache: EncoderDecoderCache | None = None, output_attentions=False, output_hidden_states=False, inputs_embeds=None,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        check_cache_and_checkpointing(cache, self.gradient_checkpointing and self.training and torch.is_grad_enabled())
        past_length = cache.get_seq_length() if cache is not None else 0
        x = self.embeddings(input_ids, inputs_embeds, past_length)  # (B, T, d_model)
        self_mask, causal = self._self_attention_mask(x.size(1), past_length, cache, attention_mask, x.device, self.window)
        memory_mask = None if encoder_attention_mask is None else encoder_attention_mask.bool()[:, None, None, :]
        if self.local_m:  # Luong's local-m: target position t looks at source t ± D
            memory_mask = local_m_mask(
                x.size(1), past_length, encoder_hidden_states.size(1), memory_mask, self.window, x.device
            )  # (B, 1, T, S)
        # The first config.decoder_layers (num_hidden_layers): assistant_early_exit lowers it for its draft
        layers = itertools.islice(self.layers, self.config.decoder_layers)  # a ModuleList slice builds a module each step
        x, hidden_states, attentions = self.run_layers(
            x, layers, encoder_hidden_states, self_mask, memory_mask, cache, causal,
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
    """§5.4: cross-entropy against the smoothed target (1 - ε)·onehot(y) + ε/V (Szegedy et al. 2016), the
    mean over the target tokens whose label is not -100. With ε = 0, the negative log-likelihood."""

    def forward(self, logits, labels, epsilon: float):  # (B, T, V), (B, T)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), label_smoothing=epsilon)


# --------------------------------------------------------------------------------------
# The models transformers loads: AutoModel (encoder and decoder) and AutoModelForSeq2SeqLM
# --------------------------------------------------------------------------------------

class VanillaTransformerPreTrainedModel(PreTrainedModel):
    config_class = VanillaTransformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EncoderLayer", "DecoderLayer"]
    _supports_sdpa = True

    def post_init(self):
        """transformers' `post_init` (weights, gradient checkpointing), then the one place where the speed-ups
        take over: each plain module with a drop-in in fast_modeling_vanilla_transformer.py (nn.Dropout,
        SinusoidalEncoding, LabelSmoothedCrossEntropy) is replaced by it. The drop-ins give the same numbers
        and run the plain forward whenever `config.fast_paths` is False."""
        super().post_init()
        from .fast_modeling_vanilla_transformer import install  # the speed-ups live in their own file

        install(self)

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """`attn_implementation`: "sdpa" (the default: torch's fused kernel where it applies) or "eager"."""
        check_attn_implementation(requested_attention)
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, plus what makes the folder load anywhere, whichever way it is
        saved (`save_pretrained`, `Trainer.save_model`, PEFT's `merge_and_unload()`, `push_to_hub`): the
        Auto classes and the `translation` pipeline in config.json, and the code files beside the weights
        (saving_vanilla_transformer.py)."""
        name_the_code(self.config)
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            copy_code(save_directory)
        return result

    @torch.no_grad()
    def _init_weights(self, module):
        """Xavier-uniform projections (as tensor2tensor and fairseq); embeddings N(0, d_model^-0.5),
        so that after the sqrt(d_model) scaling of §3.4 they have unit variance.

        The attention's W^Q, W^K and W^V get fairseq's gain of 1/sqrt(2): the Xavier bound of the three
        as one (3·d_model × d_model) matrix, which is how fairseq and tensor2tensor hold them. With the
        full bound of a square matrix the small quickstart model learned measurably slower (docs/tuning.md).
        """
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight, gain=2**-0.5 if getattr(module, "is_attention_input", False) else 1.0)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.d_model**-0.5)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, MultiHeadAttention):
            reset_score_parameters(module)


def _shared_embeddings(config: VanillaTransformerConfig) -> tuple[nn.Embedding | None, nn.Embedding, nn.Embedding]:
    """§3.4: with tied embeddings one matrix serves the source, the target and the output projection."""
    if config.tie_word_embeddings:
        shared = nn.Embedding(config.vocab_size, config.d_model)
        return shared, shared, shared
    return None, nn.Embedding(config.vocab_size, config.d_model), nn.Embedding(config.vocab_size, config.d_model)


class VanillaTransformerModel(VanillaTransformerPreTrainedModel):
    """Encoder and decoder without the output projection (for `AutoModel`)."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.shared, source_embeddings, target_embeddings = _shared_embeddings(config)
        self.encoder = VanillaTransformerEncoder(config, source_embeddings)
        self.decoder = VanillaTransformerDecoder(config, target_embeddings)
        if config.tie_word_embeddings:
            self._tied_weights_keys = {
                "encoder.embeddings.embed_tokens.weight": "shared.weight",
                "decoder.embeddings.embed_tokens.weight": "shared.weight",
            }
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.get_input_embeddings()

    def set_input_embeddings(self, value):
        if self.config.tie_word_embeddings:
            self.shared = value
            self.decoder.embeddings.embed_tokens = value
        self.encoder.embeddings.embed_tokens = value

    def get_encoder(self, modality=None):
        return self.encoder

    def get_decoder(self):
        return self.decoder

    def forward(
        self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
        encoder_outputs=None, cache=None, inputs_embeds=None, decoder_inputs_embeds=None, use_cache=None,
        output_attentions=None, output_hidden_states=None, return_dict=None, past_key_values=None,
    ) -> Seq2SeqModelOutput | tuple:
        """The source through the encoder, the target so far through the decoder. As in transformers' models:
        `inputs_embeds` and `decoder_inputs_embeds` (what `get_input_embeddings()` returns for the ids,
        unscaled) can replace the ids; the cache is `cache` or, before transformers 5.24, `past_key_values`,
        and the output names it as the installed transformers does; a cache that is passed is read and
        extended, in training too (PEFT's prefix tuning passes its prefix as one), and positions continue
        from its length; `return_dict=False` (or `config.return_dict` False) returns `to_tuple()`."""
        config = self.config
        cache = one_cache(cache, past_key_values)
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        use_cache = (config.use_cache and not self.training) if use_cache is None else use_cache

        if encoder_outputs is None:
            check_encoder_inputs(input_ids, inputs_embeds, attention_mask, config.vocab_size)
            encoder_outputs = self.encoder(
                input_ids, attention_mask, output_attentions, output_hidden_states, inputs_embeds=inputs_embeds
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        memory = encoder_outputs.last_hidden_state  # (B, S, d_model)

        check_decoder_inputs(decoder_input_ids, decoder_inputs_embeds, cache, memory.size(0), config.vocab_size)
        if use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        decoder_outputs = self.decoder(
            decoder_input_ids, memory, attention_mask, decoder_attention_mask, cache, output_attentions,
            output_hidden_states, decoder_inputs_embeds,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,  # (B, T, d_model)
            **{CACHE_NAME: cache},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=memory,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return output if wants_dict(return_dict, config) else output.to_tuple()


class VanillaTransformerForConditionalGeneration(VanillaTransformerPreTrainedModel, GenerationMixin):
    """The full translation model: encoder, decoder and the pre-softmax projection (§3.4), for
    `AutoModelForSeq2SeqLM`. Given `labels`, returns the (optionally label-smoothed, §5.4) loss."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.model = VanillaTransformerModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.criterion = LabelSmoothedCrossEntropy()
        if config.tie_word_embeddings:
            self._tied_weights_keys = {
                "lm_head.weight": "model.shared.weight",
                "model.encoder.embeddings.embed_tokens.weight": "model.shared.weight",
                "model.decoder.embeddings.embed_tokens.weight": "model.shared.weight",
            }
        self.post_init()

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def get_encoder(self, modality=None):
        return self.model.encoder

    def get_decoder(self):
        return self.model.decoder

    def generate(self, inputs=None, generation_config=None, logits_processor=None, **kwargs):
        """transformers' `generate`, with the paper's decoding (§6.1) available: GNMT length penalty
        (`length_penalty_style="gnmt"`) and outputs capped at source length + `max_length_offset`."""
        from .generation_vanilla_transformer import generate  # decoding (§6.1) lives in its own file
        return generate(self, super().generate, inputs, generation_config, logits_processor, **kwargs)

    def prepare_inputs_for_generation(self, *args, tokenizer=None, assistant_tokenizer=None, assistant_model=None,
                                      **kwargs):
        """transformers' own loops keep some of `generate`'s arguments among the model's inputs (the
        tokenizers of stop strings and token healing, an assistant that beam search ignores); `forward`
        takes none of them."""
        return super().prepare_inputs_for_generation(*args, **kwargs)

    def _reorder_cache(self, cache, beam_idx):
        """Called by transformers' beam search after each step (its hook for models with their own way).
        Beams move only within a sentence, and the cross-attention keys and values of a sentence are
        the same in every beam: only the self-attention cache is reordered, not both."""
        cache.self_attention_cache.reorder_cache(beam_idx)
        return cache

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def forward(
        self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
        encoder_outputs=None, cache=None, inputs_embeds=None, decoder_inputs_embeds=None, labels=None, use_cache=None,
        output_attentions=None, output_hidden_states=None, return_dict=None, past_key_values=None,
    ) -> Seq2SeqLMOutput | tuple:
        """As `VanillaTransformerModel.forward`, then the logits and, given `labels`, the loss."""
        if labels is not None:
            check_labels(labels, decoder_input_ids, decoder_inputs_embeds, self.config.vocab_size)
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
            use_cache = False  # as transformers' seq2seq models: scoring makes no cache (a passed one is still read)
        outputs = self.model(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, cache, inputs_embeds,
            decoder_inputs_embeds, use_cache, output_attentions, output_hidden_states, return_dict=True,
            past_key_values=past_key_values,
        )
        logits = self.lm_head(outputs.last_hidden_state)  # §3.4: the pre-softmax projection, (B, T, vocab)
        loss = None
        if labels is not None:
            loss = self.criterion(logits, labels, self.config.label_smoothing)  # §5.4
        # Everything the base model returned (caches, attentions, hidden states), the logits in place of
        # the last hidden state.
        passed_on = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
        output = Seq2SeqLMOutput(loss=loss, logits=logits, **passed_on)
        return output if wants_dict(return_dict, self.config) else output.to_tuple()


__all__ = [
    "VanillaTransformerForConditionalGeneration",
    "VanillaTransformerModel",
    "VanillaTransformerPreTrainedModel",
]
