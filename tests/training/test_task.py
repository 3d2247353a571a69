"""The task's inputs (training/task.py): the pairs tokenised, what cannot be trained on dropped and counted, the
work shared out among processes."""

from pathlib import Path

import datasets
import pytest

from vanilla_transformer.tokenizer import train_tokenizer
from vanilla_transformer.training.task import encode_texts, tokenize_pairs


@pytest.fixture(scope="module")
def tokenizer():
    words = ["in the beginning", "god created", "the heaven and the earth", "en el principio", "creó dios"]
    return train_tokenizer(words * 20, vocab_size=300)


def pairs(rows):
    return datasets.Dataset.from_list([{"translation": {"en": en, "es": es}} for en, es in rows])


def test_tokenize_drops_empty_and_long_pairs_and_counts_them(tokenizer):
    data = pairs([("in the beginning", "en el principio"), ("", "creó"), ("god", "   "[:0]),
                  ("the heaven and the earth " * 20, "creó")])
    split = tokenize_pairs(data, tokenizer, "en", "es", max_length=16)
    assert (len(split.dataset), split.total, split.empty, split.too_long) == (1, 4, 2, 1)
    row = split.dataset[0]
    assert row["input_ids"][-1] == tokenizer.eos_token_id and row["labels"][-1] == tokenizer.eos_token_id
    assert row["length"] == max(len(row["input_ids"]), len(row["labels"]))
    assert "1 of 4 pairs kept; 2 dropped with an empty or blank side, 1 dropped" in split.describe("train", 16, False)

    cut = tokenize_pairs(data, tokenizer, "en", "es", max_length=16, truncate=True, keep_references=True)
    assert (len(cut.dataset), cut.too_long) == (2, 1)
    assert len(cut.dataset[1]["input_ids"]) == 16 and cut.dataset[1]["input_ids"][-1] == tokenizer.eos_token_id
    assert cut.dataset[1]["reference"] == "creó"
    # The lengths batches are built from are those of the kept rows (read through Arrow, past the selection).
    assert cut.lengths.tolist() == [len(cut.dataset[0]["labels"]), 16] and split.lengths.tolist() == [row["length"]]


def test_pairs_with_a_side_of_white_space_only_are_dropped_and_counted(tokenizer):
    blank = ["   ", "\t", "\n", "\u3000 \u00a0"]  # spaces, a tab, a line end, an ideographic and a no-break space
    data = pairs([("in the beginning", "en el principio"), *((text, "creó") for text in blank), ("god", " \t ")])
    split = tokenize_pairs(data, tokenizer, "en", "es", max_length=16, keep_references=True)
    assert (len(split.dataset), split.total, split.empty) == (1, 6, 5)
    assert split.dataset[0]["reference"] == "en el principio"
    assert "1 of 6 pairs kept; 5 dropped with an empty or blank side" in split.describe("train", 16, False)


def test_pairs_that_tokenise_to_nothing_are_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="no pairs left in the train split.*2 dropped with an empty or blank side"):
        tokenize_pairs(pairs([("", "x"), ("y", "")]), tokenizer, "en", "es", 16, name="train")


def test_tokenising_with_several_processes_gives_the_same_split_and_a_later_load_reuses_its_cache(
        tmp_path, write_synthetic_task, monkeypatch):
    """`num_proc` workers tokenise a file-backed split into the map cache with the tokenizer just trained (as a
    first run does); the same files and that tokenizer loaded from its folder (as a resumed or repeated run loads
    them) read it back: no new cache file, the same rows. Other options, or another tokenizer, tokenise anew."""
    from transformers import AutoTokenizer

    from vanilla_transformer.corpora import load_translation_dataset

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    data = write_synthetic_task(tmp_path / "data", n_train=600, n_eval=4)
    trained = train_tokenizer([" ".join(chr(c) for c in range(97, 109))] * 10, vocab_size=300, output_dir=tmp_path / "tok")
    other = train_tokenizer([" ".join(chr(c) for c in range(97, 109))] * 10, vocab_size=270, output_dir=tmp_path / "tok2")

    def tokenise(num_proc, tokenizer=None, max_length=16):
        train = load_translation_dataset(str(data))["train"]
        cache = Path(train.cache_files[0]["filename"]).parent
        before = set(cache.glob("cache-*.arrow"))
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(tmp_path / "tok")
        split = tokenize_pairs(train, tokenizer, "src", "tgt", max_length, num_proc=num_proc)
        return len(set(cache.glob("cache-*.arrow")) - before), split

    (new_first, first), (new_again, again), (_, one_process) = tokenise(2, trained), tokenise(2), tokenise(None)
    assert new_first == 2  # one cache file per worker
    assert new_again == 0
    assert first.dataset["length"][:] == again.dataset["length"][:] == one_process.dataset["length"][:]
    assert first.dataset["labels"][:] == one_process.dataset["labels"][:] and first.total == 600
    assert tokenise(2, max_length=12)[0] == 2 and tokenise(2, other)[0] == 2


def test_tokenization_workers_scale_with_the_corpus(monkeypatch):
    from vanilla_transformer.training import task as task_module

    monkeypatch.delenv(task_module.NUM_PROC_ENV, raising=False)
    monkeypatch.setattr(task_module.os, "sched_getaffinity", lambda _: set(range(4)), raising=False)
    assert task_module.tokenization_workers(1000) is None
    assert task_module.tokenization_workers(3 * task_module.PAIRS_PER_WORKER) == 3
    assert task_module.tokenization_workers(100 * task_module.PAIRS_PER_WORKER) == 4
    monkeypatch.setenv(task_module.NUM_PROC_ENV, "2")
    assert task_module.tokenization_workers(10) == 2
    monkeypatch.setenv(task_module.NUM_PROC_ENV, "two")
    with pytest.raises(ValueError, match="VANILLA_TRANSFORMER_NUM_PROC must be a whole number.*'two'"):
        task_module.tokenization_workers(10)


def test_encoding_through_the_rust_tokenizer_gives_transformers_ids():
    tokenizer = train_tokenizer(["the cat sat on the mat", "el gato se sentó"] * 20, vocab_size=300)
    texts = ["the cat sat", "", "  el gato — ¿se sentó?  ", "ünïcödé 語"]
    assert encode_texts(tokenizer, texts) == tokenizer(texts)["input_ids"]
    tokenizer.backend_tokenizer.enable_truncation(2)  # a backend that cuts on its own: transformers' call decides
    assert encode_texts(tokenizer, texts) == tokenizer(texts)["input_ids"]
