"""The `translation` pipeline that ships inside saved folders (transformers 5 has none built in)."""

import json

import pytest
import torch

from vanilla_transformer.modeling.pipeline_vanilla_transformer import TranslationPipeline, readable_pieces

SENTENCES = ["In the beginning God created the heavens and the earth.", "Jesus wept.", "And God said, Let there be light."]
ACCENTED = "Jesús wept; ¿why? In the beginning God created the heavens and the earth."


@pytest.mark.slow
def test_pipeline_loads_from_the_folder_without_the_package(hub_tiny_folder, run_without_package):
    """`pipeline("translation", model=folder, trust_remote_code=True)` in a process that cannot import
    vanilla_transformer: strings and lists, batching, generation options, attention weights."""
    out = run_without_package(
        f"""
        import json, torch
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
        folder = {str(hub_tiny_folder)!r}
        sentences = {SENTENCES!r}
        translate = pipeline("translation", model=folder, trust_remote_code=True)
        single = translate(sentences[0])
        batched = translate(sentences, batch_size=2, num_beams=1, max_new_tokens=12)
        one_by_one = [translate(s, num_beams=1, max_new_tokens=12)[0] for s in sentences]
        short = translate(sentences[0], num_beams=1, max_new_tokens=3)
        with_blank = translate([sentences[1], " "], batch_size=2, num_beams=1, max_new_tokens=12, return_tensors=True, return_text=True)
        # the same as generate() by hand, beam search and length penalty passed through
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
        ids = model.generate(**tokenizer(sentences[:1], return_tensors="pt"), num_beams=3, length_penalty=2.0, max_new_tokens=20)
        by_hand = tokenizer.decode(ids[0], skip_special_tokens=True)
        piped = translate(sentences[0], num_beams=3, length_penalty=2.0, max_new_tokens=20)[0]["translation_text"]
        with_weights = translate(sentences[:2], batch_size=2, num_beams=1, return_attentions=True)
        weights = with_weights[1]["attentions"]
        try:  # the generation checks travel with the folder's code
            translate(sentences[0], num_beams=0)
            refused = None
        except ValueError as err:
            refused = str(err)
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            translate(sentences[1], num_beams=1, max_new_tokens=3, src_lang="en", tgt_lang="es")
            translate(sentences[1], num_beams=1, max_new_tokens=3, tgt_lang="fr")
        pair_warnings = [str(w.message) for w in caught if "translates" in str(w.message)]
        print(json.dumps(dict(refused=refused, pair_warnings=pair_warnings,
            type=type(translate).__name__, single=single, batched=batched, one_by_one=one_by_one,
            with_blank=[r["translation_text"] for r in with_blank],
            blank_ids_decode=[tokenizer.decode(r["translation_token_ids"], skip_special_tokens=True) for r in with_blank],
            short_tokens=len(tokenizer(short[0]["translation_text"], add_special_tokens=False)["input_ids"]),
            by_hand=by_hand, piped=piped, keys=sorted(with_weights[1]),
            shapes={{k: list(v.shape) for k, v in weights.items() if torch.is_tensor(v)}},
            encoder_tokens=weights["encoder_tokens"], decoder_tokens=weights["decoder_tokens"],
            source_tokens=tokenizer.convert_ids_to_tokens(tokenizer(sentences[1])["input_ids"]),
            row_sums=[float(weights[k].sum(-1).sub(1).abs().max()) for k in ("encoder_attention", "decoder_attention", "cross_attention")],
        )))
        """
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["type"] == "TranslationPipeline"
    assert result["refused"] == "`num_beams` must be a positive integer; got 0."
    assert result["pair_warnings"] == [  # the saved config knows the pair: only the wrong one is warned about
        "the model translates en->es (trained on bible-en-es), not en->fr: its output will not be in the language asked for"]
    assert len(result["single"]) == 1 and set(result["single"][0]) == {"translation_text"}
    assert result["single"][0]["translation_text"].strip()
    assert [r["translation_text"] for r in result["batched"]] == [r["translation_text"] for r in result["one_by_one"]]
    assert result["short_tokens"] <= 3
    assert result["with_blank"] == result["blank_ids_decode"] == [result["one_by_one"][1]["translation_text"], ""]
    assert result["piped"] == result["by_hand"]
    assert result["keys"] == ["attentions", "translation_text"]
    # The second text of the batch was padded; its weights are trimmed to its own tokens.
    source = len(result["source_tokens"])
    assert result["encoder_tokens"] == result["source_tokens"]
    target = len(result["decoder_tokens"])
    assert result["decoder_tokens"][0] == "<pad>"  # the decoder start token
    assert result["shapes"] == {
        "encoder_attention": [2, 4, source, source],
        "decoder_attention": [2, 4, target, target],
        "cross_attention": [2, 4, target, source],
    }
    assert max(result["row_sums"]) < 1e-5


@pytest.fixture(scope="module")
def translate(hub_tiny_model):
    model, tokenizer = hub_tiny_model
    return TranslationPipeline(model=model, tokenizer=tokenizer)


def test_attention_weights_equal_those_of_step_by_step_decoding(translate, hub_tiny_model):
    """The teacher-forced pass gives exactly the weights generate() computes one step at a time."""
    model, tokenizer = hub_tiny_model
    inputs = tokenizer(SENTENCES[0], return_tensors="pt")
    steps = model.generate(
        **inputs, num_beams=1, max_new_tokens=8, output_attentions=True, return_dict_in_generate=True
    )
    weights = translate(SENTENCES[0], num_beams=1, max_new_tokens=8, return_attentions=True)[0]["attentions"]
    assert len(weights["decoder_tokens"]) == len(steps.cross_attentions)
    for step, (cross, self_attention) in enumerate(zip(steps.cross_attentions, steps.decoder_attentions)):
        for layer in range(model.config.decoder_layers):
            torch.testing.assert_close(weights["cross_attention"][layer, :, step], cross[layer][0, :, -1], atol=1e-5, rtol=0)
            torch.testing.assert_close(
                weights["decoder_attention"][layer, :, step, : step + 1], self_attention[layer][0, :, -1], atol=1e-5, rtol=0
            )
    # Causal: no position attends to a later one.
    assert torch.all(weights["decoder_attention"].triu(1) == 0)


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ([], ValueError, "empty"),
        (42, TypeError, "must be a string"),
        (["fine", None], TypeError, r"inputs\[1\]"),
        ([b"bytes"], TypeError, "must be a string"),
    ],
)
def test_bad_input_is_refused_clearly(translate, bad, error, message):
    with pytest.raises(error, match=message):
        translate(bad)


