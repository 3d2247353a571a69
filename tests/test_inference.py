"""Translating with a loaded model: what `translate_texts` computes once and keeps."""


def test_longest_token_scans_the_vocabulary_once_per_tokenizer(hub_tiny_model, monkeypatch):
    # translate_texts scanned the vocabulary for every batch of a file, a tenth of the CLI's time on a trained model.
    from vanilla_transformer import inference

    _, tokenizer = hub_tiny_model
    tokenizer = __import__("copy").deepcopy(tokenizer)  # a tokenizer no other test has asked about
    scans = []
    scan = tokenizer.convert_tokens_to_string
    monkeypatch.setattr(tokenizer, "convert_tokens_to_string", lambda tokens: scans.append(1) or scan(tokens))
    first = inference.longest_token(tokenizer)
    assert len(scans) == len(tokenizer)
    assert [inference.longest_token(tokenizer) for _ in range(3)] == [first] * 3 and len(scans) == len(tokenizer)
    tokenizer.add_tokens(["<a-much-longer-token-than-any>"])
    assert inference.longest_token(tokenizer) > first  # a grown vocabulary is scanned again
