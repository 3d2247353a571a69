"""The translate, evaluate, attention and push commands, run on the tiny Hub folder."""

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import huggingface_hub
import pytest
import torch

from vanilla_transformer.cli import main
from vanilla_transformer.errors import MissingPackage
from vanilla_transformer.inference import score_translations, translate_texts

LINES = ["In the beginning God created the heavens and the earth.", "", "Jesus wept.", "And God said, Let there be light."]
GREEDY = ["--num-beams", "1", "--max-new-tokens", "12"]


@pytest.mark.slow
def test_translate_reads_standard_input_and_writes_one_line_per_line(hub_tiny_folder, hub_tiny_model):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "vanilla_transformer.cli", "translate", "--model", str(hub_tiny_folder), "--batch-size", "2", *GREEDY],
        input="\n".join(LINES) + "\n", capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    output = result.stdout.split("\n")
    assert output[-1] == "" and len(output) - 1 == len(LINES)
    model, tokenizer = hub_tiny_model
    expected = translate_texts(model, tokenizer, LINES, num_beams=1, max_new_tokens=12)
    assert output[:-1] == expected
    assert output[1] == "" and all(output[i] for i in (0, 2, 3))  # a blank line stays blank, in place
    assert result.stderr == ""  # standard error is for errors and warnings: no bar of the weights loading


def test_translate_from_arguments_and_from_a_file(hub_tiny_folder, tmp_path, capsys):
    assert main(["translate", "--model", str(hub_tiny_folder), *GREEDY, LINES[0], LINES[2]]) == 0
    from_arguments = capsys.readouterr().out.splitlines()
    (tmp_path / "in.txt").write_text(f"{LINES[0]}\n{LINES[2]}\n", encoding="utf-8")
    assert main(["translate", "--model", str(hub_tiny_folder), *GREEDY, "--input-file", str(tmp_path / "in.txt")]) == 0
    assert capsys.readouterr().out.splitlines() == from_arguments
    assert len(from_arguments) == 2



def test_a_bugs_value_error_while_translating_is_no_usage_error(hub_tiny_folder, monkeypatch):
    # Only a check's BadInput is refused in one line (exit status 2); any other ValueError keeps its traceback.
    def translate_with_a_bug(*args, **kwargs):
        raise ValueError("a bug inside generate")

    monkeypatch.setattr("vanilla_transformer.inference.translate_texts", translate_with_a_bug)
    with pytest.raises(ValueError, match="a bug inside generate") as raised:
        main(["translate", "--model", str(hub_tiny_folder), *GREEDY, LINES[0]])
    assert type(raised.value) is ValueError


@pytest.mark.parametrize("error, status, line", [
    (PermissionError(13, os.strerror(13), "out/tokenizer.json"), 1, "out/tokenizer.json: Permission denied"),  # the machine's
    (OSError(errno.EIO, os.strerror(errno.EIO), "data/train.tsv"), 1, "data/train.tsv: Input/output error"),  # a read too
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "out/vocab.json"), 1, "cannot write out/vocab.json: No space left "
     "on device"),
    (OSError(errno.EIO, os.strerror(errno.EIO)), 1, "the standard input or output failed: Input/output error"),
    (FileNotFoundError("no such file or folder: data.tsv"), 2, "no such file or folder: data.tsv"),  # a path given
    (MissingPackage("CTranslate2 is not installed: pip install ctranslate2"), 2, "CTranslate2 is not installed: pip "
     "install ctranslate2"),  # an optional package
    (ImportError("cannot import name 'x' from 'y'"), None, None),  # a bug's: its traceback
])
def test_how_every_command_ends_on_an_error_is_one_table_in_main(error, status, line, monkeypatch, capsys):
    from vanilla_transformer import cli
    from vanilla_transformer.cli import train_tokenizer

    def run_that_fails(args):
        raise error

    monkeypatch.setattr(train_tokenizer, "run", run_that_fails)
    monkeypatch.setattr(cli, "_silence_standard_output", lambda: None)  # pytest's own output stays
    if status is None:
        with pytest.raises(type(error)):
            main(["train-tokenizer", "--output-dir", "out"])
        return
    try:
        code = main(["train-tokenizer", "--output-dir", "out"])
    except SystemExit as usage_error:  # bad input ends as argparse's own usage errors do
        code = usage_error.code
    assert code == status
    assert capsys.readouterr().err == f"vanilla-transformer train-tokenizer: error: {line}\n"

