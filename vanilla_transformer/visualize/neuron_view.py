"""The neuron view (as bertviz draws it, Vig 2019): how one query's attention weights come about.

    view = neuron_view(model, input_ids, attention_mask, decoder_input_ids, kind="cross", layer=0, head=1, query=3)
    view.query, view.keys, view.products, view.scores, view.weights
    neurons = neuron_tensors(model, input_ids, attention_mask, decoder_input_ids)   # every block at once

For one kind of attention ("encoder" self, "decoder" self or "cross"), layer, head and query token: the
query vector q (Dh,), each key vector k_j (S, Dh), their elementwise product q×k_j (S, Dh), the score as
the model's own score function computes it (S,) (for "scaled_dot", the sum of q×k_j over √Dh), and the
normalised weight the model used (S,). Everything is read from one teacher-forced forward pass: q and
k_j are the outputs of the block's own W^Q and W^K, the scores come from its score function, and the
weights are the model's `output_attentions`; nothing is computed by a second implementation.
Location-based scores read no keys: `keys` and `products` are then None.

`neuron_tensors` gives the same for every block of the model, and beside them what its score function
is made of, by the score function's entry in score_drawings.py (its `terms`, read from the block's own parameters:
general's W_a·k_j, additive's W_q·q, W_k·k_j and v_a, cosine's learned strength, location's column of W_a
for each position) and how a page draws them (its `drawing`; the dot products, the paper's included, are drawn by
`dot_product_drawing`), and local-p's predicted position p_t.
`allowed` is the mask the block attended under: padding, the look-ahead mask of §3.2.3 and any local window.

One model may serve several threads (`serve --max-concurrent`): the hooks that read q and k keep only
what their own thread's pass computes, and one capture runs at a time (`CAPTURE_LOCK`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ..errors import BadInput
from ..modeling.attention_variants import predicted_position
from ..modeling.attention import additive_mask
from .score_drawings import SCORE_DRAWINGS

ATTENTION_OUTPUTS = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"}

CAPTURE_LOCK = threading.Lock()  # hooks live on the shared modules: one capture registers and removes them at a time


@dataclass
class NeuronView:
    query: torch.Tensor  # (Dh,)
    keys: torch.Tensor | None  # (S, Dh)
    products: torch.Tensor | None  # (S, Dh): q × k_j, elementwise
    scores: torch.Tensor  # (S,): the score function's output, before masking and normalisation
    weights: torch.Tensor  # (S,): the weights the model attended with


@dataclass
class NeuronTensors:
    """One kind of attention, every layer and head: L layers, H heads, T queries, S keys."""

    queries: torch.Tensor  # (L, H, T, Dh)
    keys: torch.Tensor | None  # (L, H, S, Dh); None for location scores
    scores: torch.Tensor  # (L, H, T, S): the score function's output, before masking and normalisation
    weights: torch.Tensor  # (L, H, T, S): the weights the model attended with
    allowed: torch.Tensor  # (L, H, T, S) bool: the mask it attended under
    terms: dict[str, torch.Tensor] = field(default_factory=dict)  # the score's terms, and "centres" for local-p


@dataclass
class Neurons:
    """The neuron-view numbers of a whole model on one sentence, and the attention settings behind them."""

    score: str  # config.attention_score
    normalization: str  # config.attention_normalization
    hard: bool
    local_attention: str  # "none", "local-m" or "local-p"
    window: int  # D, when local
    kinds: dict[str, NeuronTensors]
    drawing: dict  # how a page draws the score's terms (score_drawings.py), and "centres" a term per query


def _blocks(model, kind: str):
    stack = model.model.encoder if kind == "encoder" else model.model.decoder
    return [layer.cross_attn if kind == "cross" else layer.self_attn for layer in stack.layers]


def _block(model, kind: str, layer: int):
    blocks = _blocks(model, kind)
    if not -len(blocks) <= layer < len(blocks):
        raise BadInput(f"`layer` must be in [0, {len(blocks)}) for {kind} attention; got {layer}.")
    return blocks[layer]


@torch.no_grad()
def _capture(model, input_ids, attention_mask, decoder_input_ids, blocks):
    """One teacher-forced pass; returns its output and, per block, its q and k projections and the mask it got."""
    captured, owner = {}, threading.get_ident()

    def keep(name):
        def hook(module, args, *rest):  # (module, args, output) or, before a block, (module, args, kwargs)
            if threading.get_ident() == owner:  # another thread's pass through the same model is not ours
                captured[name] = rest[0] if name[1] != "mask" else rest[0].get("attention_mask")
        return hook

    with CAPTURE_LOCK:
        hooks = []
        for name, block in blocks.items():
            hooks.append(block.q_proj.register_forward_hook(keep((name, "q"))))
            if block.k_proj is not None:
                hooks.append(block.k_proj.register_forward_hook(keep((name, "k"))))
            hooks.append(block.register_forward_pre_hook(keep((name, "mask")), with_kwargs=True))
        try:
            out = model.eval()(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                               output_attentions=True, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
    return out, captured


def _block_tensors(block, captured, name, weights, row: int) -> dict:
    """One block's numbers for sentence `row`: q (H, T, Dh), k (H, S, Dh) or None, scores, allowed, terms."""
    dtype = block.q_proj.weight.dtype  # under autocast (a bf16 run's model) the projections are bf16, the weights not
    q = _split(block, captured[(name, "q")])[row:row + 1].to(dtype)  # (1, H, T, Dh)
    k = _split(block, captured[(name, "k")])[row:row + 1].to(dtype) if (name, "k") in captured else None  # (1, H, S, Dh)
    keys = weights.size(-1)
    # location scores read only the number of keys; any tensor with S rows stands in for them
    stand_in = k if k is not None else q.new_zeros(q.shape[:2] + (keys, q.size(-1)))
    scores = block.score(q, stand_in)[0]  # (H, T, S)
    allowed = torch.ones(q.size(-2), keys, dtype=torch.bool, device=q.device)
    mask = additive_mask(captured[(name, "mask")], block, q, stand_in)  # (B|1, 1, T, S), 0 where allowed
    if mask is not None:
        mask = mask[min(row, mask.size(0) - 1):][:1] == 0  # (1, 1, T, S)
        allowed = allowed & mask[0, 0]
    allowed = allowed.expand(block.num_heads, -1, -1)
    terms = SCORE_DRAWINGS[block.config.attention_score].terms(block, q, stand_in)
    terms = {name: term[0] for name, term in terms.items()}  # (H, rows, Dh|1) each
    if getattr(block, "predicts_position", False):  # local-p: the window is around each query's predicted position
        centres = predicted_position(block, q, keys, mask)  # (1, H, T, 1)
        allowed = allowed & ((torch.arange(keys, device=q.device) - centres[0]).abs() <= block.config.attention_window)
        terms["centres"] = centres[0]  # (H, T, 1)
    return dict(queries=q[0], keys=None if k is None else k[0], scores=scores, allowed=allowed, terms=terms)


