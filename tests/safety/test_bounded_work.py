"""Bounded work for every input: each limit checked before the work, output as it is made.

One test (or a few) per input and its limit, with the real thing: `vanilla-transformer` processes, a
real `serve` process and HTTP client, real files.
"""

import os
import select
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

import commands
from commands import CLI, UNBUFFERED as ENV
from vanilla_transformer.staging import STAGING_PREFIX

LONG_LINE = " ".join(["And the men of the city said unto him, Bring forth the man."] * 6)

run_cli = partial(commands.run_cli, timeout=600, env=ENV)


@pytest.fixture(scope="module")
def location_folder(train_tiny, tmp_path_factory):
    """A tiny model with location-based scores over at most 64 positions, saved as a folder."""
    model, tokenizer = train_tiny(steps=20, attention_score="location", location_max_length=64)
    folder = tmp_path_factory.mktemp("location")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --- Decoding a model of bounded length stops at its bound; one line too long costs that line alone ---


def test_translate_a_long_line_with_a_bounded_model_costs_nothing_else(location_folder, tmp_path):
    lines = tmp_path / "in.txt"
    lines.write_text(f"Jesus wept.\n{LONG_LINE}\nJesus wept.\n")
    result = run_cli("translate", "--model", location_folder, "--input-file", lines, "--num-beams", 1)
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout.split("\n")
    assert len(output) == 4 and output[0] == output[2] and output[3] == ""
    assert "truncated" in result.stderr


@pytest.fixture(scope="module")
def hub_tiny_ctranslate2(hub_tiny_model, tmp_path_factory):
    """The tiny model exported for CTranslate2 (`translate --engine ctranslate2`)."""
    pytest.importorskip("ctranslate2")
    from vanilla_transformer.export.ctranslate2 import export_ctranslate2

    return export_ctranslate2(*hub_tiny_model, tmp_path_factory.mktemp("ct2") / "tiny")


@pytest.mark.parametrize("engine", ["transformers", "ctranslate2"])
def test_translate_bounds_the_work_of_a_huge_line_before_tokenising_it(engine, request, tmp_path):
    # A line is cut to what the model reads before it is tokenised, not after: a 10 MB line would take minutes and
    # gigabytes; the CTranslate2 engine cuts it as early.
    folder = request.getfixturevalue("hub_tiny_folder" if engine == "transformers" else "hub_tiny_ctranslate2")
    sentence = "And the men of the city said unto him, Bring forth the man. "
    lines = tmp_path / "in.txt"
    lines.write_text(f"{sentence * 170_000}\n{sentence * 150}\n")  # 10 MB; its first 9 kB, past 1,024 tokens too
    measure = ("import resource, subprocess, sys; result = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "print(result.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
               "print(result.stdout, end=''); print(result.stderr, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", measure, *CLI, "translate", "--model", str(folder), "--engine", engine,
                             "--input-file", str(lines), "--num-beams", "1"], capture_output=True, text=True, env=ENV,
                            timeout=600)
    status, peak_kib = map(int, result.stdout.split("\n")[0].split())
    translations = result.stdout.split("\n")[1:]
    assert status == 0, result.stderr[-2000:]
    assert peak_kib < 1024 * 1024, f"{peak_kib / 1024:.0f} MB for one long line"  # the model's own run takes ~0.5 GB
    assert "line 1 is 10,200,000 characters long" in result.stderr and "truncated to the model's limit of 1024" in result.stderr
    assert len(translations) == 3 and translations[0] == translations[1] != ""  # both read the same first 1,024 tokens


def test_translate_with_a_longest_output_past_a_bounded_models_stops_there(location_folder):
    result = run_cli("translate", "--model", location_folder, "--num-beams", 1, "--max-new-tokens", 100, "--batch-size", 2,
                     "Jesus wept.", "", "In the beginning God created the heaven.")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("\n") == 3 and "not translated" not in result.stderr
    assert "`max_new_tokens`=100 is more than this model writes; translations stop at 63 tokens" in result.stderr


def test_a_text_that_fails_costs_its_line_alone(hub_tiny_model, monkeypatch):
    from vanilla_transformer.inference import translate_texts
    from vanilla_transformer.modeling.pipeline_vanilla_transformer import TranslationPipeline

    model, tokenizer = hub_tiny_model
    texts = ["Jesus wept.", "a text that fails", "In the beginning."]
    expected = translate_texts(model, tokenizer, texts[::2], num_beams=1)
    preprocess = TranslationPipeline.preprocess

    def failing(self, text, **kwargs):
        if text == texts[1]:
            raise ValueError("this text fails")
        return preprocess(self, text, **kwargs)

    monkeypatch.setattr(TranslationPipeline, "preprocess", failing)
    with pytest.warns(UserWarning, match="line 11 was not translated .*: this text fails"):
        assert translate_texts(model, tokenizer, texts, num_beams=1, first_line=10) == [expected[0], "", expected[1]]


