import math

import pytest
import torch

from vanilla_transformer import (
    VanillaTransformerConfig,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerModel,
)
from vanilla_transformer.modeling.input_checks import CACHE_NAME
from vanilla_transformer.modeling.configuration_vanilla_transformer import ATTENTION_SCORES, PRESETS
from vanilla_transformer.modeling import input_checks
from vanilla_transformer.modeling.attention import additive_mask, scaled_dot_product_attention
from vanilla_transformer.modeling.modeling_vanilla_transformer import (
    shift_tokens_right,
    sinusoidal_encoding,
)
from vanilla_transformer.modeling.saving import CODE_FILES

VOCAB = 40
PAD, BOS, EOS = 0, 1, 2


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, **overrides)
    return VanillaTransformerForConditionalGeneration(config).eval()


def batch(seed=0):
    """Two sources (the second padded by 3) and two decoder inputs."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, 6:], attention_mask[1, 6:] = PAD, 0
    decoder_input_ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    decoder_input_ids[:, 0] = PAD  # the decoder start token
    return input_ids, attention_mask, decoder_input_ids


def test_shapes_and_outputs():
    model = make_model()
    input_ids, attention_mask, decoder_input_ids = batch()
    out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                output_attentions=True, output_hidden_states=True)
    config = model.config
    assert out.logits.shape == (2, 7, VOCAB)
    assert out.encoder_last_hidden_state.shape == (2, 9, config.d_model)
    assert len(out.encoder_attentions) == config.encoder_layers
    assert len(out.decoder_attentions) == len(out.cross_attentions) == config.decoder_layers
    assert out.encoder_attentions[0].shape == (2, config.num_heads, 9, 9)
    assert out.decoder_attentions[0].shape == (2, config.num_heads, 7, 7)
    assert out.cross_attentions[0].shape == (2, config.num_heads, 7, 9)
    assert len(out.encoder_hidden_states) == config.encoder_layers + 1
    base = VanillaTransformerModel(config).eval()
    hidden = base(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).last_hidden_state
    assert hidden.shape == (2, 7, config.d_model)


def test_config_resolves_standard_names():
    config = VanillaTransformerConfig.from_preset("base")
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (512, 8, 6)
    assert config.head_dim == 64


@pytest.mark.parametrize("name,expected", [("base", 65e6), ("big", 213e6)])
def test_paper_parameter_counts(name, expected):
    """Table 3: 65M (base) and 213M (big) with a shared 37k vocabulary."""
    with torch.device("meta"):
        model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset(name, vocab_size=37000))
    count = sum(p.numel() for p in model.parameters())  # tied matrices counted once
    assert abs(count - expected) / expected < 0.04, count


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("overrides", [
    *({"attention_score": score} for score in ATTENTION_SCORES),
    {"attention_score": "location", "location_max_length": 300, "local_attention": "local-p"},
    {"local_attention": "local-m"}, {"position_encoding": "learned", "max_position_embeddings": 300},
    {"norm_position": "pre", "tie_word_embeddings": False}, {"fast_paths": False},
], ids=lambda overrides: ",".join(f"{name}={value}" for name, value in overrides.items()))
def test_parameter_count_is_the_models(preset, overrides):
    """config.parameter_count, from the fields alone (the memory check before a model is built), counts what a
    build on the meta device holds, for every preset and variant."""
    config = VanillaTransformerConfig.from_preset(preset, vocab_size=1000, **overrides)
    with torch.device("meta"):
        model = VanillaTransformerForConditionalGeneration(config)
    assert config.parameter_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("score", ["scaled_dot", "location"])  # location: position-only, still causal
def test_no_information_from_future_positions(score):
    model = make_model(attention_score=score)
    input_ids, attention_mask, decoder_input_ids = batch()
    logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    for t in range(decoder_input_ids.size(1) - 1):
        changed = decoder_input_ids.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % (VOCAB - 3) + 3
        new = model(input_ids, attention_mask=attention_mask, decoder_input_ids=changed).logits
        torch.testing.assert_close(new[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(new[:, t + 1 :], logits[:, t + 1 :])


@pytest.mark.parametrize("score", ["scaled_dot", "location"])
def test_padding_invariance(score):
    model = make_model(attention_score=score)
    input_ids, attention_mask, decoder_input_ids = batch()
    logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    # Five more pad tokens on the source, and three on the target.
    padded_ids = torch.cat([input_ids, torch.full((2, 5), PAD)], dim=1)
    padded_mask = torch.cat([attention_mask, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    padded_decoder = torch.cat([decoder_input_ids, torch.full((2, 3), PAD)], dim=1)
    padded = model(padded_ids, attention_mask=padded_mask, decoder_input_ids=padded_decoder).logits
    torch.testing.assert_close(padded[:, :7], logits, rtol=0, atol=1e-5)
    # The padded row alone gives what it gives in the batch.
    alone = model(input_ids[1:, :6], decoder_input_ids=decoder_input_ids[1:]).logits
    torch.testing.assert_close(alone, logits[1:], rtol=0, atol=1e-5)


def test_attention_rows_sum_to_one_and_masked_positions_are_zero():
    model = make_model()
    input_ids, attention_mask, decoder_input_ids = batch()
    out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
    for weights in out.encoder_attentions + out.decoder_attentions + out.cross_attentions:
        real_rows = weights[0]  # the first sequence has no padding on either side
        torch.testing.assert_close(real_rows.sum(-1), torch.ones_like(real_rows.sum(-1)))
    for weights in out.encoder_attentions + out.cross_attentions:
        assert torch.all(weights[1, :, :, 6:] == 0)  # padded source keys
    for weights in out.decoder_attentions:
        assert torch.all(weights.triu(diagonal=1) == 0)  # future target positions


def test_the_attention_mask_is_made_with_the_attention_functions():
    """additive_mask is attention math: it sits in attention.py, and input_checks.py holds only checks."""
    assert additive_mask.__module__ == scaled_dot_product_attention.__module__
    assert not hasattr(input_checks, "additive_mask")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fully_padded_rows_stay_finite_in_half_precision(dtype):
    q, k, v = (torch.randn(2, 4, 3, 8, dtype=dtype) for _ in range(3))
    mask = torch.ones(2, 1, 1, 3, dtype=torch.bool)
    mask[1] = False  # a sequence that is all padding
    module = make_model().model.encoder.layers[0].self_attn.eval()
    out, weights = scaled_dot_product_attention(module, q, k, v, additive_mask(mask, module, q, k), module.scaling)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    torch.testing.assert_close(weights[1], torch.ones_like(weights[1]) / 3)  # as Marian: spread evenly, finite
    model = make_model().to(torch.bfloat16)
    input_ids, attention_mask, decoder_input_ids = batch()
    attention_mask[1] = 0
    out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
    assert torch.isfinite(out.logits).all()


def test_sdpa_path_equals_explicit_path():
    for score in ("scaled_dot", "dot"):
        model = make_model(attention_score=score)
        input_ids, attention_mask, decoder_input_ids = batch()
        fast = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        explicit = model(
            input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True
        ).logits
        torch.testing.assert_close(fast, explicit, rtol=0, atol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "flex_attention"])
def test_a_fused_kernel_asked_for_attention_weights_gives_the_explicit_functions(implementation):
    # The weights the visualisations draw, whichever kernel the model runs; padding and causality kept.
    model = make_model()
    input_ids, attention_mask, decoder_input_ids = batch()
    attention_mask[1, -2:] = 0
    with torch.no_grad():
        explicit = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                         output_attentions=True)
        model.set_attn_implementation(implementation)
        fused = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                      output_attentions=True)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        for theirs, ours in zip(getattr(fused, name), getattr(explicit, name), strict=True):
            torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    torch.testing.assert_close(fused.logits, explicit.logits, rtol=0, atol=1e-5)


def test_a_kernel_that_returns_no_weights_is_refused_when_they_are_asked_for():
    from transformers import AttentionInterface

    def weightless(module, query, key, value, attention_mask, **kwargs):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value).transpose(1, 2), None

    AttentionInterface.register("weightless", weightless)
    model = make_model()
    model.set_attn_implementation("weightless")
    input_ids, attention_mask, decoder_input_ids = batch()
    model(input_ids, decoder_input_ids=decoder_input_ids)  # runs; only the weights are missing
    with pytest.raises(ValueError, match="`output_attentions`: the weightless kernel returns no attention weights"):
        model(input_ids, decoder_input_ids=decoder_input_ids, output_attentions=True)


@pytest.mark.parametrize("score", ["scaled_dot", "location"])
def test_incremental_decoding_equals_full_recomputation(score):
    model = make_model(attention_score=score)
    input_ids, attention_mask, decoder_input_ids = batch()
    full = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, use_cache=False).logits
    encoder_outputs = model.get_encoder()(input_ids, attention_mask)
    cache, steps = None, []
    for t in range(decoder_input_ids.size(1)):
        out = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                    decoder_input_ids=decoder_input_ids[:, t : t + 1], use_cache=True,
                    **{("cache", "past_key_values")[t % 2]: cache})  # its name from transformers 5.24, and before
        cache = out[CACHE_NAME]  # the name of the installed transformers
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_generate_with_and_without_cache_gives_identical_tokens(num_beams):
    model = make_model()
    input_ids, attention_mask, _ = batch()
    kwargs = dict(attention_mask=attention_mask, num_beams=num_beams, max_new_tokens=8, do_sample=False)
    with_cache = model.generate(input_ids, use_cache=True, **kwargs)
    without_cache = model.generate(input_ids, use_cache=False, **kwargs)
    assert torch.equal(with_cache, without_cache)
    assert torch.all(with_cache[:, 0] == model.config.decoder_start_token_id)


def test_generate_returns_every_attention():
    model = make_model()
    input_ids, attention_mask, _ = batch()
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, min_new_tokens=3,
                         output_attentions=True, return_dict_in_generate=True)
    config = model.config
    assert len(out.encoder_attentions) == config.encoder_layers
    assert len(out.decoder_attentions) == len(out.cross_attentions) == 3  # one tuple per generated token
    for step, (self_attn, cross_attn) in enumerate(zip(out.decoder_attentions, out.cross_attentions)):
        assert len(self_attn) == len(cross_attn) == config.decoder_layers
        assert self_attn[0].shape == (2, config.num_heads, 1, step + 1)
        assert cross_attn[0].shape == (2, config.num_heads, 1, 9)
        assert all(w is not None for w in self_attn + cross_attn)


def test_the_decoder_starts_from_the_configs_start_token_in_the_loss_and_in_decoding():
    # Marian's default start is the padding token, as ours is: a config that names another start must be read,
    # where labels are shifted for the loss and where generation begins.
    model = make_model(decoder_start_token_id=BOS)
    input_ids, attention_mask, decoder_input_ids = batch()
    labels = decoder_input_ids.roll(-1, dims=1)
    shifted = model.prepare_decoder_input_ids_from_labels(labels=labels)
    assert (shifted[:, 0] == BOS).all() and torch.equal(shifted[:, 1:], labels[:, :-1])
    logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=shifted).logits
    expected = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
    torch.testing.assert_close(model(input_ids, attention_mask=attention_mask, labels=labels).loss, expected)
    generated = model.generate(input_ids, attention_mask=attention_mask, num_beams=1, max_new_tokens=3)
    assert (generated[:, 0] == BOS).all()

def test_labels_give_loss_and_shifted_decoder_inputs():
    model = make_model()
    input_ids, attention_mask, decoder_input_ids = batch()
    labels = decoder_input_ids.roll(-1, dims=1)
    labels[1, 4:] = -100
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    shifted = shift_tokens_right(labels, PAD, model.config.decoder_start_token_id)
    assert shifted[0, 0] == PAD and torch.equal(shifted[0, 1:], labels[0, :-1]) and shifted[1, 5] == PAD
    logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=shifted).logits
    expected = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    # Label smoothing (§5.4): (1 - eps) * NLL + eps * mean over the vocabulary of -log p, on real tokens only.
    smoothed = make_model(label_smoothing=0.1)(input_ids, attention_mask=attention_mask, labels=labels).loss
    log_probs = logits.log_softmax(-1)[labels != -100]
    uniform_term = -log_probs.mean(-1).mean()
    torch.testing.assert_close(smoothed, 0.9 * expected + 0.1 * uniform_term)


@pytest.mark.parametrize("score", ATTENTION_SCORES)
def test_each_score_function_trains_without_nan(score):
    model = make_model(attention_score=score).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    input_ids, attention_mask, decoder_input_ids = batch()
    labels = decoder_input_ids.roll(-1, dims=1)
    losses = []
    for _ in range(3):
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    out = model.eval()(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
    torch.testing.assert_close(out.cross_attentions[0][0].sum(-1), torch.ones(4, 7))


def test_score_functions_match_their_formulas():
    model = make_model(attention_score="additive")
    module = model.model.encoder.layers[0].self_attn
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 3, 16)
    h, i, j = 2, 1, 2
    expected = module.score_vector[h] @ torch.tanh(
        q[0, h, i] @ module.score_query_weight[h] + k[0, h, j] @ module.score_key_weight[h]
    )
    torch.testing.assert_close(module.score(q, k)[0, h, i, j], expected)
    sparse = make_model(attention_normalization="sparsemax").model.encoder.layers[0].self_attn  # the paper's score
    torch.testing.assert_close(sparse.score(q, k)[0, h, i, j], q[0, h, i] @ k[0, h, j] / 4.0)
    module = make_model(attention_score="cosine").model.encoder.layers[0].self_attn
    cosine = torch.nn.functional.cosine_similarity(q[0, h, i], k[0, h, j], dim=0)
    torch.testing.assert_close(module.score(q, k)[0, h, i, j], cosine * 4.0)


def test_sinusoidal_encoding_is_the_papers_formula():
    positions = torch.tensor([0, 1, 7, 5000])
    pe = sinusoidal_encoding(positions, 16)
    for row, pos in enumerate(positions.tolist()):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert pe[row, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-4)
            assert pe[row, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-4)


def test_sinusoidal_works_past_max_positions_and_learned_fails_clearly():
    model = make_model(max_position_embeddings=8)
    long = torch.randint(3, VOCAB, (1, 20))
    assert model(long, decoder_input_ids=long).logits.shape == (1, 20, VOCAB)
    learned = make_model(max_position_embeddings=8, position_encoding="learned")
    assert learned(long[:, :8], decoder_input_ids=long[:, :8]).logits.shape == (1, 8, VOCAB)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        learned(long[:, :8], decoder_input_ids=long)


def test_pre_norm_and_untied_embeddings():
    model = make_model(norm_position="pre", tie_word_embeddings=False)
    assert model.model.encoder.final_norm is not None
    assert model.lm_head.weight is not model.model.encoder.embeddings.embed_tokens.weight
    assert model.model.encoder.embeddings.embed_tokens is not model.model.decoder.embeddings.embed_tokens
    input_ids, attention_mask, decoder_input_ids = batch()
    assert torch.isfinite(model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits).all()
    tied = make_model()
    assert tied.lm_head.weight is tied.model.shared.weight is tied.model.decoder.embeddings.embed_tokens.weight


# `gradient_checkpointing_enable` is the name every transformers 5 release has; 5.23 added
# `activation_checkpointing_enable`, which does the same, and deprecated the old name until v6.
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradient_checkpointing_gives_the_same_gradients(dropout):
    input_ids, attention_mask, decoder_input_ids = batch()
    labels = decoder_input_ids.roll(-1, dims=1)
    grads = []
    for checkpointing in (False, True):
        model = make_model(dropout=dropout).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert all(layer.gradient_checkpointing for layer in model.model.encoder.layers)
        torch.manual_seed(1)  # the recomputed forward draws the same dropout masks
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_bad_input_names_the_argument():
    model = make_model()
    input_ids, attention_mask, decoder_input_ids = batch()
    with pytest.raises(ValueError, match=r"`input_ids` holds id 40.*0\.\.39"):
        model(input_ids.clamp(max=VOCAB - 1) + 1, decoder_input_ids=decoder_input_ids)
    with pytest.raises(ValueError, match="`decoder_input_ids` holds id -1"):
        model(input_ids, decoder_input_ids=decoder_input_ids - 1)
    with pytest.raises(ValueError, match="`labels` holds id"):
        model(input_ids, labels=decoder_input_ids + VOCAB)
    with pytest.raises(ValueError, match="`attention_mask` has shape"):
        model(input_ids, attention_mask=attention_mask[:, :4], decoder_input_ids=decoder_input_ids)
    with pytest.raises(ValueError, match="`decoder_input_ids` has batch size 1"):
        model(input_ids, decoder_input_ids=decoder_input_ids[:1])
    with pytest.raises(ValueError, match="`input_ids` must have shape"):
        model(input_ids[0], decoder_input_ids=decoder_input_ids)
    with pytest.raises(ValueError, match="must hold integer"):
        model(input_ids.float(), decoder_input_ids=decoder_input_ids)


def test_the_configuration_stands_alone_as_marians_does(tmp_path):
    """configuration_vanilla_transformer.py imports the standard library and transformers' PretrainedConfig only
    (none of the model's torch side, no memory check): its file alone builds, checks and counts a config."""
    import ast
    import importlib.util
    import shutil
    import sys

    from vanilla_transformer.modeling import configuration_vanilla_transformer as configuration

    tree = ast.parse(open(configuration.__file__, encoding="utf-8").read())
    imported = {(node.module, tuple(alias.name for alias in node.names)) if isinstance(node, ast.ImportFrom)
                else (alias.name, ()) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in (node.names if isinstance(node, ast.Import) else node.names[:1])}
    assert {module for module, _ in imported if module not in sys.stdlib_module_names} == {"transformers"}
    assert ("transformers", ("PretrainedConfig",)) in imported
    alone = shutil.copy(configuration.__file__, tmp_path / "configuration_alone.py")
    spec = importlib.util.spec_from_file_location("configuration_alone", alone)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.VanillaTransformerConfig.from_preset("tiny", vocab_size=40, attention_score="location")
    assert config.parameter_count() == VanillaTransformerConfig.from_preset("tiny", vocab_size=40, attention_score="location").parameter_count()
    with pytest.raises(ValueError, match="`attention_score` must be one of"):
        module.VanillaTransformerConfig(attention_score="luong")
    assert not hasattr(config, "check_fits_in_memory")


@pytest.mark.parametrize(
    "field,value,allowed",
    [("attention_score", "luong", ", ".join(map(repr, ATTENTION_SCORES))),  # a new score class is named without a test edit
     ("position_encoding", "rotary", "'sinusoidal', 'learned'"),
     ("norm_position", "sandwich", "'post', 'pre'"),
     ("activation", "swish", "'relu', 'gelu'")],
)
def test_bad_config_names_field_and_choices(field, value, allowed):
    with pytest.raises(ValueError, match=f"`{field}` must be one of {allowed}; got '{value}'"):
        VanillaTransformerConfig(**{field: value})


@pytest.mark.parametrize(
    "overrides, message",
    [({"d_model": "abc"}, "`d_model` must be a positive integer; got 'abc'"),
     ({"num_heads": 0}, "`num_heads` must be a positive integer; got 0"),
     ({"location_max_length": 0}, "`location_max_length` must be a positive integer; got 0"),
     ({"encoder_layers": 2.5}, "`encoder_layers` must be a positive integer; got 2.5"),
     ({"d_ff": True}, "`d_ff` must be a positive integer; got True"),
     ({"dropout": 1.5}, r"`dropout` must be a number in \[0, 1\); got 1.5"),
     ({"attention_dropout": float("nan")}, r"`attention_dropout` must be a number in \[0, 1\); got nan"),
     ({"layer_norm_eps": 0}, "`layer_norm_eps` must be a positive number; got 0"),
     ({"tie_word_embeddings": "maybe"}, "`tie_word_embeddings` must be true or false; got 'maybe'"),
     ({"pad_token_id": 999}, r"`pad_token_id` must be a token id in \[0, vocab_size=40\); got 999"),
     ({"eos_token_id": -1}, r"`eos_token_id` must be a token id in \[0, vocab_size=40\); got -1"),
     ({"pad_token_id": None}, "`pad_token_id` must be a token id; got None")],
)
def test_bad_config_values_name_the_field_and_what_it_takes(overrides, message):
    # A ValueError naming the field, not an error from deep inside or a bad value stored as is.
    with pytest.raises(ValueError, match=message):
        VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, **overrides)


