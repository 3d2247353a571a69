"""Attention beyond the paper, for comparing with it: the classic score functions (dot, general,
additive, cosine, location) with their per-head parameters, the normalizations ReLU and sparsemax, hard
attention, and Luong's local attention (local-m and local-p). Each is a config field, off by default
(configuration_vanilla_transformer.py); docs/attention.md compares them.

The paper's own attention, §3.2.1's scaled dot product and softmax, stays in
modeling_vanilla_transformer.py, whose `attend` and registries (ATTENTION_SCORES,
ATTENTION_NORMALIZATIONS) call what is here. Shapes: B batch, T queries, S keys, H heads,
Dh = d_model / H; masks are boolean, True where attention is allowed.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only torch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------------------
# The classic score functions: compare queries (B, H, T, Dh) with keys (B, H, S, Dh) and return
# scores (B, H, T, S). `module` (a MultiHeadAttention) holds any learned parameters.
# --------------------------------------------------------------------------------------


def dot_score(module, q, k):
    """Luong et al. 2015: q·k."""
    return q @ k.transpose(-1, -2)


def general_score(module, q, k):
    """Luong et al. 2015: q^T W_a k, one W_a per head.

    Behind learned query/key projections W_a adds parameters but no expressiveness
    (q^T W_a k = (W_a^T q)^T k); it is here to compare score functions.
    """
    return (q @ module.score_weight) @ k.transpose(-1, -2)


def additive_score(module, q, k):
    """Bahdanau et al. 2015: v_a^T tanh(W_a [q; k]) = v_a^T tanh(W_q q + W_k k).

    Memory grows as B·H·T·S·Dh: fine for study, slow for long inputs.
    """
    query_part = (q @ module.score_query_weight).unsqueeze(-2)  # (B, H, T, 1, Dh)
    key_part = (k @ module.score_key_weight).unsqueeze(-3)  # (B, H, 1, S, Dh)
    hidden = torch.tanh(query_part + key_part)  # (B, H, T, S, Dh)
    return torch.einsum("bhtsd,hd->bhts", hidden, module.score_vector)


def cosine_score(module, q, k):
    """Graves et al. 2014 (content-based): cosine(q, k) times a learned strength per head.

    Graves sharpens with a key strength beta; without it softmax over values in [-1, 1] is
    nearly uniform and the model cannot attend.
    """
    cosine = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
    return cosine * module.score_strength.view(1, -1, 1, 1)


def location_score(module, q, k):
    """Luong et al. 2015, §3.1 (location-based): a_t = softmax(W_a h_t), scores over source positions
    from the target state alone. Here one W_a (Dh × `location_max_length`) per head maps the query to
    a score for each key position; the keys' content is never read, only their number S.

    Luong computes it once per target step from an RNN decoder's state; here it replaces the key
    comparison inside multi-head attention, in every attention block. Column j scores the j-th key
    (sources are right-padded, so j is the real position), and the padding mask hides positions past a
    sentence's end. In self-attention this is a position-only pattern (where to look, not at what);
    in the decoder the look-ahead mask of §3.2.3 still hides later positions.
    """
    keys, positions = k.size(-2), module.score_location_weight.size(-1)
    if keys > positions:
        raise ValueError(
            f"Location-based attention scores at most {positions} positions (`location_max_length`={positions}); "
            f"got a sequence of {keys} (the source, or the target so far in decoder self-attention). Use shorter "
            "inputs, or train a model with a larger `location_max_length`."
        )
    return q @ module.score_location_weight[..., :keys]  # (B, H, T, Dh) @ (H, Dh, S) -> (B, H, T, S)


CLASSIC_SCORES = {
    "dot": dot_score,
    "general": general_score,
    "additive": additive_score,
    "cosine": cosine_score,
    "location": location_score,
}


def add_score_parameters(module, config) -> None:
    """The learned parameters of `module`'s score function and of local-p's predicted position, one set
    per head (the scaled dot product and dot have none)."""
    heads, dh = config.num_heads, config.head_dim
    if module.score_name == "general":
        module.score_weight = nn.Parameter(torch.empty(heads, dh, dh))
    elif module.score_name == "additive":
        module.score_query_weight = nn.Parameter(torch.empty(heads, dh, dh))
        module.score_key_weight = nn.Parameter(torch.empty(heads, dh, dh))
        module.score_vector = nn.Parameter(torch.empty(heads, dh))
    elif module.score_name == "cosine":
        module.score_strength = nn.Parameter(torch.empty(heads))
    elif module.score_name == "location":
        module.score_location_weight = nn.Parameter(torch.empty(heads, dh, config.location_max_length))
    if module.predicts_position:  # W_p and v_p of Luong's eq. 9, per head
        module.position_weight = nn.Parameter(torch.empty(heads, dh, dh))
        module.position_vector = nn.Parameter(torch.empty(heads, dh))


def reset_score_parameters(module) -> None:
    """Initialise what `add_score_parameters` made."""
    # N(0, 1/Dh) keeps x @ W at the scale of x. (torch.nn.init, not in-place tensor ops: when a
    # checkpoint is loaded, transformers makes these calls skip the weights that were loaded.)
    if module.score_name == "general":
        nn.init.normal_(module.score_weight, std=module.head_dim**-0.5)
    elif module.score_name == "location":
        nn.init.normal_(module.score_location_weight, std=module.head_dim**-0.5)
    elif module.score_name == "additive":
        for weight in (module.score_query_weight, module.score_key_weight, module.score_vector):
            nn.init.normal_(weight, std=module.head_dim**-0.5)
    elif module.score_name == "cosine":
        # sqrt(Dh): the scale a scaled dot product of unit-variance vectors would have.
        nn.init.constant_(module.score_strength, math.sqrt(module.head_dim))
    if module.predicts_position:
        for weight in (module.position_weight, module.position_vector):
            nn.init.normal_(weight, std=module.head_dim**-0.5)


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


OTHER_NORMALIZATIONS = {"relu": relu_normalization, "sparsemax": sparsemax_normalization}


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


def local_window(positions, keys: int, window: int):
    """Luong et al. 2015, §3.2 (local attention): True for keys within ±D of each query's aligned
    position. positions (..., T) -> (..., T, keys)."""
    return (torch.arange(keys, device=positions.device) - positions[..., None]).abs() <= window


def local_self_attention_mask(mask, length: int, window: int, device):
    """In self-attention the aligned position is the query's own: `mask` (B, 1, 1, S) or None, narrowed
    to ±D around each position: (B|1, 1, S, S) or (S, S)."""
    near = local_window(torch.arange(length, device=device), length, window)  # (S, S)
    return near if mask is None else mask & near


def local_m_mask(length: int, past_length: int, source_length: int, memory_mask, window: int, device):
    """Luong's local-m in cross-attention: target position t looks at source t ± D, t clipped to each
    source's last token. `memory_mask` (B, 1, 1, S) or None -> (B|1, 1, T, S)."""
    positions = torch.arange(length, device=device) + past_length  # (T,)
    last = source_length - 1 if memory_mask is None else memory_mask.sum(dim=-1) - 1  # (B, 1, 1) or a number
    aligned = torch.minimum(positions, torch.as_tensor(last, device=positions.device).clamp_min(0))  # (B|1, 1, T)
    near = local_window(aligned, source_length, window)  # (B|1, 1, T, S)
    return near if memory_mask is None else memory_mask & near


