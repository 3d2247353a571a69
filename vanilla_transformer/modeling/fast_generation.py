"""Decoding speed-ups: two pieces of decoding that give the plain path's tokens and scores with less work,
each chosen by `generate` in one place. `fast_paths=False` in the config (the one switch, which also
chooses the model's loss) turns them off.

    plain                                       drop-in (here)
    the decoder's linear maps and lm_head       packed_products: the same products on oneDNN, each weight packed
      (§3.2.2, §3.3, §3.4) on torch's default     once per call, for the shapes oneDNN computes faster on this
      fp32 kernel (MKL on a CPU)                  machine (timed once per shape, `is_onednn_faster`)
    every row computed until the last ends      should_prune: finished sentences leave our search loops' batch

The model's linear maps are built as PackableLinear (fast_modeling.py) for this.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only the
standard library, torch and the fast modeling file beside it.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from .fast_modeling import (
    ONEDNN_LINEAR,
    PackableLinear,
    onednn_linear,
    pack_weight,
    packed_weights,
)


MARGIN = 0.05  # oneDNN replaces torch's kernel for a shape only when it is at least this much faster
ROUNDS = 5  # timings of each kernel per shape, interleaved; the fastest of each counts
_FASTER: dict[tuple, bool] = {}  # (rows, in, out, threads): whether oneDNN was faster, measured once a process


def is_onednn_faster(rows: int, in_features: int, out_features: int) -> bool:
    """Whether oneDNN, on a packed weight, computes a (rows, in) x (in, out) product at least MARGIN faster than
    torch's default float32 kernel here. It depends on the CPU and the shape (MKL can win narrow products), so
    it is timed, once a process for each shape (rows rounded up to a power of two) and thread count."""
    rows = 1 << (rows - 1).bit_length()
    key = (rows, in_features, out_features, torch.get_num_threads())
    if key not in _FASTER:
        numbers = torch.Generator().manual_seed(0)  # its own: the global random stream stays as it was
        x = torch.randn(rows, in_features, generator=numbers)
        weight = torch.randn(out_features, in_features, generator=numbers)
        bias, packed = torch.zeros(out_features), pack_weight(weight)
        kernels = (lambda: F.linear(x, weight, bias), lambda: onednn_linear(x, packed, bias))
        seconds = [math.inf, math.inf]
        with torch.no_grad():
            for kernel in kernels:
                kernel()  # the first call sets the kernel up
            for _ in range(ROUNDS):
                for i, kernel in enumerate(kernels):
                    start = time.perf_counter()
                    kernel()
                    seconds[i] = min(seconds[i], time.perf_counter() - start)
        _FASTER[key] = seconds[1] < (1 - MARGIN) * seconds[0]
    return _FASTER[key]


def worth_packing(model, linear: nn.Linear, rows: int) -> bool:
    """Whether our search loops run `linear`'s product for `rows` rows on oneDNN: the switch on, oneDNN present
    and enabled, no autocast (which would run the product in its own dtype), a float32 weight on the CPU (not
    offloaded), more than one row (one sentence does not win the packing back), and oneDNN the faster here for
    that shape."""
    weight = linear.weight
    return (
        model.config.fast_paths
        and rows > 1
        and ONEDNN_LINEAR
        and torch.backends.mkldnn.enabled
        and not torch.is_autocast_enabled("cpu")
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and is_onednn_faster(rows, linear.in_features, linear.out_features)
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


__all__ = ["is_onednn_faster", "packed_products", "should_prune", "worth_packing"]
