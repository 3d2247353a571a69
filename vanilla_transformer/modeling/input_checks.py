"""Checks of the models' forward inputs that give bad input an error naming the argument and what was expected,
not a shape error deep inside the model, and the two names of the cache; and, before a model is built, of its
config's size against this machine's memory.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only the
standard library, torch and the public API of transformers.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import torch
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_outputs import Seq2SeqLMOutput

# transformers 5.24 renamed the cache `past_key_values` to `cache` in generate's model arguments and in
# the model outputs. CACHE_NAME is the installed version's name; our models and `generate` accept both.
CACHE_NAME = "cache" if "cache" in {field.name for field in dataclasses.fields(Seq2SeqLMOutput)} else "past_key_values"


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or a name it does not know
        return None


def check_fits_in_memory(config) -> None:
    """Refuse, before any tensor is allocated, a model whose float32 parameters alone exceed this machine's
    memory: each field may be in bounds while their product (d_model × vocab_size, d_model² × layers) is not."""
    needed, memory = 4 * config.parameter_count(), physical_memory()
    if memory is not None and needed > memory:
        fields = ", ".join(f"{name}={getattr(config, name)}" for name in (
            "vocab_size", "d_model", "d_ff", "num_heads", "encoder_layers", "decoder_layers"))
        raise ValueError(f"a model of {fields} needs {needed:,} bytes for its float32 parameters alone; "
                         f"this machine has {memory:,} bytes of memory.")


def resolve_cache_argument(cache=None, past_key_values=None):
    """The cache passed under either name (`cache` since transformers 5.24, `past_key_values` before); the old
    name warns where the installed transformers has the new one, as its own models do.

    Both at once is PEFT's prefix tuning in transformers' loop: PEFT passes its prefix as `past_key_values` at every
    step beside the loop's `cache`. The prefix takes the place of the first step's empty cache, as it did while the
    two had one name; from then on the cache that holds it goes on (`cache` wins, transformers' own rule)."""
    if cache is not None and past_key_values is not None:
        return past_key_values if isinstance(cache, Cache) and cache.get_seq_length() == 0 else cache
    if past_key_values is not None and CACHE_NAME == "cache" and not torch.compiler.is_compiling():
        warnings.warn("`past_key_values` is deprecated and will be removed in version 5.40.0 for `forward`. "
                      "Use `cache` instead.", FutureWarning, stacklevel=3)
    return past_key_values if cache is None else cache


def use_return_dict(return_dict, config) -> bool:
    """transformers' rule: the argument, else `config.return_dict`."""
    return config.return_dict if return_dict is None else return_dict


def check_learned_positions(length, past_length, table_size: int) -> None:
    if not torch.compiler.is_compiling() and past_length + length > table_size:
        raise ValueError(
            f"Sequence of {past_length + length} positions is longer than the learned position table "
            f"(`max_position_embeddings`={table_size}). Use shorter inputs, a larger table, or "
            f'position_encoding="sinusoidal", which has no limit.'
        )


def check_ids(name: str, ids: torch.Tensor, vocab_size: int, allow_ignore_index: bool = False) -> None:
    if ids.dim() != 2:
        raise ValueError(f"`{name}` must have shape (batch, length); got {tuple(ids.shape)}.")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"`{name}` must hold integer token ids; got dtype {ids.dtype}.")
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or ids.device.type != "cpu":
        # Exporting (torch.export, ONNX): the values are symbolic. On an accelerator, reading them back would make
        # every forward wait for the device; there an id out of range fails in the embedding lookup instead.
        return
    valid = (ids >= 0) & (ids < vocab_size)
    if allow_ignore_index:
        valid |= ids == -100
    if not bool(valid.all()):
        bad = ids[~valid][0].item()
        allowed = f"0..{vocab_size - 1}" + (" or -100" if allow_ignore_index else "")
        raise ValueError(f"`{name}` holds id {bad}, outside the vocabulary ({allowed}; `vocab_size`={vocab_size}).")


