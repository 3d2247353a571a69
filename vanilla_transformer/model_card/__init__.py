"""The model card (README.md) of a saved model, built with huggingface_hub's `ModelCard`.

The metadata (languages, licence, library, tags, data set, scores as `model-index`) is a
`ModelCardData`, so huggingface_hub writes and validates the YAML; the body is the Jinja template
`template.md` beside this file, filled by `ModelCard.from_template`.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

__all__ = ["METRICS", "TEMPLATE", "build_model_card", "metrics_from_results"]

TEMPLATE = Path(__file__).resolve().parent / "template.md"

# Result keys the card reports, as written in `results` ("bleu", or with a split: "test_bleu"),
# and their display names. `model-index` metric types follow the Hub's metric ids.
METRICS = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER", "perplexity": "perplexity", "loss": "loss"}
_SPLIT_PREFIXES = {"test": "test", "eval": "validation", "validation": "validation", "valid": "validation", "train": "train"}
_LANGUAGE_NAMES = {"en": "English", "es": "Spanish", "fr": "French", "de": "German"}
_EXAMPLES = {"en": "In the beginning God created the heavens and the earth."}


def metrics_from_results(results: dict | None) -> list[dict]:
    """The known metrics in a flat results dict, as `{"type", "name", "split", "value"}`, in METRICS order."""
    found = []
    for key, value in (results or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        prefix, _, metric = key.lower().rpartition("_")
        if metric not in METRICS or (prefix and prefix not in _SPLIT_PREFIXES):
            continue
        split = _SPLIT_PREFIXES[prefix] if prefix else str((results or {}).get("split", "test"))
        found.append({"type": metric, "name": METRICS[metric], "split": split, "value": round(float(value), 2)})
    return sorted(found, key=lambda m: (list(METRICS).index(m["type"]), m["split"]))


def _signature(results: dict | None, metric: str) -> str | None:
    """sacrebleu's signature of a metric: `<metric>_signature`, or one `sacrebleu_signature` for all."""
    results = results or {}
    if metric not in ("bleu", "chrf", "ter"):
        return None
    return results.get(f"{metric}_signature") or results.get("sacrebleu_signature")


def build_model_card(
    config,
    *,
    results: dict | None = None,
    dataset: str | None = None,
    source_lang: str | None = None,
    target_lang: str | None = None,
    hyperparameters: dict | None = None,
    repo_id: str = "your-name/vanilla-transformer",
    license: str = "apache-2.0",
    image: str | None = None,
    num_parameters: int | None = None,
    example: str | None = None,
    max_length: int | None = None,
) -> ModelCard:
    """A `ModelCard` for a model with `config` (a VanillaTransformerConfig), trained on `dataset`.

    `results` is the flat dict of scores (see `metrics_from_results`); `image` a heat map file name
    inside the repository; `example` a source sentence for the usage snippets.
    """
    if hyperparameters is not None and not isinstance(hyperparameters, dict):
        raise TypeError(f"`hyperparameters` must be a dict; got {type(hyperparameters).__name__}")
    languages = [lang for lang in (source_lang, target_lang) if lang]
    pair = f"{source_lang}-{target_lang}" if source_lang and target_lang else None
    model_name = repo_id.split("/")[-1]
    metrics = metrics_from_results(results)
    dataset_name = dataset or "unknown"
    eval_results = [
        EvalResult(
            task_type="translation",
            task_name=f"Translation {pair}" if pair else "Translation",
            dataset_type=dataset_name,
            dataset_name=dataset_name,
            dataset_config=pair,
            dataset_split=metric["split"],
            metric_type=metric["type"],
            metric_name=metric["name"],
            metric_value=metric["value"],
            metric_config=_signature(results, metric["type"]),
        )
        for metric in metrics
    ]
    card_data = ModelCardData(
        language=languages or None,
        license=license,
        library_name="transformers",
        pipeline_tag="translation",
        tags=["translation", "transformer", "attention-is-all-you-need", "vanilla-transformer", "custom_code"]
        + ([pair] if pair else []),
        datasets=[dataset] if dataset else None,
        metrics=sorted({metric["type"] for metric in metrics}) or None,
        model_name=model_name,
        eval_results=eval_results or None,
    )
    names = [_LANGUAGE_NAMES.get(lang, lang) for lang in languages]
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        model_name=model_name,
        pair_text=" to ".join(names) if len(names) == 2 else "between two languages",
        config=config,
        num_parameters=f"{num_parameters:,}" if num_parameters else "not recorded",
        dataset=dataset,
        dataset_note="verse-aligned Bible translations embedded in the package" if dataset and dataset.startswith("bible-") else None,
        bible=bool(dataset and dataset.startswith("bible-")),
        hyperparameters=hyperparameters,
        metrics=metrics,
        signatures=sorted({s for s in (_signature(results, m) for m in ("bleu", "chrf")) if s}),
        repo_id=repo_id,
        example=(example or _EXAMPLES.get(source_lang or "en", "...")).replace('"', '\\"'),
        image=image,
        max_length=max_length or getattr(config, "max_position_embeddings", 1024),
    )
