"""Which loop serves a `generate` request (`choose_search`), and that every request handed over, or ending
unusually, gives what transformers' own loop gives."""

import copy
import logging

import pytest
import torch
from transformers import GenerationConfig, GenerationMixin, StoppingCriteriaList, StopStringCriteria

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.modeling.generation import (
    paper_generation_config,
    choose_search,
    resolved_generation_config,
)
from vanilla_transformer.modeling.search import gnmt_beam_search, greedy_search


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=40, dropout=0.0)).eval()


def transformers_loop(model, input_ids, **options):
    """transformers' own `generate`, none of our loops or our length cap."""
    return GenerationMixin.generate(model, input_ids, attention_mask=torch.ones_like(input_ids), **options)


def source(rows=2, length=6, seed=0):
    return torch.randint(4, 40, (rows, length), generator=torch.Generator().manual_seed(seed))


# Both rankings are log P alone at α = 0: our (GNMT) beam search then keeps the beams transformers' loop keeps.
SAME_BEAMS = {"transformers": {}, "gnmt": dict(length_penalty=0.0)}


def chosen(model, options, style="transformers"):
    kwargs = dict(options, length_penalty_style=style)
    return choose_search(model, kwargs, resolved_generation_config(model, None, kwargs))


@pytest.mark.parametrize("options,reason", [
    (dict(do_sample=True), "sample"),
    (dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0), "group_beam_search"),
    (dict(num_beams=2, force_words_ids=[[5]]), "constrained_beam_search"),
    (dict(penalty_alpha=0.6, top_k=4), "contrastive_search"),
    (dict(prompt_lookup_num_tokens=3), "assisted_generation"),
    (dict(assistant_early_exit=1), "assisted_generation"),
    pytest.param(dict(use_mtp=True), "assisted_generation", marks=pytest.mark.skipif(
        not hasattr(GenerationConfig(), "use_mtp"), reason="multi-token prediction is newer than this transformers")),
    (dict(is_assistant=True), "is_assistant"),
    (dict(num_beams=2, assistant_model=object(), assistant_tokenizer=object()), "assistant_tokenizer"),
    (dict(num_beams=2, is_assistant=True), "is_assistant"),
    (dict(dola_layers="low"), "dola_generation"),
    (dict(token_healing=True), "token_healing"),
    (dict(num_beams=2, low_memory=True), "low_memory"),
    (dict(synced_gpus=True), "synced_gpus"),
    (dict(stop_strings=["x"]), "stop_strings"),
    (dict(streamer=object()), "streamer"),
    (dict(cache_implementation="static"), "static cache"),
    (dict(num_beams=2, output_logits=True, return_dict_in_generate=True), "output_logits"),
    (dict(return_dict_in_generate=True), "return_dict_in_generate"),
    (dict(custom_generate=greedy_search), "custom_generate given"),
    (dict(num_beams=3), "transformers' length penalty"),
])
def test_each_request_our_loops_cannot_serve_goes_to_transformers_loop_by_name(model, options, reason):
    assert chosen(model, options) == (None, reason)


@pytest.mark.parametrize("options", [dict(assistant_model=object()), dict(prompt_lookup_num_tokens=3),
                                     dict(dola_layers="low")])
def test_options_transformers_ignores_with_beams_run_our_beam_search(model, options):
    assert chosen(model, dict(options, num_beams=3), style="gnmt") == (gnmt_beam_search, None)


def test_plain_requests_run_our_loops(model):
    assert chosen(model, {}) == (greedy_search, None)  # greedy, whichever the style
    assert chosen(model, {}, style="gnmt") == (greedy_search, None)
    assert chosen(model, dict(num_beams=3), style="gnmt") == (gnmt_beam_search, None)
    assert chosen(model, dict(num_beams=3, return_dict_in_generate=True, output_scores=True), style="gnmt") == (
        gnmt_beam_search, None)


def test_generate_logs_why_transformers_loop_serves_a_call(model, caplog):
    with caplog.at_level(logging.DEBUG, logger="vanilla_transformer.modeling.generation"):
        model.generate(source(), do_sample=True, max_new_tokens=2)
    assert "transformers' own generation loop serves this call: sample" in caplog.text


def test_a_gnmt_beam_call_handed_to_transformers_loop_says_that_its_ranking_is_not_kept(model, caplog):
    with caplog.at_level(logging.WARNING, logger="vanilla_transformer.modeling.generation"):
        model.generate(source(), num_beams=4, length_penalty_style="gnmt", max_new_tokens=3)  # our loop: silent
        model.generate(source(), num_beams=4, length_penalty_style="gnmt", max_new_tokens=3,
                       custom_generate=gnmt_beam_search)  # the caller's own search, not transformers' ranking: silent
        assert caplog.text == ""
        model.generate(source(), num_beams=4, length_penalty_style="gnmt", max_new_tokens=3, output_logits=True,
                       return_dict_in_generate=True)
    assert ("transformers' own generation loop serves this call (output_logits): it ranks finished beams by |Y|^α, "
            "not by the GNMT length penalty that length_penalty_style='gnmt' asks for") in caplog.text


