"""Translate and score with a saved model: the code behind `vanilla-transformer translate` and `evaluate`.

    model, tokenizer = load_model("path/to/folder")           # or a Hub id
    translations = translate_texts(model, tokenizer, ["Jesus wept."], num_beams=4)
    [[(best, score), (second, _)]] = translate_nbest(model, tokenizer, ["Jesus wept."], nbest=2)
    scores = score_translations(translations, references)    # sacrebleu BLEU and chrF, with signatures

Translation goes through the same `TranslationPipeline` that ships with saved models, so the command
line, the pipeline and the Hub give the same outputs.
"""

from __future__ import annotations

import os
import re
import warnings
import weakref
from pathlib import Path

import torch

from .choices import TRANSLATION_BATCH_SIZE
from .adapter_files import ADAPTER_CONFIG, check_adapter_files, merge_adapter
from .file_checks import REPO_ID, check_model_files, read_json
from .tokenizer_files import check_tokenizer_files
from .modeling.pipeline_vanilla_transformer import (
    TranslationPipeline,
    source_length_limit,
)

__all__ = ["WEIGHT_FILES", "check_config_file", "check_config_fits_weights", "check_config_sizes", "check_generation_file", "check_tokenizer_fits", "default_device", "load_model", "load_pretrained",
           "load_tokenizer", "bounded_texts", "cut_texts", "longest_token", "score_translations", "translate_nbest", "translate_texts", "weight_shapes"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def default_device() -> str:
    """The first GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def load_model(name_or_path: str | os.PathLike, device: str | None = None):
    """Load a model folder (or Hub id) and its tokenizer, in eval mode on `device` (default: GPU if present).

    A folder is checked first, so that a missing piece gets a clear error instead of a stack trace.
    """
    path = Path(name_or_path)
    if path.is_dir():
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any((path / name).is_file() for name in WEIGHT_FILES):
            missing.append("weights (model.safetensors)")
        if not (path / "tokenizer.json").is_file():
            missing.append("tokenizer (tokenizer.json)")
        if missing:
            raise ValueError(f"model folder {path} lacks {', '.join(missing)}; give a folder written by training or save_for_hub")
        check_config_file(path / "config.json")  # before the tokenizer, which reads it too
        check_tokenizer_files(path, read_json(path / "config.json").get("vocab_size"))  # before the library parses them
        if (path / "generation_config.json").is_file():  # transformers ignores a damaged one: the decoding defaults would be lost
            check_generation_file(path / "generation_config.json")
    elif not REPO_ID.match(str(name_or_path)):
        raise FileNotFoundError(f"`model` is neither a folder nor a Hub id (user/name): {name_or_path}")
    try:
        tokenizer = load_tokenizer(name_or_path)
        model = load_pretrained(name_or_path)  # the package's own classes: no remote code
    except OSError as err:
        raise ValueError(f"cannot load the model {name_or_path!r}: not a model folder, and not reachable on the Hub ({err})") from err
    check_tokenizer_fits(tokenizer, model.config, name_or_path)
    return model.to(device or default_device()).eval(), tokenizer


def check_generation_file(path: Path) -> None:
    """A ValueError naming `path` unless it is JSON whose decoding defaults keep the bounds the options typed keep
    (a beam of 100,000 would fail on every line, one warning each)."""
    from .modeling.value_checks import check_decoding_options

    generation = read_json(path)
    if not isinstance(generation, dict):
        raise ValueError(f"{path} does not hold decoding settings (a JSON object)")
    try:
        check_decoding_options(**{name: generation.get(name) for name in ("num_beams", "length_penalty", "max_new_tokens")})
    except ValueError as err:
        raise ValueError(f"{path}: {err} Put back the generation_config.json saved with the model") from None


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
        raise ValueError(f"{where} is not a tokenizer file this version can read: {cause}") from None


def check_tokenizer_fits(tokenizer, config, name_or_path) -> None:
    """Raise ValueError naming the mismatch unless the tokenizer is the one the model was trained with:
    as many tokens as embedding rows, and the same pad/start/end ids (another vocabulary translates to
    garbage, or to an IndexError, without this)."""
    problems = [] if len(tokenizer) == config.vocab_size else [
        f"its tokenizer has {len(tokenizer)} tokens and the model {config.vocab_size} embedding rows"]
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ours, theirs = getattr(config, name, None), getattr(tokenizer, name, None)
        if ours is not None and ours != theirs:
            problems.append(f"the config's {name} is {ours} and the tokenizer's {theirs}")
    if problems:
        raise ValueError(f"the tokenizer in {name_or_path} is not the model's: {'; '.join(problems)}. "
                         "Put the tokenizer.json the model was trained with beside it")


def load_pretrained(name_or_path: str | os.PathLike, **kwargs):
    """`AutoModelForSeq2SeqLM.from_pretrained` with this package's classes, refusing weights that do not fit
    them. transformers only warns and leaves such weights random; a folder saved before the attention
    projections were split (one `kv_proj`, by an earlier version of this package) loads only with its own code, in a
    process without this package: `from_pretrained(folder, trust_remote_code=True)`."""
    from transformers import AutoModelForSeq2SeqLM

    adapter = False
    if Path(name_or_path).is_dir():
        check_model_files(Path(name_or_path))
        check_config_fits_weights(Path(name_or_path))
        adapter = _check_adapter(Path(name_or_path))
    kwargs.setdefault("trust_remote_code", False)  # the package's classes: no question, no code from the folder
    model, info = AutoModelForSeq2SeqLM.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
    if adapter:
        return merge_adapter(model)  # the base weights were checked against the config above
    kinds = ("missing_keys", "unexpected_keys", "mismatched_keys")
    wrong = {kind.replace("_", " "): sorted(map(str, info.get(kind) or ())) for kind in kinds if info.get(kind)}
    if wrong:
        found = "; ".join(f"{kind}: {', '.join(keys[:4])}" + (" ..." if len(keys) > 4 else "") for kind, keys in wrong.items())
        old = (" (a fused `kv_proj`: saved by an earlier version of vanilla-transformer, whose code, saved with it, "
               "loads it in a process without this package: "
               "AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True))"
               if "kv_proj" in found else "")
        raise ValueError(f"the weights in {name_or_path} do not fit this version's model{old}: {found}")
    return model


def _check_adapter(folder: Path) -> bool:
    """Whether `folder` holds a LoRA adapter saved with it, which transformers applies as it loads (a ValueError
    names what does not fit); it needs PEFT, without which transformers would leave it out unsaid."""
    import importlib.util

    if not check_adapter_files(folder, _read_config(folder, folder / "config.json")):
        return False
    if importlib.util.find_spec("peft") is None:
        raise ValueError(f"{folder / ADAPTER_CONFIG} is a LoRA adapter saved with the model, which needs the peft "
                         "package: pip install 'vanilla-transformer[peft]'")
    warnings.warn(f"applying the LoRA adapter saved in {folder} ({ADAPTER_CONFIG}), merged into the weights", stacklevel=3)
    return True


def check_config_file(path: Path) -> None:
    """A ValueError naming `path` unless it is a JSON object with a `model_type` (without one, transformers
    would take the folder's code for the model and ask whether to run it)."""
    config = read_json(path)
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ValueError(f"{path} does not describe a model: it names no `model_type`")


def check_config_fits_weights(folder: Path) -> None:
    """Raise ValueError naming config.json and what it contradicts (an edited model_type, d_model, vocab_size
    or layer count), before transformers' own report and RuntimeError. What the config gives comes from a
    model built on the meta device: no memory, no weights."""
    from .modeling.configuration_vanilla_transformer import VanillaTransformerConfig

    config_file = folder / "config.json"
    config = _read_config(folder, config_file)
    ours = config.model_type == VanillaTransformerConfig.model_type
    index = folder / "model.safetensors.index.json"
    files = sorted(set(read_json(index)["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    present = all((folder / name).is_file() for name in files)
    if ours and present:  # before the model is built, even on the meta device (100,000 layers take minutes there)
        shapes = weight_shapes([folder / name for name in files])
        check_config_sizes(config, config_file, shapes, folder)
    tensors = _meta_tensors(config, config_file, ours)
    if not ours:
        return  # another architecture (a Marian folder, say): transformers checks its weights
    if not present:
        return  # weights in another format: transformers' own check applies
    names = {folder / name: name for name in files}
    saved = {key: (names[path], shape) for key, (shape, path) in shapes.items()}
    _check_tensors_fit(folder, config_file, files, saved, tensors)


def _read_config(folder: Path, config_file: Path):
    """The folder's config, by transformers' own classes (no code from the folder), or a ValueError naming it."""
    from transformers import AutoConfig

    check_config_file(config_file)
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"{config_file} does not describe a model: {err}") from None


def _meta_tensors(config, config_file: Path, ours: bool) -> dict:
    """The tensors the config gives, by name, from a model built on the meta device (tied ones are one tensor)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    try:
        with torch.device("meta"):
            return AutoModelForSeq2SeqLM.from_config(config, trust_remote_code=False).state_dict(keep_vars=True)
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"{config_file} does not describe a model: {err}" if ours else
                         f"{config_file} describes a {config.model_type!r} model, which is not a translation "
                         "(sequence-to-sequence) model transformers knows") from None


def _check_tensors_fit(folder: Path, config_file: Path, files: list[str], saved: dict, tensors: dict) -> None:
    """Refuse saved weights (`saved`: name -> file, shape) that lack a tensor of the config's, have one it has no
    place for, or differ in shape: the weights file is named when it is the one changed, else config.json."""
    if any("kv_proj" in key for key in saved):
        return  # a folder saved before the projections were split: load_pretrained says how it loads
    tied: dict[int, list[str]] = {}  # a tied tensor is saved under one of its names
    for key, tensor in tensors.items():
        tied.setdefault(id(tensor), []).append(key)
    lacking = [names[0] for names in tied.values() if not any(key in saved for key in names)]
    extra = [key for key in saved if key not in tensors]
    if (lacking or extra) and _layers(saved) == _layers(tensors):
        _refuse_changed_weights(folder, files, lacking, extra)
    problems = [f"{key} is {list(saved[key][1])} in {saved[key][0]} and {list(tensor.shape)} by the config"
                for key, tensor in tensors.items() if key in saved and tuple(tensor.shape) != saved[key][1]]
    problems += [f"the config has {key}, which the weights lack" for key in lacking]
    problems += [f"the weights have {key}, which the config has no place for" for key in extra]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"{config_file} does not fit the weights in {folder}: {problems[0]}{more} (was config.json "
                         "edited?). Put back the config.json saved with these weights")


def weight_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor's shape and file, from the safetensors headers alone (nothing is loaded)."""
    from safetensors import safe_open

    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as weights:
            shapes.update({key: (tuple(weights.get_slice(key).get_shape()), path) for key in weights.keys()})
    return shapes


def check_config_sizes(config, config_file: Path, shapes: dict[str, tuple[tuple[int, ...], Path]], folder: Path) -> None:
    """A ValueError naming `config_file` unless its layer counts, widths and vocabulary are those of the weights
    in `folder` (`weight_shapes`), before anything of the config's size is built. Names may carry a prefix (a
    LoRA run's checkpoint); what the weights do not show is left to the full check."""
    problems = []
    for side in ("encoder", "decoder"):
        found = {int(m.group(2)): m.group(1) for key in shapes if (m := re.search(rf"(^|.*\.){side}\.layers\.(\d+)\.", key))}
        if not found:
            continue
        given, layers, prefix = getattr(config, f"{side}_layers"), max(found) + 1, f"{found[0]}{side}.layers."
        if given > layers:
            problems.append(f"the config has {prefix}{layers}. ({side}_layers {given}), which the weights lack")
        elif given < layers:
            problems.append(f"the weights have {prefix}{given}., which the config has no place for ({side}_layers {given})")
    expected = {r"(?:^|\.)(?:shared|embed_tokens)\.weight$": ("vocab_size", "d_model"),
                r"(?:^|\.)layers\.0\.feed_forward\.fc2\.(?:base_layer\.)?weight$": ("d_model", "d_ff")}
    for pattern, names in expected.items():
        key = next((key for key in shapes if re.search(pattern, key)), None)
        sizes = [getattr(config, name) for name in names]
        if key is not None and list(shapes[key][0]) != sizes:
            problems.append(f"{key} is {list(shapes[key][0])} in {shapes[key][1].name} and {sizes} by the config")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"{config_file} does not fit the weights in {folder}: {problems[0]}{more} (was config.json "
                         "edited?). Put back the config.json saved with these weights")


def _layers(keys) -> set[str]:
    """The layers ("model.encoder.layers.2.") that tensor names belong to."""
    return {match.group(0) for key in keys if (match := re.match(r".*\.layers\.\d+\.", key))}


def _refuse_changed_weights(folder: Path, files: list[str], lacking: list[str], extra: list[str]) -> None:
    """The same layers on both sides, but a tensor missing or added: the weights file is the one changed."""
    problems = [f"they lack {key}" for key in lacking] + [f"they have {key}, which the model has no place for" for key in extra]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise ValueError(f"the weights in {folder} ({', '.join(files)}) are not those config.json describes: "
                     f"{problems[0]}{more}. Put back the weights file saved with this config.json")


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
    return cut_texts(texts, source_length_limit(model, tokenizer), longest_token(tokenizer), first_line)


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
    limit = source_length_limit(model, tokenizer)
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
    from .metrics import load

    return load().compute(predictions=hypotheses, references=references)
