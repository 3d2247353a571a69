"""Write a complete Hugging Face Hub folder for a trained model, and upload it.

`save_for_hub` writes such a folder, the model first and its descriptions after (training calls the
three parts itself, scoring the model between the first two):

    save_model_files   model.safetensors, config.json, generation_config.json    the weights and settings
                       configuration_/modeling_vanilla_transformer.py              the model code (config `auto_map`)
                       pipeline_vanilla_transformer.py             the `translation` pipeline (`custom_pipelines`)
                       tokenizer.json, tokenizer_config.json       the tokenizer (stock transformers class)
    write_results      results.json                                the scores
    write_model_card   README.md, attention.png                    the model card and one heat map (extras)

so that the folder, or a Hub repository made from it, loads with no copy of this package:

    AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
    pipeline("translation", model=folder, trust_remote_code=True)

`push_folder` checks such a folder and uploads it in one commit.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from .errors import BadInput
from .checks.files import check_repo_id, read_json
from .checks.folder_fields import MAX_JSON_BYTES
from .checks.model_folder import WEIGHT_FILES, check_model_files
from .staging import staged_files, sweep_staging, write_file_whole
from .modeling.pipeline_vanilla_transformer import longest_source
from .tokenizer import save_tokenizer_files

__all__ = [
    "DESCRIPTION_FILES",
    "STALE_WEIGHTS",
    "check_hub_folder",
    "check_repo_id",
    "push_folder",
    "save_for_hub",
    "save_model_files",
    "write_model_card",
    "write_results",
]

STALE_WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
ATTENTION_IMAGE = "attention.png"
RESULTS_FILE = "results.json"
DESCRIPTION_FILES = ("README.md", ATTENTION_IMAGE, RESULTS_FILE)  # of the model they were written with

logger = logging.getLogger(__name__)


def save_for_hub(
    model,
    tokenizer,
    output_dir: str | os.PathLike,
    results: dict | None = None,
    *,
    dataset: str | None = None,
    source_lang: str | None = None,
    target_lang: str | None = None,
    hyperparameters: dict | None = None,
    example: str | None = None,
    repo_id: str | None = None,
    license: str = "apache-2.0",
) -> Path:
    """Write `model` and `tokenizer` as a complete Hub folder at `output_dir` and return its path.

    `results` are the scores to report, a flat dict such as `{"split": "test", "bleu": 27.3,
    "chrf": 55.1, "bleu_signature": "nrefs:1|...", "chrf_signature": "...", "validation_perplexity": 9.8}`
    (`score_translations` returns these keys; one "sacrebleu_signature" is accepted too); they go to
    results.json as given and, for the known metrics, into the card's `model-index`. `dataset` (an
    embedded corpus name, which also gives the languages, or a Hub data set id), `source_lang`,
    `target_lang`, `hyperparameters` (the training settings to list), `example` (a source sentence whose
    attention heat map goes into the card) and `repo_id` (used in the card's snippets) describe the model.

    A model never told how to decode is given the paper's (§6.1: beam 4, GNMT length penalty 0.6), as
    training gives its own. The model comes first (`save_model_files`): it is staged and renamed into
    place, so `output_dir` never holds half a model. results.json follows, then the card and its heat map (`write_model_card`),
    which may fail with a warning but never take the model with them. If `output_dir` already holds
    files (say, training checkpoints), the new files replace their namesakes, stale weight files and the
    card, heat map and results of an earlier model are removed, and everything else is kept.
    """
    output_dir = Path(output_dir)
    _check_save_arguments(output_dir, results, repo_id, example)
    source_lang, target_lang = _languages(dataset, source_lang, target_lang)
    if source_lang and target_lang:  # in config.json: evaluating or translating another pair is warned about
        from .corpora import recorded_name

        model.config.update({"source_lang": source_lang, "target_lang": target_lang,
                             "dataset_name": dataset and recorded_name(dataset)})
    _write_generation_defaults(model)
    save_model_files(model, tokenizer, output_dir)
    write_results(output_dir, results or {})
    write_model_card(
        model, tokenizer, output_dir, results, example=example, repo_id=repo_id, dataset=dataset,
        source_lang=source_lang, target_lang=target_lang, hyperparameters=hyperparameters, license=license,
    )
    return output_dir


def _check_save_arguments(output_dir: Path, results, repo_id: str | None, example) -> None:
    """save_for_hub's arguments, refused before anything is written."""
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"`output_dir` exists and is not a folder: {output_dir}")
    if results is not None and not isinstance(results, dict):
        raise TypeError(f"`results` must be a dict of scores; got {type(results).__name__}")
    if repo_id is not None:
        check_repo_id(repo_id)
    if example is not None and (not isinstance(example, str) or not example.strip()):
        raise BadInput(f"`example` must be a sentence to draw the attention of; got an empty or blank {example!r}")


