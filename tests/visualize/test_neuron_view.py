"""The neuron view's numbers are the model's own: q and k from the block's projections, the score from its
score function, the weight from `output_attentions`, and normalising the scores gives those weights; and the
explorer page holds exactly those numbers (tests/visualize/test_browser.py reads them off the rendered page)."""

import base64
import json
import math
import re

import pytest
import torch

from vanilla_transformer.modeling.attention_variants import NORMALIZATIONS
from vanilla_transformer.modeling.configuration_vanilla_transformer import ATTENTION_SCORES, VanillaTransformerConfig
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.visualize.explorer import explorer_html, explorer_record
from vanilla_transformer.visualize.neuron_view import neuron_tensors, neuron_view


def make_model(**overrides):
    torch.manual_seed(0)
    return VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=40, **overrides))


def batch():
    """Two sources of 9 (the second padded by 3) and two decoder inputs of 7."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 40, (2, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    return input_ids, attention_mask, torch.randint(3, 40, (2, 7), generator=g)


@pytest.mark.parametrize("kind, query", [("encoder", 4), ("decoder", 5), ("cross", 3)])
@pytest.mark.parametrize("normalization", ["softmax", "relu"])
def test_scores_are_q_dot_k_and_normalise_to_the_models_weights(kind, query, normalization):
    model = make_model(attention_normalization=normalization)
    input_ids, attention_mask, decoder_input_ids = batch()
    view = neuron_view(model, input_ids, attention_mask, decoder_input_ids, kind, layer=1, head=2, query=query, row=1)
    dh = model.config.head_dim
    assert view.query.shape == (dh,) and view.keys.shape == view.products.shape
    torch.testing.assert_close(view.products, view.query * view.keys)
    torch.testing.assert_close(view.scores, view.products.sum(-1) / math.sqrt(dh))  # scaled_dot, §3.2.1
    # the second source is padded; decoder self-attention has the look-ahead mask of §3.2.3 instead
    allowed = torch.arange(view.scores.numel()) <= query if kind == "decoder" else attention_mask[1].bool()
    scores = view.scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    expected = NORMALIZATIONS[normalization](scores).masked_fill(~allowed, 0)
    torch.testing.assert_close(view.weights, expected, rtol=1e-5, atol=1e-6)


def test_location_scores_have_no_keys_and_still_give_the_weights():
    model = make_model(attention_score="location", location_max_length=16)
    input_ids, attention_mask, decoder_input_ids = batch()
    view = neuron_view(model, input_ids, attention_mask, decoder_input_ids, "cross", layer=0, head=0, query=2)
    assert view.keys is None and view.products is None
    torch.testing.assert_close(view.weights, view.scores.softmax(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arguments, message", [
    (dict(kind="self", layer=0, head=0, query=0), "`kind` must be one of"),
    (dict(kind="cross", layer=5, head=0, query=0), "`layer` must be in"),
    (dict(kind="cross", layer=0, head=4, query=0), "`head` must be in"),
    (dict(kind="cross", layer=0, head=0, query=99), "`query` must be in"),
])
def test_bad_choices_are_refused_in_one_line(arguments, message):
    input_ids, attention_mask, decoder_input_ids = batch()
    with pytest.raises(ValueError, match=message):
        neuron_view(make_model(), input_ids, attention_mask, decoder_input_ids, **arguments)


# --- the neuron view in the explorer page: the numbers the page holds are the model's --------------------------

SENTENCE = "In the beginning God created the heavens and the earth."
VARIANTS = [dict(attention_score=score) for score in ATTENTION_SCORES] + [
    dict(attention_normalization="relu"),
    dict(attention_score="general", attention_normalization="sparsemax"),
    dict(attention_score="additive", local_attention="local-m", attention_window=2),
    dict(attention_score="cosine", local_attention="local-p", attention_window=2),
    dict(attention_score="location", local_attention="local-p", attention_window=3),
    dict(attention_score="dot", attention_hardness="hard"),
]


def page_neurons(page: str) -> tuple[dict, dict]:
    """The page's neuron data as it holds it, and its arrays: {(kind, layer, head): {name: tensor, "allowed": bool}}."""
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S).group(1))["neurons"]
    heads = {}
    for kind, info in data["kinds"].items():
        for key, unit in info["heads"].items():
            values = torch.frombuffer(bytearray(base64.b64decode(unit["values"])), dtype=torch.float16).float()
            sizes = [rows * cols for _, rows, cols in info["fields"]]
            arrays = {name: part.view(rows, cols) for (name, rows, cols), part in zip(info["fields"], values.split(sizes))}
            bits = torch.frombuffer(bytearray(base64.b64decode(unit["allowed"])), dtype=torch.uint8)
            bits = (bits[:, None] >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1
            arrays["allowed"] = bits.flatten()[:info["queries"] * info["keys"]].view(info["queries"], info["keys"]).bool()
            layer, head = map(int, key.split(","))
            heads[kind, layer, head] = arrays
    return data, heads


def model_tensors(model, record):
    """q and k of every block, read by hooks on its projections, and its scores from the model's score function."""
    captured = {}
    blocks = {(kind, layer): layer_module.cross_attn if kind == "cross" else layer_module.self_attn
              for kind, stack in (("encoder", model.model.encoder), ("decoder", model.model.decoder), ("cross", model.model.decoder))
              for layer, layer_module in enumerate(stack.layers)}
    hooks = [getattr(block, name).register_forward_hook(lambda m, a, out, key=key + (name,): captured.__setitem__(key, out))
             for key, block in blocks.items() for name in ("q_proj", "k_proj") if getattr(block, name) is not None]
    with torch.no_grad():
        model(torch.tensor([record.source_ids]), decoder_input_ids=torch.tensor([record.target_ids[:-1]]), use_cache=False)
    for hook in hooks:
        hook.remove()
    split = lambda x: x.view(1, x.size(1), model.config.num_heads, -1).transpose(1, 2)  # noqa: E731
    tensors = {}
    for key, block in blocks.items():
        q = split(captured[key + ("q_proj",)])
        k = split(captured[key + ("k_proj",)]) if block.k_proj is not None else None
        keys = record.weights(key[0]).size(-1)
        with torch.no_grad():
            scores = block.score(q, k if k is not None else q.new_zeros(1, q.size(1), keys, q.size(-1)))
        tensors[key] = (q[0], None if k is None else k[0], scores[0])
    return tensors


OPERATIONS = {"times": torch.mul, "plus": torch.add, "divide": torch.div, "tanh": torch.tanh,
              "sum": lambda a: a.sum(-1, keepdim=True), "norm": lambda a: a.norm(dim=-1, keepdim=True)}


def drawn_scores(drawing: dict, arrays: dict) -> torch.Tensor:
    """The scores as the page's drawing makes them from its rows (its last step), for every query and key (T, S)."""
    def value(expression):
        if isinstance(expression, (int, float)):
            return expression
        if isinstance(expression, str):  # (T, 1, C) a row per query, (1, S, C) a row per key, (1, 1, C) one row
            array = arrays[expression]
            return array[:, None] if expression == "query" or expression in drawing["per_query"] else array[None]
        operation, *operands = expression
        return OPERATIONS[operation](*map(value, operands))

    return value(drawing["steps"][-1][1])[..., 0]


@pytest.fixture(scope="module")
def tokenizer(tiny_corpus):
    return tiny_corpus[0]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: "-".join(map(str, o.values())))
