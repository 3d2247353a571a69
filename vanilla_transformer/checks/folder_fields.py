"""Every field of a model folder's JSON files that the package reads, with its kind, its bound and its meaning.

`FIELDS` is the one table: model_folder.py checks a folder's files against it before anything is built from
them, and docs/folder-fields.md is `fields_table()` (a test holds the file to it). A check takes the value and
what the folder says elsewhere (`Context`: the vocabulary, the end token) and returns what the value must be, or
None. config.json's fields are checked by the configuration class itself, which names each; their rows are made
from its groups, and the gate adds the bounds on positions a whole folder needs.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..modeling.configuration_vanilla_transformer import (
    CHOICES,
    FLAGS,
    MAX_SIZE,
    OPTIONAL_STRINGS,
    PROBABILITIES,
    SIZE_FIELDS,
    TOKEN_IDS,
)
from ..modeling.generation import LENGTH_PENALTY_STYLES
from ..modeling.value_checks import MAX_LENGTH_PENALTY, MAX_NEW_TOKENS, MAX_NUM_BEAMS, is_finite_number

__all__ = ["CONFIG_FILE", "CTRANSLATE2_CONFIG", "Context", "FIELDS", "Field", "GENERATION_FILE", "MAX_JSON_BYTES",
           "MAX_POSITIONS", "OPTIONS_FILE", "TOKENIZER_CONFIG", "field_problems", "fields_table"]

CONFIG_FILE, GENERATION_FILE, TOKENIZER_CONFIG = "config.json", "generation_config.json", "tokenizer_config.json"
OPTIONS_FILE = "translation_options.json"  # a CTranslate2 export's decoding defaults: keyword arguments of translate_batch
CTRANSLATE2_CONFIG = "config.json of a CTranslate2 export"  # an export's config.json, which CTranslate2 reads

# The longest sequence a folder may describe: far past any sentence, and the CTranslate2 export stores a table of
# this many rows; a larger one (2147483647) would make every length derived from it endless.
MAX_POSITIONS = 1 << 16
# The most bytes a settings file is read to: saved ones take a few hundred; past this one is refused before parsing.
MAX_JSON_BYTES = 1 << 20
_MAX_TOKEN_CHARACTERS = 256  # a special token's text, a stop string
_MANY = 1024  # layers named, stop strings


class Context(NamedTuple):
    """What a field is checked against: the model's vocabulary size and its end tokens."""

    vocab_size: int
    eos_token_ids: frozenset


class Field(NamedTuple):
    kind: str
    bound: str
    meaning: str
    check: Callable | None  # (value, Context) -> what it must be, or None; None: checked by the configuration class


def _integer(low: int, high: int) -> Callable:
    def check(value, context):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            return f"an integer in {low}..{high}"
    return check


def _number(low: float, high: float, above_low: bool = False) -> Callable:
    def check(value, context):
        if not is_finite_number(value) or not low <= value <= high or (above_low and value == low):
            return f"a finite number in {'(' if above_low else '['}{low}, {high}]"
    return check


def _choice(*allowed) -> Callable:
    def check(value, context):
        if value not in allowed:
            return f"one of {', '.join(map(repr, allowed))}"
    return check


def _flag(value, context):
    if not isinstance(value, bool):
        return "true or false"


def _text(value, context):
    if not isinstance(value, str) or len(value) > _MAX_TOKEN_CHARACTERS:
        return f"a string of at most {_MAX_TOKEN_CHARACTERS} characters"


def _special_token(value, context):
    if isinstance(value, dict):  # transformers' AddedToken, saved as its fields
        value = value.get("content")
    return _text(value, context)


def _token_id(value, context):
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < context.vocab_size:
        return f"a token id in 0..{context.vocab_size - 1}"


def _token_id_or_list(value, context):
    values = value if isinstance(value, list) and value else [value]
    if len(values) > context.vocab_size or any(_token_id(v, context) for v in values):
        return f"a token id in 0..{context.vocab_size - 1}, or a list of them"


