"""The model card: huggingface_hub metadata that parses back, and a body with what a user needs."""

import ast
import re
import shlex

import pytest
from huggingface_hub import ModelCard

from vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.model_card import build_model_card, card_repo_id, metrics_from_results, retarget_card

RESULTS = {
    "split": "test",
    "bleu": 27.346,
    "chrf": 55.1,
    "sacrebleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
    "validation_perplexity": 9.81,
    "train_runtime_s": 1234.5,  # not a metric: results.json keeps it, the card does not list it
    "steps": 20000,  # trained: the recipe's steps
}


@pytest.fixture(scope="module")
def card():
    config = VanillaTransformerConfig.from_preset("base", vocab_size=8000)
    return build_model_card(
        config,
        results=RESULTS,
        dataset="bible-en-es",
        source_lang="en",
        target_lang="es",
        hyperparameters={"max_steps": 20000, "warmup_steps": 4000, "label_smoothing": 0.1},
        repo_id="someone/vanilla-en-es",
        image="attention.png",
        num_parameters=52_000_123,
    )


def test_metadata_parses_back_with_the_results_as_model_index(card, tmp_path):
    card.save(tmp_path / "README.md")
    data = ModelCard.load(tmp_path / "README.md").data
    assert data.language == ["en", "es"]
    assert data.license == "apache-2.0"
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "translation"
    assert data.datasets == ["bible-en-es"]
    assert {"translation", "custom_code", "en-es"} <= set(data.tags)
    scores = {(r.metric_type, r.dataset_split): r.metric_value for r in data.eval_results}
    assert scores == {("bleu", "test"): 27.35, ("chrf", "test"): 55.1, ("perplexity", "validation"): 9.81}
    bleu = next(r for r in data.eval_results if r.metric_type == "bleu")
    assert bleu.task_type == "translation" and bleu.dataset_name == "bible-en-es"
    assert bleu.metric_config == RESULTS["sacrebleu_signature"]


def test_body_has_architecture_training_usage_image_and_limitations(card):
    body = card.text
    for expected in (
        "| encoder / decoder layers (N) | 6 / 6 |", "| d_model | 512 |", "| attention heads (h) | 8", "| d_ff | 2048 |",
        "52,000,123", "| warmup_steps | 4000 |", "| BLEU | test | 27.35 |", RESULTS["sacrebleu_signature"],
        "AutoModelForSeq2SeqLM.from_pretrained('someone/vanilla-en-es', trust_remote_code=True)",
        "pipeline(\"translation\", model='someone/vanilla-en-es', trust_remote_code=True)",
        "vanilla-transformer translate --model someone/vanilla-en-es",
        "![attention heat map](attention.png)", "does **not** translate\nnews", "English to Spanish",
        "@inproceedings{vaswani2017attention", "## Evaluation", "β2 = 0.98", "20,000 steps",
        "min(step^-0.5, step · warmup^-1.5) with warmup = 4000 (§5.3)", "label smoothing ε_ls = 0.1 (§5.4)",
    ):
        assert expected in body, expected
    assert "{{" not in body and "{%" not in body


def test_card_without_results_or_image_says_so():
    card = build_model_card(VanillaTransformerConfig.from_preset("tiny", vocab_size=500), source_lang="de", target_lang="en")
    assert card.data.eval_results is None
    assert "No evaluation results were recorded." in card.text
    assert "were not recorded" in card.text and "![" not in card.text
    assert "Bible" not in card.text and "Recipe" not in card.text  # no training loop's settings: no recipe claimed


def test_metrics_are_read_with_their_split():
    found = metrics_from_results({"eval_bleu": 3.0, "test_chrf": 20.0, "loss": 1.5, "steps": 10, "best": True, "note_bleu": 1})
    assert [(m["type"], m["split"]) for m in found] == [("bleu", "validation"), ("chrf", "test"), ("loss", "test")]
    assert [m["split"] for m in metrics_from_results({"dev_bleu": 3.0, "valid_chrf": 2.0})] == ["validation", "validation"]


def test_bad_hyperparameters_are_refused():
    with pytest.raises(TypeError, match="`hyperparameters` must be a dict"):
        build_model_card(VanillaTransformerConfig.from_preset("tiny", vocab_size=500), hyperparameters=["lr", 1])


HOSTILE = '"); import os; os.system("echo pwned") # $(touch /tmp/x) `id` \'; <script>alert(1)</script>\n```\nrm -rf ~'


@pytest.fixture(scope="module")
def hostile_card():
    """Every text the card takes from the data or the options, written to break out of where it lands."""
    return build_model_card(
        VanillaTransformerConfig.from_preset("tiny", vocab_size=500),
        results={"split": "test</td><script>x</script>", "bleu": 3.0, "sacrebleu_signature": "`x` <script>s</script>"},
        dataset="bible-<script>alert(1)</script>",
        source_lang="en",
        target_lang="[es](javascript:alert(1))<img src=x onerror=alert(1)>",
        hyperparameters={"<script>": "| x | `y` <b>"},
        repo_id="someone/vanilla-en-es",
        example=HOSTILE,
    )