def test_too_long_text_is_truncated_with_a_warning_or_refused(translate):
    tokenizer = translate.tokenizer
    old_limit = tokenizer.model_max_length
    tokenizer.model_max_length = 16
    try:
        long_text = " ".join(["And the earth was without form, and void."] * 6)
        with pytest.warns(UserWarning, match="truncated to the model's limit of 16 tokens"):
            result = translate(long_text, num_beams=1, max_new_tokens=4)
        assert result[0]["translation_text"] is not None
        # transformers 4's spellings: a TruncationStrategy's name truncates as True does
        with pytest.warns(UserWarning, match="truncated"):
            assert translate(long_text, num_beams=1, max_new_tokens=4, truncation="longest_first") == result
        for refuse in (False, "do_not_truncate"):
            with pytest.raises(ValueError, match="at most 16"):
                translate(long_text, truncation=refuse)
        with pytest.raises(ValueError, match="`truncation` must be True, False"):
            translate(long_text, truncation="only_second")
    finally:
        tokenizer.model_max_length = old_limit


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_beams=0), "`num_beams` must be a positive integer; got 0"),
        (dict(num_beams=2.5), "`num_beams` must be a positive integer; got 2.5"),
        (dict(max_new_tokens=0), "`max_new_tokens` must be a positive integer; got 0"),
        (dict(length_penalty=float("nan")), "`length_penalty` must be a finite number"),
    ],
)
def test_bad_generation_options_are_refused_before_translating(translate, monkeypatch, options, message):
    # Refused before the model runs, never an error deep in transformers' beam search.
    monkeypatch.setattr(translate.model, "generate", lambda *a, **k: pytest.fail("the model was run"))
    with pytest.raises(ValueError, match=message):
        translate(SENTENCES[:2], **options)


