"""The model card: huggingface_hub metadata that parses back, and a body with what a user needs."""

import pytest
from huggingface_hub import ModelCard

from vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.model_card import build_model_card, metrics_from_results

RESULTS = {
    "split": "test",
    "bleu": 27.346,
    "chrf": 55.1,
    "sacrebleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
    "validation_perplexity": 9.81,
    "train_runtime_s": 1234.5,  # not a metric: results.json keeps it, the card does not list it
}


@pytest.fixture(scope="module")
def card():
    config = VanillaTransformerConfig.base(vocab_size=8000)
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
        'AutoModelForSeq2SeqLM.from_pretrained("someone/vanilla-en-es", trust_remote_code=True)',
        'pipeline("translation", model="someone/vanilla-en-es", trust_remote_code=True)',
        "vanilla-transformer translate --model someone/vanilla-en-es",
        "![attention heat map](attention.png)", "does **not** translate\nnews", "English to Spanish",
    ):
        assert expected in body, expected
    assert "{{" not in body and "{%" not in body


def test_card_without_results_or_image_says_so():
    card = build_model_card(VanillaTransformerConfig.tiny(vocab_size=500), source_lang="de", target_lang="en")
    assert card.data.eval_results is None
    assert "No evaluation results were recorded." in card.text
    assert "were not recorded" in card.text and "![" not in card.text
    assert "Bible" not in card.text


def test_metrics_are_read_with_their_split():
    found = metrics_from_results({"eval_bleu": 3.0, "test_chrf": 20.0, "loss": 1.5, "steps": 10, "best": True, "note_bleu": 1})
    assert [(m["type"], m["split"]) for m in found] == [("bleu", "validation"), ("chrf", "test"), ("loss", "test")]


def test_bad_hyperparameters_are_refused():
    with pytest.raises(TypeError, match="`hyperparameters` must be a dict"):
        build_model_card(VanillaTransformerConfig.tiny(vocab_size=500), hyperparameters=["lr", 1])
