"""Model folders turned against their user: sizes that disagree with the weights, decoding defaults past
the command line's bounds, weights named outside the folder, and the app called with the wrong number of inputs.
Each refusal is one line naming the file, before anything of the file's size is built or read.
"""

import json
import os
import shutil
import time
import urllib.request
from functools import partial
from pathlib import Path

import pytest
from safetensors import safe_open

import commands
import serving
from commands import ENV

served = serving.served  # the fixture: a real `serve` process, on a free port
MEMORY_CAP = 3 * 1024**3  # bytes of address space: the tiny model's run needs about 1.5 GB of it


run_cli = partial(commands.run_cli, timeout=120, memory=MEMORY_CAP)


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _refused_in_one_line(result, *expected):
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for text in expected:
        assert text in result.stderr, result.stderr


@pytest.mark.slow
def test_a_config_with_100000_layers_is_refused_from_the_weights_header(hub_tiny_folder, tmp_path):
    # The weights' header is read before any model is built: building one of 100,000 layers would not end.
    folder = shutil.copytree(hub_tiny_folder, tmp_path / "model")
    _edit_json(folder / "config.json", encoder_layers=100_000)
    started = time.monotonic()
    result = run_cli("translate", "--model", folder, "Jesus wept.", timeout=60)
    _refused_in_one_line(result, f"{folder / 'config.json'} does not fit the weights in {folder}: the config has "
                                 "model.encoder.layers.2. (encoder_layers 100000), which the weights lack")
    assert time.monotonic() - started < 60


@pytest.mark.slow
@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"])
def test_a_settings_file_nested_deeper_than_the_parser_follows_is_refused_in_one_line(hub_tiny_folder, tmp_path, name):
    folder = shutil.copytree(hub_tiny_folder, tmp_path / "model")
    (folder / name).write_text("[" * 100_000)  # Python's parser raises RecursionError, which is no ValueError
    result = run_cli("translate", "--model", folder, "Jesus wept.")
    _refused_in_one_line(result, f"{folder / name} is damaged: its values nest deeper than a JSON parser follows")


@pytest.mark.slow
def test_a_beam_count_past_the_bound_in_generation_config_is_refused(hub_tiny_folder, tmp_path):
    # A beam past the bound fails on every line, one warning each: the folder is refused before the first.
    folder = shutil.copytree(hub_tiny_folder, tmp_path / "model")
    _edit_json(folder / "generation_config.json", num_beams=100_000)
    result = run_cli("translate", "--model", folder, input="Jesus wept.\nIn the beginning.\n")
    _refused_in_one_line(result, f"{folder / 'generation_config.json'}: `num_beams` must be at most 32")


@pytest.mark.slow
def test_an_index_naming_weights_outside_the_folder_is_refused(hub_tiny_folder, tmp_path):
    folder = shutil.copytree(hub_tiny_folder, tmp_path / "a" / "b" / "model")
    (tmp_path / "other").mkdir()
    weights = tmp_path / "other" / "model.safetensors"
    shutil.move(folder / "model.safetensors", weights)
    with safe_open(str(weights), framework="pt") as opened:
        weight_map = {key: "../../../other/model.safetensors" for key in opened.keys()}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    result = run_cli("translate", "--model", folder, "Jesus wept.")
    _refused_in_one_line(result, f"{folder / 'model.safetensors.index.json'} names '../../../other/model.safetensors', "
                                 "outside the model folder")


@pytest.mark.slow
def test_a_weights_file_linked_from_outside_the_folder_is_refused(hub_tiny_folder, tmp_path):
    folder = shutil.copytree(hub_tiny_folder, tmp_path / "model")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(folder / "model.safetensors", outside)
    (folder / "model.safetensors").symlink_to(outside)
    result = run_cli("translate", "--model", folder, "Jesus wept.")
    _refused_in_one_line(result, f"{folder / 'model.safetensors'} is a link to {outside}, outside the model folder")


def test_a_snapshot_of_the_hub_cache_whose_files_link_to_its_blobs_is_read(hub_tiny_folder, tmp_path):
    # The Hub's cache keeps each file once in models--ORG--NAME/blobs and links it from snapshots/REVISION.
    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in Path(hub_tiny_folder).iterdir():
        if file.is_file():
            blob = repo / "blobs" / file.name
            shutil.copy(file, blob)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    result = run_cli("translate", "--model", snapshot, "Jesus wept.")
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    # A link from the snapshot to anywhere else is still refused.
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(repo / "blobs" / "model.safetensors", outside)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(outside)
    result = run_cli("translate", "--model", snapshot, "Jesus wept.")
    _refused_in_one_line(result, f"{snapshot / 'model.safetensors'} is a link to {outside}, outside the model folder")


