"""The model card (README.md) of a saved model, built with huggingface_hub's `ModelCard`.

The metadata (languages, licence, library, tags, data set, scores as `model-index`) is a
`ModelCardData`, so huggingface_hub writes and validates the YAML; the body is the Jinja template
`template.md` beside this file.

Every text that comes from the data or the options (the example sentence, the data set name, language
keys, hyper-parameters, signatures) is escaped for the place it lands in, with one filter each: `py` (a
Python string literal, `repr`), `sh` (one shell word, `shlex.quote`), `md` (Markdown text that no HTML,
link or code span can come out of) and `cell` (the same in a table cell). A sentence pasted from the card
is then only ever a sentence.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData

__all__ = ["METRICS", "TEMPLATE", "adapter_card", "build_model_card", "metrics_from_results"]

TEMPLATE = Path(__file__).resolve().parent / "template.md"

# Result keys the card reports, as written in `results` ("bleu", or with a split: "test_bleu"),
# and their display names. `model-index` metric types follow the Hub's metric ids.
METRICS = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER", "perplexity": "perplexity", "loss": "loss"}
_SPLIT_PREFIXES = {"test": "test", "eval": "validation", "validation": "validation", "valid": "validation", "dev": "validation",
                   "train": "train"}
_LANGUAGE_NAMES = {"en": "English", "es": "Spanish", "fr": "French", "de": "German"}
_EXAMPLES = {"en": "In the beginning God created the heavens and the earth."}


# What opens code spans, emphasis, links or HTML inline; a backslash makes each plain text (CommonMark), where
# an HTML entity would show as `&#x27;` wherever the card is read as text.
_MARKDOWN_SPECIALS = re.compile(r"([\\`*\[\]<>&])")
# Options that say how often something happens: one no run reaches is "never".
_INTERVALS = ("eval_steps", "save_steps", "log_steps")
_NO_RUN_REACHES = 10**9


def _one_line(text) -> str:
    """`text` on one line of printable characters: no line break can end a code block or start markup."""
    return " ".join("".join(c if c.isprintable() else " " for c in str(text)).split())


def _markdown(text) -> str:
    """Markdown text that renders as `text`: markup and HTML characters backslash-escaped."""
    return _MARKDOWN_SPECIALS.sub(r"\\\1", _one_line(text))


def _cell(text) -> str:
    """Markdown text for a table cell, where `|` would end the cell."""
    return _markdown(text).replace("|", "\\|")


_ENVIRONMENT = jinja2.Environment(keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
_ENVIRONMENT.filters.update(py=lambda text: repr(_one_line(text)), sh=lambda text: shlex.quote(_one_line(text)),
                            md=_markdown, cell=_cell)


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


def _recipe(hyperparameters: dict | None, config, trained_steps=None) -> list[str]:
    """The training recipe in the paper's terms, for the settings `vanilla-transformer train` records, with the
    steps the run trained (not `max_steps`, a limit it may never have reached)."""
    h = hyperparameters or {}
    if "warmup_steps" not in h:  # not a run of our training loop: its optimiser is unknown
        return []
    steps = f"; {trained_steps:,} steps" if _is_count(trained_steps) else ""
    recipe = [f"Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9{steps}"]
    if h.get("lr_schedule", "noam") == "noam":
        recipe.append(f"learning rate d_model^-0.5 · min(step^-0.5, step · warmup^-1.5) with warmup = {h['warmup_steps']} (§5.3)")
    else:
        recipe.append(f"the {h['lr_schedule']} learning-rate schedule with {h['warmup_steps']} warm-up steps (not the paper's)")
    if "label_smoothing" in h:
        recipe.append(f"label smoothing ε_ls = {h['label_smoothing']} (§5.4)")
    recipe.append(f"residual dropout P_drop = {config.dropout} (§5.4)")
    if "max_tokens" in h:
        recipe.append(f"batches of up to {h['max_tokens']} source and target tokens per process (§5.1)")
    if isinstance(h.get("average_last"), int) and h["average_last"] > 1:
        recipe.append(f"the final weights are the average of the last {h['average_last']} checkpoints (§6.1)")
    return [_markdown(item) for item in recipe]


def _shown_hyperparameters(hyperparameters: dict | None) -> dict | None:
    """The hyper-parameters as the card lists them: an interval past the last step (`eval_steps` 10**9 to
    turn evaluation off) is "never", not a number nobody ran."""
    if not hyperparameters:
        return hyperparameters
    last = hyperparameters.get("max_steps")
    last = last if isinstance(last, int) and not isinstance(last, bool) else _NO_RUN_REACHES - 1
    return {name: "never" if name in _INTERVALS and isinstance(value, int) and value > last else value
            for name, value in hyperparameters.items()}


def _training_time(results: dict | None) -> str | None:
    """How long the run trained, every part of it (the first session and each resume) counted, and each part's share."""
    minutes = (results or {}).get("train_minutes")
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)):
        return None
    parts = [p for p in results.get("parts") or [] if isinstance(p, dict) and {"steps", "seconds"} <= set(p)]
    steps = results.get("steps")
    text = f"Trained for {minutes:g} minutes{f' ({steps:,} steps)' if _is_count(steps) else ''}"
    if len(parts) > 1:
        shares = "; ".join(f"steps {p['steps'][0]}-{p['steps'][1]}: {p['seconds'] / 60:.2f} min" for p in parts)
        text += f", in {len(parts)} parts (the first session, then {len(parts) - 1} resume(s): {shares})"
    scoring = results.get("scoring_minutes")
    if isinstance(scoring, (int, float)) and not isinstance(scoring, bool):
        text += f"; validating and scoring took {scoring:g} minutes besides"
    not_scored = [str(name) for name in results.get("not_scored") or []]
    if not_scored:
        text += f". The final scoring was stopped: {', '.join(not_scored)} not scored"
    return _markdown(text + ".")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dataset_names(dataset: str | None) -> tuple[str | None, str | None]:
    """(the data set as the card names it, its name in the metadata): a local file or folder by its own name in
    the text and nowhere in the metadata, whose `datasets` are Hub data sets; an embedded corpus or a Hub data
    set as it is in both."""
    if not dataset:
        return None, None
    path = Path(dataset).expanduser()
    if os.path.isabs(dataset) or path.exists():
        return path.name or str(dataset), None
    return dataset, dataset