def predicted_position(module, q, keys: int, mask):
    """Luong et al. 2015, eq. 9 (local-p): p_t = S · sigmoid(v_p^T tanh(W_p h_t)), from each head's query,
    S each source's length (from the padding mask (B, 1, 1, S)). Returns (B, H, T, 1), in [0, S]."""
    length = keys if mask is None else mask.sum(dim=-1, keepdim=True)  # (B, 1, 1, 1): padding is not source
    hidden = torch.tanh(q @ module.position_weight)  # (B, H, T, Dh)
    return length * torch.sigmoid(torch.einsum("bhtd,hd->bht", hidden, module.position_vector)).unsqueeze(-1)


def local_p_window(module, q, keys: int, mask):
    """Luong's local-p in cross-attention: the window moves to each query's predicted position p_t (eq. 9).
    Returns `mask` narrowed to it (B, H, T, S) and eq. 10's factor for the weights, which favours keys
    near p_t: exp(-(s - p_t)^2 / 2 sigma^2), sigma = D / 2 (B, H, T, S)."""
    window = module.config.attention_window
    centre = predicted_position(module, q, keys, mask)  # (B, H, T, 1)
    distance = torch.arange(keys, device=q.device) - centre  # (B, H, T, S)
    near = distance.abs() <= window
    return (near if mask is None else mask & near), torch.exp(-(distance**2) / (2 * (window / 2) ** 2))
