"""Decoding speed-ups: two pieces of decoding that give the plain path's tokens and scores with less work,
each chosen by `generate` in one place. `fast_paths=False` in the config (the one switch, which also
chooses the model's loss) turns them off.

    plain                                       drop-in (here)
    the decoder's linear maps and lm_head       packed_products: the same products on oneDNN, each weight packed
      (§3.2.2, §3.3, §3.4) on torch's default     once per call, where the model's `onednn_decoding` asks for it
      fp32 kernel (MKL on a CPU)                  (set at load to the shapes timed faster:
                                                  decoding_kernel.py in the package)
    every row computed until the last ends      should_prune: finished sentences leave our search loops' batch

The model's linear maps are built as PackableLinear (fast_modeling.py) for this.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only the
standard library, torch and the fast modeling file beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from .fast_modeling import (
    ONEDNN_LINEAR,
    PackableLinear,
    pack_weight,
    packed_weights,
)


def _asked(onednn_decoding, linear: nn.Linear) -> bool:
    """Whether a model's `onednn_decoding` (a bool, or a set of (in, out) shapes) asks for `linear` on oneDNN."""
    if isinstance(onednn_decoding, bool):
        return onednn_decoding
    return (linear.in_features, linear.out_features) in onednn_decoding


def worth_packing(model, linear: nn.Linear, rows: int) -> bool:
    """Whether our search loops run `linear`'s product for `rows` rows on oneDNN: asked for (the model's
    `onednn_decoding`: True for every product, or the (in, out) shapes to pack), the switch on, oneDNN present and
    enabled, no autocast (which would run the product in its own dtype), a float32 weight on the CPU (not
    offloaded) and more than one row (one sentence does not win the packing back)."""
    weight = linear.weight
    return (
        _asked(model.onednn_decoding, linear)
        and model.config.fast_paths
        and rows > 1
        and ONEDNN_LINEAR
        and torch.backends.mkldnn.enabled
        and not torch.is_autocast_enabled("cpu")
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
    )


def packed_products(model, rows: int):
    """While one of our search loops runs over `rows` rows: each PackableLinear of the decoder, and the output
    projection, that is `worth_packing` runs on its weight packed for oneDNN (the weights cannot change
    meanwhile; the packed copies are memory for the call). The packing is this call's own: other threads
    decoding with the same model, under autocast or not, see none of it, and nothing is stored on the model."""
    modules = [*model.get_decoder().modules(), model.get_output_embeddings()]
    return packed_weights({module: pack_weight(module.weight) for module in modules
                           if isinstance(module, PackableLinear) and worth_packing(model, module, rows)})


def should_prune(going_on: int, batch: int) -> bool:
    """The one rule by which finished rows leave the batch of our searches (greedy and beam): at once,
    when fewer than the `batch` rows (or, in beam search, sentences) are `going_on`. Gathering the rows
    that stay costs no more than computing finished rows for a step or two, and beam search gathers its
    self-attention cache at every step anyway (to reorder its beams)."""
    return going_on < batch


__all__ = ["packed_products", "should_prune", "worth_packing"]
