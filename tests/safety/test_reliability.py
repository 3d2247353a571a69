"""Nothing from a file the user was handed is executed, nothing they made is overwritten."""

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from crafted import Payload
from vanilla_transformer.training.checkpoints import newest_sound_checkpoint, save_checkpoint, verify_checkpoint
from vanilla_transformer.training.schedule import make_scheduler


@pytest.fixture
def checkpointed(tmp_path):
    """A real checkpoint with a registered schedule, as `train` writes it (custom_checkpoint_0.pkl)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = make_scheduler(optimizer, 8, 4, 1.0, "noam", remaining_steps=lambda step: 10)
    accelerator.register_for_checkpointing(scheduler)
    root = tmp_path / "checkpoints"
    return accelerator, root, save_checkpoint(accelerator, root, 3, {"epoch": 0})


def test_a_crafted_custom_checkpoint_is_refused_and_never_run(tmp_path, checkpointed):
    accelerator, root, checkpoint = checkpointed
    custom = checkpoint / "custom_checkpoint_0.pkl"
    verify_checkpoint(checkpoint)  # the genuine file: tensors and plain values
    accelerator.load_state(str(checkpoint))
    marker = tmp_path / "ran"
    torch.save(Payload(marker), custom)  # a valid zip archive with correct CRCs: only its content is hostile
    with pytest.raises(ValueError, match=r"custom_checkpoint_0.pkl holds more than tensors and plain values"):
        verify_checkpoint(checkpoint)
    assert not marker.exists()
    # `train --resume` reads only a checkpoint that verifies: with no other one, it stops before loading.
    with pytest.raises(ValueError, match="no checkpoint in .* can be read: .*custom_checkpoint_0.pkl holds more"):
        newest_sound_checkpoint(root)
    assert not marker.exists()


def test_resume_falls_back_past_a_crafted_checkpoint(tmp_path, checkpointed):
    accelerator, root, older = checkpointed
    newer = save_checkpoint(accelerator, root, 4, {"epoch": 0})
    marker = tmp_path / "ran"
    torch.save(Payload(marker), newer / "custom_checkpoint_0.pkl")
    chosen, problems = newest_sound_checkpoint(root)
    assert chosen == older and len(problems) == 1 and "custom_checkpoint_0.pkl holds more" in problems[0]
    assert not marker.exists() and (root / "damaged-checkpoint-00000004").is_dir()


@pytest.mark.slow
def test_a_model_folder_with_another_tokenizer_is_refused_in_one_line(hub_tiny_folder, tiny_corpus, tmp_path, capsys):
    import shutil

    from vanilla_transformer.cli import main
    from vanilla_transformer.model_folder import load_model
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


@pytest.mark.parametrize("options, message", [
    (["--device", "banana"], "--device 'banana' is not a device; expected cpu, cuda, cuda:N or mps"),
    (["--max-new-tokens", "1000000000"], "--max-new-tokens must be a positive integer up to 4096"),
    (["--length-penalty", "1e308"], "--length-penalty must be between -10.0 and 10.0"),
])
def test_decoding_options_beyond_what_can_run_are_refused_in_one_line(tmp_path, options, message, capsys):
    from vanilla_transformer.cli import main

    with pytest.raises(SystemExit) as stop:  # refused before any model is read
        main(["translate", "--model", str(tmp_path), *options, "In the beginning."])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"vanilla-transformer translate: error: {message}")


def test_cuda_without_cuda_is_refused(monkeypatch):
    from vanilla_transformer.cli.options import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda:1: this machine has no CUDA device; use --device cpu"):
        check_device("cuda:1")
    check_device("cpu")


def _translate_process(folder, stdin, stdout, *extra):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "translate", "--model", str(folder),
                           "--device", "cpu", "--num-beams", "1", "--max-new-tokens", "8", *extra],
                          stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.mark.slow
def test_closed_stdin_full_disk_and_broken_pipe_end_in_one_line(hub_tiny_folder, tmp_path):
    import subprocess
    import sys

    closed = subprocess.run(  # standard input closed by the shell
        ["bash", "-c", f"{sys.executable} -m vanilla_transformer.cli translate --model {hub_tiny_folder} --device cpu <&-"],
        capture_output=True, text=True, timeout=300)
    assert closed.returncode == 2 and "Traceback" not in closed.stderr
    assert closed.stderr.strip().splitlines()[-1] == ("vanilla-transformer translate: error: standard input is closed; "
                                                      "give the texts as arguments or with --input-file")
    with open("/dev/full", "w") as full:
        result = _translate_process(hub_tiny_folder, subprocess.DEVNULL, full, "In the beginning.")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("vanilla-transformer translate: error: cannot write the output: "
                                                      "No space left on device")
    lines = tmp_path / "many.txt"
    lines.write_text("In the beginning.\n" * 20)
    # The reader has left before the first write (as `| head` does after its lines): the pipe is broken for
    # certain, not only once the pipe's buffer fills.
    reader = subprocess.Popen(["true"], stdin=subprocess.PIPE)
    reader.wait()
    result = _translate_process(hub_tiny_folder, subprocess.DEVNULL, reader.stdin, "--input-file", str(lines))
    reader.stdin.close()
    assert result.returncode == 141 and "Traceback" not in result.stderr and "Exception ignored" not in result.stderr


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


@pytest.mark.slow
def test_a_byte_order_mark_does_not_change_the_first_lines_translation(hub_tiny_folder, tmp_path, capsys, monkeypatch):
    import codecs

    from vanilla_transformer import inference
    from vanilla_transformer.cli import main
    from vanilla_transformer.tokenizer import read_text_files

    seen = []  # what reaches the model: the BOM's three bytes would be three more source tokens

    def translate_texts(model, tokenizer, texts, **options):
        seen.append(list(texts))
        return translate(model, tokenizer, texts, **options)

    translate = inference.translate_texts
    monkeypatch.setattr(inference, "translate_texts", translate_texts)
    text = "In the beginning God created the heavens.\nJesus wept.\n"
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text(text, encoding="utf-8")
    marked.write_bytes(codecs.BOM_UTF8 + text.encode())  # as Notepad saves "UTF-8 with BOM"
    outputs = []
    for path in (plain, marked):
        main(["translate", "--model", str(hub_tiny_folder), "--device", "cpu", "--num-beams", "1", "--input-file", str(path)])
        outputs.append(capsys.readouterr().out)
    assert seen[0] == seen[1] == ["In the beginning God created the heavens.", "Jesus wept."]
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 2
    assert list(read_text_files([marked])) == seen[0]  # train-tokenizer --text-files


_FULL_DISK_AT = """
import errno, os, sys
from vanilla_transformer.cli import main, train_tokenizer

