"""Attention beyond the paper, for comparing with it: the classic score functions (dot, general,
additive, cosine, location) with their per-head parameters, the normalizations ReLU and sparsemax, hard
attention, and Luong's local attention (local-m and local-p). Each is a config field, off by default
(configuration_vanilla_transformer.py); docs/attention.md compares them.

The paper's own attention, §3.2.1's scaled dot product and softmax in `MultiHeadAttention`, stays in
attention.py. modeling_vanilla_transformer.py asks this file once, when a layer is
built, for the class the config names (`variant_attention_class`) and for local attention's masks
(`LocalAttentionMasks`), and when a model is built, which attention implementations its config runs on
(`check_attn_implementation`). The classes here are MultiHeadAttention with their own `attend`: the explicit path, score -> mask ->
normalization -> weights · V, on which every combination of the options runs. Luong's dot product with
softmax needs none of it: it is MultiHeadAttention with a scale of 1. Shapes: B batch, T queries, S keys,
H heads, Dh = d_model / H. Masks are transformers' additive ones: 0 where attention is allowed, the
dtype's minimum where not.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only the
standard library, torch and the files beside it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MultiHeadAttention, additive_mask


# --------------------------------------------------------------------------------------
# The explicit path, and the classic score functions: each compares queries (B, H, T, Dh) with keys
# (B, H, S, Dh) and returns scores (B, H, T, S), with its own parameters, one set per head.
# --------------------------------------------------------------------------------------


class ExplicitAttention(MultiHeadAttention):
    """Multi-head attention (§3.2.2) whose attention function is spelled out, so that each step can be another:
    the score (`score`, the scaled dot product here; the classes below override it), the mask, the
    normalization (softmax, ReLU or sparsemax) or hard attention, and local-p's window."""

    def __init__(self, config, layer_idx=None, is_cross_attention=False, is_causal=False):
        super().__init__(config, layer_idx, is_cross_attention, is_causal)
        self.normalize = NORMALIZATIONS[config.attention_normalization]
        self.hard = config.attention_hardness == "hard"
        # local-p predicts where to look in the source; in self-attention the aligned position is the query's own.
        self.predicts_position = is_cross_attention and config.local_attention == "local-p"
        if self.predicts_position:  # W_p and v_p of Luong's eq. 9, per head
            self.position_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))
            self.position_vector = nn.Parameter(torch.empty(self.num_heads, self.head_dim))

    def attend(self, q, k, v, attention_mask, output_attentions=False):
        scores = self.score(q, k)  # (B, H, T, S)
        if self.predicts_position:  # local-p: only keys near each query's predicted position p_t (Luong §3.2)
            attention_mask, favour = local_p_window(self, q, k.size(-2), attention_mask)  # (B, H, T, S) each
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = hard_attention(self, scores) if self.hard else self.normalize(scores)  # (B, H, T, S)
        if self.predicts_position:  # Luong eq. 10: favour keys near p_t
            weights = weights * favour
        weights = weights.to(v.dtype)
        out = F.dropout(weights, p=self.dropout, training=self.training) @ v  # (B, H, T, Dh)
        return out.transpose(1, 2), weights

    def init_score_parameters(self) -> None:
        """Initialise the parameters of the score and of local-p. N(0, 1/Dh) keeps x @ W at the scale of x.
        (torch.nn.init, not in-place tensor ops: when a checkpoint is loaded, transformers makes these calls
        skip the weights that were loaded.)"""
        for weight in self.score_parameters() + ((self.position_weight, self.position_vector) if self.predicts_position else ()):
            nn.init.normal_(weight, std=self.head_dim**-0.5)

    def score_parameters(self) -> tuple:
        return ()


class GeneralAttention(ExplicitAttention):
    """Luong et al. 2015: q^T W_a k, one W_a per head.

    Behind learned query/key projections W_a adds parameters but no expressiveness
    (q^T W_a k = (W_a^T q)^T k); it is here to compare score functions.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.score_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))

    def score(self, q, k):
        return (q @ self.score_weight) @ k.transpose(-1, -2)

    def score_parameters(self) -> tuple:
        return (self.score_weight,)


class AdditiveAttention(ExplicitAttention):
    """Bahdanau et al. 2015: v_a^T tanh(W_a [q; k]) = v_a^T tanh(W_q q + W_k k).

    Memory grows as B·H·T·S·Dh: fine for study, slow for long inputs.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.score_query_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))
        self.score_key_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.head_dim))
        self.score_vector = nn.Parameter(torch.empty(self.num_heads, self.head_dim))

    def score(self, q, k):
        query_part = (q @ self.score_query_weight).unsqueeze(-2)  # (B, H, T, 1, Dh)
        key_part = (k @ self.score_key_weight).unsqueeze(-3)  # (B, H, 1, S, Dh)
        hidden = torch.tanh(query_part + key_part)  # (B, H, T, S, Dh)
        return torch.einsum("bhtsd,hd->bhts", hidden, self.score_vector)

    def score_parameters(self) -> tuple:
        return self.score_query_weight, self.score_key_weight, self.score_vector