def _ids(value, context, most: int) -> bool:
    """Whether `value` is a list of at most `most` token ids."""
    return isinstance(value, list) and len(value) <= most and not any(_token_id(v, context) for v in value)


def _suppressed(value, context):
    """A list of token ids none of which ends a sentence: a run whose end token is suppressed never ends."""
    if not _ids(value, context, context.vocab_size):
        return f"a list of at most {context.vocab_size} token ids in 0..{context.vocab_size - 1}"
    if context.eos_token_ids & set(value):
        return f"a list without the end token ({', '.join(map(str, sorted(context.eos_token_ids)))}), which ends a sentence"


def _bad_words(value, context):
    """Lists of token ids never generated in a row; the end token alone would be one, and no sentence would end."""
    if not isinstance(value, list) or len(value) > context.vocab_size or not all(
            _ids(words, context, MAX_NEW_TOKENS) and words for words in value):
        return f"at most {context.vocab_size} lists of 1..{MAX_NEW_TOKENS} token ids in 0..{context.vocab_size - 1}"
    if any(len(words) == 1 and words[0] in context.eos_token_ids for words in value):
        return "lists of which none is the end token alone, which ends a sentence"


def _early_stopping(value, context):
    if not isinstance(value, bool) and value != "never":
        return "true, false or 'never'"


def _dola_layers(value, context):
    if value not in ("low", "high") and not (isinstance(value, list) and len(value) <= _MANY and not any(
            _integer(0, _MANY)(layer, context) for layer in value)):
        return f"'low', 'high' or a list of at most {_MANY} layer numbers"


def _stop_strings(value, context):
    values = value if isinstance(value, list) else [value]
    if len(values) > _MANY or any(_text(text, context) for text in values):
        return f"a string, or a list of at most {_MANY}, each of at most {_MAX_TOKEN_CHARACTERS} characters"


def _forced_words(value, context):
    if not isinstance(value, list) or len(value) > context.vocab_size or not all(
            _ids(words, context, MAX_NEW_TOKENS) for words in value):
        return f"at most {context.vocab_size} lists of token ids in 0..{context.vocab_size - 1}"


def _absent(value, context):
    return "absent: constraints are objects, which no file holds"


def _entries(value, context):
    if not isinstance(value, (list, dict)) or len(value) > context.vocab_size:
        return f"a list or object of at most {context.vocab_size} entries"


