"""Export to CTranslate2: the same numbers and the same translations as our model, from a folder that
works on its own. (What CTranslate2 can and cannot express: vanilla_transformer/export/ctranslate2.py.)"""

import json
import os
import re
import shutil
import sys

import pytest
import torch

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.cli import main
from vanilla_transformer.corpora import load_translation_dataset, text_pairs
from vanilla_transformer.export.ctranslate2 import CTranslate2Translator, export_ctranslate2
from vanilla_transformer.inference import load_model, translate_texts

MAX_NEW_TOKENS = 24
# CTranslate2's beam search, in our generate: |Y|^α and stopping once 4 hypotheses have ended.
BEAM4 = dict(num_beams=4, length_penalty=0.6, early_stopping=True, length_penalty_style="transformers")


@pytest.fixture(scope="module")
def verses():
    sources, _ = text_pairs(load_translation_dataset("bible-en-es")["test"], "en", "es")
    return sources[:16]


def ours_generate(model, tokenizer, texts, **options) -> list[list[int]]:
    """Our output ids per text (the start token and the first </s> onwards dropped)."""
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        sequences = model.generate(**batch, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, **options)
    rows = [row[1:] for row in sequences.tolist()]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    return [row[: row.index(eos)] if eos in row else [t for t in row if t != pad] for row in rows]


@pytest.mark.parametrize("norm_position", ["post", "pre"])
@pytest.mark.parametrize("position_encoding", ["sinusoidal", "learned"])
def test_float32_export_gives_our_greedy_and_beam_outputs(norm_position, position_encoding, train_tiny, verses, tmp_path):
    model, tokenizer = train_tiny(norm_position=norm_position, position_encoding=position_encoding,
                                  max_position_embeddings=256)
    translator = CTranslate2Translator(export_ctranslate2(model, tokenizer, tmp_path / "ct2"), device="cpu")
    sources = translator.encode(verses)
    assert sources == [tokenizer.convert_ids_to_tokens(tokenizer(v)["input_ids"]) for v in verses]
    lengths = []
    for ours_options, ct2_options in ((dict(num_beams=1), dict(num_beams=1)),
                                      (BEAM4, dict(num_beams=4, length_penalty=0.6))):
        ours = ours_generate(model, tokenizer, verses, **ours_options)
        assert len({token for row in ours for token in row}) >= 8  # real translations, not one token repeated
        assert translator.translate_tokens(sources, max_new_tokens=MAX_NEW_TOKENS, **ct2_options) == ours
        lengths += map(len, ours)
    assert min(lengths) < MAX_NEW_TOKENS - 1 and max(lengths) == MAX_NEW_TOKENS  # both ends: </s> and the cap


SETTINGS = [
    dict(),
    dict(norm_position="pre", position_encoding="learned", max_position_embeddings=256),
    dict(activation="gelu", tie_word_embeddings=False, scale_embedding=False, layer_norm_eps=1e-6),
    dict(attention_score="dot", decoder_start_token_id=1),
]


@pytest.mark.parametrize("overrides", SETTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "paper")
def test_every_setting_gives_our_log_probabilities(overrides, tiny_corpus, verses, tmp_path):
    """Random weights, every token of a teacher-forced target scored by both: the mapping of each option."""
    tokenizer, _ = tiny_corpus
    torch.manual_seed(1)
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), **overrides)
    model = VanillaTransformerForConditionalGeneration(config).eval()
    with torch.no_grad():  # biases and LayerNorm gains away from their initial 0 and 1, so that they count
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.2)
    translator = CTranslate2Translator(export_ctranslate2(model, tokenizer, tmp_path / "ct2"), device="cpu")
    sources, targets = verses[:4], [tokenizer.convert_ids_to_tokens(ids) for ids in tokenizer(verses[4:8])["input_ids"]]
    scored = translator.translator.score_batch(translator.encode(sources), [t[:-1] for t in targets])
    batch = tokenizer(sources, padding=True, return_tensors="pt")
    labels = tokenizer(verses[4:8], padding=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        log_probs = model(**batch, labels=labels).logits.log_softmax(-1)
    for row, (result, target) in enumerate(zip(scored, targets)):
        expected = log_probs[row, torch.arange(len(target)), labels[row, : len(target)]]
        torch.testing.assert_close(torch.tensor(result.log_probs), expected, rtol=0, atol=2e-4)


@pytest.mark.parametrize("score", ["general", "additive", "cosine", "location"])
def test_a_score_function_ctranslate2_cannot_compute_is_refused(score, tiny_corpus, tmp_path):
    tokenizer, _ = tiny_corpus
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer),
                                                                                     attention_score=score))
    with pytest.raises(ValueError, match=f"cannot express `attention_score`='{score}'"):
        export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    assert list(tmp_path.iterdir()) == []