def test_bad_preset_and_shapes():
    with pytest.raises(ValueError, match="`preset` must be one of 'base', 'big', 'tiny', 'small'; got 'huge'"):
        VanillaTransformerConfig.from_preset("huge")
    with pytest.raises(ValueError, match="divisible"):
        VanillaTransformerConfig(d_model=100, num_heads=8)


def test_an_odd_width_is_refused_for_sinusoidal_positions_and_trains_with_learned_ones():
    # §3.5 interleaves sin and cos of d_model / 2 frequencies: an odd width has no encoding of its size.
    with pytest.raises(ValueError, match=r"`d_model` must be even for sinusoidal positions .*; got 33"):
        VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, d_model=33, num_heads=1)
    model = make_model(d_model=33, num_heads=1, position_encoding="learned")
    input_ids, attention_mask, decoder_input_ids = batch()
    assert model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits.shape[-1] == VOCAB


@pytest.mark.parametrize("score", ["general", "location"])  # learned score parameters are saved and loaded
def test_save_load_round_trip_is_bit_identical(tmp_path, score):
    model = make_model(attention_score=score, tie_word_embeddings=False)
    model.save_pretrained(tmp_path)
    loaded = VanillaTransformerForConditionalGeneration.from_pretrained(tmp_path).eval()
    input_ids, attention_mask, decoder_input_ids = batch()
    args = dict(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    assert torch.equal(model(input_ids, **args).logits, loaded(input_ids, **args).logits)
    assert (tmp_path / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, {"attention_score": "location", "location_max_length": 16}])