def fill_the_disk(parser, args):  # what a write to a full disk raises, naming its file as os.open does
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(args.output_dir, "tokenizer.json"))

train_tokenizer.run = fill_the_disk
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_names_the_file_that_could_not_be_written(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _FULL_DISK_AT, "train-tokenizer", "--output-dir", str(tmp_path / "tok")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (f"vanilla-transformer train-tokenizer: error: cannot write "
                                                      f"{tmp_path / 'tok' / 'tokenizer.json'}: No space left on device")


_NO_NETWORK = """
import socket, sys
attempts = []
def refuse(*args, **kwargs):
    attempts.append(repr(args[:2]))
    raise OSError("no network in this test")
socket.getaddrinfo = socket.create_connection = socket.socket.connect = refuse
from vanilla_transformer.cli import main

try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print("exit", code, "network", attempts)
"""


@pytest.mark.slow
def test_scoring_local_data_sends_no_request_when_not_offline(hub_tiny_folder, tmp_path):
    import json
    import os
    import subprocess
    import sys

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"en": f"In the beginning {i}.", "es": f"En el principio {i}."}) + "\n" for i in range(3)))
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_UPDATE_DOWNLOAD_COUNTS")}
    # datasets counted a download of its "json" builder with a request to S3 for every local file read.
    result = subprocess.run(
        [sys.executable, "-c", _NO_NETWORK, "evaluate", "--model", str(hub_tiny_folder), "--dataset", str(data),
         "--split", "train", "--device", "cpu", "--num-beams", "1", "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.stdout.strip().splitlines()[-1] == "exit 0 network []", result.stderr[-2000:]


def test_the_app_refuses_a_request_beyond_its_limits_naming_the_limit(hub_tiny_model, tmp_path):
    import re

    gr = pytest.importorskip("gradio")
    from vanilla_transformer.inference import translate_texts
    from vanilla_transformer.visualize.app import Limits, make_translate

    model, tokenizer = hub_tiny_model
    translate = make_translate(model, tokenizer, Limits(max_input_tokens=12, max_new_tokens=5, max_beams=2), tmp_path)
    for request, message in (
        (("In the beginning God created the heavens and the earth.", 1, 0.6, 0),
         r"The sentence is \d+ tokens long; this app translates at most 12 \(max_input_tokens\)"),
        (("Jesus wept.", 3, 0.6, 0), r"Beam size 3 is over this app's limit of 2 \(max_beams\)"),
        (("Jesus wept.", 1, 0.6, 6), r"The longest output asked for, 6 tokens, is over this app's limit of 5 \(max_new_tokens\)"),
        (("Jesus wept.", 1, 1e308, 0), r"The length penalty must be between -10.0 and 10.0"),
    ):
        with pytest.raises(gr.Error) as refused:  # refused, not clipped
            translate(*request)
        assert re.match(message, refused.value.message), refused.value.message
    # Within the limits; asking for no length gives the model's default, here capped at max_new_tokens.
    translation, frame, page = translate("Jesus wept.", 2, 0.6, 0)
    assert translation == translate_texts(model, tokenizer, ["Jesus wept."], num_beams=2, max_new_tokens=5)[0]
    assert translate("Jesus wept.", 1, 0.6, 3)[0] == translate_texts(model, tokenizer, ["Jesus wept."], num_beams=1,
                                                                      max_new_tokens=3)[0]


def test_the_app_serves_its_limits(hub_tiny_folder):
    import gc

    gr = pytest.importorskip("gradio")
    from vanilla_transformer.visualize.app import Limits, build_app

    demo = build_app(hub_tiny_folder, "cpu", Limits(max_beams=2, max_concurrent=2, max_queued=3))
    gc.collect()  # the explorer pages' folder lives as long as the app
    (translate,) = {block.fn for block in demo.fns.values() if block.fn.__name__ == "translate"}  # click and submit
    with pytest.raises(gr.Error, match="over this app's limit of 2"):
        translate("Jesus wept.", 3, 0.6, 0)
    assert Path(translate("Jesus wept.", 2, 0.6, 0)[2]).is_file()


def test_the_apps_limits_come_from_serves_options_then_the_environment_then_the_defaults(monkeypatch, capsys):
    pytest.importorskip("gradio")
    from vanilla_transformer.cli import main
    from vanilla_transformer.visualize import app

    assert app.Limits() == app.Limits(max_input_tokens=128, max_new_tokens=256, max_beams=8, max_concurrent=1, max_queued=8)
    served = []
    monkeypatch.setattr(app, "serve", lambda model, host, port, device, limits: served.append(limits))
    monkeypatch.setenv("VANILLA_TRANSFORMER_MAX_NEW_TOKENS", "64")  # as a Space's variable sets it
    monkeypatch.setenv("VANILLA_TRANSFORMER_MAX_BEAMS", "4")
    assert main(["serve", "--model", "m", "--max-beams", "2", "--max-concurrent", "3", "--max-input-tokens", "32"]) == 0
    assert capsys.readouterr().err == "threads: 1 (OMP_NUM_THREADS; --threads N to change)\n"  # the suite's, as serve starts
    assert served == [app.Limits(max_input_tokens=32, max_new_tokens=64, max_beams=2, max_concurrent=3, max_queued=8)]
    for argv, message in ((["--max-queued", "0"], "--max-queued must be a positive integer; got 0"),
                          ([], "--max-beams (VANILLA_TRANSFORMER_MAX_BEAMS) must be a whole number of at least 1; got 'many'"),
                          (["--max-new-tokens", "100000"], "--max-new-tokens must be a positive integer up to 4096 (its "
                                                           "cache is allocated up front); got 100000")):
        monkeypatch.setenv("VANILLA_TRANSFORMER_MAX_BEAMS", "many" if not argv else "4")
        with pytest.raises(SystemExit) as stop:
            main(["serve", "--model", "m", *argv])
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"vanilla-transformer serve: error: {message}\n"
