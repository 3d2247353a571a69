"""The neuron view (as bertviz draws it, Vig 2019): how one query's attention weights come about.

    view = neuron_view(model, input_ids, attention_mask, decoder_input_ids, kind="cross", layer=0, head=1, query=3)
    view.query, view.keys, view.products, view.scores, view.weights

For one kind of attention ("encoder" self, "decoder" self or "cross"), layer, head and query token: the
query vector q (Dh,), each key vector k_j (S, Dh), their elementwise product q×k_j (S, Dh), the score as
the model's own score function computes it (S,) (for "scaled_dot", the sum of q×k_j over √Dh), and the
normalised weight the model used (S,). Everything is read from one teacher-forced forward pass: q and
k_j are the outputs of the block's own W^Q and W^K, the scores come from its score function, and the
weights are the model's `output_attentions`; nothing is computed by a second implementation.
Location-based scores read no keys: `keys` and `products` are then None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modeling.modeling_vanilla_transformer import ATTENTION_SCORES

KINDS = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"}


@dataclass
class NeuronView:
    query: torch.Tensor  # (Dh,)
    keys: torch.Tensor | None  # (S, Dh)
    products: torch.Tensor | None  # (S, Dh): q × k_j, elementwise
    scores: torch.Tensor  # (S,): the score function's output, before masking and normalisation
    weights: torch.Tensor  # (S,): the weights the model attended with


def _block(model, kind: str, layer: int):
    stack = model.model.encoder if kind == "encoder" else model.model.decoder
    if not -len(stack.layers) <= layer < len(stack.layers):
        raise ValueError(f"`layer` must be in [0, {len(stack.layers)}) for {kind} attention; got {layer}.")
    return stack.layers[layer].cross_attn if kind == "cross" else stack.layers[layer].self_attn


@torch.no_grad()
def neuron_view(model, input_ids, attention_mask, decoder_input_ids, kind: str, layer: int, head: int, query: int,
                row: int = 0) -> NeuronView:
    """The neuron view of sentence `row` of the batch. The model runs in evaluation mode."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {', '.join(map(repr, KINDS))}; got {kind!r}.")
    block = _block(model, kind, layer)
    if not 0 <= head < block.num_heads:
        raise ValueError(f"`head` must be in [0, {block.num_heads}); got {head}.")
    captured = {}
    hooks = [projection.register_forward_hook(lambda module, args, out, name=name: captured.setdefault(name, out))
             for name, projection in (("q", block.q_proj), ("k", block.k_proj)) if projection is not None]
    try:
        out = model.eval()(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                           output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    q = _split(block, captured["q"])  # (B, H, T, Dh)
    if not 0 <= query < q.size(-2):
        raise ValueError(f"`query` must be in [0, {q.size(-2)}); got {query}.")
    k = _split(block, captured["k"]) if "k" in captured else None  # (B, H, S, Dh)
    weights = getattr(out, KINDS[kind])[layer][row, head, query]  # (S,)
    # location scores read only the number of keys; any tensor with S rows stands in for them
    stand_in = k if k is not None else q.new_zeros(q.shape[:2] + (weights.numel(), q.size(-1)))
    scores = ATTENTION_SCORES[block.score_name](block, q[row:row + 1, :, query:query + 1], stand_in[row:row + 1])
    q_vector = q[row, head, query]
    keys = None if k is None else k[row, head]
    return NeuronView(query=q_vector, keys=keys, products=None if keys is None else q_vector * keys,
                      scores=scores[0, head, 0], weights=weights)


def _split(block, projected: torch.Tensor) -> torch.Tensor:
    """(B, L, d_model) -> (B, H, L, Dh), as the block splits its projections into heads."""
    batch, length, _ = projected.shape
    return projected.view(batch, length, block.num_heads, block.head_dim).transpose(1, 2)