@pytest.mark.slow
def test_evaluate_prints_the_numbers_of_the_sacrebleu_command_line(hub_tiny_folder, tmp_path, capsys):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    assert main(["evaluate", "--model", str(hub_tiny_folder), "--max-samples", "8", *GREEDY,
                 "--hypotheses-out", str(hyp), "--references-out", str(ref)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(hyp.read_text(encoding="utf-8").splitlines()) == len(ref.read_text(encoding="utf-8").splitlines()) == 8
    from vanilla_transformer.corpora import load_translation_dataset, text_pairs

    assert ref.read_text(encoding="utf-8").splitlines() == text_pairs(load_translation_dataset("bible-en-es")["test"], "en", "es")[1][:8]
    ours = {line.split(" = ")[0]: line.split(" = ")[1].split()[0] for line in printed if " = " in line}
    signatures = [line.split("signature: ")[1] for line in printed if "signature: " in line]
    def sacrebleu_command_line(width):
        lines = subprocess.run(
            [sys.executable, "-m", "sacrebleu", str(ref), "-i", str(hyp), "-m", "bleu", "chrf", "-f", "text", "-w", str(width)],
            capture_output=True, text=True, check=True,
        ).stdout.splitlines()
        return {line.split("|")[0].strip(): line.split(" = ")[1].split()[0] for line in lines if " = " in line}

    assert set(ours) == {"BLEU", "chrF2"}
    assert ours == sacrebleu_command_line(2)  # what evaluate prints
    exact = score_translations(hyp.read_text(encoding="utf-8").splitlines(), ref.read_text(encoding="utf-8").splitlines())
    assert sacrebleu_command_line(6) == {"BLEU": f"{exact['bleu']:.6f}", "chrF2": f"{exact['chrf']:.6f}"}
    assert float(ours["BLEU"]) == round(exact["bleu"], 2)
    assert signatures[0].startswith("nrefs:1|case:mixed|eff:no|tok:13a") and "nc:6" in signatures[1]


@pytest.mark.slow
def test_attention_writes_the_maps(hub_tiny_folder, tmp_path, capsys):
    assert main(["attention", "--model", str(hub_tiny_folder), "Jesus wept.", "--output-dir", str(tmp_path / "maps"), "--num-beams", "1"]) == 0
    out = capsys.readouterr().out
    assert "Jesus wept." in out and "-> " in out
    names = sorted(p.name for p in (tmp_path / "maps").iterdir())
    assert names == sorted(["bertviz.pt", "overview.png"] + [f"{k}_layer{n}.png" for k in ("encoder", "decoder", "cross") for n in (1, 2)])


def test_push_uploads_the_folder(hub_tiny_folder, tmp_path, monkeypatch, capsys):
    folder = shutil.copytree(hub_tiny_folder, tmp_path / "tiny-en-es")  # push rewrites the card's repo id in place
    calls = []
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.append(repo_id) or f"https://huggingface.co/{repo_id}")
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **kw: calls.append((kw["repo_id"], kw["folder_path"])))
    assert main(["push", "--folder", str(folder), "--repo-id", "someone/tiny-en-es"]) == 0
    assert calls == ["someone/tiny-en-es", ("someone/tiny-en-es", str(folder))]
    assert "https://huggingface.co/someone/tiny-en-es" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["push", "--folder", "{folder}", "--repo-id", "tiny"], "`repo_id` must look like"),
    (["push", "--folder", "{empty}", "--repo-id", "someone/tiny"], "missing: weights"),
    (["translate", "--model", "{empty}", "x"], "lacks config.json, weights"),
    (["translate", "--model", "{no_tokenizer}", "x"], "lacks tokenizer"),
    (["translate", "--model", "./no/such/folder", "x"], "neither a folder nor a Hub id"),
    # evaluate reads the data set the folder records: through the gate first, as every command
    (["evaluate", "--model", "{empty}"], "lacks config.json, weights"),
    (["evaluate", "--model", "{no_tokenizer}"], "lacks tokenizer"),
    (["translate", "--model", "{folder}", "--input-file", "{empty}/none.txt"], "--input-file {empty}/none.txt: No such file"),
    (["translate", "--model", "{folder}", "--input-file", "{empty}"], "--input-file {empty}: Is a directory"),
    (["evaluate", "--model", "{folder}", "--source-file", "{one_line}", "--reference-file", "{empty}"],
     "--reference-file {empty}: Is a directory"),
    (["translate", "--model", "{folder}", "--batch-size", "0", "x"], "--batch-size must be a positive integer"),
    (["evaluate", "--model", "{folder}", "--split", "devtest"], "--split 'devtest' is not in"),
    (["evaluate", "--model", "{folder}", "--split", "valid", "--source-file", "{one_line}", "--reference-file",
      "{one_line}"], "--split picks a split of --dataset; --source-file and --reference-file are scored whole"),
    (["attention", "--model", "{folder}", " "], "empty"),
    # Each is refused before the work, in one line, never in a traceback.
    (["translate", "--model", "{folder}", "--input-file", "{latin1}"], "latin1.txt, line 2: byte 0xf3 at column 6 is not UTF-8"),
    (["evaluate", "--model", "{folder}", "--hypotheses-out", "{empty}"], "is a folder; give the name of a file"),
    (["evaluate", "--model", "{folder}", "--references-out", "{empty}/no/such/ref.txt"], "there is no folder"),
    (["evaluate", "--model", "{folder}", "--length-penalty", "nan"], "--length-penalty must be a finite number"),
    (["translate", "--model", "{folder}", "--length-penalty", "inf", "x"], "--length-penalty must be a finite number"),
    (["translate", "--model", "{damaged}", "x"],
     "damaged/model.safetensors is damaged (truncated or corrupt; 4,000 bytes): Error while deserializing header"),
    (["evaluate", "--model", "{damaged}"], "Copy the model folder again, or save the model again."),
    (["push", "--folder", "{damaged}", "--repo-id", "someone/tiny"], "damaged/model.safetensors is damaged"),
    # Data as it comes, and what the inference command line tells.
    (["translate", "--model", "{folder}", "--nbest", "0", "x"], "--nbest must be a positive integer up to"),
    (["translate", "--model", "{folder}", "--engine", "ctranslate2", "--with-scores", "x"],
     "--nbest and --with-scores are for --engine transformers"),
    (["evaluate", "--model", "{folder}", "--source-file", "{latin1}"], "--source-file and --reference-file go together"),
    (["evaluate", "--model", "{folder}", "--dataset", "bible-en-es", "--source-file", "{latin1}", "--reference-file",
      "{latin1}"], "give --dataset or --source-file and --reference-file, not both"),
    (["evaluate", "--model", "{folder}", "--source-file", "{latin1}", "--reference-file", "{latin1}"],
     "latin1.txt, line 2: byte 0xf3 at column 6 is not UTF-8"),
    (["evaluate", "--model", "{folder}", "--source-file", "{headerless}", "--reference-file", "{one_line}"],
     "headerless.tsv has 2 lines and --reference-file {one_line} 1; they must translate each other line by line"),
    (["evaluate", "--model", "{folder}", "--dataset", "{headerless}"], ("headerless.tsv: the first row (Jesus wept. | "
     "Jesús lloró.) does not name the languages; a .tsv/.csv file needs a header row such as 'en<TAB>fr'")),
])
def test_bad_input_is_a_usage_error_and_nothing_is_uploaded(argv, message, hub_tiny_folder, tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("the Hub was called, or translating started")

    monkeypatch.setattr(huggingface_hub, "create_repo", refuse)
    monkeypatch.setattr(huggingface_hub, "upload_folder", refuse)
    monkeypatch.setattr("vanilla_transformer.inference.translate_texts", refuse)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    (tmp_path / "empty").mkdir()
    (tmp_path / "latin1.txt").write_bytes("Jesus wept.\nY cri\u00f3 Dios.\n".encode("latin-1"))
    (tmp_path / "one_line.txt").write_text("Jesús lloró.\n", encoding="utf-8")
    (tmp_path / "headerless.tsv").write_text("Jesus wept.\tJesús lloró.\nAnd God said.\tY dijo Dios.\n", encoding="utf-8")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((hub_tiny_folder / name).read_bytes())
    damaged = shutil.copytree(hub_tiny_folder, tmp_path / "damaged")
    os.truncate(damaged / "model.safetensors", 4000)  # a copy or download cut short
    paths = {"folder": hub_tiny_folder, "empty": tmp_path / "empty", "no_tokenizer": no_tokenizer,
             "latin1": tmp_path / "latin1.txt", "damaged": damaged, "headerless": tmp_path / "headerless.tsv",
             "one_line": tmp_path / "one_line.txt"}
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(**paths) for arg in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    # One line, not the usage text: the arguments were well formed (a loading bar may come before it).
    assert message.format(**paths) in err.splitlines()[-1] and "usage:" not in err


def test_evaluate_leaves_out_pairs_with_a_missing_side_and_says_so(hub_tiny_folder, tmp_path, capsys):
    # A pair with a side missing is left out, as `train` drops it, and the note names its rows.
    rows = [{"en": "Jesus wept.", "es": "Jesús lloró."}, {"en": "And God said.", "es": None},
            {"en": "Let there be light.", "es": "Sea la luz."}, {"en": "   ", "es": "Y fue la luz."}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    assert main(["evaluate", "--model", str(hub_tiny_folder), "--dataset", str(tmp_path), *GREEDY]) == 0
    out, err = capsys.readouterr()
    assert "note: 2 of 4 pairs left out: a side is missing or blank (rows 2, 4)" in err
    assert "2 segments translated" in out and "BLEU = " in out


def test_evaluate_warns_when_the_data_is_another_language_pair(hub_tiny_folder, capsys):
    # The model stores its language pair: scoring it on another pair is said.
    assert main(["evaluate", "--model", str(hub_tiny_folder), "--dataset", "bible-en-fr", "--max-samples", "2", *GREEDY]) == 0
    err = capsys.readouterr().err
    assert ("warning: the model translates en->es (trained on bible-en-es), not en->fr: its output will not be in the "
            "language asked for; scoring bible-en-fr test (en->fr) anyway") in err
    assert main(["evaluate", "--model", str(hub_tiny_folder), "--max-samples", "2", *GREEDY]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.slow
def test_help_is_instant_and_imports_neither_torch_nor_transformers():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    start = time.perf_counter()
    shown = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "--help"], capture_output=True, text=True,
                           env=env, timeout=60)
    seconds = time.perf_counter() - start
    assert shown.returncode == 0 and "COMMAND" in shown.stdout
    assert seconds < 2, f"--help took {seconds:.1f} s"  # importing torch and transformers would take seconds
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, vanilla_transformer.cli as cli; cli.build_parser().format_help(); "
         "print(sorted({'torch', 'transformers', 'datasets'} & set(sys.modules)))"],
        capture_output=True, text=True, env=env, timeout=60)
    assert imported.stdout.strip() == "[]", imported.stderr
    # The classes still come with their registration: the Auto classes know the model in this process.
    registered = subprocess.run(
        [sys.executable, "-c", "from vanilla_transformer import VanillaTransformerConfig as C\n"
         "from transformers import AutoConfig\nprint(type(AutoConfig.for_model(C.model_type)).__name__)"],
        capture_output=True, text=True, env=env, timeout=120)
    assert registered.stdout.strip() == "VanillaTransformerConfig", registered.stderr