class CosineAttention(ExplicitAttention):
    """Graves et al. 2014 (content-based): cosine(q, k) times a learned strength per head.

    Graves sharpens with a key strength beta; without it softmax over values in [-1, 1] is
    nearly uniform and the model cannot attend.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.score_strength = nn.Parameter(torch.empty(self.num_heads))

    def score(self, q, k):
        cosine = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
        return cosine * self.score_strength.view(1, -1, 1, 1)

    def init_score_parameters(self) -> None:
        # sqrt(Dh): the scale a scaled dot product of unit-variance vectors would have.
        super().init_score_parameters()
        nn.init.constant_(self.score_strength, math.sqrt(self.head_dim))


class LocationAttention(ExplicitAttention):
    """Luong et al. 2015, §3.1 (location-based): a_t = softmax(W_a h_t), scores over source positions
    from the target state alone. Here one W_a (Dh × `location_max_length`) per head maps the query to
    a score for each key position; the keys' content is never read, only their number S, so the block
    has no key projection.

    Luong computes it once per target step from an RNN decoder's state; here it replaces the key
    comparison inside multi-head attention, in every attention block. Column j scores the j-th key
    (sources are right-padded, so j is the real position), and the padding mask hides positions past a
    sentence's end. In self-attention this is a position-only pattern (where to look, not at what);
    in the decoder the look-ahead mask of §3.2.3 still hides later positions.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.k_proj = None  # W^K: no keys are compared
        self.score_location_weight = nn.Parameter(torch.empty(self.num_heads, self.head_dim, config.location_max_length))

    def keys_and_values(self, source):
        values = self._heads(self.v_proj, source)
        return values, values  # the cache, which holds keys beside values, gets the values

    def score(self, q, k):
        keys, positions = k.size(-2), self.score_location_weight.size(-1)
        if keys > positions:
            raise ValueError(
                f"Location-based attention scores at most {positions} positions (`location_max_length`={positions}); "
                f"got a sequence of {keys} (the source, or the target so far in decoder self-attention). Use shorter "
                "inputs, or train a model with a larger `location_max_length`."
            )
        return q @ self.score_location_weight[..., :keys]  # (B, H, T, Dh) @ (H, Dh, S) -> (B, H, T, S)

    def score_parameters(self) -> tuple:
        return (self.score_location_weight,)


SCORE_CLASSES = {
    "scaled_dot": ExplicitAttention,
    "dot": ExplicitAttention,
    "general": GeneralAttention,
    "additive": AdditiveAttention,
    "cosine": CosineAttention,
    "location": LocationAttention,
}  # the config's ATTENTION_SCORES, one class each (tests/modeling/test_attention_variants.py holds them equal)


def variant_attention_class(config):
    """The attention class of a config beyond the paper's; None where MultiHeadAttention computes it (the
    scaled dot product or Luong's dot product, with softmax, on any of transformers' attention functions)."""
    return SCORE_CLASSES[config.attention_score] if explicit_attention(config) else None


def explicit_attention(config) -> bool:
    """Whether the config asks for attention beyond what transformers' attention functions compute (a score
    class with a `score` of its own rather than MultiHeadAttention's dot product, a normalization other than
    softmax, hard attention, local-p's predicted window): that runs on its own explicit function only."""
    return (
        SCORE_CLASSES[config.attention_score].score is not MultiHeadAttention.score
        or config.attention_normalization != "softmax"
        or config.attention_hardness == "hard"
        or config.local_attention == "local-p"
    )


def check_attn_implementation(config, requested: str | None) -> None:
    """Attention beyond the paper runs on its own explicit function only ("eager"); local-m's window is a mask,
    which flash attention does not take."""
    if explicit_attention(config) and requested not in (None, "eager"):
        raise ValueError(
            f'`attn_implementation`={requested!r}: this model\'s attention (its `attention_score`, '
            '`attention_normalization`, `attention_hardness` or `local_attention`) runs only on its own explicit '
            'function; use "eager" or leave it out.'
        )
    if config.local_attention != "none" and requested is not None and requested.startswith("flash"):
        raise ValueError(f'`attn_implementation`={requested!r} takes no mask for local attention\'s window; use '
                         '"sdpa", "eager" or "flex_attention".')


# --------------------------------------------------------------------------------------
# Normalizations other than softmax, and hard attention: scores (B, H, T, S) -> weights (B, H, T, S)
# --------------------------------------------------------------------------------------