def test_the_pages_neuron_data_is_the_models_own(overrides, tokenizer):
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), **overrides))
    record = explorer_record(model.eval(), tokenizer, SENTENCE, num_beams=1, max_new_tokens=8)
    assert len(record.target_ids) >= 4
    data, heads = page_neurons(explorer_html(record))
    config = model.config
    assert (data["score"], data["normalization"], data["hard"], data["local_attention"]) == (
        config.attention_score, config.attention_normalization, config.attention_hardness == "hard", config.local_attention)
    assert data["kept"] == data["of"] == len(heads) == 3 * 2 * 4  # a short sentence: every head, every query
    tensors = model_tensors(model, record)
    float16 = dict(rtol=2e-3, atol=2e-3)
    for (kind, layer, head), arrays in heads.items():
        q, k, scores = tensors[kind, layer][0][head], tensors[kind, layer][1], tensors[kind, layer][2][head]
        torch.testing.assert_close(arrays["query"], q, **float16)
        if k is not None:
            torch.testing.assert_close(arrays["key"], k[head], **float16)
        torch.testing.assert_close(arrays["score"], scores, **float16)
        torch.testing.assert_close(arrays["weight"], record.weights(kind)[layer, head], rtol=0, atol=1e-3)
        # what the page draws adds up to the scores
        drawn = drawn_scores(data["drawing"], arrays)
        torch.testing.assert_close(drawn.expand_as(arrays["score"]), arrays["score"], rtol=1e-2, atol=2e-2)
        # and the scores, masked and normalised as the model does, give its weights
        allowed = arrays["allowed"]
        masked = arrays["score"].masked_fill(~allowed, torch.finfo(torch.float32).min)
        if config.attention_hardness == "hard":  # the key the model took has the top score (to the page's fp16)
            taken = arrays["weight"].argmax(-1, keepdim=True)
            torch.testing.assert_close(masked.gather(-1, taken), masked.amax(-1, keepdim=True), rtol=1e-3, atol=1e-3)
            expected = torch.nn.functional.one_hot(taken[..., 0], masked.size(-1)).float()
        else:
            expected = NORMALIZATIONS[config.attention_normalization](masked)
        if "centres" in arrays:  # local-p (Luong eq. 10)
            distance = torch.arange(allowed.size(1)) - arrays["centres"]
            expected = expected * torch.exp(-distance**2 / (2 * (config.attention_window / 2) ** 2))
        torch.testing.assert_close(arrays["weight"], expected.masked_fill(~allowed, 0), rtol=0, atol=5e-3)
        # the mask is the model's: look-ahead in the decoder, the window where attention is local
        queries, keys = allowed.shape
        expected_mask = torch.ones(queries, keys, dtype=torch.bool)
        if kind == "decoder":
            expected_mask = expected_mask.tril()
        if config.local_attention != "none" and kind != "cross":  # self-attention: ±D around the query itself
            expected_mask &= (torch.arange(keys) - torch.arange(queries)[:, None]).abs() <= config.attention_window
        elif config.local_attention == "local-m":  # target position t aligned with source position t
            aligned = torch.arange(queries).clamp(max=keys - 1)
            expected_mask &= (torch.arange(keys) - aligned[:, None]).abs() <= config.attention_window
        if config.local_attention == "local-p" and kind == "cross":  # around the predicted position p_t (in float16)
            near = (torch.arange(keys) - arrays["centres"]).abs() <= config.attention_window + 0.01
            assert (allowed <= near).all() and allowed.any(-1).all()
        else:
            assert torch.equal(allowed, expected_mask)