def save_model_files(model, tokenizer, output_dir: str | os.PathLike) -> Path:
    """The model itself: weights, config.json (auto_map, custom_pipelines), generation_config.json, the code
    and pipeline files, and the tokenizer, written to a staging folder inside `output_dir` (so that a
    read-only parent does not matter) and then renamed into place, config.json last. What a process that
    died while saving left there is removed first; a full disk is raised as DiskFull naming the file."""
    output_dir = Path(output_dir)
    sweep_staging(output_dir)
    with staged_files(output_dir, "model", last=["config.json"]) as staging:  # a model once config.json lands
        model.save_pretrained(staging)
        save_tokenizer_files(tokenizer, staging)
        _drop_absent_code(staging)
        stale = _stale_files(staging, output_dir)
    for path in stale:  # only once the new model is in place: a save that fails before leaves the old one whole
        path.unlink(missing_ok=True)
    return output_dir


def write_results(output_dir: str | os.PathLike, results: dict) -> Path:
    """results.json, written whole or not at all; a full disk is raised as DiskFull naming it."""
    return write_file_whole(Path(output_dir) / RESULTS_FILE, json.dumps(results, indent=2, ensure_ascii=False) + "\n")


def write_model_card(
    model, tokenizer, output_dir: str | os.PathLike, results: dict | None = None, *, example: str | None = None,
    repo_id: str | None = None, **descriptions,
) -> Path | None:
    """The model card (README.md) and, given an `example` sentence, the heat map of its cross-attention
    (attention.png) that the card shows. `descriptions` are `build_model_card`'s: dataset, source_lang,
    target_lang, hyperparameters, license. These are extras: when either cannot be made (say, the example
    is longer than the model reads), a warning says why, the rest is written, and the model stays as it
    is. Returns the card's path, or None when there is no card."""
    from .model_card import build_model_card

    output_dir = Path(output_dir)
    image = ATTENTION_IMAGE if example and _draw_attention(model, tokenizer, example, output_dir / ATTENTION_IMAGE) else None
    try:
        card = build_model_card(
            model.config,
            results=results,
            repo_id=repo_id or f"your-name/{output_dir.name}",
            image=image,
            num_parameters=model.num_parameters(),
            example=example,
            max_length=longest_source(model, tokenizer),
            **descriptions,
        )
        write_file_whole(output_dir / "README.md", card.save)
    except Exception as err:  # an extra: whatever went wrong, the model is saved
        logger.warning(f"the model card (README.md) was not written: {type(err).__name__}: {err}. The model in "
                       f"{output_dir} is complete without it.")
        return None
    return output_dir / "README.md"


def _draw_attention(model, tokenizer, example: str, path: Path) -> bool:
    """The last decoder layer's attention over the source (the closest thing to a word alignment) as `path`."""
    from .visualize.attention_maps import collect_attentions, plot_layer

    try:
        record = collect_attentions(model, tokenizer, example)
        write_file_whole(path, lambda staging: plot_layer(record, "cross", record.num_decoder_layers - 1, staging))
        return True
    except Exception as err:  # an extra: the card goes without it
        logger.warning(f"no attention heat map in the model card: {type(err).__name__}: {err}")
        return False


def _languages(dataset, source_lang, target_lang) -> tuple[str | None, str | None]:
    from .corpora import EMBEDDED_CORPORA

    corpus = EMBEDDED_CORPORA.get(dataset or "")
    if corpus is not None:
        return source_lang or corpus.source_lang, target_lang or corpus.target_lang
    return source_lang, target_lang


def _write_generation_defaults(model) -> None:
    """Give a model that was never told how to decode the paper's beam search (§6.1: beam 4, GNMT length
    penalty 0.6, at most source length + 50 tokens); keep the settings of one that was."""
    from .modeling.generation import paper_generation_config

    if model.generation_config.num_beams in (None, 1):
        model.generation_config = paper_generation_config(model.config)


def _named_classes(auto_map: dict) -> list[str]:
    """Each class an `auto_map` names: a string, or transformers' [slow, fast] pair for AutoTokenizer."""
    named = []
    for value in auto_map.values():
        named += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, str)]
    return named


