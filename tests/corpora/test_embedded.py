"""The corpora shipped inside the package, loaded by their short names."""

from __future__ import annotations

import pytest

from vanilla_transformer.corpora import (
    EMBEDDED_CORPORA,
    language_keys,
    load_translation_dataset,
    resolve_languages,
    text_pairs,
)


@pytest.mark.parametrize("name, pair", [("bible-en-es", ("en", "es")), ("bible-en-fr", ("en", "fr"))])
def test_embedded_corpora(name, pair):
    corpus = EMBEDDED_CORPORA[name]
    assert (corpus.source_lang, corpus.target_lang) == pair
    data = load_translation_dataset(name)
    assert set(data) == {"train", "validation", "test"}
    assert len(data["train"]) > 28_000 and len(data["validation"]) > 600 and len(data["test"]) > 600
    assert language_keys(data["train"]) == list(pair)
    assert resolve_languages(data["validation"]) == pair
    src, tgt = text_pairs(data["validation"], *pair)
    assert len(src) == len(tgt) == len(data["validation"])
    assert all(isinstance(s, str) and s for s in src + tgt)