def test_blank_lines_translate_to_empty_strings_and_leave_their_batch_alone(translate):
    """A blank line costs nothing but itself: the other lines of its batch are translated as alone."""
    lines = [SENTENCES[0], "", SENTENCES[1], "  \t ", SENTENCES[2]]
    alone = [translate(line)[0] for line in SENTENCES]
    with pytest.warns(UserWarning, match="empty or blank text translates to the empty string"):
        batched = translate(lines, batch_size=3)
    assert batched == [alone[0], {"translation_text": ""}, alone[1], {"translation_text": ""}, alone[2]]
    with pytest.warns(UserWarning, match="empty or blank"):
        assert translate("   ") == [{"translation_text": ""}]
    with pytest.warns(UserWarning, match="empty or blank"):  # a batch with nothing to translate runs no model
        assert translate(["", " "], batch_size=2) == [{"translation_text": ""}] * 2
    model = translate.model
    with pytest.warns(UserWarning, match="empty or blank"):
        ids = translate(["", SENTENCES[1]], batch_size=2, return_tensors=True, num_beams=2, num_return_sequences=2)[0]
    start, eos = model.generation_config.decoder_start_token_id, model.generation_config.eos_token_id
    assert [r["translation_token_ids"].tolist() for r in ids] == [[start, eos]] * 2


def test_return_tensors_gives_the_generated_ids(translate, hub_tiny_model):
    model, tokenizer = hub_tiny_model
    texts = [r["translation_text"] for r in translate(SENTENCES, batch_size=2)]
    only_ids = translate(SENTENCES, batch_size=2, return_tensors=True)
    assert all(set(r) == {"translation_token_ids"} for r in only_ids)  # transformers 4: the ids instead of the text
    ids = [r["translation_token_ids"] for r in only_ids]
    assert [tokenizer.decode(i, skip_special_tokens=True) for i in ids] == texts
    for sentence, row in zip(SENTENCES, ids):  # what generate() returns for the sentence alone, without padding
        torch.testing.assert_close(row, model.generate(**tokenizer(sentence, return_tensors="pt"))[0])
        assert row[0] == model.generation_config.decoder_start_token_id and row[-1] == tokenizer.eos_token_id
    both = translate(SENTENCES, batch_size=2, return_tensors=True, return_text=True)
    assert [r["translation_text"] for r in both] == texts
    assert all(torch.equal(r["translation_token_ids"], i) for r, i in zip(both, ids))
    # return_text=False alone asks for the ids; transformers 4's return_type: 0 ids, 1 text
    for ids_only in (dict(return_text=False), dict(return_type=0)):
        assert all(torch.equal(r["translation_token_ids"], i) and len(r) == 1 for r, i in zip(translate(SENTENCES, **ids_only), ids))
    assert [r["translation_text"] for r in translate(SENTENCES, return_type=1, return_text=None)] == texts
    with pytest.raises(ValueError, match="nothing to return"):
        translate(SENTENCES[0], return_text=False, return_tensors=False)