def test_translate_nbest_with_scores_gives_n_ranked_lines_per_text(hub_tiny_folder, hub_tiny_model, capsys):
    texts = [LINES[0], "", LINES[2]]
    assert main(["translate", "--model", str(hub_tiny_folder), "--nbest", "3", "--with-scores", "--num-beams", "3",
                 "--max-new-tokens", "12", *texts]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 * len(texts) and lines[3:6] == ["1\t\t"] * 3  # a blank text: N lines, no score, no text
    assert [line.split("\t")[0] for line in lines] == ["0"] * 3 + ["1"] * 3 + ["2"] * 3  # each the index of its text
    lines = [line.split("\t", 1)[1] for line in lines]
    model, tokenizer = hub_tiny_model
    best = translate_texts(model, tokenizer, texts, num_beams=3, max_new_tokens=12)
    for first in (0, 6):
        scores, hypotheses = zip(*(line.split("\t", 1) for line in lines[first : first + 3]))
        assert hypotheses[0] == best[first // 3]  # the best of the n is what translate writes
        assert list(map(float, scores)) == sorted(map(float, scores), reverse=True) and float(scores[0]) < 0
        assert len(set(hypotheses)) == 3
    # The scores are generate's own `sequences_scores`, as Python has them.
    inputs = tokenizer([texts[2]], return_tensors="pt")
    output = model.generate(**inputs, num_beams=3, num_return_sequences=3, max_new_tokens=12, output_scores=True,
                            return_dict_in_generate=True)
    assert [f"{score:.4f}" for score in output.sequences_scores.tolist()] == [line.split("\t")[0] for line in lines[6:]]


@pytest.mark.slow
def test_translate_nbest_lines_carry_the_index_of_their_input_line_across_batches(hub_tiny_folder):
    """Each of the N lines of an input carries its index, so that a script need not count them."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "vanilla_transformer.cli", "translate", "--model", str(hub_tiny_folder), "--nbest", "2",
         "--with-scores", "--batch-size", "2", *GREEDY],
        input="\n".join(LINES) + "\n", capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    assert [int(row[0]) for row in rows] == [0, 0, 1, 1, 2, 2, 3, 3] and {len(row) for row in rows} == {3}
    assert rows[2] == rows[3] == ["1", "", ""]  # the blank line
    assert all(float(row[1]) < 0 and row[2] for i, row in enumerate(rows) if i not in (2, 3))


def test_translate_nbest_without_scores_and_greedy_scores(hub_tiny_folder, hub_tiny_model, capsys):
    from vanilla_transformer.inference import translate_nbest

    model, tokenizer = hub_tiny_model
    assert main(["translate", "--model", str(hub_tiny_folder), "--nbest", "2", "--max-new-tokens", "12", LINES[2]]) == 0
    assert capsys.readouterr().out.splitlines() == [f"0\t{text}" for text, _ in translate_nbest(
        model, tokenizer, [LINES[2]], nbest=2, max_new_tokens=12)[0]]
    # Greedy keeps no sequence score: the sum of its tokens' log-probabilities, as teacher forcing gives it.
    [[(text, score)]] = translate_nbest(model, tokenizer, [LINES[2]], num_beams=1, max_new_tokens=12)
    assert text == translate_texts(model, tokenizer, [LINES[2]], num_beams=1, max_new_tokens=12)[0]
    source = tokenizer([LINES[2]], return_tensors="pt")
    output = model.generate(**source, num_beams=1, max_new_tokens=12)
    labels = output[:, 1:].masked_fill(output[:, 1:] == tokenizer.pad_token_id, -100)
    with torch.no_grad():
        logits = model(**source, decoder_input_ids=output[:, :-1]).logits
    log_probs = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    assert score == pytest.approx(float(log_probs[labels != -100].sum()), abs=1e-3)


@pytest.mark.slow
def test_translate_on_standard_input_answers_each_line_before_the_next_comes(hub_tiny_folder, hub_tiny_model):
    """A person at a terminal: write one line, read its translation, then write the next."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "vanilla_transformer.cli", "translate", "--model", str(hub_tiny_folder), *GREEDY],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, bufsize=1,
    )
    watchdog = threading.Timer(240, process.kill)  # a line held back for a batch would block readline forever
    watchdog.start()
    try:
        answers = []
        for line in (LINES[0], LINES[2]):
            process.stdin.write(line + "\n")
            process.stdin.flush()
            answers.append(process.stdout.readline())
        process.stdin.close()
        assert process.wait(60) == 0
    finally:
        watchdog.cancel()
    model, tokenizer = hub_tiny_model
    assert answers == [text + "\n" for text in translate_texts(model, tokenizer, [LINES[0], LINES[2]], num_beams=1,
                                                               max_new_tokens=12)]


def test_evaluate_scores_a_source_file_against_a_reference_file(hub_tiny_folder, tmp_path, capsys):
    from vanilla_transformer.corpora import load_translation_dataset, text_pairs

    english, spanish = text_pairs(load_translation_dataset("bible-en-es")["test"], "en", "es")
    (tmp_path / "test.en").write_text("".join(text + "\n" for text in english[:6]), encoding="utf-8")
    (tmp_path / "test.es").write_text("".join(text + "\n" for text in spanish[:6]), encoding="utf-8")
    assert main(["evaluate", "--model", str(hub_tiny_folder), "--source-file", str(tmp_path / "test.en"),
                 "--reference-file", str(tmp_path / "test.es"), *GREEDY]) == 0
    from_files = capsys.readouterr().out.splitlines()
    assert from_files[0].startswith(f"{tmp_path / 'test.en'} against {tmp_path / 'test.es'}: 6 segments translated")
    assert main(["evaluate", "--model", str(hub_tiny_folder), "--max-samples", "6", *GREEDY]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == from_files[1:]  # the same numbers as the data set's 6 pairs


def test_evaluate_reads_a_headerless_tsv_whose_columns_are_named(hub_tiny_folder, tmp_path, capsys):
    """--columns names the columns of a file without a header row."""
    (tmp_path / "pairs.tsv").write_text("Jesus wept.\tJesús lloró.\nAnd God said.\tY dijo Dios.\n", encoding="utf-8")
    assert main(["evaluate", "--model", str(hub_tiny_folder), "--dataset", str(tmp_path / "pairs.tsv"),
                 "--columns", "en,es", "--split", "train", *GREEDY]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'pairs.tsv'} train en->es: 2 segments translated")


def test_evaluate_without_dataset_scores_the_data_set_the_model_records(hub_tiny_folder, tmp_path, capsys):
    """Without --dataset, the data set the model records is scored, not the embedded en-es Bible."""
    from vanilla_transformer.corpora import load_translation_dataset, text_pairs

    english, spanish = text_pairs(load_translation_dataset("bible-en-es")["validation"], "en", "es")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "dev.en").write_text("".join(text + "\n" for text in english[:3]), encoding="utf-8")
    (corpus / "dev.es").write_text("".join(text + "\n" for text in spanish[:3]), encoding="utf-8")
    model = shutil.copytree(hub_tiny_folder, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "dataset_name": str(corpus)}))
    assert main(["evaluate", "--model", str(model), "--split", "valid", *GREEDY]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"{corpus} valid en->es: 3 segments translated") and "warning" not in err
    (model / "config.json").write_text(json.dumps({**config, "dataset_name": None}))
    with pytest.raises(SystemExit):
        main(["evaluate", "--model", str(model), *GREEDY])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "records no data set (its config.json has no dataset_name); name one with --dataset, or give --source-file "
        "and --reference-file")