def relu_normalization(scores):
    """The lecture's alternative to softmax: ReLU(s_j) / sum_i ReLU(s_i).

    A row with no positive score (or every key masked) has nothing to share out: its weights are all 0.
    """
    positive = scores.float().relu()
    return positive / positive.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def sparsemax_normalization(scores):
    """Sparsemax (Martins & Astudillo 2016): the closest point of the probability simplex to the scores,
    max(s_j - tau, 0) with tau chosen so that the row sums to 1; low scores get exactly 0."""
    scores = scores.float()
    ranked = scores.sort(dim=-1, descending=True).values
    cumulative = ranked.cumsum(dim=-1)
    k = torch.arange(1, scores.size(-1) + 1, device=scores.device, dtype=scores.dtype)
    support = (1 + k * ranked > cumulative).sum(dim=-1, keepdim=True).clamp_min(1)  # (B, H, T, 1): keys kept
    tau = (cumulative.gather(-1, support - 1) - 1) / support
    return (scores - tau).clamp_min(0)


def softmax_normalization(scores):
    """§3.2.1's softmax, in fp32 (fp16's exp overflows)."""
    return scores.softmax(dim=-1, dtype=torch.float32)


NORMALIZATIONS = {"softmax": softmax_normalization, "relu": relu_normalization, "sparsemax": sparsemax_normalization}


def hard_attention(module, scores):
    """Hard attention (Xu et al. 2015): each query takes exactly one key, its weights one-hot (B, H, T, S).

    Inference takes the best-scoring key. Training samples with the straight-through Gumbel-softmax
    (Jang et al. 2017): the forward pass is one-hot, the gradient is the softmax's. (REINFORCE, the other
    estimator, did not train: docs/attention.md.)
    """
    if module.training:
        return F.gumbel_softmax(scores.float(), hard=True)
    return F.one_hot(scores.argmax(dim=-1), scores.size(-1)).float()


# --------------------------------------------------------------------------------------
# Local attention (Luong et al. 2015, §3.2): each query sees only the keys within ±D
# (`attention_window`) of an aligned position
# --------------------------------------------------------------------------------------


class LocalAttentionMasks:
    """Luong et al. 2015, §3.2 (local attention) as transformers' mask functions (`and_mask_function`, called
    with a batch, head, query and key index), which the model's stacks add to the padding and look-ahead
    masks: each query sees only the keys within ±D (`attention_window`) of an aligned position."""

    def __init__(self, config):
        self.window = config.attention_window
        self.local_m = config.local_attention == "local-m"  # local-p places its cross-attention window itself

    def self_attention(self):
        """In self-attention the aligned position is the query's own."""
        return lambda batch, head, query, key: (query - key).abs() <= self.window

    def cross_attention(self, encoder_attention_mask, encoder_hidden_states, past_length):
        """local-m: target position t (query t + past_length) looks at source t ± D, t clipped to each
        source's last token. None for local-p."""
        if not self.local_m:
            return None
        batch, source_length = encoder_hidden_states.shape[:2]
        if encoder_attention_mask is None:
            last = torch.full((batch,), source_length - 1, device=encoder_hidden_states.device)
        else:
            last = (encoder_attention_mask.sum(dim=-1) - 1).clamp_min(0)  # (B,)
        return lambda b, head, query, key: (key - torch.minimum(query + past_length, last[b])).abs() <= self.window

    def decoder_windows(self, encoder_attention_mask, encoder_hidden_states, past_length):
        """The decoder's: self-attention's and cross-attention's."""
        return self.self_attention(), self.cross_attention(encoder_attention_mask, encoder_hidden_states, past_length)


def predicted_position(module, q, keys: int, allowed):
    """Luong et al. 2015, eq. 9 (local-p): p_t = S · sigmoid(v_p^T tanh(W_p h_t)), from each head's query,
    S each source's length (from the padding mask `allowed` (B, 1, T, S)). Returns (B, H, T, 1), in [0, S]."""
    length = keys if allowed is None else allowed.sum(dim=-1, keepdim=True)  # (B, 1, T, 1): padding is not source
    hidden = torch.tanh(q @ module.position_weight)  # (B, H, T, Dh)
    return length * torch.sigmoid(torch.einsum("bhtd,hd->bht", hidden, module.position_vector)).unsqueeze(-1)


def local_p_window(module, q, keys: int, attention_mask):
    """Luong's local-p in cross-attention: the window moves to each query's predicted position p_t (eq. 9).
    Returns the additive `attention_mask` narrowed to it (B, H, T, S) and eq. 10's factor for the weights,
    which favours keys near p_t: exp(-(s - p_t)^2 / 2 sigma^2), sigma = D / 2 (B, H, T, S)."""
    window = module.config.attention_window
    allowed = None if attention_mask is None else attention_mask == 0  # (B, 1, T, S): the source, not its padding
    centre = predicted_position(module, q, keys, allowed)  # (B, H, T, 1)
    distance = torch.arange(keys, device=q.device) - centre  # (B, H, T, S)
    near = distance.abs() <= window
    mask = additive_mask(near if allowed is None else allowed & near, module, q, None)
    return mask, torch.exp(-(distance**2) / (2 * (window / 2) ** 2))
