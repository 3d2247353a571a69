"""The model follows transformers' conventions where transformers has one, as MarianMTModel does: each of
these is a behaviour that transformers' own common model tests (ModelTesterMixin, GenerationTesterMixin)
check, tested here on our classes."""

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import GradientCheckpointingLayer

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.modeling.attention_variants import check_attn_implementation
from vanilla_transformer.modeling.input_checks import CACHE_NAME, check_ids
from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerModel

VOCAB = 40


def make_model(cls=VanillaTransformerForConditionalGeneration, seed=0, **overrides):
    torch.manual_seed(seed)
    return cls(VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, dropout=0.0, **overrides)).eval()


def batch():
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5:] = 0
    return input_ids, attention_mask, torch.randint(3, VOCAB, (2, 6), generator=g)


@pytest.mark.parametrize("cls", [VanillaTransformerModel, VanillaTransformerForConditionalGeneration])
def test_tied_embeddings_missing_from_a_checkpoint_are_reported_and_initialised(cls, tmp_path):
    """Each embedding is its own module, tied by transformers (`_tied_weights_keys`): a checkpoint without
    the shared matrix loads with the key reported missing and the matrix initialised, not left on `meta`."""
    model = make_model(cls)
    assert model.get_input_embeddings().weight is model.get_decoder().get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    shared = next(name for name in weights if name.endswith("shared.weight"))
    save_file({name: tensor for name, tensor in weights.items() if name != shared}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert shared in info["missing_keys"]
    embeddings = loaded.get_input_embeddings().weight
    assert embeddings.device.type == "cpu" and torch.isfinite(embeddings).all() and embeddings.abs().sum() > 0
    assert embeddings is loaded.get_decoder().get_input_embeddings().weight
    if cls is VanillaTransformerForConditionalGeneration:
        assert loaded.get_output_embeddings().weight is embeddings
    input_ids, attention_mask, decoder_input_ids = batch()
    loaded(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)  # runs


def test_untied_embeddings_are_three_matrices():
    model = make_model(tie_word_embeddings=False)
    matrices = {id(model.get_input_embeddings().weight), id(model.get_decoder().get_input_embeddings().weight),
                id(model.get_output_embeddings().weight)}
    assert len(matrices) == 3 and not hasattr(model.model, "shared")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_is_transformers_and_honours_its_kwargs(use_reentrant, monkeypatch):
    """The layers are GradientCheckpointingLayers: `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`
    reaches torch's checkpoint, and the gradients are those of the plain pass."""
    import transformers.modeling_utils

    calls = []
    real = transformers.modeling_utils.checkpoint  # what transformers binds the kwargs to
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", lambda *a, **k: calls.append(k) or real(*a, **k))
    input_ids, attention_mask, decoder_input_ids = batch()
    labels = decoder_input_ids.roll(-1, dims=1)
    grads = []
    for checkpointing in (False, True):
        model = make_model().train()
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        assert len(layers) == model.config.encoder_layers + model.config.decoder_layers
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            assert all(layer.gradient_checkpointing for layer in layers)
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert len(calls) == len(layers) and all(call["use_reentrant"] is use_reentrant for call in calls)
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flex_attention"])
def test_each_attention_implementation_runs_the_papers_attention_and_can_be_set_at_run_time(implementation):
    model = make_model()
    input_ids, attention_mask, decoder_input_ids = batch()
    inputs = dict(attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    with torch.no_grad():  # flex attention has no backward on a CPU
        expected = model(input_ids, **inputs).logits
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        assert all(m.config._attn_implementation == implementation for m in model.modules() if hasattr(m, "q_proj"))
        torch.testing.assert_close(model(input_ids, **inputs).logits, expected, rtol=1e-4, atol=1e-5)
        greedy = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, num_beams=1)
    model.set_attn_implementation("eager")
    assert torch.equal(greedy, model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, num_beams=1))


def test_attention_beyond_the_paper_runs_on_its_own_function_and_refuses_another():
    model = make_model(attention_score="general")
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"`attn_implementation`='sdpa'.*`attention_score`"):
        model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="`attn_implementation`='flex_attention'"):
        VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", 
            vocab_size=VOCAB, attention_normalization="relu", attn_implementation="flex_attention"))
    assert make_model(attention_score="dot").config._attn_implementation == "sdpa"  # Luong's dot: a scale of 1
    local = make_model(local_attention="local-m")  # a window is a mask: sdpa and flex take it, flash does not
    assert local.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="`attn_implementation`='flash_attention_2' takes no mask for local"):
        check_attn_implementation(local.config, "flash_attention_2")