def test_clean_up_tokenization_spaces_is_that_of_decode(translate, monkeypatch):
    tokenizer = translate.tokenizer
    spaced = "Dios dijo , Sea la luz ."
    fixed = [0, *tokenizer(spaced, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    monkeypatch.setattr(translate.model, "generate", lambda input_ids, **_: torch.tensor([fixed] * input_ids.size(0)))
    # Recent transformers skip the clean-up for BPE tokenizers unless told to clean up all the same.
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True, raising=False)
    assert translate(SENTENCES[0]) == [{"translation_text": spaced}]  # transformers 4's default: False
    assert translate(SENTENCES[0], clean_up_tokenization_spaces=False) == [{"translation_text": spaced}]
    assert translate(SENTENCES[:2], clean_up_tokenization_spaces=True) == [{"translation_text": "Dios dijo, Sea la luz."}] * 2


def test_num_return_sequences_gives_a_list_per_text(translate, hub_tiny_model):
    model, tokenizer = hub_tiny_model
    single = translate(SENTENCES[1], num_beams=4, num_return_sequences=2, return_tensors=True, return_text=True)
    assert len(single) == 2 and single[0]["translation_text"] != single[1]["translation_text"]
    by_hand = model.generate(**tokenizer(SENTENCES[1], return_tensors="pt"), num_beams=4, num_return_sequences=2)
    assert [r["translation_text"] for r in single] == tokenizer.batch_decode(by_hand, skip_special_tokens=True)
    assert single[0]["translation_text"] == translate(SENTENCES[1], num_beams=4)[0]["translation_text"]  # the best first

    batched = translate(SENTENCES, batch_size=2, num_beams=4, num_return_sequences=2, return_attentions=True)
    assert [len(results) for results in batched] == [2, 2, 2]
    assert batched[1][0]["translation_text"] == single[0]["translation_text"]
    for results in batched:
        assert results[0]["translation_text"] != results[1]["translation_text"]
        for result in results:  # each sequence has the attention weights behind it
            assert result["attentions"]["decoder_pieces"][0] == "<pad>"
            assert "".join(result["attentions"]["decoder_pieces"][1:]).strip() == result["translation_text"]
    with pytest.raises(ValueError, match="`num_return_sequences` must be a positive integer; got 0"):
        translate(SENTENCES[0], num_return_sequences=0)


def test_stop_sequence_ends_generation_at_its_first_token(translate):
    tokenizer = translate.tokenizer
    ids = translate(SENTENCES[0], num_beams=1, return_tensors=True)[0]["translation_token_ids"].tolist()
    stop = next(i for i in ids[2:-1] if tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i])
    stopped = translate(SENTENCES[0], num_beams=1, return_tensors=True, stop_sequence=tokenizer.decode([stop]))
    assert stopped[0]["translation_token_ids"].tolist() == ids[: ids.index(stop) + 1]


def test_readable_pieces_join_to_the_decoded_text(hub_tiny_model):
    """Byte-level tokens become the text they stand for; a character split over tokens goes to the last of them."""
    _, tokenizer = hub_tiny_model
    ids = tokenizer(ACCENTED + " 漢字 😀")["input_ids"]
    pieces = readable_pieces(tokenizer, ids)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert len(pieces) == len(ids) and pieces[-1] == "</s>"
    assert "".join(pieces[:-1]) == tokenizer.decode(ids, skip_special_tokens=True) == ACCENTED + " 漢字 😀"
    assert any("Ã" in token for token in tokens) and not any("Ã" in piece or "Ġ" in piece for piece in pieces)
    emoji = pieces.index("😀")  # 4 bytes, one token each in this 600-token vocabulary
    assert tokens[emoji - 3: emoji + 1] == ["ð", "Ł", "ĺ", "Ģ"] and pieces[emoji - 3: emoji] == ["", "", ""]


def test_the_pipeline_gives_readable_pieces_and_keeps_ids_and_raw_tokens(hub_tiny_model):
    model, tokenizer = hub_tiny_model
    result = TranslationPipeline(model=model, tokenizer=tokenizer)(ACCENTED, num_beams=1, max_new_tokens=8, return_attentions=True)[0]
    weights = result["attentions"]
    source_ids = tokenizer(ACCENTED)["input_ids"]
    assert weights["encoder_ids"] == source_ids
    assert weights["encoder_tokens"] == tokenizer.convert_ids_to_tokens(source_ids)  # raw, as bertviz takes them
    assert weights["encoder_pieces"] == readable_pieces(tokenizer, source_ids)
    assert weights["decoder_pieces"][0] == "<pad>" and len(weights["decoder_pieces"]) == len(weights["decoder_ids"])
    assert weights["decoder_attention"].shape[-1] == len(weights["decoder_ids"])