def test_saved_folder_loads_with_auto_classes_without_the_package(tmp_path, run_without_package, overrides):
    model = make_model(**overrides)
    model.save_pretrained(tmp_path / "model")
    config = (tmp_path / "model" / "config.json").read_text()
    for auto_class in ("AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM"):
        assert f'"{auto_class}"' in config
    input_ids, attention_mask, decoder_input_ids = batch()
    torch.save({"inputs": (input_ids, attention_mask, decoder_input_ids),
                "logits": model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits,
                "tokens": model.generate(input_ids, attention_mask=attention_mask, num_beams=2, max_new_tokens=5)},
               tmp_path / "expected.pt")
    out = run_without_package(
        """
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM
        expected = torch.load("expected.pt")
        input_ids, attention_mask, decoder_input_ids = expected["inputs"]
        config = AutoConfig.from_pretrained("model", trust_remote_code=True)
        model = AutoModelForSeq2SeqLM.from_pretrained("model", trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        assert torch.equal(logits, expected["logits"])
        tokens = model.generate(input_ids, attention_mask=attention_mask, num_beams=2, max_new_tokens=5)
        assert torch.equal(tokens, expected["tokens"])
        base = AutoModel.from_pretrained("model", trust_remote_code=True)
        print(type(config).__name__, type(base).__name__, type(model).__name__, config.attention_score)
        """,
        cwd=tmp_path,
    )
    assert out.split() == ["VanillaTransformerConfig", "VanillaTransformerModel", "VanillaTransformerForConditionalGeneration",
                           model.config.attention_score]