# --- translate writes each batch as soon as it is done ---


def test_translate_writes_the_first_lines_before_the_input_ends(hub_tiny_folder):
    process = subprocess.Popen([*CLI, "translate", "--model", str(hub_tiny_folder), "--batch-size", "1", "--num-beams", "1"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    try:
        process.stdin.write(b"Jesus wept.\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], 120)
        assert ready, "no line written while the input was still open"
        first = process.stdout.readline()
        assert first.strip() and process.poll() is None
        process.stdin.write(b"In the beginning.\n")
        process.stdin.close()
        rest = process.stdout.read()
        assert process.wait(60) == 0 and rest.count(b"\n") == 1
    finally:
        process.kill()
        process.wait()


# --- serve bounds a request before reading it, and keeps its files in one folder it removes ---


@pytest.fixture(scope="module")
def served(hub_tiny_folder, tmp_path_factory):
    """A real `serve` process on a free loopback port, its Gradio cache in a folder of its own: (url, process, cache)."""
    import socket
    import urllib.request

    pytest.importorskip("gradio_client")
    cache = tmp_path_factory.mktemp("gradio")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([*CLI, "serve", "--model", str(hub_tiny_folder), "--port", str(port)],
                               env={**ENV, "GRADIO_TEMP_DIR": str(cache)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 300
    while True:
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode()[-2000:]
        try:
            urllib.request.urlopen(url, timeout=5)
            break
        except OSError:
            time.sleep(1)
    yield url, process, cache
    process.kill()
    process.wait()


def _client(url):
    from gradio_client import Client

    return Client(url, download_files=False, verbose=False)


def test_serve_refuses_a_large_request_from_its_length_before_reading_it(served):
    import http.client
    from urllib.parse import urlparse

    url, process, _ = served
    connection = http.client.HTTPConnection(urlparse(url).hostname, urlparse(url).port, timeout=30)
    connection.putrequest("POST", "/gradio_api/queue/join")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(50_000_000))
    connection.endheaders()  # the 50 MB never sent: the answer comes from the header alone
    response = connection.getresponse()
    assert response.status == 413 and b"over this app's limit of" in response.read()
    # A sentence within the body's limit but longer than max_input_tokens could be: refused before tokenising.
    client = _client(url)
    with pytest.raises(Exception, match=r"The sentence is 50000 characters long, more than the 128 tokens"):
        client.predict("x" * 50_000, 1, 0.6, 0, api_name="/translate")
    assert client.predict("Jesus wept.", 1, 0.6, 0, api_name="/translate")[0].strip()


def test_serve_keeps_its_files_in_one_folder_and_removes_it_when_stopped(served):
    import signal

    url, process, cache = served
    client = _client(url)
    pages = {Path(client.predict(text, 1, 0.6, 0, api_name="/translate")[2]["path"])
             for text in ("Jesus wept.", "In the beginning.")}
    (folder,) = {page.parent for page in pages}
    assert folder.parent == cache and sorted(folder.iterdir()) == sorted(pages)
    assert [path for path in cache.rglob("*.html") if path.parent != folder] == []  # no copy in Gradio's cache
    process.send_signal(signal.SIGTERM)
    process.wait(60)
    assert not folder.exists()


def test_the_app_keeps_the_newest_explorer_pages(hub_tiny_model, tmp_path, monkeypatch):
    pytest.importorskip("gradio")
    from vanilla_transformer.visualize import app

    monkeypatch.setattr(app, "KEPT_PAGES", 2, raising=False)
    translate = app.make_translate(*hub_tiny_model, app.Limits(max_new_tokens=5), tmp_path)
    pages = [Path(translate(text, 1, 0.6, 0)[2]) for text in ("Jesus wept.", "In the beginning.", "God is love.")]
    assert sorted(tmp_path.iterdir()) == sorted(pages[1:])


# --- attention's pictures have a size ceiling, and its staging folder is cleaned on every exit ---

LONGER_LINE = " ".join([LONG_LINE] * 2)


def test_attention_on_a_long_sentence_draws_pictures_of_bounded_size(hub_tiny_folder, tmp_path):
    from PIL import Image

    from vanilla_transformer.inference import load_tokenizer

    result = run_cli("attention", "--model", hub_tiny_folder, "--output-dir", tmp_path, "--num-beams", 1,
                     "--max-new-tokens", 60, LONGER_LINE)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(load_tokenizer(hub_tiny_folder)(LONGER_LINE)["input_ids"]) > 200
    for path in tmp_path.glob("*.png"):
        with Image.open(path) as image:
            image.load()  # PIL reads it whole: no decompression-bomb refusal
            assert max(image.size) <= 6600, (path.name, image.size)  # 60 inches at 110 dpi
            assert image.size[0] * image.size[1] <= 25_000_000, (path.name, image.size)


def test_attention_stopped_by_sigterm_leaves_no_staging_folder(hub_tiny_folder, tmp_path):
    import signal

    process = subprocess.Popen([*CLI, "attention", "--model", str(hub_tiny_folder), "--output-dir", str(tmp_path),
                                "--num-beams", "1", "--max-new-tokens", "60", LONGER_LINE],
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(f"{STAGING_PREFIX}attention/*.png")):  # drawing has begun
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 130
        assert list(tmp_path.iterdir()) == []
    finally:
        process.kill()
        process.wait()


# --- The beam count is bounded on every path ---


@pytest.mark.parametrize("command", ["translate", "attention", "evaluate", "train"])
def test_a_beam_count_past_the_bound_is_refused_by_every_command(command, hub_tiny_folder, tmp_path):
    args = {"translate": ["translate", "--model", hub_tiny_folder, "Jesus wept."],
            "attention": ["attention", "--model", hub_tiny_folder, "--output-dir", tmp_path, "Jesus wept."],
            "evaluate": ["evaluate", "--model", hub_tiny_folder],
            "train": ["train", "--output-dir", tmp_path / "run", "--max-steps", 1]}[command]
    result = run_cli(*args, "--num-beams", 10000)
    assert result.returncode == 2
    assert "--num-beams must be a positive integer up to 32 (each beam holds a copy of the search's state); got 10000" \
        in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_pipeline_refuses_a_beam_count_or_length_past_the_bound(hub_tiny_model):
    from vanilla_transformer.modeling.pipeline_vanilla_transformer import TranslationPipeline

    model, tokenizer = hub_tiny_model
    translate = TranslationPipeline(model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"`num_beams` must be at most 32 \(.*\); got 10000"):
        translate("Jesus wept.", num_beams=10000)
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be at most 4096 \(.*\); got 100000"):
        translate("Jesus wept.", max_new_tokens=100_000)


# --- The saved tokenizer.json reads texts whole, without training's truncation ---


def test_a_saved_tokenizer_reads_long_texts_whole_with_tokenizers_alone(tiny_corpus, tmp_path):
    from tokenizers import Tokenizer

    from vanilla_transformer.hub import save_model_files
    from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig
    from vanilla_transformer.modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration
    from vanilla_transformer.tokenizer import save_tokenizer

    tokenizer, _ = tiny_corpus
    whole = len(tokenizer(LONG_LINE)["input_ids"])
    tokenizer([LONG_LINE], truncation=True, max_length=16)  # as training tokenises its pairs
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer)))
    save_model_files(model, tokenizer, tmp_path / "model")
    save_tokenizer(tokenizer, tmp_path / "tokenizer")
    for folder in ("model", "tokenizer"):
        assert len(Tokenizer.from_file(str(tmp_path / folder / "tokenizer.json")).encode(LONG_LINE).ids) == whole > 16


# --- A size too large for torch to index is refused by the config ---


def test_a_size_past_what_torch_indexes_is_refused_in_one_line(tmp_path):
    from vanilla_transformer.modeling.configuration_vanilla_transformer import VanillaTransformerConfig

    with pytest.raises(ValueError, match=r"`attention_window` must be at most 2147483647; got 100000000000000000000"):
        VanillaTransformerConfig(local_attention="local-m", attention_window=10**20)
    result = run_cli("train", "--output-dir", tmp_path / "run", "--max-steps", 1,
                     "--config-overrides", "local_attention=local-m,attention_window=100000000000000000000")
    assert result.returncode == 2 and "`attention_window` must be at most 2147483647" in result.stderr
    assert result.stderr.count("\n") == 1


# --- A saved folder's auto_map names only code it holds, in either of transformers' forms ---


def _edit_json(path, **changes):
    import json

    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_a_model_saved_from_a_folder_keeps_no_auto_map_entry_whose_code_it_lacks(hub_tiny_folder, tmp_path):
    import json
    import shutil

    from vanilla_transformer.hub import check_hub_folder, save_model_files
    from vanilla_transformer.inference import load_model

    base = shutil.copytree(hub_tiny_folder, tmp_path / "base")
    config = json.loads((base / "config.json").read_text())
    _edit_json(base / "config.json", auto_map={**config["auto_map"], "AutoModelForCausalLM": "modeling_other.Other"})
    _edit_json(base / "tokenizer_config.json", auto_map={"AutoTokenizer": ["tokenization_other.OtherTokenizer", None]})
    model, tokenizer = load_model(base, "cpu")  # fine-tuned, say: its config and tokenizer carry the entries
    save_model_files(model, tokenizer, tmp_path / "tuned")
    saved = json.loads((tmp_path / "tuned" / "config.json").read_text())["auto_map"]
    assert "AutoModelForCausalLM" not in saved and saved["AutoConfig"] == config["auto_map"]["AutoConfig"]
    assert "auto_map" not in json.loads((tmp_path / "tuned" / "tokenizer_config.json").read_text())
    check_hub_folder(tmp_path / "tuned")


def test_push_checks_a_folder_whose_auto_map_holds_the_tokenizers_list_form(hub_tiny_folder, tmp_path):
    import json
    import shutil

    folder = shutil.copytree(hub_tiny_folder, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    _edit_json(folder / "config.json", auto_map={**config["auto_map"], "AutoTokenizer": [None, "tokenization_x.XFast"]})
    result = run_cli("push", "--folder", folder, "--repo-id", "someone/model")
    assert result.returncode == 2 and "missing: tokenization_x.py" in result.stderr and "Traceback" not in result.stderr


# --- The card draws the heat map of a model trained in bf16 ---


@pytest.mark.parametrize("overrides", [{"attention_score": "general"}, {"attention_score": "additive"},
                                       {"local_attention": "local-p"}])
def test_the_card_draws_the_attention_of_a_model_trained_in_bf16(overrides, tiny_corpus, tmp_path):
    from accelerate import Accelerator

    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
    from vanilla_transformer.hub import save_for_hub

    tokenizer, _ = tiny_corpus
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), **overrides))
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.unwrap_model(accelerator.prepare(model))  # as train's final model: its forward autocasts
    model.generation_config.max_new_tokens = 5
    folder = save_for_hub(model, tokenizer, tmp_path / "model", example="Jesus wept.")
    assert (folder / "attention.png").is_file()


