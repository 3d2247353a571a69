"""§3.2 of "Attention Is All You Need": scaled dot-product attention (§3.2.1) and multi-head attention
(§3.2.2), the paper's own, used three ways (§3.2.3) by the layers of modeling_vanilla_transformer.py.
Shapes: B batch, T queries, S keys, H heads, Dh = d_model / H.

Attention beyond the paper (attention_variants.py) is MultiHeadAttention with its own
`attend`: it builds on this file, and the model file chooses between the two when a layer is built.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only torch
and the public API of transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# --------------------------------------------------------------------------------------
# §3.2.1: scaled dot-product attention. Queries (B, H, T, Dh) against keys and values (B, H, S, Dh).
# --------------------------------------------------------------------------------------


def scaled_dot_product_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """§3.2.1: Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, the scale keeping softmax out of its flat
    regions; transformers' "eager" attention for this model. `attention_mask` (B|1, 1, T, S) is added to the
    scores: 0 where attention is allowed, the dtype's minimum where not (exp of it is exactly 0), as
    transformers' mask functions build it. Returns the output (B, T, H, Dh) and the weights (B, H, T, S)."""
    scores = query @ key.transpose(-1, -2) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype)  # in fp32, as fp16's exp overflows
    out = F.dropout(weights, p=dropout, training=module.training) @ value  # (B, H, T, Dh)
    return out.transpose(1, 2), weights


def additive_mask(mask, module, query, key):
    """The additive mask of the explicit attention function (0 where allowed, the dtype's minimum where not)
    from one built for torch's fused kernels: a boolean one (True where allowed), flex attention's block mask
    (its rule evaluated at every query and key), or None where the kernel applies §3.2.3's causality itself.
    An additive mask is returned as it is."""
    if isinstance(mask, BlockMask):
        mask = create_mask(mask.mask_mod, *mask.shape, device=query.device)
    if mask is not None and mask.dtype != torch.bool:
        return mask
    if mask is None:
        queries, keys = query.size(-2), key.size(-2)
        if not (module.is_causal and queries > 1):
            return None
        mask = torch.ones(1, 1, queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, torch.finfo(query.dtype).min)


# --------------------------------------------------------------------------------------
# §3.2.2: multi-head attention
# --------------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """§3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The h per-head projections of each of Q, K and V are one d_model × d_model matrix with a bias (as in
    fairseq and Marian), named as transformers' seq2seq models name them, so that PEFT finds them. Used three
    ways (§3.2.3): encoder self-attention, masked decoder self-attention, and attention over the encoder
    output. The attention function is the model's `attn_implementation`: "eager" (the function above),
    "sdpa", "flex_attention" or "flash_attention_2" (transformers' kernels of the same)."""

    def __init__(self, config, layer_idx: int | None = None, is_cross_attention=False, is_causal=False):
        super().__init__()
        self.config = config  # a VanillaTransformerConfig; `attn_implementation` is read from it
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.layer_idx, self.is_cross_attention = layer_idx, is_cross_attention
        self.is_causal = is_causal  # §3.2.3's look-ahead mask; transformers' fused kernels read it
        self.scaling = 1.0 if config.attention_score == "dot" else self.head_dim**-0.5  # Luong's dot: unscaled
        self.dropout = config.attention_dropout
        d_model = config.d_model
        self.q_proj = nn.Linear(d_model, d_model)  # W^Q of all heads
        self.k_proj = nn.Linear(d_model, d_model)  # W^K
        self.v_proj = nn.Linear(d_model, d_model)  # W^V
        self.out_proj = nn.Linear(d_model, d_model)  # W^O
        for projection in (self.q_proj, self.k_proj, self.v_proj):
            projection.is_attention_input = True  # initialised as fairseq does (see _init_weights)

    def _heads(self, projection: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self._split_heads(projection(x))

    def _split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        batch, length, _ = projected.shape
        return projected.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, cache=None, output_attentions=False):
        batch, length, d_model = hidden_states.shape
        # The encoder output does not change while decoding: project it once, reuse it every step.
        cached = self.is_cross_attention and cache is not None and cache.is_updated.get(self.layer_idx)
        source = None if cached else (key_value_states if self.is_cross_attention else hidden_states)
        q, k, v = self.projections(hidden_states, source)  # (B, H, T, Dh), then (B, H, S, Dh) each
        if cached:
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            k, v = layer.keys, layer.values
        elif cache is not None and self.is_cross_attention:
            k, v = cache.cross_attention_cache.update(k, v, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        elif cache is not None:
            k, v = cache.self_attention_cache.update(k, v, self.layer_idx)
        out, weights = self.attend(q, k, v, attention_mask, output_attentions)  # (B, T, H, Dh), (B, H, T, S)
        return self.out_proj(out.reshape(batch, length, d_model)), weights  # heads concatenated, then W^O

    def projections(self, hidden_states, source):
        """Q W^Q, and K W^K and V W^V of `source` (None where the cache holds them), split into heads."""
        q = self._heads(self.q_proj, hidden_states)
        return (q, None, None) if source is None else (q, *self.keys_and_values(source))

    def keys_and_values(self, source):
        return self._heads(self.k_proj, source), self._heads(self.v_proj, source)

    def score(self, q, k):
        """§3.2.1's scores (B, H, T, S), as the attention functions compute them (the neuron view reads them here)."""
        return q @ k.transpose(-1, -2) * self.scaling

    def attend(self, q, k, v, attention_mask, output_attentions=False):
        implementation = self.config._attn_implementation
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, scaled_dot_product_attention)
        if output_attentions and implementation in ("sdpa", "flex_attention"):
            # torch's fused kernels return no weights: the explicit function computes the same numbers.
            attention, attention_mask = scaled_dot_product_attention, additive_mask(attention_mask, self, q, k)
        elif output_attentions and attention is not scaled_dot_product_attention:
            raise ValueError(f"`output_attentions`: the {implementation} kernel returns no attention weights; load the "
                             "model with attn_implementation='eager' or 'sdpa' to see them")
        dropout = self.dropout if self.training else 0.0
        return attention(self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling)


__all__ = ["MultiHeadAttention", "additive_mask", "scaled_dot_product_attention"]