_LENGTH = _integer(1, MAX_NEW_TOKENS)
_NOT_NEGATIVE_LENGTH = _integer(0, MAX_NEW_TOKENS)
_BEAMS = _integer(1, MAX_NUM_BEAMS)
_PENALTY = _number(-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
_IDS = "0..vocab_size-1"

_CONFIG_MEANINGS = {
    "vocab_size": "rows of the shared embedding table", "d_model": "width of every layer", "d_ff": "feed-forward width",
    "encoder_layers": "encoder layers", "decoder_layers": "decoder layers", "num_heads": "attention heads",
    "location_max_length": "key positions a location score reads", "attention_window": "half-width of local attention",
    "dropout": "dropout", "attention_dropout": "dropout on attention weights", "label_smoothing": "the loss's smoothing",
    "scale_embedding": "embeddings times sqrt(d_model)", "tie_word_embeddings": "one embedding table",
    "use_cache": "decoding keeps its keys and values", "fast_paths": "the measured speed-ups",
    "pad_token_id": "padding, the decoder's start by default", "bos_token_id": "sentence start",
    "eos_token_id": "sentence end", "decoder_start_token_id": "the decoder's first input",
    "source_lang": "language translated from", "target_lang": "language translated to",
    "dataset_name": "data set trained on", "dataset_config": "its configuration, where it has several",
    "dataset_columns": "its columns, where a header does not name them", "attention_score": "how queries meet keys",
    "attention_normalization": "how scores become weights", "local_attention": "which keys a query sees",
    "attention_hardness": "soft or one key", "position_encoding": "sinusoids or a learned table",
    "norm_position": "LayerNorm after or before each block", "activation": "the feed-forward nonlinearity",
}


def _config_fields() -> dict[str, Field]:
    """config.json's rows, from the configuration's own groups (which its `_validate` checks, naming the field)."""
    fields = {"model_type": Field("string", "names a model transformers knows", "the architecture", _text)}
    for name, allowed in CHOICES.items():
        fields[name] = Field("string", "one of " + ", ".join(allowed), _CONFIG_MEANINGS[name], None)
    for name in SIZE_FIELDS:
        fields[name] = Field("integer", f"1..{MAX_SIZE}", _CONFIG_MEANINGS.get(name, ""), None)
    for name in PROBABILITIES:
        fields[name] = Field("number", "[0, 1)", _CONFIG_MEANINGS[name], None)
    for name in FLAGS:
        fields[name] = Field("boolean", "true or false", _CONFIG_MEANINGS[name], None)
    for name in TOKEN_IDS:
        fields[name] = Field("integer", _IDS, _CONFIG_MEANINGS[name], None)
    for name in OPTIONAL_STRINGS:
        fields[name] = Field("string or null", "any", _CONFIG_MEANINGS[name], None)
    fields["layer_norm_eps"] = Field("number", "finite, above 0", "epsilon of every LayerNorm", None)
    # Bounds a whole folder needs beyond what a configuration can be built with.
    fields["max_position_embeddings"] = Field("integer", f"1..{MAX_POSITIONS}", "longest sequence: a learned table's "
                                              "rows, a hint for sinusoids", _integer(1, MAX_POSITIONS))
    fields["location_max_length"] = fields["location_max_length"]._replace(
        bound=f"1..{MAX_POSITIONS}", check=_integer(1, MAX_POSITIONS))
    return fields


FIELDS: dict[str, dict[str, Field]] = {
    CONFIG_FILE: _config_fields(),
    GENERATION_FILE: {
        "num_beams": Field("integer", f"1..{MAX_NUM_BEAMS}", "beam size (§6.1: 4)", _BEAMS),
        "num_return_sequences": Field("integer", f"1..{MAX_NUM_BEAMS}", "translations returned per text", _BEAMS),
        "length_penalty": Field("number", f"-{MAX_LENGTH_PENALTY}..{MAX_LENGTH_PENALTY}", "α (§6.1: 0.6)", _PENALTY),
        "length_penalty_style": Field("string", " or ".join(LENGTH_PENALTY_STYLES), "how finished beams are ranked",
                                      _choice(*LENGTH_PENALTY_STYLES)),
        "max_length_offset": Field("integer", f"1..{MAX_NEW_TOKENS}", "output tokens past the source's (§6.1: 50)", _LENGTH),
        "max_new_tokens": Field("integer", f"1..{MAX_NEW_TOKENS}", "ceiling on any output's tokens", _LENGTH),
        "max_length": Field("integer", f"1..{MAX_NEW_TOKENS}", "transformers' cap; the source-length cap replaces it",
                            _LENGTH),
        "min_length": Field("integer", f"0..{MAX_NEW_TOKENS}", "shortest output, prompt included", _NOT_NEGATIVE_LENGTH),
        "min_new_tokens": Field("integer", f"0..{MAX_NEW_TOKENS}", "shortest output", _NOT_NEGATIVE_LENGTH),
        "no_repeat_ngram_size": Field("integer", f"0..{MAX_NEW_TOKENS}", "n-grams never repeated", _NOT_NEGATIVE_LENGTH),
        "early_stopping": Field("boolean or 'never'", "", "when beam search stops", _early_stopping),
        "do_sample": Field("boolean", "true or false", "sample instead of search", _flag),
        "pad_token_id": Field("integer", _IDS, "padding", _token_id),
        "bos_token_id": Field("integer", _IDS, "sentence start", _token_id),
        "decoder_start_token_id": Field("integer", _IDS, "the decoder's first input", _token_id),
        "eos_token_id": Field("integer or list", _IDS, "sentence end", _token_id_or_list),
        "forced_bos_token_id": Field("integer", _IDS, "first output token", _token_id),
        "forced_eos_token_id": Field("integer or list", _IDS, "token forced at the cap", _token_id_or_list),
        "suppress_tokens": Field("list of integers", f"at most vocab_size ids in {_IDS}, not the end token",
                                 "never generated", _suppressed),
        "begin_suppress_tokens": Field("list of integers", f"at most vocab_size ids in {_IDS}, not the end token",
                                       "never generated first", _suppressed),
        "bad_words_ids": Field("list of lists of integers", f"at most vocab_size lists of 1..{MAX_NEW_TOKENS} ids, "
                               "not the end token alone", "sequences never generated", _bad_words),
        "force_words_ids": Field("list of lists of integers", f"at most vocab_size lists of ids in {_IDS}",
                                 "sequences every output holds", _forced_words),
        "constraints": Field("objects", "absent", "constrained beam search", _absent),
        "num_beam_groups": Field("integer", f"1..{MAX_NUM_BEAMS}", "diverse beam search's groups", _BEAMS),
        "penalty_alpha": Field("number", "[0, 1]", "contrastive search's degeneration penalty", _number(0, 1)),
        "prompt_lookup_num_tokens": Field("integer", f"1..{MAX_NEW_TOKENS}", "tokens prompt lookup proposes", _LENGTH),
        "assistant_early_exit": Field("integer", f"1..{_MANY}", "the layer a self-speculating model drafts from",
                                      _integer(1, _MANY)),
        "dola_layers": Field("string or list", f"low, high, or at most {_MANY} layer numbers", "DoLa's contrasted "
                             "layers", _dola_layers),
        "stop_strings": Field("string or list", f"at most {_MANY} strings of at most {_MAX_TOKEN_CHARACTERS} characters",
                              "texts that end an output", _stop_strings),
        "cache_implementation": Field("string", f"at most {_MAX_TOKEN_CHARACTERS} characters; transformers' names",
                                      "the decoding cache", _text),
        **{name: Field("boolean", "true or false", meaning, _flag) for name, meaning in (
            ("low_memory", "beam search one beam at a time"), ("token_healing", "the prompt's last token redone"),
            ("is_assistant", "the model drafts for another"), ("use_mtp", "multi-token prediction"),
            ("return_dict_in_generate", "an output object, not ids"), ("output_scores", "each step's scores"),
            ("output_logits", "each step's logits"), ("output_attentions", "attention weights returned"),
            ("output_hidden_states", "hidden states returned"))},
    },
    TOKENIZER_CONFIG: {
        "tokenizer_class": Field("string", "TokenizersBackend or PreTrainedTokenizerFast", "reads tokenizer.json",
                                 _choice("TokenizersBackend", "PreTrainedTokenizerFast")),
        "backend": Field("string", "tokenizers", "the library behind it", _choice("tokenizers")),
        "model_max_length": Field("integer", f"1..{MAX_POSITIONS}", "longest source, in tokens",
                                  _integer(1, MAX_POSITIONS)),
        "padding_side": Field("string", "left or right", "where padding goes", _choice("left", "right")),
        "truncation_side": Field("string", "left or right", "which end a long text loses", _choice("left", "right")),
        "clean_up_tokenization_spaces": Field("boolean", "true or false", "spaces removed when decoding", _flag),
        **{name: Field("string", f"at most {_MAX_TOKEN_CHARACTERS} characters", meaning, _special_token)
           for name, meaning in (("bos_token", "sentence start"), ("eos_token", "sentence end"),
                                 ("pad_token", "padding"), ("unk_token", "unknown text"))},
        "added_tokens_decoder": Field("object", "at most vocab_size entries", "tokens added to the vocabulary", _entries),
        "extra_special_tokens": Field("list or object", "at most vocab_size entries", "more special tokens", _entries),
    },
    OPTIONS_FILE: {
        "beam_size": Field("integer", f"1..{MAX_NUM_BEAMS}", "beam size", _BEAMS),
        "length_penalty": Field("number", f"-{MAX_LENGTH_PENALTY}..{MAX_LENGTH_PENALTY}", "α, over |Y|^α", _PENALTY),
        "min_decoding_length": Field("integer", f"0..{MAX_NEW_TOKENS}", "shortest output", _NOT_NEGATIVE_LENGTH),
        "max_input_length": Field("integer", f"1..{MAX_POSITIONS}", "longest source, in tokens",
                                  _integer(1, MAX_POSITIONS)),
        "max_decoding_length": Field("integer", f"1..{MAX_NEW_TOKENS}", "ceiling on any output's tokens", _LENGTH),
        "max_length_offset": Field("integer", f"1..{MAX_NEW_TOKENS}", "output tokens past the longest source's", _LENGTH),
    },
    CTRANSLATE2_CONFIG: {
        "add_source_bos": Field("boolean", "true or false", "CTranslate2 prepends <s>", _flag),
        "add_source_eos": Field("boolean", "true or false", "CTranslate2 appends </s>", _flag),
        "multi_query_attention": Field("boolean", "true or false", "one key and value head", _flag),
        "layer_norm_epsilon": Field("number", "(0, 1]", "epsilon of every LayerNorm", _number(0, 1, above_low=True)),
        **{name: Field("string", f"at most {_MAX_TOKEN_CHARACTERS} characters", meaning, _text)
           for name, meaning in (("bos_token", "sentence start"), ("eos_token", "sentence end"),
                                 ("unk_token", "unknown text"), ("decoder_start_token", "the decoder's first input"))},
    },
}


def field_problems(file: str, data: dict, context: Context) -> list[str]:
    """What is wrong with the fields of `data` that `file`'s table checks: "`name` must be X; got V" each."""
    found = []
    for name, field in FIELDS[file].items():
        if field.check is not None and data.get(name) is not None:
            wanted = field.check(data[name], context)
            if wanted is not None:
                found.append(f"`{name}` must be {wanted}; got {_shown(data[name])}")
    return found


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(value):,} entries)" if isinstance(value, (list, dict)) \
        else f"{text[:40]}..."


