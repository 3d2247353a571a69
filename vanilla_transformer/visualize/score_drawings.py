"""What the neuron view (neuron_view.py) draws of each score function, by its name (`attention_score`): the tensors
beside q and k that the score is made of (`terms`, read from the block's own parameters) and how a page shows them
(`drawing`). The attention classes (modeling/attention_variants.py) hold only the attention math, as they ship
in every saved folder; what a page needs lives here.

`terms(block, q, k)` gives tensors (B, H, rows, columns): a row per key, per query, or one row. `drawing(block)`
says how they are drawn: the formula, the rows drawn for each key (the last one's sum makes the score), the
query's rows beside q (`top`), the terms with a row per query (`per_query`), and the steps from the rows to the
score, shown when a score is hovered (the last step is the score). Its expressions name a tensor ("query", "key"
or a term: the row of this query, of this key, or the only row) or apply an operation to others:
["times" | "plus" | "divide", a, b], ["tanh", a], ["sum" | "norm", a] (a vector to a number); numbers are numbers.
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class ScoreDrawing(NamedTuple):
    terms: Callable  # (block, q, k) -> {name: tensor (B, H, rows, columns)}
    drawing: Callable  # (block) -> the page's drawing of the score


def summed_rows(formula: str, rows: list) -> dict:
    """A drawing whose score is the sum of its last row."""
    return dict(formula=formula, rows=rows, top=[], per_query=[], steps=[["Σ of the last row", ["sum", rows[-1][1]]]])


def no_terms(block, q, k) -> dict:
    return {}


def dot_product_drawing(block) -> dict:
    """A dot-product score, q·k times the block's `scaling`: the paper's MultiHeadAttention, or its explicit twin."""
    product = ["sum", ["times", "query", "key"]]
    scaled = block.scaling != 1.0
    formula = (f"q·k / √{block.head_dim}: the scaled dot product of §3.2.1" if scaled
               else "q·k: the dot product (Luong et al. 2015)")
    steps = [["q·k = Σ q×k", product]]
    if scaled:
        steps.append([f"/ √{block.head_dim}", ["times", product, block.scaling]])
    return dict(formula=formula, rows=[["k", "key"], ["q×k", ["times", "query", "key"]]], top=[],
                per_query=[], steps=steps)


def general_terms(block, q, k) -> dict:
    return {"transformed_keys": k @ block.score_weight.transpose(-1, -2)}  # W_a·k_j, a row per key


def general_drawing(block) -> dict:
    return summed_rows("q·(W_a k): the general score (Luong et al. 2015), W_a learned per head",
                       [["k", "key"], ["W_a·k", "transformed_keys"], ["q×W_a·k", ["times", "query", "transformed_keys"]]])


def additive_terms(block, q, k) -> dict:
    return {"query_part": q @ block.score_query_weight, "key_part": k @ block.score_key_weight,
            "vector": block.score_vector[None, :, None]}  # W_q·q (a row per query), W_k·k_j (per key), v_a


def additive_drawing(block) -> dict:
    units = ["tanh", ["plus", "key_part", "query_part"]]
    formula = "v_a·tanh(W_q q + W_k k): the additive score (Bahdanau et al. 2015), one tanh unit per dimension"
    rows = [["k", "key"], ["W_k·k", "key_part"], ["tanh units", units], ["v_a×tanh", ["times", "vector", units]]]
    drawing = summed_rows(formula, rows)
    top = [["W_q·q", "query_part", "the query's part of the tanh units' input"], ["v_a", "vector", "the head's learned vector v_a"]]
    return {**drawing, "top": top, "per_query": ["query_part"]}


def cosine_terms(block, q, k) -> dict:
    return {"strength": block.score_strength[None, :, None, None]}  # one number per head


def cosine_drawing(block) -> dict:
    cosine = ["divide", ["sum", ["times", "query", "key"]], ["times", ["norm", "query"], ["norm", "key"]]]
    drawing = summed_rows("β · q·k / (|q| |k|): the cosine times the head's learned strength β (Graves et al. 2014)",
                          [["k", "key"], ["q×k", ["times", "query", "key"]]])
    steps = [["q·k", drawing["steps"][0][1]], ["|q|", ["norm", "query"]], ["|k|", ["norm", "key"]], ["cosine", cosine],
             ["β", ["sum", "strength"]], ["β · cosine", ["times", ["sum", "strength"], cosine]]]
    return {**drawing, "steps": steps}


def location_terms(block, q, k) -> dict:  # W_a's column for key position j, a row per key
    return {"position_weights": block.score_location_weight[None, ..., :k.size(-2)].transpose(-1, -2)}


def location_drawing(block) -> dict:
    return summed_rows("(W_aᵀ q)_j: the location score (Luong et al. 2015), from q alone, one column of W_a per key "
                       "position j", [["W_a col j", "position_weights"], ["q×W_a col j", ["times", "query", "position_weights"]]])


# One entry per value of `attention_score` (tests/visualize/test_neuron_view.py holds the keys to the config's).
SCORE_DRAWINGS = {
    "scaled_dot": ScoreDrawing(no_terms, dot_product_drawing),
    "dot": ScoreDrawing(no_terms, dot_product_drawing),
    "general": ScoreDrawing(general_terms, general_drawing),
    "additive": ScoreDrawing(additive_terms, additive_drawing),
    "cosine": ScoreDrawing(cosine_terms, cosine_drawing),
    "location": ScoreDrawing(location_terms, location_drawing),
}