# --- location-based scores (Luong et al. 2015), from the query alone ---


def test_location_score_is_the_query_through_w_a_and_has_no_key_projection():
    model = make_model(attention_score="location", location_max_length=12)
    module = model.model.decoder.layers[0].cross_attn
    assert module.k_proj is None  # no keys are compared: no W^K
    assert module.score_location_weight.shape == (4, 16, 12)  # (H, Dh, location_max_length)
    q, k = torch.randn(2, 4, 3, 16), torch.randn(2, 4, 5, 16)
    scores = module.score(q, k)
    assert scores.shape == (2, 4, 3, 5)
    h, i, j = 3, 2, 4
    torch.testing.assert_close(scores[1, h, i, j], q[1, h, i] @ module.score_location_weight[h, :, j])
    assert torch.equal(module.score(q, torch.randn(2, 4, 5, 16)), scores)  # other keys, same scores


def test_location_rows_sum_to_one_over_real_positions_and_are_zero_on_padding():
    model = make_model(attention_score="location")
    input_ids, attention_mask, decoder_input_ids = batch()  # the second source: 6 real tokens, 3 padding
    out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
    for weights in out.encoder_attentions + out.cross_attentions:
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))  # both sentences' rows
        assert torch.all(weights[1, :, :, 6:] == 0)  # exactly 0 on the padding
        assert torch.all(weights[1, :, :, :6] > 0)
    for weights in out.decoder_attentions:
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
        assert torch.all(weights.triu(diagonal=1) == 0)  # the look-ahead mask still holds


