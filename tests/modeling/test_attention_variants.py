"""Attention beyond the paper's softmax over every key: ReLU normalisation, Luong's local attention
(local-m, local-p) and hard attention, each a config field applied in every attention block."""

import pytest
import torch

from vanilla_transformer.export.ctranslate2 import _check_exportable
from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.modeling.attention_variants import relu_normalization, sparsemax_normalization
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration

VOCAB = 40
WINDOW = 2
LOCAL = [{"local_attention": "local-m", "attention_window": WINDOW},
         {"local_attention": "local-p", "attention_window": WINDOW}]


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, **overrides)).eval()


def batch():
    """Two sources of 9 (the second padded by 3) and two decoder inputs of 11, longer than the sources."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    input_ids[1, 6:] = 0
    return input_ids, attention_mask, torch.randint(3, VOCAB, (2, 11), generator=g)


def attentions(model):
    input_ids, attention_mask, decoder_input_ids = batch()
    out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
    return {"encoder": out.encoder_attentions, "decoder": out.decoder_attentions, "cross": out.cross_attentions}


# --- normalisation ---


def test_relu_normalization_rows_sum_to_one_and_a_row_without_positive_scores_is_zero():
    scores = torch.tensor([[1.0, -2.0, 3.0], [-1.0, 0.0, -5.0], [0.0, 0.0, 0.0]])
    weights = relu_normalization(scores)
    torch.testing.assert_close(weights[0], torch.tensor([0.25, 0.0, 0.75]))
    assert torch.equal(weights[1:], torch.zeros(2, 3))


def test_sparsemax_is_the_projection_onto_the_simplex_and_ignores_masked_keys():
    scores = torch.tensor([[1.0, 0.5, -1.0], [2.0, 2.0, torch.finfo(torch.float32).min]])
    torch.testing.assert_close(sparsemax_normalization(scores), torch.tensor([[0.75, 0.25, 0.0], [0.5, 0.5, 0.0]]))
    masked = torch.full((1, 3), torch.finfo(torch.float32).min)
    assert torch.isfinite(sparsemax_normalization(masked)).all()


@pytest.mark.parametrize("normalization", ["relu", "sparsemax"])
def test_normalized_model_rows_sum_to_one_or_zero_and_padding_gets_nothing(normalization):
    maps = attentions(make_model(attention_normalization=normalization))
    for kind, layers in maps.items():
        for weights in layers:
            sums = weights.sum(-1)
            assert torch.all(((sums - 1).abs() < 1e-5) | ((sums == 0) & (normalization == "relu"))), kind
            assert (weights >= 0).all()
    for weights in maps["encoder"] + maps["cross"]:
        assert torch.equal(weights[1, ..., 6:], torch.zeros_like(weights[1, ..., 6:]))


# --- local attention (Luong et al. 2015, §3.2) ---


@pytest.mark.parametrize("overrides", LOCAL)
def test_local_attention_is_exactly_zero_outside_the_window_in_every_attention_kind(overrides):
    maps = attentions(make_model(**overrides))
    source = torch.arange(9)
    target = torch.arange(11)
    lengths = torch.tensor([9, 6])
    for weights in maps["encoder"]:  # around each source position, and never on padding
        outside = (source[:, None] - source[None, :]).abs() > WINDOW
        # (the second source's padding positions 7 and 8 have only padding in their window: as in transformers'
        # models their rows are spread evenly, and nothing reads them)
        assert (weights[0][:, outside] == 0).all() and (weights[1, :, :6][:, outside[:6]] == 0).all()
        assert (weights[1, :, :6, 6:] == 0).all()
        assert torch.allclose(weights[0].sum(-1), torch.ones(4, 9))
    for weights in maps["decoder"]:  # the window behind each target position (ahead is the look-ahead mask)
        inside = (target[:, None] - target[None, :] <= WINDOW) & (target[None, :] <= target[:, None])
        assert (weights[:, :, ~inside] == 0).all() and (weights[:, :, inside] > 0).all()
    for row, length in enumerate(lengths):
        for weights in maps["cross"]:
            w = weights[row]  # (H, T, S)
            assert (w[..., length:] == 0).all()
            if overrides["local_attention"] == "local-m":  # aligned with t, clipped to the last source token
                aligned = target.clamp(max=length - 1)
                outside = (source[None, :] - aligned[:, None]).abs() > WINDOW
                assert (w[:, outside] == 0).all() and (w[:, ~outside & (source < length)] > 0).all()
            else:  # a window of width 2D around a predicted position: nonzero keys span at most 2D
                present = w > 0
                index = torch.arange(9).expand_as(w)
                spans = index.masked_fill(~present, -1).amax(-1) - index.masked_fill(~present, 99).amin(-1)
                assert present.any(-1).all() and (spans <= 2 * WINDOW).all()


@pytest.mark.parametrize("overrides", LOCAL)
def test_local_attention_cached_decoding_gives_the_full_pass(overrides):
    """The window follows each position while decoding one token at a time."""
    model = make_model(**overrides)
    input_ids, attention_mask, decoder_input_ids = batch()
    args = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(model.generate(input_ids, **args), model.generate(input_ids, use_cache=False, **args))
    full = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids[:, :6], use_cache=True)
    step = model(encoder_outputs=(out.encoder_last_hidden_state,), attention_mask=attention_mask,
                 decoder_input_ids=decoder_input_ids[:, 6:7], past_key_values=out.past_key_values).logits
    torch.testing.assert_close(step[:, 0], full[:, 6], rtol=1e-5, atol=1e-5)


def test_local_m_fused_kernel_gives_the_explicit_path():
    model = make_model(local_attention="local-m", attention_window=WINDOW)
    input_ids, attention_mask, decoder_input_ids = batch()
    args = dict(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    fused = model(input_ids, **args).logits
    model.config._attn_implementation = "eager"
    torch.testing.assert_close(model(input_ids, **args).logits, fused, rtol=1e-5, atol=1e-5)


def test_a_window_covering_everything_is_global_attention():
    model = make_model(local_attention="local-m", attention_window=64)
    plain = make_model()
    input_ids, attention_mask, decoder_input_ids = batch()
    args = dict(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    torch.testing.assert_close(model(input_ids, **args).logits, plain(input_ids, **args).logits, rtol=1e-5, atol=1e-5)


# --- hard attention ---


def test_hard_attention_is_one_hot_at_inference():
    for kind, layers in attentions(make_model(attention_hardness="hard")).items():
        for weights in layers:
            assert torch.all((weights == 0) | (weights == 1)), kind
            assert torch.equal(weights.sum(-1), torch.ones_like(weights.sum(-1))), kind


@pytest.mark.parametrize("overrides", [{"attention_hardness": "hard"}, {"attention_normalization": "relu"},
                                       {"attention_normalization": "sparsemax", **LOCAL[0]},
                                       {"attention_hardness": "hard", "attention_score": "additive", **LOCAL[1]}])
def test_every_option_trains_a_few_steps_without_nan(overrides):
    model = make_model(**overrides).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    input_ids, attention_mask, labels = batch()
    for _ in range(5):
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()


def test_hard_attention_training_samples_one_hot_weights_with_gradients():
    model = make_model(attention_hardness="hard").train()
    input_ids, attention_mask, decoder_input_ids = batch()
    out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
    weights = out.cross_attentions[0]
    assert torch.all((weights == 0) | (weights == 1)) and weights.requires_grad
    out.logits.sum().backward()
    assert model.model.decoder.layers[0].cross_attn.q_proj.weight.grad.abs().sum() > 0  # straight-through gradient


def test_the_benchmarks_reinforce_term_trains_the_scores_without_changing_the_loss():
    """REINFORCE, measured in benchmarks/hard_attention.py beside straight-through (it did not train), is
    tested there as here: the sample passes no gradient, the term is 0 in value and is what reaches the scores."""
    from benchmarks.hard_attention import Reinforce

    model = make_model(attention_hardness="hard", attention_score="general").train()
    input_ids, attention_mask, labels = batch()
    for with_term in (False, True):
        model.zero_grad()
        reinforce = Reinforce()
        with reinforce.installed():
            out = model(input_ids, attention_mask=attention_mask, labels=labels, output_attentions=True)
        weights = out.cross_attentions[0]
        assert torch.all((weights == 0) | (weights == 1)) and not weights.requires_grad  # no gradient through the sample
        loss = out.loss + reinforce.term(out.logits, labels) if with_term else out.loss
        torch.testing.assert_close(loss, out.loss)  # the term is 0 in value
        loss.backward()
        cross = model.model.decoder.layers[1].cross_attn.score_weight.grad
        assert (cross is not None and cross.abs().sum() > 0) if with_term else cross is None


# --- configuration, save/load, export ---


@pytest.mark.parametrize("overrides, message", [
    ({"attention_normalization": "entmax"}, "`attention_normalization` must be one of"),
    ({"local_attention": "local"}, "`local_attention` must be one of"),
    ({"attention_window": 0}, "`attention_window` must be a positive integer"),
    ({"attention_hardness": "hard", "attention_normalization": "relu"}, "cannot be combined with"),
    ({"attention_hardness": "hard", "attention_normalization": "sparsemax"}, "cannot be combined with"),
    ({"attention_hardness": "hard-reinforce"}, "`attention_hardness` must be one of"),
])
def test_bad_attention_options_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        VanillaTransformerConfig.from_preset("tiny", **overrides)
    assert "\n" not in str(error.value)


def test_local_attention_none_is_the_default_spelled_either_way():
    assert VanillaTransformerConfig(local_attention=None).local_attention == "none"


@pytest.mark.parametrize("overrides", [{"attention_normalization": "relu"}, LOCAL[0], {"attention_hardness": "hard"}])
def test_ctranslate2_export_refuses_options_it_cannot_express(overrides):
    with pytest.raises(ValueError, match=f"cannot express `{next(iter(overrides))}`"):
        _check_exportable(make_model(**overrides), None, "float32")


ALL_OPTIONS = {"attention_normalization": "relu", "local_attention": "local-p", "attention_window": 3}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [ALL_OPTIONS, {"attention_hardness": "hard", "local_attention": "local-m"}])
def test_a_saved_folder_with_the_options_loads_in_a_fresh_process(tmp_path, run_without_package, overrides):
    model = make_model(**overrides)
    model.save_pretrained(tmp_path / "model")
    loaded = VanillaTransformerForConditionalGeneration.from_pretrained(tmp_path / "model").eval()
    input_ids, attention_mask, decoder_input_ids = batch()
    args = dict(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    logits = model(input_ids, **args).logits
    assert torch.equal(loaded(input_ids, **args).logits, logits)
    torch.save({"inputs": (input_ids, attention_mask, decoder_input_ids), "logits": logits,
                "tokens": model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5)},
               tmp_path / "expected.pt")
    out = run_without_package(
        """
        import torch
        from transformers import AutoModelForSeq2SeqLM
        expected = torch.load("expected.pt")
        input_ids, attention_mask, decoder_input_ids = expected["inputs"]
        model = AutoModelForSeq2SeqLM.from_pretrained("model", trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        assert torch.equal(logits, expected["logits"])
        tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5)
        assert torch.equal(tokens, expected["tokens"])
        c = model.config
        print(c.attention_normalization, c.local_attention, c.attention_window, c.attention_hardness)
        """,
        cwd=tmp_path,
    )
    config = model.config
    assert out.split() == [config.attention_normalization, config.local_attention, str(config.attention_window),
                           config.attention_hardness]


def test_the_score_classes_hold_the_attention_math_only():
    """A saved folder's attention_variants.py is the attention math: one class per name the config takes, and
    nothing of the neuron view's page (visualize/score_drawings.py draws the scores)."""
    from vanilla_transformer.modeling import attention_variants
    from vanilla_transformer.modeling.configuration_vanilla_transformer import ATTENTION_SCORES

    assert tuple(attention_variants.SCORE_CLASSES) == ATTENTION_SCORES
    drawing = {"score_terms", "score_drawing", "summed_rows", "dot_product_drawing", "parameters_added"}
    assert not drawing & set(vars(attention_variants))
    for score_class in attention_variants.SCORE_CLASSES.values():
        assert not drawing & {name for cls in score_class.__mro__ for name in vars(cls)}, score_class