def test_bad_input_is_refused_and_a_failed_export_leaves_nothing(hub_tiny_model, monkeypatch, tmp_path):
    model, tokenizer = hub_tiny_model
    with pytest.raises(ValueError, match="`quantization` must be one of"):
        export_ctranslate2(model, tokenizer, tmp_path / "a", quantization="int4")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    with pytest.raises(ValueError, match="already exists and is not an empty folder"):
        export_ctranslate2(model, tokenizer, tmp_path / "taken")
    assert (tmp_path / "taken" / "file").read_text() == "mine"
    small = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=500))
    with pytest.raises(ValueError, match="must number the model's 500 embedding rows"):
        export_ctranslate2(small, tokenizer, tmp_path / "b")
    import vanilla_transformer.export.ctranslate2 as module

    monkeypatch.setattr(module, "_readme", lambda *args: 1 / 0)  # fails after model.bin was written
    with pytest.raises(ZeroDivisionError):
        export_ctranslate2(model, tokenizer, tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no folder, no staging left behind
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    with pytest.raises(ImportError, match=r"pip install 'vanilla-transformer\[ctranslate2\]'"):
        export_ctranslate2(model, tokenizer, tmp_path / "d")


@pytest.mark.slow
def test_the_exported_folder_translates_without_the_package(hub_tiny_folder, run_without_package, tmp_path):
    """The README's own example, run in a process where vanilla_transformer cannot be imported."""
    folder = export_ctranslate2(*load_model(hub_tiny_folder, "cpu"), tmp_path / "ct2")
    assert {"model.bin", "config.json", "shared_vocabulary.json", "tokenizer.json", "translation_options.json",
            "README.md"} == {p.name for p in folder.iterdir()}
    readme = (folder / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    printed = run_without_package(example, cwd=folder)
    expected = CTranslate2Translator(folder, device="cpu").translate(["Jesus wept.", "Love is patient."])
    assert printed.strip() == repr(expected)
    assert any(expected)
    options = json.loads((folder / "translation_options.json").read_text())
    assert options == {"beam_size": 4, "length_penalty": 0.6, "min_decoding_length": 0, "max_input_length": 1024,
                       "max_decoding_length": 1023, "max_length_offset": 50}
    config = json.loads((folder / "config.json").read_text())
    assert config["decoder_start_token"] == "<pad>" and not config["add_source_eos"]


@pytest.mark.parametrize("quantization", ["int8", "int8_float32"])
def test_a_quantized_export_leaves_the_model_it_was_given_untouched(hub_tiny_folder, tmp_path, quantization):
    model, tokenizer = load_model(str(hub_tiny_folder), "cpu")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    export_ctranslate2(model, tokenizer, tmp_path / "export", quantization)
    changed = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, before[name])]
    assert not changed