def test_a_cache_passed_in_and_peft_go_to_transformers_loop(model):
    from vanilla_transformer.modeling.input_checks import CACHE_NAME

    assert chosen(model, {CACHE_NAME: object()}) == (None, "a cache passed in")
    patched = VanillaTransformerForConditionalGeneration(model.config)
    patched.prepare_inputs_for_generation = model.prepare_inputs_for_generation
    assert chosen(patched, {}) == (None, "PEFT's prepare_inputs_for_generation")


@pytest.mark.parametrize("options", [dict(min_new_tokens=80), dict(suppress_tokens=[2])])
@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("style", SAME_BEAMS)
def test_no_hypothesis_can_end_in_time_gives_transformers_output(model, options, num_beams, style):
    """</s> ruled out up to the length limit: the best live beams at the limit, as transformers returns them."""
    input_ids = source()
    options = dict(options, num_beams=num_beams, max_new_tokens=7, **SAME_BEAMS[style])
    ours = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), length_penalty_style=style, **options)
    assert torch.equal(ours, transformers_loop(model, input_ids, **options))


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("style", SAME_BEAMS)
def test_no_hypothesis_can_end_inside_the_source_length_cap(model, num_beams, style):
    """Under the cap (source + max_length_offset) a sentence that cannot end stops at its cap unfinished."""
    input_ids = source()
    out = model.generate(input_ids, num_beams=num_beams, min_new_tokens=80, max_length_offset=5,
                         length_penalty_style=style)
    assert out.shape == (2, 1 + 6 + 5) and not (out[:, 1:] == model.config.eos_token_id).any()


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("style", SAME_BEAMS)
def test_a_decoder_prompt_is_read_whole_as_in_transformers_loop(model, num_beams, style):
    """`decoder_input_ids` longer than the start token: the first step reads all of it (beam search once
    fed only its last token to an empty cache)."""
    input_ids, prompt = source(), torch.tensor([[0, 7], [0, 9]])
    options = dict(num_beams=num_beams, max_new_tokens=6, decoder_input_ids=prompt, **SAME_BEAMS[style])
    ours = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), length_penalty_style=style, **options)
    assert torch.equal(ours, transformers_loop(model, input_ids, **options))


@pytest.mark.parametrize("options", [dict(num_beams=3), dict(num_beams=3, length_penalty_style="gnmt"),
                                     dict(do_sample=True), dict(return_dict_in_generate=True)])
@pytest.mark.parametrize("in_config", [False, True])
def test_chunked_prefill_is_ignored_in_every_loop(model, options, in_config):
    """`prefill_chunk_size`: transformers' loop would pass `position_ids`, which our forward does not take; the
    decoder's prompt is read whole in every loop (ours and transformers'), as without it."""
    input_ids = source()
    torch.manual_seed(0)
    plain = model.generate(input_ids, max_new_tokens=4, **options)
    torch.manual_seed(0)
    chunking = dict(generation_config=GenerationConfig(prefill_chunk_size=1)) if in_config else dict(prefill_chunk_size=1)
    chunked = model.generate(input_ids, max_new_tokens=4, **chunking, **options)
    assert torch.equal(getattr(chunked, "sequences", chunked), getattr(plain, "sequences", plain))


@pytest.mark.parametrize("assistance", [dict(assistant_model="self"), dict(prompt_lookup_num_tokens=3),
                                        dict(assistant_early_exit=1)])
def test_assisted_greedy_search_gives_the_unassisted_tokens(model, assistance):
    assistance = {k: model if v == "self" else v for k, v in assistance.items()}
    input_ids = source(rows=1)
    plain = model.generate(input_ids, max_new_tokens=12)
    assert torch.equal(model.generate(input_ids, max_new_tokens=12, **assistance), plain)
    assert torch.equal(transformers_loop(model, input_ids, max_new_tokens=12, **assistance), plain)


def test_assisted_sampling_runs(model):
    out = model.generate(source(rows=1), do_sample=True, assistant_model=model, max_new_tokens=8)
    assert out.shape[0] == 1 and out.shape[1] <= 9


