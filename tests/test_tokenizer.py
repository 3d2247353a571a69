"""The joint BPE tokenizer: exact round trip on real text, special tokens, save/load, bad input."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from vanilla_transformer.cli import main
from vanilla_transformer.corpora import iter_texts, load_translation_dataset
from vanilla_transformer.tokenizer import (
    check_appends_eos,
    read_text_files,
    save_tokenizer,
    train_tokenizer,
)

EDGE_CASES = [
    "In the beginning, “God” said: ‘Let there be light’ — and it’s so…",
    "  two leading spaces, three   inside, two trailing  ",
    " ",
    "tabs\tand\nnewlines\r\nand a form feed\f",
    "emoji 😀 👍🏽 👨‍👩‍👧 and flags 🇪🇸",
    "日本語のテキスト、中文句子。한국어",
    "accents é ñ ü Ç œ, decomposed é ñ (NFD), ligature ﬁ, full-width ＡＢＣ",
    "SentencePiece's own marker ▁ and GPT-2's Ġ are plain text here",
    "",
]


@pytest.fixture(scope="module")
def corpora():
    return {name: load_translation_dataset(name) for name in ("bible-en-es", "bible-en-fr")}


@pytest.fixture(scope="module")
def tokenizer(corpora):
    """One en+es+fr vocabulary, learnt from the train splits of both embedded corpora."""
    texts = [*iter_texts(corpora["bible-en-es"]), *iter_texts(corpora["bible-en-fr"], ["fr"])]
    return train_tokenizer(texts)


def held_out_lines(corpora):
    return [text for data in corpora.values() for split in ("validation", "test") for text in iter_texts(data, splits=(split,))]


def round_trip(tokenizer, text):
    return tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True)


def test_round_trip_is_exact_on_every_held_out_line(tokenizer, corpora):
    lines = held_out_lines(corpora)
    assert len(lines) > 4900
    ids = tokenizer(lines)["input_ids"]
    decoded = tokenizer.batch_decode(ids, skip_special_tokens=True)
    failures = [(line, out) for line, out in zip(lines, decoded) if line != out]
    assert not failures, failures[:5]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_round_trip_is_exact_on_hard_text(tokenizer, text):
    assert round_trip(tokenizer, text) == text


def test_typed_special_tokens_are_the_one_exception(tokenizer):
    # Like every transformers tokenizer, literal "<s>"/"</s>" in text are read as the special tokens
    # (and so dropped by skip_special_tokens); split_special_tokens=True reads them as plain text.
    text = "<s> and </s> typed by a user"
    assert round_trip(tokenizer, text) == " and  typed by a user"
    ids = tokenizer(text, split_special_tokens=True)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.slow
def test_no_unknown_tokens_on_the_corpora(tokenizer, corpora):
    texts = [text for data in corpora.values() for text in iter_texts(data, splits=("train", "validation", "test"))]
    # The backend's batch encoder: 3x faster than the Python wrapper, same ids.
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(texts + EDGE_CASES, add_special_tokens=False)
    assert sum(e.ids.count(tokenizer.unk_token_id) for e in encodings) == 0


def test_special_token_ids_come_first(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    assert len(tokenizer) == 8000
    assert tokenizer.padding_side == "right" and tokenizer.model_max_length == 1024


def test_eos_is_appended_and_text_target_gives_labels(tokenizer):
    batch = tokenizer("In the beginning.", text_target="En el principio.")
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"][-1] == batch["labels"][-1] == tokenizer.eos_token_id
    assert tokenizer.bos_token_id not in batch["input_ids"]
    assert batch["input_ids"][:-1] == tokenizer("In the beginning.", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(batch["labels"]) == "En el principio.</s>"


def test_padding_and_truncation_give_the_lengths_asked_for(tokenizer, corpora):
    lines = held_out_lines(corpora)[:64]
    fixed = tokenizer(lines, padding="max_length", truncation=True, max_length=16)
    assert {len(row) for row in fixed["input_ids"]} == {16}
    assert all(row[-1] in (tokenizer.eos_token_id, tokenizer.pad_token_id) for row in fixed["input_ids"])
    longest = tokenizer(lines, padding=True)
    width = max(len(tokenizer(line)["input_ids"]) for line in lines)
    assert {len(row) for row in longest["input_ids"]} == {width}
    short = tokenizer(["Amen.", "Jesus wept, and the people answered him."], padding=True)
    row, mask = short["input_ids"][0], short["attention_mask"][0]
    n = sum(mask)
    assert mask == [1] * n + [0] * (len(row) - n)  # padding on the right
    assert row[n - 1] == tokenizer.eos_token_id and set(row[n:]) == {tokenizer.pad_token_id}


def test_save_and_load_give_identical_encodings(tokenizer, corpora, tmp_path):
    folder = save_tokenizer(tokenizer, tmp_path / "tok")
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(folder))
    lines = held_out_lines(corpora)[:500] + EDGE_CASES
    expected = tokenizer(lines)["input_ids"]
    for loaded in (PreTrainedTokenizerFast.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)):
        assert type(loaded) is type(tokenizer)
        assert loaded(lines)["input_ids"] == expected
        assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2, 3)
        assert loaded.batch_decode(expected, skip_special_tokens=True) == lines


@pytest.mark.slow
def test_autotokenizer_loads_offline_without_the_package(tokenizer, tmp_path):
    folder = save_tokenizer(tokenizer, tmp_path / "tok")
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["vanilla_transformer"] = None  # no custom code may be needed
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained({str(folder)!r})
        text = "Y dijo Dios: “Sea la luz” 😀"
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text
        print(ids)
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == tokenizer("Y dijo Dios: “Sea la luz” 😀")["input_ids"]


def test_extra_special_tokens_follow_the_core_four(tmp_path):
    tok = train_tokenizer(["hello world"] * 10 + ["hola mundo"] * 10, vocab_size=300, special_tokens=["<2es>", "<2fr>"])
    assert tok.convert_tokens_to_ids(["<2es>", "<2fr>"]) == [4, 5]
    ids = tok("<2es> hello world")["input_ids"]
    assert ids[0] == 4 and tok.decode(ids, skip_special_tokens=True) == " hello world"


def test_dataset_input_and_language_choice(corpora):
    small = corpora["bible-en-fr"]["validation"]
    tok = train_tokenizer(small, languages=["fr"], vocab_size=400)
    assert len(tok) == 400
    with pytest.raises(ValueError, match=r"\['en', 'fr'\]"):
        train_tokenizer(small, languages=["es"])


def assert_nothing_written(parent, name):
    assert not (parent / name).exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(f".{name}.")], "staging folder left behind"


def test_bad_input_raises_clear_errors_and_writes_nothing(tmp_path):
    out = tmp_path / "tok"
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer([], output_dir=out)
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer(["", "   "], output_dir=out)
    with pytest.raises(ValueError, match=r"vocab_size=200 .*byte alphabet \(256\).*special tokens \(4\)"):
        train_tokenizer(["hello"], vocab_size=200, output_dir=out)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        train_tokenizer(read_text_files([tmp_path / "missing.txt"]), output_dir=out)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("crió\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt, line 1: byte 0xf3 at column 4 is not UTF-8"):
        train_tokenizer(read_text_files([latin1]), output_dir=out)
    assert_nothing_written(tmp_path, "tok")


def test_a_failed_save_leaves_no_folder(tmp_path, monkeypatch):
    tok = train_tokenizer(["hello world"] * 5, vocab_size=270)

    def save_half_then_fail(self, folder, **kwargs):
        (folder / "tokenizer.json").write_text("{")
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", save_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_tokenizer(tok, tmp_path / "tok")
    assert_nothing_written(tmp_path, "tok")


def test_saving_into_a_model_folder_keeps_its_files(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    tok = train_tokenizer(["hello world"] * 5, vocab_size=270, output_dir=model_dir)
    assert sorted(os.listdir(model_dir)) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert AutoTokenizer.from_pretrained(model_dir)("hello")["input_ids"] == tok("hello")["input_ids"]
    assert_nothing_written(tmp_path, "model-absent")


def test_cli_trains_and_saves(tmp_path, corpora, capsys):
    data = tmp_path / "pairs.jsonl.gz"
    with gzip.open(data, "wt", encoding="utf-8") as f:
        for row in corpora["bible-en-es"]["validation"]:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    out = tmp_path / "tok"
    assert main(["train-tokenizer", "--dataset", str(data), "--vocab-size", "600", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "600 tokens" in printed and "en " in printed and "es " in printed
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 600 and tok.eos_token_id == 2

    text_file = tmp_path / "lines.txt"
    text_file.write_text("".join(t + "\n" for t in iter_texts(corpora["bible-en-fr"], ["fr"], splits=("test",))))
    out2 = tmp_path / "tok2"
    assert main(["train-tokenizer", "--text-files", str(text_file), "--vocab-size", "500", "--output-dir", str(out2)]) == 0
    assert len(AutoTokenizer.from_pretrained(out2)) == 500


def test_cli_refuses_the_folder_of_a_trained_model(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    with pytest.raises(SystemExit) as stop:
        main(["train-tokenizer", "--dataset", "bible-en-es", "--vocab-size", "300", "--output-dir", str(model)])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"vanilla-transformer train-tokenizer: error: --output-dir {model} holds a trained model (model.safetensors) "
        "whose tokenizer a new vocabulary would replace; give another --output-dir")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_cli_bad_input_is_a_usage_error(tmp_path, capsys):
    out = tmp_path / "tok"
    with pytest.raises(SystemExit) as exit_info:
        main(["train-tokenizer", "--dataset", "bible-en-fr", "--target-lang", "es", "--output-dir", str(out)])
    assert exit_info.value.code == 2
    assert "['en', 'fr']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train-tokenizer", "--text-files", str(tmp_path / "nope.txt"), "--output-dir", str(out)])
    assert "nope.txt" in capsys.readouterr().err
    assert_nothing_written(tmp_path, "tok")


@pytest.fixture(scope="module")
def unigram(corpora):
    """SentencePiece's unigram model over bytes, learnt from the English and French validation splits."""
    return train_tokenizer(iter_texts(corpora["bible-en-fr"], splits=("validation",)), vocab_size=1000, model_type="unigram")