@torch.no_grad()
def neuron_tensors(model, input_ids, attention_mask, decoder_input_ids, row: int = 0) -> Neurons:
    """The neuron-view numbers of every block, from one teacher-forced pass over sentence `row` of the batch."""
    blocks = {(kind, layer): block for kind in ATTENTION_OUTPUTS for layer, block in enumerate(_blocks(model, kind))}
    out, captured = _capture(model, input_ids, attention_mask, decoder_input_ids, blocks)
    kinds = {}
    for kind, output_name in ATTENTION_OUTPUTS.items():
        per_layer = [
            _block_tensors(block, captured, (kind, layer), weights[row], row)
            for layer, (block, weights) in enumerate(zip(_blocks(model, kind), getattr(out, output_name)))
        ]
        stack = lambda values: torch.stack(values).float().cpu() if values[0] is not None else None  # noqa: E731
        kinds[kind] = NeuronTensors(
            queries=stack([layer["queries"] for layer in per_layer]),
            keys=stack([layer["keys"] for layer in per_layer]),
            scores=stack([layer["scores"] for layer in per_layer]),
            weights=torch.stack([weights[row] for weights in getattr(out, output_name)]).float().cpu(),
            allowed=torch.stack([layer["allowed"] for layer in per_layer]).cpu(),
            terms={name: stack([layer["terms"][name] for layer in per_layer]) for name in per_layer[0]["terms"]},
        )
    block = blocks["encoder", 0]  # every block of a model draws alike
    config = model.config
    drawing = SCORE_DRAWINGS[config.attention_score].drawing(block)
    return Neurons(score=config.attention_score, normalization=config.attention_normalization,
                   hard=config.attention_hardness == "hard", local_attention=config.local_attention,
                   window=config.attention_window, kinds=kinds,
                   drawing={**drawing, "per_query": [*drawing["per_query"], "centres"]})


@torch.no_grad()
def neuron_view(model, input_ids, attention_mask, decoder_input_ids, kind: str, layer: int, head: int, query: int,
                row: int = 0) -> NeuronView:
    """The neuron view of sentence `row` of the batch. The model runs in evaluation mode."""
    if kind not in ATTENTION_OUTPUTS:
        raise BadInput(f"`kind` must be one of {', '.join(map(repr, ATTENTION_OUTPUTS))}; got {kind!r}.")
    block = _block(model, kind, layer)
    if not 0 <= head < block.num_heads:
        raise BadInput(f"`head` must be in [0, {block.num_heads}); got {head}.")
    out, captured = _capture(model, input_ids, attention_mask, decoder_input_ids, {"block": block})
    queries = captured[("block", "q")].size(1)
    if not 0 <= query < queries:
        raise BadInput(f"`query` must be in [0, {queries}); got {query}.")
    weights = getattr(out, ATTENTION_OUTPUTS[kind])[layer][row]  # (H, T, S)
    numbers = _block_tensors(block, captured, "block", weights, row)
    q_vector = numbers["queries"][head, query]
    keys = None if numbers["keys"] is None else numbers["keys"][head]
    return NeuronView(query=q_vector, keys=keys, products=None if keys is None else q_vector * keys,
                      scores=numbers["scores"][head, query], weights=weights[head, query])


def _split(block, projected: torch.Tensor) -> torch.Tensor:
    """(B, L, d_model) -> (B, H, L, Dh), as the block splits its projections into heads."""
    batch, length, _ = projected.shape
    return projected.view(batch, length, block.num_heads, block.head_dim).transpose(1, 2)