@pytest.mark.parametrize("assistance", [dict(assistant_model="self"), dict(prompt_lookup_num_tokens=3)])
def test_assisted_beam_search_ignores_the_assistance_as_transformers_does(model, assistance):
    assistance = {k: model if v == "self" else v for k, v in assistance.items()}
    input_ids = source(rows=1)
    plain = model.generate(input_ids, num_beams=2, max_new_tokens=12)
    assert torch.equal(model.generate(input_ids, num_beams=2, max_new_tokens=12, **assistance), plain)
    assert torch.equal(transformers_loop(model, input_ids, num_beams=2, max_new_tokens=12, **assistance), plain)


def test_early_exit_leaves_the_model_whole(model):
    """transformers lowers num_hidden_layers while the draft runs: the decoder runs that many layers."""
    input_ids = source(rows=1)
    model.generate(input_ids, max_new_tokens=4, assistant_early_exit=1)
    assert model.config.decoder_layers == len(model.model.decoder.layers) == 2


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(), dict(num_beams=3), dict(do_sample=True, top_k=1)])
def test_stop_strings_end_the_output_as_in_transformers_loop(hub_tiny_model, options):
    options = dict(options, max_new_tokens=20, min_new_tokens=6)
    """The tokenizer passed to `generate` reaches transformers' stop-string criterion, not `forward`."""
    model, tokenizer = hub_tiny_model
    model = copy.deepcopy(model)  # transformers' ranking, as in its loop
    model.generation_config = paper_generation_config(model.config, num_beams=1, length_penalty_style="transformers")
    inputs = tokenizer(["In the beginning God created the heaven and the earth."], return_tensors="pt")
    free = model.generate(**inputs, **options)
    assert free.shape[1] > 4
    stop = tokenizer.decode(free[0, 3]).strip()[:2]  # a string the output reaches by its third token
    ours = model.generate(**inputs, stop_strings=[stop], tokenizer=tokenizer, **options)
    criterion = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])  # what transformers builds from them
    theirs = GenerationMixin.generate(model, **inputs, stopping_criteria=criterion, **options)
    assert torch.equal(ours, theirs)
    # the last token completes the stop string (it may run past it, as in transformers)
    assert ours.shape[1] < free.shape[1] and stop in tokenizer.decode(ours[0], skip_special_tokens=True)
    assert stop not in tokenizer.decode(ours[0, :-1], skip_special_tokens=True)


def test_a_saved_model_decodes_as_it_did_in_memory(model, tmp_path):
    """The paper's settings (`paper_generation_config`, a config not derived from the model's) survive
    save_pretrained + from_pretrained: the same style, cap and tokens."""
    model = copy.deepcopy(model)
    model.generation_config = paper_generation_config(model.config, max_length_offset=9)
    input_ids = source(rows=3)
    before = model.generate(input_ids, attention_mask=torch.ones_like(input_ids))
    model.save_pretrained(tmp_path)
    loaded = VanillaTransformerForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert (loaded.generation_config.length_penalty_style, loaded.generation_config.max_length_offset) == ("gnmt", 9)
    assert torch.equal(loaded.generate(input_ids, attention_mask=torch.ones_like(input_ids)), before)


@pytest.mark.parametrize("position_encoding,refused", [("learned", True), ("sinusoidal", False)])
def test_an_input_past_the_learned_position_table_is_refused_in_one_line(position_encoding, refused):
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=40, dropout=0.0, max_position_embeddings=16,
                                           position_encoding=position_encoding)
    model = VanillaTransformerForConditionalGeneration(config).eval()
    assert model.generate(source(length=16), max_new_tokens=3).shape == (2, 4)
    if refused:
        with pytest.raises(ValueError, match=r"^The input is 17 tokens long; this model reads at most 16 "
                                             r"\(max_position_embeddings\)\. Truncate it: .*truncation=True"):
            model.generate(source(length=17), max_new_tokens=3)
    else:  # sinusoids extend past the table's nominal length
        assert model.generate(source(length=17), max_new_tokens=3).shape == (2, 4)


@pytest.mark.parametrize("num_return_sequences", [1, 2])
def test_a_beam_search_in_which_every_token_is_ruled_out_returns_transformers_rows(model, num_return_sequences):
    """Every token banned, </s> suppressed: no hypothesis is ever finished, and each sentence still has its rows."""
    input_ids, eos = source(), model.config.eos_token_id
    options = dict(num_beams=2, num_return_sequences=num_return_sequences, max_new_tokens=5, suppress_tokens=[eos],
                   bad_words_ids=[[token] for token in range(40) if token != eos], return_dict_in_generate=True,
                   output_scores=True)
    ours = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), length_penalty_style="transformers",
                          **options)
    theirs = transformers_loop(model, input_ids, **options)
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(ours.sequences_scores, theirs.sequences_scores)
    gnmt = model.generate(input_ids, length_penalty_style="gnmt", **options)
    assert torch.equal(gnmt.sequences, theirs.sequences) and (gnmt.sequences_scores == float("-inf")).all()
