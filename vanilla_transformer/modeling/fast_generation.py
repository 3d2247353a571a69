"""Decoding speed-ups: two pieces of decoding that give the plain path's tokens and scores with less work,
each chosen by `generate` in one place. `fast_paths=False` in the config (the one switch, which also
chooses the model's loss) turns them off.

    plain                                       drop-in (here)
    the decoder's linear maps and lm_head       onednn_decoding_weights: the same products on oneDNN, each
      (§3.2.2, §3.3, §3.4) on torch's default     weight packed once per call, where the model's
      fp32 kernel (MKL on a CPU)                  `onednn_decoding` asks for it (set at load to the shapes
                                                  timed faster: onednn_decoding.py in the package)
    every row computed until the last is done   should_prune: done sentences leave search.py's loops' batch

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
    """Whether search.py's loops run `linear`'s product for `rows` rows on oneDNN: asked for (the model's
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


def onednn_decoding_weights(model, rows: int):
    """The model's `onednn_decoding` for one call of search.py's loops over `rows` rows: while it lasts, each
    PackableLinear of the decoder, and the output projection, that is `worth_packing` runs on its weight packed for
    oneDNN (the weights cannot change meanwhile; the packed copies are memory for the call). The packing is this
    call's own: other threads decoding with the same model, under autocast or not, see none of it, and nothing is
    stored on the model."""
    modules = [*model.get_decoder().modules(), model.get_output_embeddings()]
    return packed_weights({module: pack_weight(module.weight) for module in modules
                           if isinstance(module, PackableLinear) and worth_packing(model, module, rows)})


def should_prune(not_done: int, batch: int) -> bool:
    """The one rule by which done rows (in beam search, done sentences) leave the batch of search.py's loops: at
    once, when fewer than the `batch` rows (or sentences) are `not_done`. Gathering the rows that stay costs no
    more than computing done rows for a step or two, and beam search gathers its
    self-attention cache at every step anyway (to reorder its beams)."""
    return not_done < batch


__all__ = ["onednn_decoding_weights", "should_prune", "worth_packing"]
