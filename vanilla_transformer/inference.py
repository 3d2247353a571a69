"""Load a saved model, translate and score with it: the code behind `vanilla-transformer translate` and `evaluate`.

    model, tokenizer = load_model("path/to/folder")           # checked by checks/model_folder.py, then loaded
    translations = translate_texts(model, tokenizer, ["Jesus wept."], num_beams=4)
    [[(best, score), (second, _)]] = translate_nbest(model, tokenizer, ["Jesus wept."], nbest=2)
    scores = score_translations(translations, references)    # sacrebleu BLEU and chrF, with signatures

A folder (or a Hub id's files) goes through the gate of checks/model_folder.py before anything is built from it,
and is loaded with the package's own classes, never code from the folder. Translation goes through the same
`TranslationPipeline` that ships with saved models, so the command line, the pipeline and the Hub give the same
outputs.
"""

from __future__ import annotations

import os
import warnings
import weakref
from pathlib import Path

import torch

from .checks.files import REPO_ID, read_json
from .checks.model_folder import check_model_folder, check_tokenizer_fits
from .choices import TRANSLATION_BATCH_SIZE
from .errors import BadInput
from .modeling.pipeline_vanilla_transformer import (
    TranslationPipeline,
    longest_source,
)
from .onednn_decoding import choose_onednn_decoding

__all__ = ["bounded_texts", "cut_texts", "default_device", "load_model", "load_tokenizer", "local_folder",
           "longest_token", "score_translations", "translate_nbest", "translate_texts"]

# What loading a Hub repository reads: its settings, tokenizer, weights (and shards) and adapter; never its code.
HUB_FILES = ["*.json", "*.safetensors", "*.bin"]


