"""The shipped `evaluate` metric: sacrebleu's command-line BLEU and chrF, loaded offline from the package."""

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import evaluate
import numpy as np
import pytest
from transformers import EvalPrediction

from vanilla_transformer import metrics
from vanilla_transformer.corpora import load_translation_dataset, text_pairs
from vanilla_transformer.inference import score_translations
from vanilla_transformer.tokenizer import train_tokenizer

SACREBLEU = Path(sys.executable).parent / "sacrebleu"  # the command line of the sacrebleu we test against
KEYS = {"bleu", "chrf", "bleu_signature", "chrf_signature", "bleu_text", "chrf_text"}


@pytest.fixture(scope="module")
def spanish():
    """The Spanish side of the embedded en-es test split: 634 real verses, one line each."""
    references = text_pairs(load_translation_dataset("bible-en-es")["test"], "en", "es")[1]
    return [" ".join(text.split()) for text in references]


def perturb(sentences, seed):
    """Translations of mixed quality: some exact, others with a word dropped, two words swapped,
    lower-cased, cut in half, or empty."""
    rng = random.Random(seed)
    out = []
    for sentence in sentences:
        words, draw = sentence.split(), rng.random()
        if draw < 0.05:
            words = []
        elif draw < 0.3 and len(words) > 2:
            del words[rng.randrange(len(words))]
        elif draw < 0.5 and len(words) > 2:
            i = rng.randrange(len(words) - 1)
            words[i], words[i + 1] = words[i + 1], words[i]
        elif draw < 0.6:
            words = [word.lower() for word in words]
        elif draw < 0.7:
            words = words[: len(words) // 2]
        out.append(" ".join(words))
    return out


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def sacrebleu_command_line(references: list[str], hypotheses: str) -> dict:
    """`sacrebleu REF... -i HYP -m bleu chrf -f text -w 10`, as {name: (signature, score, rest of the line)}."""
    command = [str(SACREBLEU), *references, "-i", hypotheses, "-m", "bleu", "chrf", "-f", "text", "-w", "10"]
    printed = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    scores = {}
    for line in printed.splitlines():
        head, tail = line.strip().split(" = ", 1)
        name, signature = head.split("|", 1)
        score, _, rest = tail.partition(" ")
        scores[name] = (signature, score, rest)
    return scores


def assert_same_as_command_line(ours: dict, command_line: dict):
    assert set(ours) == KEYS
    assert set(command_line) == {"BLEU", "chrF2"}
    signature, score, rest = command_line["BLEU"]
    assert (ours["bleu_signature"], f"{ours['bleu']:.10f}") == (signature, score)
    assert ours["bleu_text"] == f"BLEU = {ours['bleu']:.2f} {rest}"  # precisions, BP, ratio and lengths too
    signature, score, _ = command_line["chrF2"]
    assert (ours["chrf_signature"], f"{ours['chrf']:.10f}") == (signature, score)
    assert ours["chrf_text"] == f"chrF2 = {ours['chrf']:.2f}"


@pytest.mark.slow
def test_evaluate_load_offline_gives_the_numbers_of_the_sacrebleu_command_line(spanish, tmp_path):
    hypotheses = perturb(spanish, seed=0)
    (tmp_path / "inputs.json").write_text(json.dumps({"predictions": hypotheses, "references": spanish}), encoding="utf-8")
    # A user's fresh process, offline, with an empty module cache: evaluate copies the script from the package.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    code = f"""
        import json
        import evaluate
        from vanilla_transformer.metrics import BLEU_CHRF

        inputs = json.load(open({str(tmp_path / "inputs.json")!r}, encoding="utf-8"))
        print(json.dumps(evaluate.load(BLEU_CHRF).compute(**inputs)))
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "%|" not in result.stderr  # no progress bar
    ours = json.loads(result.stdout)

    command_line = sacrebleu_command_line([write_lines(tmp_path / "ref.txt", spanish)], write_lines(tmp_path / "hyp.txt", hypotheses))
    assert_same_as_command_line(ours, command_line)
    assert ours["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|")
    assert ours["chrf_signature"].startswith("nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|")
    assert 20 < ours["bleu"] < 95 and 20 < ours["chrf"] < 95  # a real test: neither trivial nor perfect


@pytest.mark.slow
def test_several_references_per_prediction(spanish, tmp_path):
    spanish = spanish[:200]
    hypotheses, second = perturb(spanish, seed=1), perturb(spanish, seed=2)
    metric = evaluate.load(os.path.dirname(metrics.BLEU_CHRF))  # the folder loads too
    ours = metric.compute(predictions=hypotheses, references=[list(pair) for pair in zip(spanish, second)])

    files = [write_lines(tmp_path / "ref1.txt", spanish), write_lines(tmp_path / "ref2.txt", second)]
    assert_same_as_command_line(ours, sacrebleu_command_line(files, write_lines(tmp_path / "hyp.txt", hypotheses)))
    assert ours["bleu_signature"].startswith("nrefs:2|")
    one = metric.compute(predictions=hypotheses, references=spanish)
    assert metric.compute(predictions=hypotheses, references=[[text] for text in spanish]) == one
    assert ours["bleu"] > one["bleu"]


def test_batches_add_up_to_one_compute(spanish):
    metric = evaluate.load(metrics.BLEU_CHRF)
    references = spanish[:100]
    hypotheses = perturb(references, seed=3)
    for start in range(0, 100, 30):
        metric.add_batch(predictions=hypotheses[start : start + 30], references=references[start : start + 30])
    metric.add(prediction="Jesús lloró.", reference="Jesús lloró.")
    expected = metrics.load_bleu_chrf().compute(predictions=[*hypotheses, "Jesús lloró."], references=[*references, "Jesús lloró."])
    assert metric.compute() == expected


@pytest.mark.parametrize("predictions, references, error, message", [
    (["a", "b"], ["a"], ValueError, "2 `predictions` but 1 `references`; they must pair up"),
    ([], [], ValueError, "nothing to score: `predictions` and `references` are empty"),
    ("a b", ["a b"], TypeError, "`predictions` must be a list, one entry per segment; got str"),
    (["a", None], ["a", "b"], TypeError, "`predictions[1]` must be a string; got NoneType"),
    ([[5, 9, 2]], ["a"], TypeError, "`predictions[0]` must be a string; got list"),  # token ids, not decoded
    (["a", "b"], ["a", 3], TypeError, "`references[1]` is of type int, but `references[0]` is a string"),
    (["a", "b"], [["a"], "b"], TypeError, "`references[1]` is of type str: give every segment one reference string"),
    (["a", "b"], [["a", "x"], ["b"]], ValueError, "`references[1]` holds 1 references but `references[0]` 2"),
    (["a"], [[]], ValueError, "`references[0]` is an empty list"),
    (["a"], [["a", 3]], TypeError, "`references[0][1]` must be a string; got int"),
])
def test_bad_inputs_are_clear_errors(predictions, references, error, message):
    metric = metrics.load_bleu_chrf()
    with pytest.raises(error) as raised:
        metric.compute(predictions=predictions, references=references)
    assert message in str(raised.value)
    assert metric.compute(predictions=["Jesús lloró."], references=["Jesús lloró."])["chrf"] == 100.0  # still usable


def test_our_scoring_uses_the_metric_loaded_once(spanish):
    assert metrics.load_bleu_chrf() is metrics.load_bleu_chrf()
    hypotheses = perturb(spanish[:50], seed=4)
    assert score_translations(hypotheses, spanish[:50]) == metrics.load_bleu_chrf().compute(predictions=hypotheses, references=spanish[:50])
    with pytest.raises(ValueError, match="pair up"):
        score_translations(hypotheses, spanish[:49])


def test_the_script_imports_only_what_evaluate_can_check():
    """evaluate reads the script's imports line by line (`import a, b` would be a module named "a,")."""
    imports = evaluate.loading.get_imports(metrics.BLEU_CHRF)
    assert {(kind, name) for kind, name, *_ in imports} == {("library", "datasets"), ("library", "evaluate"), ("library", "sacrebleu")}


# The README's example: scoring Seq2SeqTrainer(..., compute_metrics=compute_metrics) with
# Seq2SeqTrainingArguments(predict_with_generate=True). `tokenizer` is the model's.
def make_compute_metrics(tokenizer):
    bleu_chrf = evaluate.load(metrics.BLEU_CHRF)

    def compute_metrics(eval_pred):
        """BLEU and chrF of the generated translations against the labels."""
        predictions, labels = eval_pred.predictions, eval_pred.label_ids
        # The Trainer pads labels, and generations gathered from batches of different lengths, with -100.
        predictions = np.where(predictions != -100, predictions, tokenizer.pad_token_id)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        hypotheses = tokenizer.batch_decode(predictions, skip_special_tokens=True)
        references = tokenizer.batch_decode(labels, skip_special_tokens=True)
        result = bleu_chrf.compute(predictions=hypotheses, references=references)
        return {"bleu": result["bleu"], "chrf": result["chrf"]}

    return compute_metrics


def test_compute_metrics_for_seq2seq_trainer(spanish):
    references = spanish[:64]
    hypotheses = perturb(references, seed=5)
    tokenizer = train_tokenizer(spanish, vocab_size=500)
    labels = tokenizer(text_target=references, padding=True, return_tensors="np")["input_ids"]
    labels[labels == tokenizer.pad_token_id] = -100  # as DataCollatorForSeq2Seq pads them
    # Two generation batches of different lengths (each padded with pad_token_id by generate), put in one
    # array by the Trainer, which pads the shorter with -100.
    halves = [tokenizer(hypotheses[i : i + 32], padding=True, return_tensors="np")["input_ids"] for i in (0, 32)]
    width = max(half.shape[1] for half in halves)
    generated = np.concatenate([np.pad(half, ((0, 0), (0, width - half.shape[1])), constant_values=-100) for half in halves])
    assert (generated == -100).any() and (generated == tokenizer.pad_token_id).any()

    scores = make_compute_metrics(tokenizer)(EvalPrediction(predictions=generated, label_ids=labels))
    expected = metrics.load_bleu_chrf().compute(predictions=hypotheses, references=references)
    assert scores == {"bleu": expected["bleu"], "chrf": expected["chrf"]}
    json.dumps(scores)
