"""Decoding as the paper does it (§6.1): beam size 4, length penalty α = 0.6, output capped at input length + 50.

This file serves a `generate` call: the two options this model adds, §6.1's length cap, the call's options
resolved and the loop that serves it. The loops themselves, greedy search and the paper's beam search with the GNMT length
penalty (`GNMTRanking`), are in search.py, whose docstring says what *finished* (a hypothesis) and *done* (a
sentence) mean here too.

Two generation-config attributes select the paper's behaviour (GenerationConfig keeps unknown
attributes and saves them in generation_config.json; they can also be passed to `generate`):

    length_penalty_style: "gnmt" runs `gnmt_beam_search` (search.py) for beam search; "transformers" (the
        default when unset) hands beam search to transformers' own loop, with its ranking and its rule
        for when a sentence is done. Greedy search and sampling are unaffected by a length penalty. Set both
        attributes with `paper_generation_config`: set on a generation config derived from the model config
        (`_from_model_config`), transformers drops them when it loads the saved folder.
    max_length_offset: when the call sets neither `max_new_tokens` nor `max_length` (as arguments or
        in a `generation_config` argument), sentence i may generate at most
        (number of non-padding source tokens of i) + max_length_offset new tokens, </s> included;
        </s> is forced at the last allowed step. Default 50, the paper's; it holds for every mode
        (greedy, sampling, either beam search), per sentence in a batch.

Lengths stored in the model's generation config (generation_config.json), the rule: a stored
`max_new_tokens` is a ceiling on the per-sentence cap (nothing in transformers sets it unasked); a
stored `max_length` is ignored by the cap. transformers fills `max_length` with its default of 20
tokens wherever it is unset (`Seq2SeqTrainer` writes it into the model's generation config at every
evaluation, and `save_model` then saves it), so honouring it would cut every later translation at 19
tokens. To cap outputs, pass `max_new_tokens` or `max_length` to `generate` (or the pipeline), which
replaces the cap, store `max_new_tokens`, or lower `max_length_offset`.

Which loop serves a request (`choose_search`): transformers decides its mode, from the call's options
resolved with GenerationConfig's public methods (`resolved_generation_config`, then its
`get_generation_mode`); the loops of search.py (passed to `generate` as `custom_generate`) serve greedy and
beam search, and every other mode (sampling, beam groups, constraints, contrastive search, assisted
generation, DoLa, ...) goes to transformers' own loop, named. Tables name what search.py's loops cannot do
within their modes: `HAND_OVERS` (streamers, a cache passed in, output_logits and the like), for greedy
search only `GREEDY_HAND_OVERS` (a static cache, return_dict_in_generate), and for beam search only
`BEAM_HAND_OVERS` (transformers' length penalty, whose rules are transformers' to keep). transformers'
loop ranks beams by |Y|^α: a beam call with length_penalty_style="gnmt" handed to it says so in a
warning, once per reason, unless the call brings its own search (`custom_generate`), which runs as it is.
An input longer than a learned position table (`max_position_embeddings`) is refused in one line.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only the
standard library, torch, the public API of transformers and the files beside it.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import GenerationConfig
from transformers.generation import GenerationMode, LogitsProcessorList
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.utils import logging

from .input_checks import CACHE_NAME, check_source_not_empty, resolve_cache_argument
from .value_checks import MAX_NEW_TOKENS, check_decoding_options
from .search import SourceLengthCap, first_token_id, gnmt_beam_search, greedy_search

logger = logging.get_logger(__name__)

LENGTH_PENALTY_STYLES = ("gnmt", "transformers")
DEFAULT_MAX_LENGTH_OFFSET = 50  # §6.1: "maximum output length to input length + 50"
ADDED_OPTIONS = {"length_penalty_style": "transformers", "max_length_offset": DEFAULT_MAX_LENGTH_OFFSET}  # what this model adds to GenerationConfig, with their defaults


def paper_generation_config(model_config, **overrides) -> GenerationConfig:
    """The paper's decoding settings (§6.1) for a model: `model.generation_config = paper_generation_config(model.config)`.

    A new GenerationConfig rather than edits to `model.generation_config`: that one is derived from
    the model config, and transformers drops unknown attributes such as these when it loads a
    generation config marked as derived (`_from_model_config`).
    """
    settings = dict(num_beams=4, length_penalty=0.6, length_penalty_style="gnmt",
                    max_length_offset=DEFAULT_MAX_LENGTH_OFFSET)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        settings[name] = getattr(model_config, name)
    return GenerationConfig(**{**settings, **overrides})


def generate_with_added_options(model, base_generate, inputs=None, generation_config=None, logits_processor=None, **kwargs):
    """`generate` with the two attributes described at the top of this file; everything else is transformers'.

    `base_generate` is transformers' `GenerationMixin.generate` bound to `model`. In steps: the call's options
    resolved once and checked (the added ones taken out of the call), the source-length cap added unless the call sets a
    length, the loop chosen (`choose_search`). The cache is transformers' own (an `EncoderDecoderCache` of
    `DynamicCache`s unless the call brings one or names another), so a returned one continues a generation.
    """
    cache = resolve_cache_argument(kwargs.pop("cache", None), kwargs.pop("past_key_values", None))
    if cache is not None:  # either name works, with any transformers version
        kwargs[CACHE_NAME] = cache
    resolved = resolved_generation_config(model, generation_config, kwargs)
    _check_options(resolved)
    for name in ADDED_OPTIONS:  # not model inputs
        kwargs.pop(name, None)
    source = _source(inputs, kwargs)
    _check_source_fits(model, source)

    if source is not None and not _sets_length(kwargs, generation_config):
        cap = _source_length_cap(model, source, kwargs, resolved)
        logits_processor = LogitsProcessorList([*(logits_processor or []), cap])
        generation_config = _with_longest_output(model, cap, kwargs, generation_config)
    if resolved.prefill_chunk_size is not None:  # see _with_option
        generation_config = _with_option(kwargs, generation_config, "prefill_chunk_size", None)

    search, reason = choose_search(model, kwargs, resolved)
    if search is not None:
        kwargs["custom_generate"] = search
    elif (resolved.length_penalty_style == "gnmt" and (resolved.num_beams or 1) > 1
          and kwargs.get("custom_generate") is None):  # else scores would change unsaid; a caller's search runs as is
        logger.warning_once(f"transformers' own generation loop serves this call ({reason}): it ranks finished beams "
                            "by |Y|^α, not by the GNMT length penalty that length_penalty_style='gnmt' asks for")
    else:
        logger.debug(f"transformers' own generation loop serves this call: {reason}")
    return base_generate(inputs, generation_config=generation_config, logits_processor=logits_processor, **kwargs)


def _check_options(config: GenerationConfig) -> None:
    """Our two options, and the settings transformers would fail on late (`config`: the call's, resolved)."""
    style, offset = config.length_penalty_style, config.max_length_offset
    if style not in LENGTH_PENALTY_STYLES:
        raise ValueError(f"`length_penalty_style` must be one of {LENGTH_PENALTY_STYLES}; got {style!r}.")
    if not isinstance(offset, int) or isinstance(offset, bool) or not 1 <= offset <= MAX_NEW_TOKENS:
        raise ValueError(f"`max_length_offset` must be an integer in 1..{MAX_NEW_TOKENS}; got {offset!r}.")
    check_decoding_options(num_beams=config.num_beams, length_penalty=config.length_penalty,
                           max_new_tokens=config.max_new_tokens)


def _source(inputs, kwargs) -> torch.Tensor | None:
    """What the call translates: its token ids, their embeddings or, where the encoder has run, its output (B, S,
    d_model); §6.1's cap counts the source's tokens in any of them."""
    encoded = kwargs.get("encoder_outputs")
    given = (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds"), encoded[0] if encoded is not None else None)
    return next((x for x in given if x is not None), None)


def _check_source_fits(model, source) -> None:
    """Refuse an empty input, and one longer than a learned position table (the pipeline's `longest_source`;
    location-based scores refuse a source longer than their map themselves, naming it)."""
    if source is not None:
        check_source_not_empty(source.shape)
    limit = model.config.sequence_bounds().get("max_position_embeddings")
    if source is not None and limit is not None and source.size(1) > limit:
        raise ValueError(f"The input is {source.size(1)} tokens long; this model reads at most {limit} "
                         f"(max_position_embeddings). Truncate it: tokenizer(..., truncation=True, max_length={limit}).")


def _sets_length(kwargs, generation_config) -> bool:
    """Does the call set a length (`max_new_tokens` or `max_length`, as an argument or in its config)? Then it
    replaces §6.1's cap."""
    in_call = (kwargs, vars(generation_config) if generation_config is not None else {})
    return any(c.get(name) is not None for c in in_call for name in ("max_new_tokens", "max_length"))


def _source_length_cap(model, source, kwargs, config: GenerationConfig) -> SourceLengthCap:
    """§6.1's cap: sentence i may generate its number of non-padding source tokens + `max_length_offset`."""
    mask = kwargs.get("attention_mask")
    if mask is not None:
        lengths = mask.sum(1)
    elif source.dim() == 3:  # inputs_embeds or the encoder's output (B, S, d_model)
        lengths = torch.full((source.size(0),), source.size(1), device=source.device)
    else:
        lengths = (source != model.config.pad_token_id).sum(1)
    prompt = kwargs["decoder_input_ids"].size(1) if kwargs.get("decoder_input_ids") is not None else 1
    # A stored max_new_tokens is a ceiling (see the top of this file), and so are the longest target the model reads
    # and the longest output any option may ask for: a sinusoidal model's positions alone bound nothing.
    ceiling = min(model.generation_config.max_new_tokens or math.inf, longest_target(model.config) - prompt,
                  MAX_NEW_TOKENS)
    return SourceLengthCap((lengths + config.max_length_offset).clamp(max=ceiling), first_token_id(config.eos_token_id), prompt)


def longest_target(config) -> int:
    """The longest decoder input the model reads: the config's `longest_sequence`, and where nothing bounds
    it `max_position_embeddings`, which sinusoids take as a hint."""
    longest = config.longest_sequence()
    return config.max_position_embeddings if longest is None else min(longest, config.max_position_embeddings)


def _with_longest_output(model, cap: SourceLengthCap, kwargs, generation_config):
    """Tell transformers the longest output the cap allows: in the call, or on a copy of the call's config
    (transformers warns about a config and generation kwargs together). The call's config is returned."""
    longest = int(cap.max_new_tokens.max())
    # Named as the stored config names it, or transformers warns that both are set.
    if model.generation_config.max_new_tokens:
        return _with_option(kwargs, generation_config, "max_new_tokens", longest)
    return _with_option(kwargs, generation_config, "max_length", cap.prompt_length + longest)


def _with_option(kwargs, generation_config, name: str, value):
    """`name` set to `value` for the call: in its arguments, or on a copy of its config (transformers warns about a
    config and generation kwargs together). The call's config is returned. Set so: the longest output, and no
    chunked prefill (`prefill_chunk_size`), which transformers' loop runs with `position_ids` the model's forward does not
    take; the decoder's prompt is read whole, as search.py's loops read it."""
    if generation_config is None:
        kwargs[name] = value
        return None
    generation_config = copy.deepcopy(generation_config)
    setattr(generation_config, name, value)
    return generation_config


def resolved_generation_config(model, generation_config, kwargs) -> GenerationConfig:
    """The call's options as `generate` resolves them, built with GenerationConfig's public methods: the model's
    generation config, then what the call's `generation_config` sets (its values that are not None), then the
    call's own arguments (`update` takes those that are options and leaves model inputs). Our two options, in the
    same order: `update` sets only the attributes a config already has."""
    config = copy.deepcopy(model.generation_config)
    if generation_config is not None:
        config.update(**{name: value for name, value in generation_config.to_dict().items() if value is not None})
    config.update(**kwargs)
    for name, default in ADDED_OPTIONS.items():
        given = (kwargs.get(name), getattr(generation_config, name, None), getattr(model.generation_config, name, None))
        setattr(config, name, next((value for value in given if value is not None), default))
    return config


# Requests in a mode search.py's loops serve (greedy and beam search) that they still cannot: the first rule that holds
# hands the call to transformers' own loop, by name. Which mode a request is, transformers decides.
HAND_OVERS = (
    ("custom_generate given", lambda model, kwargs, config: kwargs.get("custom_generate") is not None),
    # an assistant's loop crops its cache, which only transformers' dynamic cache can do
    ("is_assistant", lambda model, kwargs, config: bool(config.is_assistant)),
    # transformers checks an assistant's tokenizer in its own loops (with beams too)
    ("assistant_tokenizer", lambda model, kwargs, config: kwargs.get("assistant_tokenizer") is not None),
    # transformers hands the tokenizer these need only to its own loops
    ("stop_strings", lambda model, kwargs, config: config.stop_strings is not None),
    ("token_healing", lambda model, kwargs, config: bool(config.token_healing)),
    ("streamer", lambda model, kwargs, config: kwargs.get("streamer") is not None),
    ("a cache passed in", lambda model, kwargs, config: kwargs.get(CACHE_NAME) is not None),
    ("output_logits", lambda model, kwargs, config: bool(config.output_logits)),
    # options transformers refuses or acts on in its own loop: its error, or its synchronisation across GPUs
    ("low_memory", lambda model, kwargs, config: bool(config.low_memory)),
    ("synced_gpus", lambda model, kwargs, config: bool(kwargs.get("synced_gpus"))),
    # PEFT's prompt learning (prefix tuning) feeds its prefix through prepare_inputs_for_generation,
    # which only transformers' loop calls.
    ("PEFT's prepare_inputs_for_generation", lambda model, kwargs, config:
     "prepare_inputs_for_generation" in vars(model)),
)
# Greedy search only: with a static cache transformers' loop compiles the decoder step (beam search does not
# compile in transformers), and per-step outputs come from transformers' loop.
GREEDY_HAND_OVERS = (
    ("static cache", lambda model, kwargs, config: config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS),
    ("return_dict_in_generate", lambda model, kwargs, config: bool(config.return_dict_in_generate)),
)
# Beam search only: transformers' ranking and its rule for when a sentence is done are its own, run by its loop.
BEAM_HAND_OVERS = (
    ("transformers' length penalty", lambda model, kwargs, config: config.length_penalty_style != "gnmt"),
)
CUSTOM_LOOP_MODES = {GenerationMode.GREEDY_SEARCH: GREEDY_HAND_OVERS, GenerationMode.BEAM_SEARCH: BEAM_HAND_OVERS}


def choose_search(model, kwargs, config: GenerationConfig):
    """The loop that serves a `generate` request: (search.py's loop, None), or (None, the reason it goes to
    transformers' own loop: the mode's name, or the rule's). `config`: the call's options, resolved
    (`resolved_generation_config`); search.py's beam search serves the paper's ranking (`length_penalty_style="gnmt"`)."""
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    if mode not in CUSTOM_LOOP_MODES:
        return None, mode.value
    for reason, applies in HAND_OVERS + CUSTOM_LOOP_MODES[mode]:
        if applies(model, kwargs, config):
            return None, reason
    # done sentences leave the batch in both
    return (greedy_search if mode == GenerationMode.GREEDY_SEARCH else gnmt_beam_search), None


__all__ = [
    "choose_search",
    "longest_target",
    "generate_with_added_options",
    "paper_generation_config",
    "resolved_generation_config",
]
