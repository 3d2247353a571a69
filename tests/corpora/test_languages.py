"""A data set's languages and its sides as strings, on the embedded corpora."""

from __future__ import annotations

import pytest

from vanilla_transformer.corpora import iter_texts, load_translation_dataset, text_pairs


def test_iter_texts_reads_both_sides_of_train_only():
    data = load_translation_dataset("bible-en-es")
    texts = list(iter_texts(data))
    assert len(texts) == 2 * len(data["train"])
    assert texts[0] == data["train"][0]["translation"]["en"]
    assert texts[len(data["train"])] == data["train"][0]["translation"]["es"]
    assert len(list(iter_texts(data, ["es"], splits=("validation",)))) == len(data["validation"])


def test_missing_language_lists_existing_keys():
    with pytest.raises(ValueError, match=r"target_lang='de'.*\['en', 'es'\]"):
        load_translation_dataset("bible-en-es", target_lang="de")
    data = load_translation_dataset("bible-en-fr")
    with pytest.raises(ValueError, match=r"\['en', 'fr'\]"):
        text_pairs(data["test"], "en", "es")
    with pytest.raises(ValueError, match=r"\['en', 'fr'\]"):
        list(iter_texts(data, ["de"]))