@pytest.mark.parametrize("score, independent", [("location", True), ("scaled_dot", False)])
def test_location_weights_do_not_depend_on_the_source_tokens(score, independent):
    """Given the same query, other source tokens of the same length leave location weights unchanged: at the
    first decoder layer the query does not see the source, so its cross-attention is the same. A score
    that compares keys (the control) changes."""
    model = make_model(attention_score=score)
    input_ids, attention_mask, decoder_input_ids = batch()
    other = (input_ids + 5) % (VOCAB - 3) + 3
    other[1, 6:] = PAD
    weights = [
        model(ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, output_attentions=True)
        .cross_attentions[0]
        for ids in (input_ids, other)
    ]
    assert torch.equal(weights[0], weights[1]) == independent


def test_location_explicit_and_fast_paths_agree(monkeypatch):
    """Location scores have no fused kernel: the "sdpa" model takes the explicit path too, with or without
    weights, and gives the "eager" model's numbers; cached decoding and generation give the full pass's."""
    model = make_model(attention_score="location")
    eager = make_model(attention_score="location")
    eager.config._attn_implementation = "eager"
    input_ids, attention_mask, decoder_input_ids = batch()
    args = dict(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)

    def fused_kernel(*args, **kwargs):
        raise AssertionError("location-based scores must not run the fused dot-product kernel")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fused_kernel)
    fast = model(input_ids, **args).logits
    torch.testing.assert_close(model(input_ids, output_attentions=True, **args).logits, fast, rtol=0, atol=0)
    torch.testing.assert_close(eager(input_ids, **args).logits, fast, rtol=0, atol=0)
    kwargs = dict(attention_mask=attention_mask, num_beams=4, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(input_ids, use_cache=True, **kwargs), model.generate(input_ids, use_cache=False, **kwargs))