# --- A number in a language column is refused, naming its row ---


@pytest.mark.parametrize("command", ["train-tokenizer", "train"])
def test_a_number_in_a_language_column_is_named_with_its_row(command, tmp_path):
    import json

    data = tmp_path / "pairs.jsonl"
    rows = [{"en": "In the beginning", "es": "En el principio"}] * 4
    rows[2] = {"en": "Jesus wept.", "es": 5}
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_cli(command, "--dataset", data, "--source-lang", "en", "--target-lang", "es",
                     "--output-dir", tmp_path / "out", *(["--max-steps", 1] if command == "train" else []))
    assert result.returncode == 2
    assert "target_lang='es': the column must hold text, and row 3 holds int 5" in result.stderr


# --- A command-line text that is not UTF-8 is refused, naming the byte ---


@pytest.mark.parametrize("command", ["translate", "attention"])
def test_a_text_argument_that_is_not_utf8_is_named(command, hub_tiny_folder):
    result = subprocess.run([*map(os.fsencode, CLI), command.encode(), b"--model", os.fsencode(hub_tiny_folder), b"Jes\xffus"],
                            capture_output=True, env=ENV, timeout=300)
    shown = "TEXT" if command == "translate" else "text"
    assert result.returncode == 2
    assert result.stderr.decode() == (f"vanilla-transformer {command}: error: argument {shown}: byte 0xff at character 4 "
                                      "is not UTF-8; give the text in UTF-8\n")


