"""Every command that reads a model folder refuses a hostile one through the same gate (checks/model_folder.py), with
the same one line naming the file and the bound, before anything is built: translate, evaluate, attention,
export, serve and `train --model-name-or-path`. The cases: decoding that could never end (positions and a
length offset in the billions, the end token suppressed or banned), settings files too large to parse, an unknown
length-penalty style, a tokenizer whose pattern backtracks without end or that links out of the folder, and a
CTranslate2 export whose options ask for a beam of 100,000 or outputs of a billion tokens.
"""

import json
import shutil
import socket
import subprocess

import pytest

from commands import run_cli

MEMORY_CAP = 3 << 30  # bytes of address space: the tiny model's commands need about 1.5 GB of it
TIMEOUT = 120


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _endless(folder, outside):
    _edit_json(folder / "config.json", max_position_embeddings=2147483647)
    _edit_json(folder / "generation_config.json", suppress_tokens=[2], max_length_offset=1000000000, num_beams=1)
    return folder / "config.json", "`max_position_embeddings` must be an integer in 1..65536; got 2147483647"


def _end_suppressed(folder, outside):
    _edit_json(folder / "generation_config.json", suppress_tokens=[2], num_beams=1)
    return folder / "generation_config.json", "`suppress_tokens` must be a list without the end token (2)"


def _end_banned(folder, outside):
    _edit_json(folder / "generation_config.json", bad_words_ids=[[5, 6], [2]])
    return folder / "generation_config.json", "`bad_words_ids` must be lists of which none is the end token alone"


def _offset_of_a_billion(folder, outside):
    _edit_json(folder / "generation_config.json", max_length_offset=1000000000)
    return folder / "generation_config.json", "`max_length_offset` must be an integer in 1..4096; got 1000000000"


def _five_million_suppressed(folder, outside):
    _edit_json(folder / "generation_config.json", suppress_tokens=list(range(5, 600)) * 8404)
    size = (folder / "generation_config.json").stat().st_size
    return folder / "generation_config.json", f"is {size:,} bytes, more than such a file holds (at most 1,048,576)"


def _evil_style(folder, outside):
    _edit_json(folder / "generation_config.json", length_penalty_style="evil")
    return folder / "generation_config.json", "`length_penalty_style` must be one of 'gnmt', 'transformers'; got 'evil'"


def _config_of_300_mb(folder, outside):
    text = (folder / "config.json").read_text()
    with open(folder / "config.json", "w") as file:
        file.write(text[:-1] + " " * (300 << 20) + "}")
    return folder / "config.json", f"is {(folder / 'config.json').stat().st_size:,} bytes, more than such a file holds"


def _backtracking_tokenizer(folder, outside):
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": r"(\w+\s?)*$"}, "behavior": "Isolated", "invert": False}
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tokenizer["pre_tokenizer"]]}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder / "tokenizer.json", "its pre_tokenizer matches the regular expression '(\\\\w+\\\\s?)*$'"


def _tokenizer_linked_outside(folder, outside):
    shutil.move(folder / "tokenizer.json", outside)
    (folder / "tokenizer.json").symlink_to(outside)
    return folder / "tokenizer.json", f"is a link to {outside}, outside the model folder; it is not read"


CASES = [_endless, _end_suppressed, _end_banned, _offset_of_a_billion, _five_million_suppressed, _evil_style,
         _config_of_300_mb, _backtracking_tokenizer, _tokenizer_linked_outside]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.__name__.strip("_"))
def hostile(request, hub_tiny_folder, tmp_path_factory):
    """(folder, the file refused, what the refusal says): a copy of the tiny model's folder edited by one case."""
    root = tmp_path_factory.mktemp(request.param.__name__.strip("_"))
    folder = shutil.copytree(hub_tiny_folder, root / "model")
    file, expected = request.param(folder, root / "elsewhere.json")
    return folder, file, expected


@pytest.fixture(scope="module")
def parallel_text(tmp_path_factory):
    """A folder of a few en-es pairs (train and valid), and its train files: data for train and evaluate."""
    from vanilla_transformer.corpora import load_translation_dataset, text_pairs

    folder = tmp_path_factory.mktemp("data")
    sources, targets = text_pairs(load_translation_dataset("bible-en-es")["train"].select(range(40)), "en", "es")
    for split, rows in (("train", slice(0, 32)), ("valid", slice(32, 40))):
        (folder / f"{split}.en").write_text("\n".join(sources[rows]) + "\n")
        (folder / f"{split}.es").write_text("\n".join(targets[rows]) + "\n")
    return folder


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