def test_location_refuses_inputs_longer_than_its_map_naming_the_option():
    model = make_model(attention_score="location", location_max_length=8)
    ids = torch.randint(3, VOCAB, (1, 9))
    assert model(ids[:, :8], decoder_input_ids=ids[:, :8]).logits.shape == (1, 8, VOCAB)
    with pytest.raises(ValueError, match=r"at most 8 positions \(`location_max_length`=8\); got a sequence of 9"):
        model(ids, decoder_input_ids=ids[:, :8])  # the source
    with pytest.raises(ValueError, match="`location_max_length`=8"):
        model(ids[:, :8], decoder_input_ids=ids)  # the target, in decoder self-attention



@pytest.mark.parametrize(
    ("position_encoding", "attention_score", "bounds"),
    [("sinusoidal", "scaled_dot", {}), ("learned", "scaled_dot", {"max_position_embeddings": 64}),
     ("sinusoidal", "location", {"location_max_length": 16}),
     ("learned", "location", {"location_max_length": 16, "max_position_embeddings": 64})],
)
def test_one_length_rule_bounds_the_source_the_target_and_training(position_encoding, attention_score, bounds):
    from types import SimpleNamespace

    from vanilla_transformer.modeling.generation import longest_target
    from vanilla_transformer.modeling.pipeline_vanilla_transformer import longest_source
    from vanilla_transformer.training.setup import _check_max_length

    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, max_position_embeddings=64, location_max_length=16,
                                           position_encoding=position_encoding, attention_score=attention_score)
    assert config.sequence_bounds() == bounds
    longest = min(bounds.values(), default=None)
    assert config.longest_sequence() == longest
    # The places that bound a length ask the config, each with what it adds: the tokenizer's own limit for a
    # source, the table's nominal length for a target of sinusoids; training refuses a longer max_length.
    model = SimpleNamespace(config=config)
    assert longest_source(model, SimpleNamespace(model_max_length=1000)) == (longest or 1000)
    assert longest_target(config) == (longest or 64)
    _check_max_length(longest or 10_000, config)
    for name, bound in bounds.items():
        if bound == longest:
            with pytest.raises(ValueError, match=rf"over the model's {name} \({bound}\)"):
                _check_max_length(bound + 1, config)