# --- A weights file with a tensor added or removed is the file named, not config.json ---


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_a_weights_file_with_a_tensor_added_or_removed_is_the_one_named(change, hub_tiny_folder, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(hub_tiny_folder, tmp_path / "model")
    weights = load_file(folder / "model.safetensors")
    if change == "extra":
        weights["model.encoder.layers.0.spare.weight"] = torch.zeros(2)
    else:
        weights.pop(next(key for key in weights if key.startswith("model.encoder.layers.0.") and key.endswith("bias")))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    result = run_cli("translate", "--model", folder, "Jesus wept.")
    assert result.returncode == 2 and "config.json edited" not in result.stderr
    assert f"the weights in {folder} (model.safetensors) are not those config.json describes: they " in result.stderr
    assert ("have model.encoder.layers.0.spare.weight" if change == "extra" else "lack model.encoder.layers.0.") in result.stderr


# --- export's hint runs as printed, spaces in the path included ---


def test_the_export_hint_runs_as_printed_with_spaces_in_the_path(hub_tiny_folder, tmp_path):
    import shlex

    pytest.importorskip("ctranslate2")
    result = run_cli("export", "--model", hub_tiny_folder, "--format", "ctranslate2", "--output-dir", tmp_path / "my export")
    assert result.returncode == 0, result.stderr[-2000:]
    hint = shlex.split(result.stdout.splitlines()[-1])
    assert hint[hint.index("--model") + 1] == str(tmp_path / "my export") and hint[-1] == "Jesus wept."