@pytest.mark.slow
def test_a_hub_id_is_read_from_its_snapshot_through_the_gate(hub_tiny_folder, tmp_path):
    # The Hub's cache as huggingface_hub lays it out: refs/main names the snapshot a Hub id loads, offline.
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = shutil.copytree(hub_tiny_folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = {**ENV, "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = run_cli("translate", "--model", "someone/tiny", "Jesus wept.", env=env)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    _edit_json(snapshot / "config.json", max_position_embeddings=2**31 - 1)
    result = run_cli("translate", "--model", "someone/tiny", "Jesus wept.", env=env)
    _refused_in_one_line(result, f"{snapshot / 'config.json'}: `max_position_embeddings` must be an integer in 1..65536")
    result = run_cli("translate", "--model", "someone/elsewhere", "Jesus wept.", env=env)
    _refused_in_one_line(result, "cannot load the model 'someone/elsewhere': not a model folder, and not reachable on the Hub")


@pytest.mark.slow
@pytest.mark.parametrize("data", [["Jesus wept."], ["Jesus wept.", 1, 0.6, 0, "one too many"]])
def test_the_app_answers_a_call_with_the_wrong_number_of_inputs_with_a_message(data, served):
    # A call of /translate with one input of its four was answered {"error": null}; Gradio ignored a fifth.
    host, port = served
    status, text = serving.post(host, port, "/gradio_api/call/translate", {"data": data})
    assert status == 200, text
    with urllib.request.urlopen(f"http://{host}:{port}/gradio_api/call/translate/{json.loads(text)['event_id']}",
                                timeout=120) as stream:
        lines = stream.read().decode().splitlines()
    assert lines[0] == "event: error", lines
    assert json.loads(lines[1].removeprefix("data: "))["error"] == (
        "This call takes 4 inputs (Sentence, Beam size (1: greedy), Length penalty (beam search), Longest output in "
        f"tokens (0: source length + 50, at most 256)); it was given {len(data)}.")


@pytest.mark.slow
def test_a_model_folder_with_another_tokenizer_is_refused_in_one_line(hub_tiny_folder, tiny_corpus, tmp_path, capsys):
    import shutil

    from vanilla_transformer.cli import main
    from vanilla_transformer.inference import load_model
    from vanilla_transformer.tokenizer import train_tokenizer

    load_model(hub_tiny_folder, "cpu")  # its own tokenizer fits
    folder = tmp_path / "mixed"
    shutil.copytree(hub_tiny_folder, folder)
    _, pairs = tiny_corpus
    other = train_tokenizer([text for pair in pairs[:500] for text in pair], vocab_size=300)
    other.save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "tokenizer.json", folder / "tokenizer.json")
    rows = load_model(hub_tiny_folder, "cpu")[0].config.vocab_size
    with pytest.raises(ValueError, match=rf"the tokenizer in {folder} is not the model's: its tokenizer has "
                                         rf"{len(other)} tokens and the model {rows} embedding rows"):
        load_model(folder, "cpu")
    with pytest.raises(SystemExit) as stop:
        main(["translate", "--model", str(folder), "--device", "cpu", "In the beginning."])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert error.strip().splitlines()[-1].startswith(f"vanilla-transformer translate: error: the tokenizer in {folder} is not")


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    ["translate", "In the beginning."],
    ["evaluate", "--max-samples", "2"],
    ["attention", "In the beginning."],
    ["export", "--format", "ctranslate2"],
])
def test_a_config_of_another_shape_or_a_tokenizer_without_its_keys_is_named_in_one_line(
        hub_tiny_folder, tmp_path, command, capsys):
    import json
    import shutil

    from vanilla_transformer.cli import main

    def edited(name, file, edit):
        folder = tmp_path / name
        shutil.copytree(hub_tiny_folder, folder)
        content = json.loads((folder / file).read_text())
        edit(content)
        (folder / file).write_text(json.dumps(content))
        return folder

    shape = edited("shape", "config.json", lambda config: config.update(d_model=2 * config["d_model"]))
    layers = edited("layers", "config.json", lambda config: config.update(encoder_layers=config["encoder_layers"] + 1))
    keyless = edited("keyless", "tokenizer.json", lambda tokenizer: tokenizer.pop("model"))
    # Another model_type made transformers ask whether to run the folder's code, on the terminal.
    other = edited("other", "config.json", lambda config: config.update(model_type="bert"))
    typeless = edited("typeless", "config.json", lambda config: config.pop("model_type"))
    listed = edited("listed", "config.json", lambda config: None)
    (listed / "config.json").write_text("[1, 2]")  # once blamed on the tokenizer
    damaged = edited("damaged", "generation_config.json", lambda generation: None)
    (damaged / "generation_config.json").write_text("{")  # transformers ignored it: the model's decoding defaults were lost
    for folder, message in ((other, f"{other / 'config.json'} describes a 'bert' model, which is not a translation"),
                            (typeless, f"{typeless / 'config.json'} does not describe a model: it names no `model_type`"),
                            (listed, f"{listed / 'config.json'} does not describe a model: it names no `model_type`"),
                            (damaged, f"{damaged / 'generation_config.json'} is damaged: not valid JSON"),
                            (shape, f"{shape / 'config.json'} does not fit the weights in {shape}: model.shared.weight "
                                    "is [600, 64] in model.safetensors and [600, 128] by the config"),
                            (layers, f"{layers / 'config.json'} does not fit the weights in {layers}: the config has "
                                     "model.encoder.layers.2."),
                            (keyless, f"{keyless / 'tokenizer.json'} is not a tokenizer file this version can read: "
                                      "Model missing")):
        extra = ["--output-dir", str(tmp_path / "out")] if command[0] in ("export", "attention") else []
        with pytest.raises(SystemExit) as stop:
            main([command[0], "--model", str(folder), *command[1:], *extra])
        assert stop.value.code == 2
        out, error = capsys.readouterr()
        assert error.startswith(f"vanilla-transformer {command[0]}: error: {message}") and "Traceback" not in error
        assert "custom code" not in out + error  # transformers' question whether to run the folder's code
        assert not (tmp_path / "out").exists()