def check_same_shape(name: str, tensor, reference_name: str, shape) -> None:
    if tensor is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"`{name}` has shape {tuple(tensor.shape)} but `{reference_name}` has shape {tuple(shape)}; they must match."
        )


def tokens_or_embeddings(name: str, ids, embeds, vocab_size: int) -> tuple[int, int] | None:
    """Check whichever of `<name>_ids` and `<name>s_embeds` was given (not both); return its (batch, length)."""
    ids_name, embeds_name = f"{name}_ids", f"{name}s_embeds"
    if ids is not None and embeds is not None:
        raise ValueError(f"Pass `{ids_name}` or `{embeds_name}`, not both.")
    if embeds is not None:
        if embeds.dim() != 3:
            raise ValueError(f"`{embeds_name}` must have shape (batch, length, d_model); got {tuple(embeds.shape)}.")
        return tuple(embeds.shape[:2])
    if ids is not None:
        check_ids(ids_name, ids, vocab_size)
        return tuple(ids.shape)
    return None


def check_source_not_empty(shape) -> None:
    """A source of no sentence or no token leaves attention nothing to attend to: refused here, not in a reshape."""
    if 0 in tuple(shape)[:2]:
        raise ValueError(f"The source is empty (shape {tuple(shape)}): give at least one sentence of at least one "
                         "token (a tokenized text ends in </s>).")


def check_encoder_inputs(ids, embeds, attention_mask, vocab_size: int) -> None:
    """The source: `input_ids` or `inputs_embeds`, not empty, and an `attention_mask` of the same (batch, length)."""
    shape = tokens_or_embeddings("input", ids, embeds, vocab_size)
    if shape is None:
        raise ValueError("Pass `input_ids` (the source token ids), `inputs_embeds` or `encoder_outputs`.")
    check_source_not_empty(shape)
    check_same_shape("attention_mask", attention_mask, "the source", shape)


def check_labels(labels, decoder_input_ids, decoder_inputs_embeds, vocab_size: int) -> None:
    """`labels`: token ids or -100, of the decoder input's (batch, length) when one is given (without one
    the decoder reads the labels shifted right, which have their shape)."""
    check_ids("labels", labels, vocab_size, allow_ignore_index=True)
    decoder_input = decoder_input_ids if decoder_inputs_embeds is None else decoder_inputs_embeds
    if decoder_input is not None:
        check_same_shape("labels", labels, "the decoder input", decoder_input.shape[:2])


def check_cache_and_checkpointing(cache, checkpointing: bool) -> None:
    if cache is not None and checkpointing:
        raise ValueError(
            "Gradient checkpointing replays each layer in the backward pass, which would extend `cache` a second "
            "time: train with a cache (PEFT's prefix tuning) without gradient checkpointing."
        )


def check_decoder_inputs(ids, embeds, cache, batch_size: int, vocab_size: int) -> None:
    if cache is not None and not isinstance(cache, EncoderDecoderCache):
        raise ValueError(
            "`cache` (`past_key_values`) must be an EncoderDecoderCache (self-attention and cross-attention "
            f"caches); got {type(cache).__name__}."
        )
    if cache is None or (not torch.compiler.is_compiling() and cache.get_seq_length() == 0):
        shape = tokens_or_embeddings("decoder_input", ids, embeds, vocab_size)
    else:
        # Once decoding has started the ids come from the model itself; checking is a sync per step
        # (and a break in a compiled step's graph: a static cache's length is a tensor).
        shape = (ids if embeds is None else embeds).shape[:2]
    if shape is None:
        raise ValueError(
            "Pass `decoder_input_ids` or `decoder_inputs_embeds`, or `labels` to the ForConditionalGeneration model."
        )
    if shape[0] != batch_size:
        name = "decoder_input_ids" if embeds is None else "decoder_inputs_embeds"
        raise ValueError(f"`{name}` has batch size {shape[0]} but the source has {batch_size}.")