def test_location_model_decodes_within_its_map_whatever_the_source_length():
    """Decoding stops a translation at the source length + 50 new tokens (§6.1), and with `location_max_length`
    L at L - 1 (the positions the decoder reads): with no </s> in reach, every source up to L tokens translates;
    a longer source is refused, naming the field."""
    from vanilla_transformer.modeling.generation import paper_generation_config

    model = make_model(attention_score="location", location_max_length=60, eos_token_id=VOCAB - 1)
    model.generation_config = paper_generation_config(model.config)
    ids = torch.randint(3, VOCAB - 1, (1, 61))
    bad_words = dict(suppress_tokens=[VOCAB - 1])  # never </s> (bad_words_ids may not hold </s>)
    assert model.generate(ids[:, :5], num_beams=4, **bad_words).shape == (1, 56)  # start + 5 + 50 tokens
    for length in (10, 11, 60):  # start + 59 tokens
        assert model.generate(ids[:, :length], num_beams=4, **bad_words).shape == (1, 60)
    with pytest.raises(ValueError, match="`location_max_length`=60"):
        model.generate(ids, num_beams=4, **bad_words)


@pytest.mark.parametrize("score", ["scaled_dot", "location"])
def test_attention_input_projections_get_fairseqs_xavier_gain(score):
    # W^Q, W^K, W^V: Xavier-uniform with gain 1/sqrt(2), bound sqrt(6 / (2 d)) / sqrt(2) (fairseq); W^O and the
    # feed-forward layers the full bound. The full bound on W^Q, W^K, W^V learned measurably slower.
    config = VanillaTransformerConfig.from_preset("tiny", d_model=128, d_ff=256, num_heads=4, attention_score=score)
    model = VanillaTransformerForConditionalGeneration(config)
    attention = model.model.decoder.layers[0].cross_attn
    bound = (6 / (2 * 128)) ** 0.5
    for projection in filter(None, (attention.q_proj, attention.k_proj, attention.v_proj)):
        assert projection.weight.abs().max() <= bound / 2**0.5 + 1e-6
        assert projection.weight.std().item() == pytest.approx(bound / 2**0.5 / 3**0.5, rel=0.05)
    assert attention.out_proj.weight.std().item() == pytest.approx(bound / 3**0.5, rel=0.05)


# --- transformers' model contract: tuples, a cache passed in training, the shipped files ---


def _same_items(got, expected):
    assert type(got) is tuple and len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b) if torch.is_tensor(b) else type(a) is type(b)


