"""The gate of a model folder: everything a folder must pass before anything is built from it.

    checked = check_model_folder("runs/en-es")       # a ValueError naming the file and the bound, or a CheckedFolder
    model = checked.load()                           # the model, built only from a folder that passed
    check_export_folder("runs/en-es-ct2")            # a CTranslate2 export's files

translate, evaluate, attention, export, serve and `train --model-name-or-path` load a folder through here
(inference.py's `load_model` and `load_tokenizer` for the commands), so each refuses a hostile one with the same
line. What is checked, in order: the files a folder needs are there and
none is a link out of it; each settings file is small enough to read (`MAX_JSON_BYTES`) and every field it holds
that the package reads is of its kind and within its bound (`folder_fields.FIELDS`, the table of
docs/folder-fields.md); the tokenizer files fit the vocabulary and hold no pattern that backtracks without end;
the weights files are whole, a pickled one holds tensors alone, and their headers fit the config; a LoRA adapter
saved with the model fits it. Only then do transformers' loaders read the folder (`CheckedFolder.load`), with no
code from it.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .adapters import ADAPTER_CONFIG, check_adapter_files, merge_adapter
from ..errors import BadInput, MissingPackage
from .files import check_inside, check_plain_pickle, check_weights_file, parse_json, read_json
from .folder_fields import (
    CONFIG_FILE,
    CTRANSLATE2_CONFIG,
    GENERATION_FILE,
    MAX_JSON_BYTES,
    OPTIONS_FILE,
    TOKENIZER_CONFIG,
    Context,
    FIELDS,
    field_problems,
)

__all__ = ["MAX_INDEX_BYTES", "TOKENIZER_FILES", "WEIGHT_FILES", "CheckedFolder", "check_config_fits_weights",
           "check_config_sizes", "check_export_folder", "check_generation_file", "check_model_files",
           "check_model_folder", "check_tokenizer_files", "check_tokenizer_fits", "max_tokenizer_bytes", "weight_shapes"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# A shard index names every tensor once, in tens of bytes each: far past any model's, far below a slow parse.
MAX_INDEX_BYTES = 16 << 20
VOCABULARY_FILE = "shared_vocabulary.json"  # a CTranslate2 export's tokens, in id order
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# A token's entry in tokenizer.json (its string, id, merges, score) takes tens of bytes; a kilobyte each, with a
# megabyte for the rest, is far past any tokenizer's own and far below what takes minutes to parse.
_BYTES_PER_TOKEN = 1024
_BYTES_BESIDES = 1 << 20

# A group holding a quantifier or a choice, itself repeated: `(a+)+`, `(\w+\s?)*`, `(a|aa)+`. Matching it can
# backtrack exponentially, and the regex engine's retry limit is a panic in the tokenizers library, not an error.
_REPEATED_GROUP = re.compile(r"\((?:[^()\\]|\\.)*(?:[+*|]|\{\d+,\d*\})(?:[^()\\]|\\.)*\)(?:[+*]|\{\d+,\d*\})")


class CheckedFolder(NamedTuple):
    """A model folder that passed the gate (`check_model_folder`): the only thing a model is built from here."""

    folder: Path
    config: Any  # transformers' config of the folder's architecture, read by its own classes
    adapter: bool  # a LoRA adapter saved with the model, checked against it, to merge as it loads

    def load(self, **kwargs):
        """`AutoModelForSeq2SeqLM.from_pretrained` with this package's classes (no code from the folder), refusing
        weights that do not fit them (transformers only warns and leaves such weights random); an adapter is
        merged into the weights. `kwargs` go to `from_pretrained` (config overrides among them)."""
        from transformers import AutoModelForSeq2SeqLM

        if self.adapter:
            warnings.warn(f"applying the LoRA adapter saved in {self.folder} ({ADAPTER_CONFIG}), merged into the "
                          "weights", stacklevel=2)
        kwargs.setdefault("trust_remote_code", False)
        model, info = AutoModelForSeq2SeqLM.from_pretrained(self.folder, output_loading_info=True, **kwargs)
        if self.adapter:
            return merge_adapter(model)  # the base weights were checked against the config by the gate
        kinds = ("missing_keys", "unexpected_keys", "mismatched_keys")
        wrong = {kind.replace("_", " "): sorted(map(str, info.get(kind) or ())) for kind in kinds if info.get(kind)}
        if wrong:
            found = "; ".join(f"{kind}: {', '.join(keys[:4])}" + (" ..." if len(keys) > 4 else "") for kind, keys in wrong.items())
            raise BadInput(f"the weights in {self.folder} do not fit this version's model: {found}")
        return model


def check_model_folder(folder: str | os.PathLike, needs_tokenizer: bool = True) -> CheckedFolder:
    """The folder, passed (a `CheckedFolder`, which loads it), or a ValueError naming the file and what it must be
    unless the model folder passes every check of this module (in the order the top says); nothing is built, no file
    is read past its bound, and each settings file is read once. `needs_tokenizer`: a folder without tokenizer.json
    is refused (fine-tuning may take the tokenizer from elsewhere)."""
    folder = Path(folder)
    _check_complete(folder, needs_tokenizer)
    settings = _read_settings(folder)
    config = _read_config(folder, settings[CONFIG_FILE])
    generation = settings.get(GENERATION_FILE)
    context = _context(config, generation)
    _check_fields(folder / CONFIG_FILE, settings[CONFIG_FILE], context)
    check_tokenizer_files(folder, context.vocab_size)  # before the library parses them
    if TOKENIZER_CONFIG in settings:
        _check_fields(folder / TOKENIZER_CONFIG, settings[TOKENIZER_CONFIG], context)
    if generation is not None:  # transformers ignores a damaged one: the decoding defaults would be lost
        check_generation_file(folder / GENERATION_FILE, generation, context)
    check_model_files(folder)
    check_config_fits_weights(folder, config)
    return CheckedFolder(folder, config, _check_adapter(folder, config))


def _read_settings(folder: Path) -> dict:
    """The settings files (config.json, and generation_config.json and tokenizer_config.json where there are), each
    read once, within MAX_JSON_BYTES, by name; none of the files the loaders read is a link out of the folder."""
    for name in (CONFIG_FILE, GENERATION_FILE, *TOKENIZER_FILES):
        check_inside(folder / name)
    names = [name for name in (CONFIG_FILE, GENERATION_FILE, TOKENIZER_CONFIG) if (folder / name).is_file()]
    return {name: read_json(folder / name, MAX_JSON_BYTES) for name in names}


def _check_complete(folder: Path, needs_tokenizer: bool) -> None:
    """A ValueError naming what a model folder lacks: its config, its weights, its tokenizer."""
    missing = []
    if not (folder / CONFIG_FILE).is_file():
        missing.append(CONFIG_FILE)
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        missing.append("weights (model.safetensors)")
    if needs_tokenizer and not (folder / "tokenizer.json").is_file():
        missing.append("tokenizer (tokenizer.json)")
    if missing:
        raise BadInput(f"model folder {folder} lacks {', '.join(missing)}; give a folder written by training or save_for_hub")


def _context(config, generation) -> Context:
    """The vocabulary size and end tokens that the folder's other fields are checked against, from its config
    (built by the configuration class, which checks each of its fields) and its decoding defaults."""
    ends = {config.eos_token_id} if isinstance(config.eos_token_id, int) else set()
    given = generation.get("eos_token_id") if isinstance(generation, dict) else None
    ends |= {i for i in (given if isinstance(given, list) else [given]) if isinstance(i, int)}
    return Context(config.vocab_size, frozenset(ends))


def _check_fields(path: Path, data, context: Context, table: str | None = None) -> None:
    """A ValueError naming `path` and the first field out of its bound (`folder_fields.FIELDS[table]`, by default
    the table of the file's name)."""
    if not isinstance(data, dict):
        raise BadInput(f"{path} does not hold settings (a JSON object)")
    found = field_problems(table or path.name, data, context)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise BadInput(f"{path}: {found[0]}{more}. Put back the {path.name} saved with the model")


def check_generation_file(path: Path, generation, context: Context) -> None:
    """A ValueError naming `path` unless it is JSON whose decoding defaults keep the bounds the options typed keep
    (a beam of 100,000 would fail on every line, one warning each), every field of `folder_fields.FIELDS` within
    its bound (the end token never suppressed, lengths that end), and the rest as transformers' own
    `GenerationConfig.validate` takes them. `generation`: what `path` holds, as read."""
    from transformers import GenerationConfig

    from ..modeling.value_checks import check_decoding_options

    if not isinstance(generation, dict):
        raise BadInput(f"{path} does not hold decoding settings (a JSON object)")
    try:
        check_decoding_options(**{name: generation.get(name) for name in ("num_beams", "length_penalty", "max_new_tokens")})
    except ValueError as err:
        raise BadInput(f"{path}: {err} Put back the generation_config.json saved with the model") from None
    _check_fields(path, generation, context)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flags that only some modes read: transformers warns, and ignores them
            GenerationConfig(**generation).validate()
    except (TypeError, ValueError) as err:
        reason = " ".join(str(err).split())
        raise BadInput(f"{path}: {reason[:300]}. Put back the generation_config.json saved with the model") from None


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
        raise BadInput(f"the tokenizer in {name_or_path} is not the model's: {'; '.join(problems)}. "
                       "Put the tokenizer.json the model was trained with beside it")


def _check_adapter(folder: Path, config) -> bool:
    """Whether `folder` (its model's `config`) holds a LoRA adapter saved with it, which transformers applies as it
    loads (a ValueError names what does not fit); it needs PEFT, without which transformers would leave it out unsaid."""
    import importlib.util

    if not check_adapter_files(folder, config):
        return False
    if importlib.util.find_spec("peft") is None:
        raise MissingPackage(f"{folder / ADAPTER_CONFIG} is a LoRA adapter saved with the model, which needs the peft "
                       "package: pip install 'vanilla-transformer[peft]'")
    return True


def _check_model_type(path: Path, config) -> None:
    """Without a `model_type`, transformers would take the folder's code for the model and ask whether to run it."""
    if not isinstance(config, dict) or not config.get("model_type"):
        raise BadInput(f"{path} does not describe a model: it names no `model_type`")


def check_config_fits_weights(folder: Path, config) -> None:
    """Raise ValueError naming config.json and what its `config` contradicts (an edited model_type, d_model,
    vocab_size or layer count), before transformers' own report and RuntimeError. What the config gives comes from
    a model built on the meta device: no memory, no weights."""
    from ..modeling.configuration_vanilla_transformer import VanillaTransformerConfig

    config_file = folder / CONFIG_FILE
    ours = config.model_type == VanillaTransformerConfig.model_type
    index = folder / "model.safetensors.index.json"
    files = sorted(set(read_json(index, MAX_INDEX_BYTES)["weight_map"].values())) if index.is_file() else ["model.safetensors"]
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


def _read_config(folder: Path, settings):
    """The folder's config, by transformers' own classes (no code from the folder), or a ValueError naming it;
    `settings`: what its config.json holds, as read."""
    from transformers import AutoConfig

    config_file = folder / CONFIG_FILE
    _check_model_type(config_file, settings)
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (TypeError, ValueError, KeyError) as err:
        raise BadInput(f"{config_file} does not describe a model: {err}") from None


def _meta_tensors(config, config_file: Path, ours: bool) -> dict:
    """The tensors the config gives, by name, from a model built on the meta device (tied ones are one tensor)."""
    from transformers import AutoModelForSeq2SeqLM

    try:
        with torch.device("meta"):
            return AutoModelForSeq2SeqLM.from_config(config, trust_remote_code=False).state_dict(keep_vars=True)
    except (TypeError, ValueError, KeyError) as err:
        raise BadInput(f"{config_file} does not describe a model: {err}" if ours else
                       f"{config_file} describes a {config.model_type!r} model, which is not a translation "
                       "(sequence-to-sequence) model transformers knows") from None


def _check_tensors_fit(folder: Path, config_file: Path, files: list[str], saved: dict, tensors: dict) -> None:
    """Refuse saved weights (`saved`: name -> file, shape) that lack a tensor of the config's, have one it has no
    place for, or differ in shape: the weights file is named when it is the one changed, else config.json."""
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
        raise BadInput(f"{config_file} does not fit the weights in {folder}: {problems[0]}{more} (was config.json "
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
        raise BadInput(f"{config_file} does not fit the weights in {folder}: {problems[0]}{more} (was config.json "
                       "edited?). Put back the config.json saved with these weights")


def _layers(keys) -> set[str]:
    """The layers ("model.encoder.layers.2.") that tensor names belong to."""
    return {match.group(0) for key in keys if (match := re.match(r".*\.layers\.\d+\.", key))}


def _refuse_changed_weights(folder: Path, files: list[str], lacking: list[str], extra: list[str]) -> None:
    """The same layers on both sides, but a tensor missing or added: the weights file is the one changed."""
    problems = [f"they lack {key}" for key in lacking] + [f"they have {key}, which the model has no place for" for key in extra]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise BadInput(f"the weights in {folder} ({', '.join(files)}) are not those config.json describes: "
                   f"{problems[0]}{more}. Put back the weights file saved with this config.json")


def check_model_files(folder: str | os.PathLike) -> None:
    """The weights of a saved model folder read back whole, and a pickled weights file (pytorch_model.bin) holds
    tensors and plain values alone; a ValueError names the file otherwise."""
    folder = Path(folder)
    try:
        shards = ["model.safetensors", "pytorch_model.bin"]
        for index in (folder / "model.safetensors.index.json", folder / "pytorch_model.bin.index.json"):
            if index.is_file():
                named = sorted(set(read_json(index, MAX_INDEX_BYTES)["weight_map"].values()))
                for name in named:
                    if Path(name).is_absolute() or ".." in Path(name).parts:
                        raise BadInput(f"{index} names {name!r}, outside the model folder; its weights are not read")
                shards += named
        for name in shards:
            check_inside(folder / name)
            if (folder / name).is_file():
                check_weights_file(folder / name)
                if not name.endswith(".safetensors"):
                    check_plain_pickle(folder / name)
    except ValueError as err:
        raise BadInput(f"{err}. Copy the model folder again, or save the model again.") from None


def max_tokenizer_bytes(vocab_size: int) -> int:
    """The most bytes a tokenizer file of a `vocab_size`-token vocabulary is read to."""
    return _BYTES_BESIDES + _BYTES_PER_TOKEN * vocab_size


def check_tokenizer_files(folder: str | Path, vocab_size) -> None:
    """A ValueError naming the file and what is refused unless the tokenizer files in `folder` fit a model of
    `vocab_size` embedding rows (by their size and their added tokens) and hold no pattern that backtracks
    without end. Files that are not there, or a `vocab_size` that is no number, are left to the loader."""
    folder = Path(folder)
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        return
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file() and path.stat().st_size > max_tokenizer_bytes(vocab_size):
            raise BadInput(f"{path} is {path.stat().st_size:,} bytes, more than a tokenizer of the model's "
                           f"{vocab_size:,} tokens needs (at most {max_tokenizer_bytes(vocab_size):,}); it is not read. "
                           "Put the tokenizer the model was trained with beside it")
    path = folder / "tokenizer.json"
    if not path.is_file():
        return
    try:
        tokenizer = parse_json(path.read_text(encoding="utf-8"), path)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # the loader names what is wrong with it
    if not isinstance(tokenizer, dict):
        return
    added = tokenizer.get("added_tokens")
    if isinstance(added, list) and len(added) > vocab_size:
        raise BadInput(f"{path} adds {len(added):,} tokens to a model of {vocab_size:,}; it is not read. "
                       "Put the tokenizer the model was trained with beside it")
    for part in ("normalizer", "pre_tokenizer"):
        for pattern in _patterns(tokenizer.get(part)):
            if _REPEATED_GROUP.search(pattern):
                raise BadInput(f"{path}: its {part} matches the regular expression {pattern[:80]!r}, whose repeated "
                               "group can take the matcher for ever; it is not read. Put the tokenizer the model was "
                               "trained with beside it")


def _patterns(part) -> list[str]:
    """The regular expressions anywhere in a normalizer's or pre-tokenizer's description."""
    if isinstance(part, dict):
        found = [part["Regex"]] if isinstance(part.get("Regex"), str) else []
        return found + [pattern for value in part.values() for pattern in _patterns(value)]
    if isinstance(part, list):
        return [pattern for value in part for pattern in _patterns(value)]
    return []


def check_export_folder(folder: str | os.PathLike) -> dict:
    """The decoding options of a CTranslate2 export (`export_ctranslate2`'s folder), or a ValueError naming the file
    unless it holds the export's files, none a link out of it, its options (and no others: each is an argument of
    CTranslate2's `translate_batch`) and CTranslate2's config within their bounds, and a tokenizer that fits its
    vocabulary."""
    folder = Path(folder)
    missing = [name for name in ("model.bin", "tokenizer.json", OPTIONS_FILE) if not (folder / name).is_file()]
    if missing:
        model = folder if (folder / CONFIG_FILE).is_file() else "MODEL"  # a model folder: export it elsewhere
        raise BadInput(
            f"`model` {folder} is not a CTranslate2 export (it lacks {', '.join(missing)}); write one with "
            f"`vanilla-transformer export --model {model} --format ctranslate2 --output-dir {folder.name}-ct2`"
        )
    for name in ("model.bin", CONFIG_FILE, OPTIONS_FILE, VOCABULARY_FILE, "tokenizer.json"):
        check_inside(folder / name)
    vocabulary = read_json(folder / VOCABULARY_FILE, MAX_INDEX_BYTES) if (folder / VOCABULARY_FILE).is_file() else None
    context = Context(len(vocabulary) if isinstance(vocabulary, list) and vocabulary else MAX_INDEX_BYTES, frozenset())
    options = read_json(folder / OPTIONS_FILE, MAX_JSON_BYTES)
    _check_fields(folder / OPTIONS_FILE, options, context)
    wrong = sorted(set(options) ^ set(FIELDS[OPTIONS_FILE]))
    if wrong:
        raise BadInput(f"{folder / OPTIONS_FILE}: the export writes exactly {', '.join(FIELDS[OPTIONS_FILE])}; "
                       f"{', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not as the export writes them")
    if (folder / CONFIG_FILE).is_file():
        _check_export_config(folder / CONFIG_FILE, context)
    check_tokenizer_files(folder, context.vocab_size)
    return options


def _check_export_config(path: Path, context: Context) -> None:
    """CTranslate2's config.json of an export: bounded in bytes, its fields within `folder_fields.FIELDS`; one that is
    not JSON is left to CTranslate2, whose loading names it."""
    if path.stat().st_size > MAX_JSON_BYTES:
        read_json(path, MAX_JSON_BYTES)  # the refusal naming its size
    try:
        settings = parse_json(path.read_text(encoding="utf-8"), path)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return
    _check_fields(path, settings, context, CTRANSLATE2_CONFIG)