def _blocks(text, language):
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def test_python_snippets_hold_the_sentence_as_one_string_and_run_nothing_else(hostile_card):
    sentence = " ".join(HOSTILE.split())  # the card shows it on one line
    for block in _blocks(hostile_card.text, "python"):
        tree = ast.parse(block)
        imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
        assert [node.module for node in imports] == ["transformers"]
        calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        assert calls <= {"AutoTokenizer.from_pretrained", "AutoModelForSeq2SeqLM.from_pretrained", "tokenizer",
                         "model.generate", "print", "tokenizer.batch_decode", "pipeline", "translate"}
        lists = [node for node in ast.walk(tree) if isinstance(node, ast.List)]
        assert [[ast.literal_eval(item) for item in node.elts] for node in lists] == [[sentence]]


def test_shell_lines_hold_the_sentence_as_one_argument(hostile_card):
    sentence = " ".join(HOSTILE.split())
    (block,) = _blocks(hostile_card.text, "bash")
    lines = block.splitlines()
    assert [shlex.split(line)[:5] for line in lines] == [
        ["vanilla-transformer", "translate", "--model", "someone/vanilla-en-es", sentence],
        ["vanilla-transformer", "attention", "--model", "someone/vanilla-en-es", sentence],
    ]


def test_markdown_holds_no_html_from_the_data(hostile_card, tmp_path):
    body = re.sub(r"^```\w*\n.*?^```", "", hostile_card.text, flags=re.MULTILINE | re.DOTALL)  # code shows as text
    assert body.count("```") == 0  # and no sentence closed a code block early
    assert not re.search(r"(?<!\\)[<>&]", body) and "[es](" not in body  # every <, > and & backslash-escaped
    assert "&#" not in body and "&lt;" not in body  # and no HTML entity, which shows as such where the card is text
    assert "English to \\[es\\](javascript:alert(1))\\<img src=x onerror=alert(1)\\>." in body  # text, not a link
    assert "Data: bible-\\<script\\>alert(1)\\</script\\>" in body
    assert "| \\<script\\> | \\| x \\| \\`y\\` \\<b\\> |" in body  # one row, two cells
    assert "sacrebleu signature: \\`x\\` \\<script\\>" in body
    hostile_card.save(tmp_path / "README.md")  # the front matter is YAML, written by huggingface_hub: it reads back as given
    data = ModelCard.load(tmp_path / "README.md").data
    assert data.datasets == ["bible-<script>alert(1)</script>"]
    assert data.language == ["en", "[es](javascript:alert(1))<img src=x onerror=alert(1)>"]


def test_retarget_points_the_snippets_title_and_model_index_at_the_repository(card, tmp_path):
    retargeted = retarget_card(card, "alice/x")
    assert card_repo_id(retargeted) == "alice/x"
    assert "someone/vanilla-en-es" not in retargeted.content
    assert "vanilla-transformer translate --model alice/x " in retargeted.text
    assert retargeted.text.startswith("\n# x\n") and retargeted.data.model_name == "x"
    retargeted.save(tmp_path / "README.md")
    data = ModelCard.load(tmp_path / "README.md").data
    assert data.model_name == "x" and len(data.eval_results) == len(card.data.eval_results)
    assert retarget_card(retargeted, "alice/x") is retargeted


def test_card_shows_apostrophes_claims_only_the_metrics_it_lists_and_no_sentinel():
    card = build_model_card(
        VanillaTransformerConfig.from_preset("tiny", vocab_size=500),
        results={"split": "test", "bleu": 3.0, "chrf": 20.0, "validation_perplexity": 40.0},
        dataset="opus-l'Europe", source_lang="fr", target_lang="en",
        hyperparameters={"max_steps": 30, "warmup_steps": 4000, "eval_steps": 1000, "save_steps": 10, "log_steps": 10**9},
        example="Et l'Éternel dit: « Qu'il y ait de la lumière »",
    )
    body = card.text
    assert "&#" not in body and "&lt;" not in body and "&amp;" not in body
    assert "Data: opus-l'Europe." in body  # shown as written (it was opus-l&#x27;Europe)
    assert "TER" not in body  # never computed, never claimed
    assert "BLEU and chrF are sacrebleu's, on the detokenized translations against one reference" in body
    assert "perplexity is the exponent of the per-token loss." in body
    assert "| eval_steps | never |" in body and "| log_steps | never |" in body and "| save_steps | 10 |" in body
    quickstart = build_model_card(VanillaTransformerConfig.from_preset("tiny", vocab_size=500), results={"validation_perplexity": 9.0},
                                  hyperparameters={"time_limit": 5.0, "eval_steps": 10**9, "warmup_steps": 100})
    assert "| eval_steps | never |" in quickstart.text and "1000000000" not in quickstart.text
    assert "Perplexity is the exponent of the per-token loss." in quickstart.text and "sacrebleu's" not in quickstart.text


def test_the_scores_say_how_many_sentences_of_the_split_they_cover():
    """A score of part of the split says so beside the score, not only in the hyper-parameters."""
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=100)
    part = build_model_card(config, results={**RESULTS, "scored_pairs": 200, "split_pairs": 634})
    whole = build_model_card(config, results={**RESULTS, "scored_pairs": 634, "split_pairs": 634})
    evaluation = {name: card.text.split("## Evaluation")[1].split("|")[0].strip() for name, card in
                  (("part", part), ("whole", whole))}
    assert evaluation["part"].startswith("Scored on the first 200 of the 634 sentences of the test split only "
                                         "(`test_samples`): the whole split's scores may differ. BLEU and chrF are")
    assert evaluation["whole"].startswith("Scored on all 634 sentences of the test split. BLEU and chrF are")
    assert "Scored on" not in build_model_card(config, results=RESULTS).text  # results that do not say