def test_return_dict_false_returns_to_tuple_as_marian_does():
    from transformers import MarianConfig, MarianMTModel

    model = make_model()
    input_ids, attention_mask, decoder_input_ids = batch()
    labels = decoder_input_ids.roll(-1, dims=1)
    args = dict(attention_mask=attention_mask, labels=labels)
    expected = model(input_ids, **args).to_tuple()  # loss, logits, encoder output, nll: labels make no cache
    _same_items(model(input_ids, return_dict=False, **args), expected)
    model.config.return_dict = False  # transformers' other way to ask for tuples
    _same_items(model(input_ids, **args), expected)
    assert model(input_ids, return_dict=True, **args).loss is not None
    # MarianMTModel, the same architecture in transformers, returns the same fields in the same order.
    marian = MarianMTModel(MarianConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                        decoder_ffn_dim=16, pad_token_id=PAD, decoder_start_token_id=PAD)).eval()
    theirs = marian(input_ids, return_dict=False, **args)
    assert [type(item) for item in theirs] == [type(item) for item in expected[:-1]]  # ours adds the NLL last
    assert [item.shape[:2] for item in theirs if torch.is_tensor(item) and item.dim()] == [(2, 7), (2, 9)]

    base = VanillaTransformerModel(make_model().config).eval()
    inputs = dict(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    _same_items(base(input_ids, return_dict=False, **inputs), base(input_ids, **inputs).to_tuple())
    encoder = base.get_encoder()
    _same_items(encoder(input_ids, attention_mask, return_dict=False), encoder(input_ids, attention_mask).to_tuple())


def _prefix_cache(prefix):
    """A cache holding a prefix of keys and values for each decoder layer, as PEFT's prefix tuning passes it."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    for layer, (keys, values) in enumerate(prefix):
        cache.self_attention_cache.update(keys, values, layer)
    return cache


def test_a_cache_passed_in_training_is_read_like_peft_s_prefix():
    model = make_model(dropout=0.0).train()
    config = model.config
    input_ids, attention_mask, decoder_input_ids = batch()
    labels = decoder_input_ids.roll(-1, dims=1)
    # (layers, keys/values, B, H, prefix length, Dh)
    prefix = torch.randn(config.decoder_layers, 2, 2, config.num_heads, 3, config.head_dim, requires_grad=True)
    args = dict(attention_mask=attention_mask, labels=labels)
    loss = model(input_ids, past_key_values=_prefix_cache(prefix), **args).loss
    (grad,) = torch.autograd.grad(loss, prefix)
    assert grad[:, 0].abs().sum() > 0 and grad[:, 1].abs().sum() > 0  # keys and values of the prefix both count
    with torch.no_grad():
        other = model(input_ids, cache=_prefix_cache(prefix * 2), **args).loss
        without = model(input_ids, **args).loss
    assert not torch.allclose(loss, other) and not torch.allclose(loss, without)
    model.gradient_checkpointing_enable()  # its replay in backward would extend the cache twice: refused
    with pytest.raises(ValueError, match="without gradient checkpointing"):
        model(input_ids, cache=_prefix_cache(prefix), **args)


def test_the_code_files_import_one_another_in_one_direction_and_all_are_shipped():
    """No circle among the model's files: each imports its neighbours at the top, none inside a function,
    so that an order exists in which every file comes after those it imports."""
    import ast
    import graphlib
    from pathlib import Path

    import vanilla_transformer.modeling.modeling_vanilla_transformer as modeling

    folder = Path(modeling.__file__).parent
    imports = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
        assert all(node in tree.body for node in relative), f"{path.name} imports a file beside it inside a function"
        imports[path.stem] = {node.module for node in relative}
    graphlib.TopologicalSorter(imports).prepare()  # CycleError names a circle
    assert [name for name, names in imports.items() if "modeling_vanilla_transformer" in names] == ["__init__"]  # on top
    source = (folder / "modeling_vanilla_transformer.py").read_text()
    assert "torch.ops" not in source and "torch._" not in source  # no private torch ops
    assert len(source.splitlines()) < 600  # the paper's path, read in one sitting
    shipped = {path.name for path in folder.glob("*.py")} - {"__init__.py"}
    assert set(CODE_FILES) == shipped


def test_the_model_file_and_the_design_name_every_file_that_ships_with_it():
    """The model file's docstring (read in a saved folder, where docs/ is not) and docs/design.md's layout each
    name every code file a folder holds, one line a file."""
    from pathlib import Path

    import vanilla_transformer.modeling.modeling_vanilla_transformer as modeling

    design = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text(encoding="utf-8")
    named = {line.split()[0] for line in modeling.__doc__.splitlines() if line.startswith("    ") and line.split()}
    assert set(CODE_FILES) - {"modeling_vanilla_transformer.py"} <= named, "missing from the model file's docstring"
    listed = {line.split()[0] for line in design.splitlines() if line.startswith("        ") and line.split()}
    assert set(CODE_FILES) <= listed, "missing from design.md's package layout"