def _code_file(reference: str) -> str:
    """The module file of an `auto_map` class, "module.Class" or "user/repo--module.Class"."""
    return reference.split("--")[-1].rsplit(".", 1)[0] + ".py"


def _drop_absent_code(folder: Path) -> None:
    """Remove the `auto_map` entries of config.json and tokenizer_config.json whose module `folder` lacks
    (a fine-tuned model's folder may name code it never held): such an entry fails every load of the folder.
    An entry naming another repository's code ("user/repo--module.Class") stays."""
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        auto_map = data.get("auto_map")
        if not isinstance(auto_map, dict):
            continue
        kept = {key: value for key, value in auto_map.items()
                if all("--" in ref or (folder / _code_file(ref)).is_file() for ref in _named_classes({key: value}))}
        if kept != auto_map:
            logger.warning(f"{name}: auto_map entries dropped, their code is not in the folder: "
                           f"{', '.join(sorted(set(auto_map) - set(kept)))}")
            data["auto_map"] = kept
            if not kept:
                del data["auto_map"]
            path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _stale_files(staging: Path, output_dir: Path) -> list[Path]:
    """What the new model in `staging` leaves over in `output_dir`: weights of another shape (say, sharded), the old
    model's card and scores."""
    new_names = {entry.name for entry in staging.iterdir()}
    return [entry for entry in output_dir.iterdir()
            if entry.name not in new_names and (STALE_WEIGHTS.match(entry.name) or entry.name in DESCRIPTION_FILES)]


# ----------------------------------------------------------------------------------------------
# Upload
# ----------------------------------------------------------------------------------------------


def check_hub_folder(folder: str | os.PathLike) -> Path:
    """Check that `folder` holds everything a Hub model repository needs; raise ValueError naming what is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"`folder` is not a folder: {folder}")
    missing = []
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        missing.append("weights (model.safetensors)")
    config = {}
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    else:
        config = read_json(folder / "config.json", MAX_JSON_BYTES)
    if not (folder / "tokenizer.json").is_file() or not (folder / "tokenizer_config.json").is_file():
        missing.append("tokenizer (tokenizer.json and tokenizer_config.json)")
    auto_map = config.get("auto_map")
    references = _named_classes(auto_map) if isinstance(auto_map, dict) else []
    references += [task["impl"] for task in (config.get("custom_pipelines") or {}).values()]
    if config and not references:
        missing.append("auto_map in config.json (save the model with vanilla_transformer imported)")
    for reference in references:
        if not (folder / _code_file(reference)).is_file():
            missing.append(_code_file(reference))
    if missing:
        raise BadInput(
            f"{folder} is not a complete model folder; missing: {', '.join(dict.fromkeys(missing))}. "
            "Write it with `save_for_hub` (or `vanilla-transformer train`)."
        )
    check_model_files(folder)  # a truncated weights file must not reach the Hub
    return folder


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload vanilla-transformer model",
) -> str:
    """Upload a folder written by `save_for_hub` to the Hub model repository `repo_id`; return its URL.

    The folder and the repo id are checked before anything is sent. The folder's card (README.md) is
    rewritten to load `repo_id` in its snippets and to carry its name (`retarget_card`), so that what a
    visitor pastes from the Hub page runs. `upload_folder` makes one commit,
    so an interrupted upload leaves the repository as it was. The token is found the usual way when
    not given: the HF_TOKEN environment variable, or the one saved by `hf auth login`.
    """
    import huggingface_hub

    check_repo_id(repo_id)
    folder = check_hub_folder(folder)
    if token is None and huggingface_hub.get_token() is None:
        raise BadInput(
            "No Hugging Face token: set HF_TOKEN, run `hf auth login`, or pass `token=`. "
            "Nothing was uploaded."
        )
    _retarget_card_file(folder / "README.md", repo_id)
    repo_url = huggingface_hub.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
    huggingface_hub.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        token=token,
        commit_message=commit_message,
        # Training leftovers that do not belong in a model repository.
        ignore_patterns=["checkpoints/**", "checkpoint-*", "checkpoint-*/**", "runs/**", ".*", "**/.*", "*.tmp"],
    )
    return str(repo_url)


def _retarget_card_file(path: Path, repo_id: str) -> None:
    """Write the card at `path` for the repository `repo_id`, whole or not at all; a folder without a card,
    or with one that loads no repository, is left as it is."""
    from huggingface_hub import ModelCard

    from .model_card import retarget_card

    if not path.is_file():
        return
    card = ModelCard.load(path)
    retargeted = retarget_card(card, repo_id)
    if retargeted is card:
        return
    write_file_whole(path, retargeted.save)
