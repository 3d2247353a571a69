"""Decoding speed-ups: two pieces of decoding that give the plain path's tokens and scores with less work,
each chosen by `generate` in one place. `fast_paths=False` in the config (the one switch, which also
chooses the model's loss) turns them off.

    plain                                   drop-in (here)
    lm_head(x) (§3.4)                       output_projection: the same product on oneDNN, weight packed once per call
    every row computed until the last ends  rows_leave: finished sentences leave our search loops' batch

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only torch
(and looks up two of torch's own oneDNN ops by name, see below).
"""

from __future__ import annotations

import torch
from torch import nn


def enabled(config) -> bool:
    """The one switch: `config.fast_paths`."""
    return config.fast_paths


# The output projection (§3.4's pre-softmax linear transformation, d_model x vocabulary) is the largest
# product of a decoding step. In float32 on a CPU torch runs it on MKL; oneDNN, also inside torch, can
# take the weight laid out ("packed") for its kernels once per `generate` call (the weights cannot change
# meanwhile). The ops are those torch.compile uses when it freezes weights on a CPU; their names are
# private, so they are looked up, and without them nothing is packed. benchmarks/ reports what it saves.
ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and all(
    hasattr(torch.ops.mkldnn, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
)


def output_projection(model, rows: int):
    """The function our search loops turn the decoder's last hidden states (rows, d_model) into logits
    with: `model.lm_head`, or the same product on oneDNN with the weight packed for this call, where that
    applies (the switch on, float32 on a CPU, a plain `nn.Linear` without hooks, oneDNN present and
    enabled, more than one row: one sentence does not win the packing back)."""
    lm_head = model.get_output_embeddings()
    if not (
        enabled(model.config)
        and rows > 1
        and ONEDNN_LINEAR
        and torch.backends.mkldnn.enabled
        and type(lm_head) is nn.Linear
        and lm_head.weight.device.type == "cpu"
        and lm_head.weight.dtype == torch.float32
        and not (lm_head._forward_hooks or lm_head._forward_pre_hooks or hasattr(lm_head, "_hf_hook"))
    ):
        return lm_head
    packed = torch.ops.mkldnn._reorder_linear_weight(lm_head.weight.detach())

    def project(hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != torch.float32 or torch.is_grad_enabled():
            return lm_head(hidden_states)
        return torch.ops.mkldnn._linear_pointwise(hidden_states, packed, lm_head.bias, "none", [], "")

    project.packed = True  # for tests: which path a loop took
    return project


def rows_leave(going_on: int, batch: int) -> bool:
    """The one rule by which finished rows leave the batch of our searches (greedy and beam): at once,
    when fewer than the `batch` rows (or, in beam search, sentences) are `going_on`. Gathering the rows
    that stay costs no more than computing finished rows for a step or two, and beam search gathers its
    self-attention cache at every step anyway (to reorder its beams)."""
    return going_on < batch


__all__ = ["ONEDNN_LINEAR", "enabled", "output_projection", "rows_leave"]