def default_device() -> str:
    """The first GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def load_model(name_or_path: str | os.PathLike, device: str | None = None):
    """Load a model folder (or Hub id) and its tokenizer, in eval mode on `device` (default: GPU if present).

    The folder (a Hub repository's files, downloaded or from the cache) goes through the gate first
    (`check_model_folder`), so that a missing piece or a field out of bounds gets one clear line instead of a stack
    trace, a hang or a translation that never ends.
    """
    checked = check_model_folder(local_folder(name_or_path))
    try:
        tokenizer = load_tokenizer(checked.folder)
        model = checked.load()  # the package's own classes: no remote code
    except OSError as err:
        raise BadInput(f"cannot load the model {name_or_path!r}: {err}") from err
    check_tokenizer_fits(tokenizer, model.config, name_or_path)
    model = model.to(device or default_device()).eval()
    choose_onednn_decoding(model)  # timed here, once, not inside generate
    return model, tokenizer


def local_folder(name_or_path: str | os.PathLike) -> Path:
    """A model folder, or a Hub id's: the files of the repository that loading reads, downloaded into the Hub's
    cache (or found there), so that the gate checks them as it checks any folder before anything reads them."""
    from huggingface_hub import snapshot_download

    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    if not REPO_ID.match(str(name_or_path)):
        raise FileNotFoundError(f"{name_or_path}: neither a folder nor a Hub id (user/name)")
    try:
        return Path(snapshot_download(str(name_or_path), allow_patterns=HUB_FILES))
    except OSError as err:
        raise BadInput(f"cannot load the model {name_or_path!r}: not a model folder, and not reachable on the Hub "
                       f"({' '.join(str(err).split())[:300]})") from err


def load_tokenizer(name_or_path: str | os.PathLike):
    """`AutoTokenizer.from_pretrained`, with a tokenizer.json the tokenizers library cannot read (a key missing,
    another format) named in a ValueError instead of its bare `Exception`."""
    from transformers import AutoTokenizer

    folder = Path(name_or_path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if folder.is_dir() and (folder / name).is_file():
            read_json(folder / name)  # a damaged one is named, not blamed on tokenizer.json
    try:
        return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)  # never a question, never code
    except OSError:
        raise
    except Exception as err:  # tokenizers raises plain Exception ("Model missing. at line 1 column 1214")
        where = folder / "tokenizer.json" if folder.is_dir() else f"the tokenizer of {name_or_path}"
        cause = f"it lacks the key {err}" if isinstance(err, KeyError) else err
        raise BadInput(f"{where} is not a tokenizer file this version can read: {cause}") from None


def translate_texts(
    model,
    tokenizer,
    texts: list[str],
    *,
    batch_size: int = TRANSLATION_BATCH_SIZE,
    num_beams: int | None = None,
    length_penalty: float | None = None,
    max_new_tokens: int | None = None,
    first_line: int = 1,
) -> list[str]:
    """Translate each text; blank texts give "". Output i is the translation of text i, on one line.

    Texts are translated longest first, so that a batch holds texts of similar length (little padding),
    and put back in input order. A text that cannot be translated gives "" with a warning naming its line
    (`first_line` is the number of `texts[0]`), the rest of its batch translated without it. A text
    longer than the model reads is cut before it is tokenised, with a warning naming its line: only
    its beginning is translated, and the work per line is bounded whatever its length.
    """
    pipe = TranslationPipeline(model=model, tokenizer=tokenizer, device=model.device)
    options = {"num_beams": num_beams, "length_penalty": length_penalty, "max_new_tokens": max_new_tokens}
    options = {key: value for key, value in options.items() if value is not None}
    texts = bounded_texts(model, tokenizer, texts, first_line)
    order = sorted((i for i, text in enumerate(texts) if text.strip()), key=lambda i: -len(texts[i]))
    translations = [""] * len(texts)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        lines = {first_line + i: texts[i] for i in batch}
        for i, result in zip(batch, _translate_batch(pipe, lines, options)):
            translations[i] = " ".join(result.splitlines())  # one line per input line
    return translations


def longest_token(tokenizer) -> int:
    """The most characters one token stands for: a text of more than `n * longest_token` characters has more
    than n tokens, which tells a text too long without tokenising it. Scanned once per tokenizer (and again if
    its vocabulary grows): a scan of 8,000 tokens costs what translating a few lines does."""
    known = _LONGEST_TOKENS.get(tokenizer)
    if known is None or known[0] != len(tokenizer):
        known = len(tokenizer), max(len(tokenizer.convert_tokens_to_string([token])) for token in tokenizer.get_vocab())
        _LONGEST_TOKENS[tokenizer] = known
    return known[1]


_LONGEST_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its size, longest_token)


def bounded_texts(model, tokenizer, texts: list[str], first_line: int = 1) -> list[str]:
    """`texts`, each cut before tokenising where it is longer than the model reads (with a warning naming its line)."""
    return cut_texts(texts, longest_source(model, tokenizer), longest_token(tokenizer), first_line)


def cut_texts(texts: list[str], max_tokens: int, token_characters: int, first_line: int = 1) -> list[str]:
    """`texts`, each cut to twice the characters that `max_tokens` tokens of at most `token_characters` each stand
    for (so the words they come from are kept whole), with a warning naming the line of each text cut."""
    characters = 2 * max_tokens * token_characters
    cut = []
    for line, text in enumerate(texts, first_line):
        if len(text) > characters:
            warnings.warn(f"line {line} is {len(text):,} characters long, more than the model reads: only its first "
                          f"{characters:,} are tokenised", stacklevel=3)
            text = text[:characters]
        cut.append(text)
    return cut


def _translate_batch(pipe, lines: dict[int, str], options: dict) -> list[str]:
    """The translations of one batch ({line number: text}); where the batch fails, of each text alone, and
    "" with a warning naming the line for a text that fails alone."""
    try:
        return [result["translation_text"] for result in pipe(list(lines.values()), batch_size=len(lines), **options)]
    except (ValueError, RuntimeError, IndexError) as err:
        if len(lines) == 1:
            warnings.warn(f"line {next(iter(lines))} was not translated (an empty line stands for it): {err}", stacklevel=3)
            return [""]
    return [_translate_batch(pipe, {line: text}, options)[0] for line, text in lines.items()]


@torch.inference_mode()
def translate_nbest(
    model,
    tokenizer,
    texts: list[str],
    *,
    nbest: int = 1,
    batch_size: int = TRANSLATION_BATCH_SIZE,
    num_beams: int | None = None,
    length_penalty: float | None = None,
    max_new_tokens: int | None = None,
) -> list[list[tuple[str, float]]]:
    """The `nbest` best translations of each text, best first, each with its score: the log-probability the
    search ranks it by (beam search's is divided by its length penalty, §6.1; greedy's is the plain sum).

    The beam is widened to `nbest` where it is narrower. A blank text gives `nbest` times ("", 0.0). Texts
    longer than the model reads are cut to its limit, as `translate_texts` cuts them.
    """
    beams = max(num_beams or model.generation_config.num_beams or 1, nbest)
    options = {"num_beams": beams, "num_return_sequences": nbest, "length_penalty": length_penalty,
               "max_new_tokens": max_new_tokens, "output_scores": True, "return_dict_in_generate": True}
    options = {key: value for key, value in options.items() if value is not None}
    limit = longest_source(model, tokenizer)
    texts = bounded_texts(model, tokenizer, texts)
    order = sorted((i for i, text in enumerate(texts) if text.strip()), key=lambda i: -len(texts[i]))
    results = [[("", 0.0)] * nbest for _ in texts]
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        inputs = tokenizer([texts[i] for i in batch], return_tensors="pt", padding=True, truncation=True,
                           max_length=limit).to(model.device)
        output = model.generate(**inputs, **options)
        if beams > 1:
            scores = output.sequences_scores
        else:  # greedy search keeps no sequence score: its tokens' log-probabilities, summed
            steps = model.compute_transition_scores(output.sequences, output.scores, normalize_logits=True)
            generated = output.sequences[:, -steps.size(1) :]
            scores = steps.masked_fill(generated == model.generation_config.pad_token_id, 0).sum(1)  # after </s>
        texts_out = tokenizer.batch_decode(output.sequences, skip_special_tokens=True)
        for row, i in enumerate(batch):
            results[i] = [(" ".join(texts_out[k].splitlines()), float(scores[k]))
                          for k in range(row * nbest, (row + 1) * nbest)]
    return results


def score_translations(hypotheses: list[str], references: list[str] | list[list[str]]) -> dict:
    """Corpus BLEU and chrF with sacrebleu's defaults (those of its command line), their signatures and
    the lines sacrebleu prints: the package's `evaluate` metric (`metrics.BLEU_CHRF`), loaded once.

    `references` holds one reference per hypothesis, or a list of references per hypothesis.
    """
    from .metrics import load_bleu_chrf

    return load_bleu_chrf().compute(predictions=hypotheses, references=references)