def test_which_scores_run_on_transformers_kernels_is_read_from_the_score_classes(monkeypatch):
    """A score class that keeps MultiHeadAttention's `score` (a dot product) runs on any attention function; one
    with its own `score` only on the explicit one: no list of score names to keep beside SCORE_CLASSES."""
    from types import SimpleNamespace

    from vanilla_transformer.modeling import attention_variants

    class OwnScore(attention_variants.ExplicitAttention):
        def score(self, q, k):
            return q @ k.transpose(-1, -2)

    monkeypatch.setitem(attention_variants.SCORE_CLASSES, "dot_again", attention_variants.ExplicitAttention)
    monkeypatch.setitem(attention_variants.SCORE_CLASSES, "own_score", OwnScore)
    paper = dict(attention_normalization="softmax", attention_hardness="soft", local_attention="none")
    assert not attention_variants.explicit_attention(SimpleNamespace(attention_score="dot_again", **paper))
    assert attention_variants.explicit_attention(SimpleNamespace(attention_score="own_score", **paper))
    check_attn_implementation(SimpleNamespace(attention_score="dot_again", **paper), "sdpa")


def test_a_custom_4d_attention_mask_gives_what_the_2d_one_gives():
    model = make_model()
    model.set_attn_implementation("eager")
    input_ids, attention_mask, decoder_input_ids = batch()
    expected = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    length = decoder_input_ids.size(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    additive = torch.zeros(2, 1, length, length).masked_fill(~causal, torch.finfo(torch.float32).min)
    got = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                decoder_attention_mask=additive).logits
    torch.testing.assert_close(got, expected)


def test_the_old_cache_name_warns_as_transformers_models_do():
    model = make_model()
    input_ids, attention_mask, decoder_input_ids = batch()
    out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, use_cache=True)
    cache = getattr(out, CACHE_NAME)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids[:, -1:],
              past_key_values=cache)
    deprecations = [w for w in caught if issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message)]
    assert len(deprecations) == (1 if CACHE_NAME == "cache" else 0)


def test_flags_transformers_reads_are_declared():
    cls = VanillaTransformerForConditionalGeneration
    assert cls._can_compile_fullgraph and cls._supports_sdpa and cls._supports_flex_attn and cls._supports_flash_attn
    assert cls.supports_gradient_checkpointing and cls.accepts_loss_kwargs


def test_the_id_check_reads_values_only_from_cpu_tensors():
    """On an accelerator, reading ids back would make every forward wait for the device."""
    with pytest.raises(ValueError, match="`input_ids` holds id 40"):
        check_ids("input_ids", torch.tensor([[1, 40]]), VOCAB)
    check_ids("input_ids", torch.tensor([[1, 40]], device="meta"), VOCAB)  # no value read: no error, no wait
    with pytest.raises(ValueError, match="must have shape"):
        check_ids("input_ids", torch.tensor([1, 40], device="meta"), VOCAB)  # shapes are still checked


# A cache that `generate` returns continues a generation: tests/modeling/test_search.py.


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("size", [VOCAB + 20, VOCAB - 10])
@pytest.mark.parametrize("cls", [VanillaTransformerModel, VanillaTransformerForConditionalGeneration])
def test_resized_token_embeddings_are_every_matrix_of_the_new_vocabulary(cls, size, tied):
    """`resize_token_embeddings` resizes the encoder's and the decoder's embeddings and the output projection,
    tied or not (untied, the decoder's is a matrix of its own, as Marian's): the ids of the new vocabulary run
    through `forward` and `generate`."""
    model = make_model(cls, tie_word_embeddings=tied)
    model.resize_token_embeddings(size, mean_resizing=False)
    matrices = [model.get_input_embeddings(), model.get_decoder().get_input_embeddings()]
    if cls is VanillaTransformerForConditionalGeneration:
        matrices.append(model.get_output_embeddings())
    assert model.config.vocab_size == size
    assert [matrix.weight.shape[0] for matrix in matrices] == [size] * len(matrices)
    assert len({id(matrix.weight) for matrix in matrices}) == (1 if tied else len(matrices))
    if tied:  # one matrix: the decoder's alone cannot be set
        with pytest.raises(ValueError, match="set both with `set_input_embeddings`"):
            model.base_model.set_decoder_input_embeddings(matrices[0])
    last = size - 1  # beyond the old vocabulary when it grew, its last id kept when it shrank
    input_ids, decoder_input_ids = torch.tensor([[5, last, 2]]), torch.tensor([[0, last, 7]])
    if cls is VanillaTransformerModel:
        assert model(input_ids, decoder_input_ids=decoder_input_ids).last_hidden_state.shape[1] == 3
        return
    out = model(input_ids, labels=torch.tensor([[last, 7, 2]]))
    assert out.logits.shape == (1, 3, size) and torch.isfinite(out.loss)
    generated = model.generate(input_ids, decoder_input_ids=decoder_input_ids, max_new_tokens=3, num_beams=2)
    assert generated[0, :3].tolist() == [0, last, 7] and int(generated.max()) < size