def fields_table() -> str:
    """docs/folder-fields.md: one table per file, every field with its kind, bound and meaning."""
    lines = ["# The fields of a model folder", "",
             "Every field of a model folder's JSON files that the package reads, and the bound it is checked against "
             "before anything is built from the folder (`vanilla_transformer/checks/model_folder.py`).", "",
             "This page is generated from `vanilla_transformer/checks/folder_fields.py` by `fields_table()`; "
             "`tests/checks/test_model_folder.py` holds this file to it.", "",
             "What is read at all:", "",
             f"- a settings file below, when it is at most {MAX_JSON_BYTES:,} bytes;",
             "- a tokenizer file, when it is at most 1 MiB plus 1 KiB per token of the vocabulary;",
             "- no file that is a link out of the folder.", "",
             "A field outside these tables is left to transformers' own checks (`GenerationConfig.validate`, the "
             "tokenizer's loader). In translation_options.json it is refused.", ""]
    for file, fields in FIELDS.items():
        bounded = sum(field.check is not None for field in fields.values())
        lines += [f"## {file}", "", f"{len(fields)} fields; {bounded} bounded here, "
                  f"{len(fields) - bounded} by the configuration class." if bounded < len(fields) else
                  f"{len(fields)} fields, each bounded here.", "", "| field | kind | bound | meaning |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {field.kind} | {field.bound} | {field.meaning} |" for name, field in fields.items()]
        lines.append("")
    return "\n".join(lines)
