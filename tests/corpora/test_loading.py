"""What the loader makes of a name: a path that does not exist, a name that is nothing here."""

from __future__ import annotations

import datasets
import pytest

from vanilla_transformer.corpora import load_translation_dataset


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_translation_dataset(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_translation_dataset(str(tmp_path / "nope.jsonl"))


def test_unknown_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="not an embedded corpus"):
        load_translation_dataset("surely-not-a-dataset-xyz")