def test_the_papers_attention_class_carries_no_neuron_view_code():
    """§3.2's MultiHeadAttention reads as the paper: what the neuron view draws of a score lives with the score
    classes (attention_variants.py), the dot product's drawing included."""
    from vanilla_transformer.modeling.attention import MultiHeadAttention

    assert not {"score_terms", "score_drawing"} & set(vars(MultiHeadAttention))


# What main drew before the drawings left attention_variants.py: sha256 of each drawing's JSON, tiny's head_dim 16.
DRAWING_DIGESTS = {"scaled_dot": "8492598a87e790c1", "dot": "2df3e45efa1899b2", "general": "c3615db3b95eab0b",
                   "additive": "7af5ed3949b7548a", "cosine": "8fd205e3c1c35c63", "location": "34ca99b0b1494926"}
TERMS = {"scaled_dot": [], "dot": [], "general": ["transformed_keys"], "additive": ["key_part", "query_part", "vector"],
         "cosine": ["strength"], "location": ["position_weights"]}


@pytest.mark.parametrize("normalization", ["softmax", "relu"])  # relu: the dot products on the explicit class
@pytest.mark.parametrize("score", ATTENTION_SCORES)
def test_each_score_is_drawn_as_before_from_its_entry_in_score_drawings(score, normalization):
    import hashlib

    from vanilla_transformer.visualize.score_drawings import SCORE_DRAWINGS

    assert tuple(SCORE_DRAWINGS) == ATTENTION_SCORES  # a score function without a drawing fails here
    model = make_model(attention_score=score, attention_normalization=normalization).eval()
    torch.manual_seed(0)
    neurons = neuron_tensors(model, torch.randint(3, 40, (1, 5)), None, torch.randint(3, 40, (1, 4)))
    drawn = json.dumps(neurons.drawing, sort_keys=True, ensure_ascii=False).encode()
    assert hashlib.sha256(drawn).hexdigest()[:16] == DRAWING_DIGESTS[score]
    assert sorted(neurons.kinds["cross"].terms) == TERMS[score]