COMMANDS = {
    "translate": lambda model, data, out: ["translate", "--model", model, "Jesus wept."],
    "evaluate": lambda model, data, out: ["evaluate", "--model", model, "--source-file", data / "valid.en",
                                          "--reference-file", data / "valid.es"],
    "attention": lambda model, data, out: ["attention", "--model", model, "--output-dir", out, "Jesus wept."],
    "export": lambda model, data, out: ["export", "--model", model, "--format", "ctranslate2", "--output-dir", out],
    "serve": lambda model, data, out: ["serve", "--model", model, "--port", _free_port()],
    "train": lambda model, data, out: ["train", "--model-name-or-path", model, "--output-dir", out, "--dataset", data,
                                       "--source-lang", "en", "--target-lang", "es", "--max-steps", 1],
}


def run_command(args) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=TIMEOUT, memory=MEMORY_CAP)


def refusal(result, command: str) -> str:
    """The one line a command refused with (its last: `train` and `serve` say their threads first), after its name."""
    assert result.returncode == 2 and result.stdout == "", (result.returncode, result.stdout, result.stderr[-3000:])
    assert "Traceback" not in result.stderr and "panicked" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 or command in ("train", "serve") and len(lines) <= 4, result.stderr[-3000:]
    prefix = f"vanilla-transformer {command}: error: "
    assert lines[-1].startswith(prefix), result.stderr[-3000:]
    return lines[-1].removeprefix(prefix)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_a_hostile_folder_with_the_same_line(command, hostile, parallel_text, tmp_path):
    folder, file, expected = hostile
    result = run_command(COMMANDS[command](folder, parallel_text, tmp_path / "out"))
    line = refusal(result, command)
    assert line.startswith(f"{file}") and expected in line, line
    assert not (tmp_path / "out").exists() or command == "train", "the command wrote before refusing"


def _exported(folder, **options):
    """The CTranslate2 export in `folder` with its translation_options.json changed."""
    _edit_json(folder / "translation_options.json", **options)
    return folder


@pytest.fixture(scope="module")
def exported(hub_tiny_folder, tmp_path_factory):
    """The tiny model exported to CTranslate2 once; each test edits a copy."""
    pytest.importorskip("ctranslate2")
    folder = tmp_path_factory.mktemp("export") / "ct2"
    result = run_command(["export", "--model", hub_tiny_folder, "--format", "ctranslate2", "--output-dir", folder])
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("command", ["translate", "evaluate"])
@pytest.mark.parametrize("options, expected", [
    ({"beam_size": 100000}, "`beam_size` must be an integer in 1..32; got 100000"),
    ({"max_decoding_length": 1000000000}, "`max_decoding_length` must be an integer in 1..4096; got 1000000000"),
    ({"max_input_length": 1e9}, "`max_input_length` must be an integer in 1..65536; got 1000000000.0"),
    ({"length_penalty": float("nan")}, "`length_penalty` must be a finite number in [-10.0, 10.0]; got nan"),
    ({"num_hypotheses": 100000}, "num_hypotheses is not as the export writes them"),
], ids=["beam", "decoding-length", "input-length", "nan-penalty", "unknown-option"])
def test_a_hostile_ctranslate2_export_is_refused_at_load_in_one_line(command, options, expected, exported, parallel_text,
                                                                   tmp_path):
    folder = _exported(shutil.copytree(exported, tmp_path / "ct2"), **options)
    args = COMMANDS[command](folder, parallel_text, tmp_path / "out")
    line = refusal(run_command([*args, "--engine", "ctranslate2"]), command)
    assert line.startswith(f"{folder / 'translation_options.json'}: ") and expected in line, line


@pytest.mark.slow
def test_an_export_decoding_past_its_position_table_is_refused_in_one_line(exported, tmp_path):
    # Within the bound, past the table: CTranslate2's own error, named, instead of its traceback.
    folder = _exported(shutil.copytree(exported, tmp_path / "ct2"), max_decoding_length=4000, max_length_offset=4000,
                       min_decoding_length=2000)
    result = run_command(["translate", "--engine", "ctranslate2", "--model", folder, "--num-beams", "1", "Jesus wept."])
    line = refusal(result, "translate")
    assert line.startswith(f"{folder / 'translation_options.json'}: CTranslate2 cannot decode with these options"), line