def test_export_translate_and_evaluate_from_the_command_line(hub_tiny_folder, hub_tiny_model, tmp_path, capsys):
    lines = ["In the beginning God created the heavens and the earth.", "", "Jesus wept."]
    greedy = ["--num-beams", "1", "--max-new-tokens", "12"]
    folders = {}
    for quantization in ("float32", "int8"):
        folders[quantization] = tmp_path / quantization
        assert main(["export", "--model", str(hub_tiny_folder), "--format", "ctranslate2", "--output-dir",
                     str(folders[quantization]), "--quantization", quantization]) == 0
        assert f"({quantization} weights" in capsys.readouterr().out
    sizes = {q: (folder / "model.bin").stat().st_size for q, folder in folders.items()}
    assert sizes["int8"] < 0.5 * sizes["float32"]

    assert main(["translate", "--engine", "ctranslate2", "--model", str(folders["float32"]), *greedy, *lines]) == 0
    model, tokenizer = hub_tiny_model
    assert capsys.readouterr().out.split("\n")[:-1] == translate_texts(model, tokenizer, lines, num_beams=1,
                                                                       max_new_tokens=12)
    assert main(["translate", "--engine", "ctranslate2", "--model", str(folders["int8"]), "Jesus wept."]) == 0
    assert capsys.readouterr().out.strip()

    hypotheses = {}
    for engine, folder in (("ctranslate2", folders["float32"]), ("transformers", hub_tiny_folder)):
        hypotheses[engine] = tmp_path / f"{engine}.txt"
        assert main(["evaluate", "--engine", engine, "--model", str(folder), "--dataset", "bible-en-es", "--max-samples", "8", *greedy,
                     "--hypotheses-out", str(hypotheses[engine])]) == 0
        out = capsys.readouterr().out
        assert "8 segments translated in" in out and f"({engine})" in out
    assert hypotheses["ctranslate2"].read_text() == hypotheses["transformers"].read_text()


@pytest.mark.parametrize("argv, message", [
    (["export", "--model", "{folder}", "--format", "ctranslate2", "--output-dir", "{taken}"], "not an empty folder"),
    (["export", "--model", "{folder}", "--format", "onnx", "--output-dir", "x"], "invalid choice: 'onnx'"),
    (["translate", "--engine", "ctranslate2", "--model", "{folder}", "x"], "is not a CTranslate2 export"),
    (["translate", "--engine", "ctranslate2", "--model", "{folder}", "x"],  # not the model's own folder, which is taken
     "write one with `vanilla-transformer export --model {folder} --format ctranslate2 --output-dir tiny-en-es-ct2`"),
    (["translate", "--engine", "ctranslate2", "--model", "{export}", "--device", "mps", "x"], "cpu, cuda or cuda:N"),
    # Each once a traceback (found by trying bad input from outside).
    (["translate", "--engine", "ctranslate2", "--model", "{export}", "--max-new-tokens", "4096", "x"],
     "`max_new_tokens` must be at most 1023 for this export (the longest output its model decodes); got 4096"),
    (["translate", "--engine", "ctranslate2", "--model", "{damaged:model.bin}", "x"], "CTranslate2 cannot load it:"),
    (["translate", "--engine", "ctranslate2", "--model", "{damaged:config.json}", "x"], "CTranslate2 cannot load it:"),
    (["translate", "--engine", "ctranslate2", "--model", "{damaged:tokenizer.json}", "x"],
     "tokenizer.json is not a tokenizer file this version can read"),
    (["translate", "--engine", "ctranslate2", "--model", "{damaged:translation_options.json}", "x"],
     "translation_options.json is damaged: not valid JSON"),
])
def test_bad_export_or_engine_input_is_a_usage_error(argv, message, hub_tiny_folder, hub_tiny_model, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    export = export_ctranslate2(*hub_tiny_model, tmp_path / "export")
    paths = {"folder": hub_tiny_folder, "taken": tmp_path / "taken", "export": export}
    for i, arg in enumerate(argv):
        if arg.startswith("{damaged:"):  # a copy of the export with one file cut short
            name = arg[len("{damaged:"):-1]
            damaged = shutil.copytree(export, tmp_path / "damaged")
            os.truncate(damaged / name, (damaged / name).stat().st_size // 2)
            argv = [*argv[:i], str(damaged), *argv[i + 1:]]
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(**paths) for arg in argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert message.format(**paths) in error.strip().splitlines()[-1] and "Traceback" not in error, error