def _metrics_note(metrics: list[dict]) -> str:
    """What the scores listed are, naming only those the card lists."""
    names = list(dict.fromkeys(m["name"] for m in metrics if m["type"] in ("bleu", "chrf", "ter")))
    notes = []
    if names:
        listed = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        notes.append(f"{listed} {'are' if len(names) > 1 else 'is'} sacrebleu's, on the detokenized translations "
                     "against one reference (the signatures below say how)")
    if any(m["type"] == "perplexity" for m in metrics):
        notes.append("perplexity is the exponent of the per-token loss")
    text = "; ".join(notes)
    return f"{text[:1].upper()}{text[1:]}." if text else ""


def _scored_note(results: dict | None) -> str:
    """How many sentences of the headline split the scores cover (`scored_pairs` of `split_pairs`), with a space
    after it; empty where the results do not say."""
    results = results or {}
    scored, total, split = results.get("scored_pairs"), results.get("split_pairs"), results.get("split", "test")
    if not (isinstance(scored, int) and isinstance(total, int)):
        return ""
    if scored >= total:
        return f"Scored on all {total:,} sentences of the {_markdown(split)} split. "
    return (f"Scored on the first {scored:,} of the {total:,} sentences of the {_markdown(split)} split only "
            "(`test_samples`): the whole split's scores may differ. ")


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
    model_name, metrics = repo_id.split("/")[-1], metrics_from_results(results)
    dataset, hub_dataset = _dataset_names(dataset)
    card_data = _card_data(model_name, license, hub_dataset, languages, pair, metrics, results, label=dataset)
    names = [_LANGUAGE_NAMES.get(lang, lang) for lang in languages]
    text = _ENVIRONMENT.from_string(TEMPLATE.read_text(encoding="utf-8")).render(
        card_data=card_data.to_yaml(),
        model_name=model_name,
        pair_text=" to ".join(names) if len(names) == 2 else "between two languages",
        config=config,
        num_parameters=f"{num_parameters:,}" if num_parameters else "not recorded",
        dataset=dataset,
        dataset_note="verse-aligned Bible translations embedded in the package" if dataset and dataset.startswith("bible-") else None,
        bible=bool(dataset and dataset.startswith("bible-")),
        hyperparameters=_shown_hyperparameters(hyperparameters),
        recipe=_recipe(hyperparameters, config, (results or {}).get("steps")),
        training_time=_training_time(results),
        metrics=metrics,
        metrics_note=_metrics_note(metrics),
        scored_note=_scored_note(results),
        signatures=sorted({s for s in (_signature(results, m) for m in ("bleu", "chrf")) if s}),
        repo_id=repo_id,
        example=example or _EXAMPLES.get(source_lang or "en", "..."),
        image=image,
        max_length=max_length or getattr(config, "max_position_embeddings", 1024),
    )
    return ModelCard(re.sub(r"\n(?:[ \t]*\n){2,}", "\n\n", text))  # the blank lines that skipped sections leave


def _card_data(
    model_name: str, license: str, dataset: str | None, languages: list[str], pair: str | None, metrics: list[dict],
    results: dict | None, label: str | None = None,
) -> ModelCardData:
    """The card's YAML metadata: what the Hub files the model under, and its scores as `model-index`
    entries, each with its sacrebleu signature."""
    dataset_name = dataset or label or "unknown"  # `label`: a local data set's own name, never its path
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
    return ModelCardData(
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


def adapter_card(base: str | None, rank: int, alpha: float, dropout: float, targets, folder_name: str) -> str:
    """The README of a LoRA run's adapter folder, in place of PEFT's empty template: what it adapts and how, and
    how to load it. The base model is named, a local folder by its own name (its path is in adapter_config.json)."""
    local = base is not None and (os.path.isabs(base) or Path(base).expanduser().exists())
    base_name = Path(base).name if local else base
    metadata = ["library_name: peft", "tags:", "- lora", "- translation", "- vanilla-transformer"]
    if base_name is not None and not local:
        metadata.append(f"base_model: {base_name}")
    loaded = repr(base_name or "BASE_MODEL")
    what = (f"the model {_markdown(base_name)}" if base_name else "a model trained from a preset")
    return "\n".join([
        "---", *metadata, "---", "",
        f"# LoRA adapter of {_markdown(folder_name)}", "",
        f"Low-rank adapters (LoRA, Hu et al., 2021) of {what}, trained with `vanilla-transformer train "
        f"--lora-rank {rank}`: rank {rank}, alpha {alpha:g} (updates scaled by alpha / rank), dropout {dropout:g}, on "
        f"the layers {_markdown(', '.join(targets))} of every attention block. The folder above holds the same model "
        "with the adapters merged into its weights; this one keeps them apart, for PEFT.", "",
        "```python", "from peft import PeftModel", "from transformers import AutoModelForSeq2SeqLM", "",
        f"base = AutoModelForSeq2SeqLM.from_pretrained({loaded}, trust_remote_code=True)",
        "model = PeftModel.from_pretrained(base, \"adapter\")  # this folder", "```", "",
        "`base_model_name_or_path` in adapter_config.json says where the base model was read from.", "",
    ])