@pytest.mark.parametrize("text", EDGE_CASES)
def test_unigram_round_trip_is_exact_on_hard_text(unigram, text):
    assert round_trip(unigram, text) == text


def test_unigram_is_lossless_ends_with_eos_and_loads_as_a_stock_tokenizer(unigram, corpora, tmp_path):
    held_out = list(iter_texts(corpora["bible-en-fr"], splits=("test",)))
    assert all(round_trip(unigram, text) == text for text in held_out)
    assert not any(unigram.unk_token_id in unigram(text)["input_ids"] for text in held_out)
    assert [unigram.convert_ids_to_tokens(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    check_appends_eos(unigram, "unigram")
    save_tokenizer(unigram, tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "Unigram"
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(held_out[:20])["input_ids"] == unigram(held_out[:20])["input_ids"]
    with pytest.raises(ValueError, match="model_type must be one of bpe, unigram; got 'wordpiece'"):
        train_tokenizer(["hello"], model_type="wordpiece")


def test_a_tokenizer_that_appends_no_eos_is_refused_by_name(tokenizer, tmp_path):
    check_appends_eos(tokenizer, "the trained one")
    saved = json.loads(tokenizer.backend_tokenizer.to_str())
    saved["post_processor"] = None  # e.g. a tokenizer.json made for a decoder-only model
    (tmp_path / "tokenizer.json").write_text(json.dumps(saved), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    without = AutoTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^--tokenizer /x: the tokenizer does not append </s> to an encoded sentence"):
        check_appends_eos(without, "--tokenizer /x")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))
    with pytest.raises(ValueError, match=r"^--tokenizer /x: the tokenizer has no end-of-sequence token"):
        check_appends_eos(AutoTokenizer.from_pretrained(tmp_path), "--tokenizer /x")


def test_cli_learns_a_unigram_vocabulary_from_plain_parallel_text(tmp_path, corpora, capsys):
    """A fr->en folder as OPUS ships it: train.fr and train.en, one sentence a line."""
    for lang in ("fr", "en"):
        (tmp_path / f"train.{lang}").write_text(
            "".join(text + "\n" for text in iter_texts(corpora["bible-en-fr"], [lang], splits=("validation",))),
            encoding="utf-8")
    out = tmp_path / "tok"
    assert main(["train-tokenizer", "--dataset", str(tmp_path), "--source-lang", "fr", "--target-lang", "en",
                 "--model-type", "unigram", "--vocab-size", "800", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "800 tokens" in printed and "fr " in printed and "en " in printed
    assert json.loads((out / "tokenizer.json").read_text())["model"]["type"] == "Unigram"