def _test_split(tmp_path):
    """A data set folder with a test split of two pairs, for the tests that are refused before it is read."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_text("".join(json.dumps({"translation": {"src": text, "tgt": text}}) + "\n"
                                             for text in ("a b c", "d e f")))
    return data


@pytest.mark.parametrize("kind", ["link", "pipe"])
def test_single_file_outputs_refuse_a_link_or_a_device(tmp_path, kind, capsys):
    # Written to a temporary file and renamed into place, an output would replace the link or the device
    # itself (/dev/null, as root, becomes a plain file).
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    target = tmp_path / "target.txt"
    target.write_text("kept\n")
    special = tmp_path / "special.html"
    if kind == "link":
        special.symlink_to(target)
    else:
        os.mkfifo(special)
    for argv, message in (
        (["evaluate", "--model", str(model), "--dataset", str(_test_split(tmp_path)), "--hypotheses-out", str(special)],
         f"--hypotheses-out {special} is a link or a device"),
        (["attention", "--model", str(model), "x", "--html", str(special)], f"`--html` {str(special)!r} is a link or a device"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        assert message in capsys.readouterr().err
    assert special.is_symlink() if kind == "link" else not special.is_file()
    assert target.read_text() == "kept\n"


def _evaluate(model, data, *outputs):
    return main(["evaluate", "--model", str(model), "--dataset", str(data), "--max-samples", "2",
                 "--num-beams", "1", *outputs])


@pytest.mark.parametrize("case", ["the data file", "a file of the model", "the other output"])
def test_evaluate_refuses_an_output_that_is_an_input_or_the_other_output(tmp_path, case, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = _test_split(tmp_path)
    test_file = data / "test.jsonl"
    data_before = test_file.read_bytes()
    hypotheses, references = {
        "the data file": (test_file, tmp_path / "ref.txt"),
        "a file of the model": (model / "config.json", tmp_path / "ref.txt"),
        "the other output": (tmp_path / "same.txt", tmp_path / "same.txt"),
    }[case]
    with pytest.raises(SystemExit) as stop:
        _evaluate(model, data, "--hypotheses-out", str(hypotheses), "--references-out", str(references))
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    if case == "the other output":
        assert f"--references-out {references} is also the file of --hypotheses-out" in error
    else:
        assert f"--hypotheses-out {hypotheses} is an input of this command" in error
    assert test_file.read_bytes() == data_before and (model / "config.json").read_text() == "{}"
    assert not references.exists()


def test_translate_sorts_a_file_by_length_across_several_batches(hub_tiny_folder, hub_tiny_model, tmp_path, capsys,
                                                                 monkeypatch):
    # A file went to the model 32 lines at a time, each batch padded to its longest line, as the pipeline does.
    from vanilla_transformer import inference

    seen = []
    translate = inference.translate_texts
    monkeypatch.setattr(inference, "translate_texts", lambda model, tokenizer, texts, **options:
                        seen.append(len(texts)) or translate(model, tokenizer, texts, **options))
    lines = [LINES[i % len(LINES)] + " Amen." * (i % 5) for i in range(20)]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["translate", "--model", str(hub_tiny_folder), *GREEDY, "--batch-size", "2", "--input-file",
                 str(tmp_path / "in.txt")]) == 0
    assert seen == [16, 4]  # 8 batches sorted together, then the rest
    assert capsys.readouterr().out.splitlines() == translate(*hub_tiny_model, lines, num_beams=1, max_new_tokens=12)


@pytest.mark.slow
def test_translate_writes_what_the_folders_pipeline_writes(hub_tiny_folder, tmp_path):
    from transformers import pipeline

    lines = [LINES[i % len(LINES)] + " Amen." * (i % 7) for i in range(40)]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "vanilla_transformer.cli", "translate", "--model", str(hub_tiny_folder),
                             "--input-file", str(tmp_path / "in.txt"), "--num-beams", "1", "--batch-size", "8"],
                            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    translate = pipeline("translation", model=str(hub_tiny_folder), trust_remote_code=True, device="cpu")
    expected = [" ".join(r["translation_text"].splitlines()) for r in translate(lines, batch_size=8, num_beams=1)]
    assert result.stdout.splitlines() == expected


def _deliberate_bug(*args, **kwargs):
    raise TypeError("a deliberate bug")


@pytest.mark.parametrize("argv, function", [
    (["translate", "--model", "{folder}", "Jesus wept."], "vanilla_transformer.cli.translators.translator"),
    (["translate", "--model", "{folder}", "Jesus wept."], "vanilla_transformer.inference.translate_texts"),
    (["translate", "--model", "{folder}", "--device", "cpu", "Jesus wept."], "torch.device"),
    (["evaluate", "--model", "{folder}", "--source-file", "{lines}", "--reference-file", "{lines}"],
     "vanilla_transformer.cli.translators.translator"),
    (["attention", "--model", "{folder}", "Jesus wept.", "--output-dir", "{maps}"],
     "vanilla_transformer.inference.load_model"),
])
def test_a_type_error_in_the_code_is_a_traceback_not_a_refused_input(argv, function, hub_tiny_folder, tmp_path,
                                                                      monkeypatch):
    # A TypeError is a bug in the code, not in what the user typed: it must not be shown as a one-line refusal.
    (tmp_path / "lines.txt").write_text("Jesus wept.\n")
    paths = {"folder": hub_tiny_folder, "lines": tmp_path / "lines.txt", "maps": tmp_path / "maps"}
    monkeypatch.setattr(function, _deliberate_bug)
    with pytest.raises(TypeError, match="a deliberate bug"):
        main([arg.format(**paths) for arg in argv])


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
from vanilla_transformer.staging import DiskFull

def fill_the_disk(args):  # what a write to a full disk raises, naming its file
    path = os.path.join(args.output_dir, "tokenizer.json")
    raise {error}

train_tokenizer.run = fill_the_disk
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("error, reason", [
    ("OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)", "No space left on device"),  # as os.open raises it
    ("OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), path)", "Disk quota exceeded"),
    ('DiskFull(f"could not write {path}: no space left on device")', "no space left on device"),  # staging's
])
def test_a_full_disk_names_the_file_that_could_not_be_written(tmp_path, error, reason):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _FULL_DISK_AT.format(error=error), "train-tokenizer", "--output-dir",
                             str(tmp_path / "tok")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (f"vanilla-transformer train-tokenizer: error: "
                                                      f"{'could not' if 'DiskFull' in error else 'cannot'} write "
                                                      f"{tmp_path / 'tok' / 'tokenizer.json'}: {reason}")
