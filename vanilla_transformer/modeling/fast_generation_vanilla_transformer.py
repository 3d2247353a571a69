"""Decoding speed-ups: drop-ins for three plain pieces of decoding that give the same tokens and scores
with less work. `config.fast_paths = False` (the one switch, shared with fast_modeling_vanilla_transformer.py)
turns them off.

    plain                                   drop-in (here)
    lm_head(x) (§3.4)                       output_projection: the same product on oneDNN, weight packed once per call
    transformers' DynamicCache              preallocated_cache: buffers written in place, gathered on reorder
    every row computed until the last ends  rows_leave: finished sentences leave our search loops' batch

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only torch and
the public API of transformers (and looks up two of torch's own oneDNN ops by name, see below).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache



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


def rows_leave(finished: torch.Tensor) -> bool:
    """The one rule by which finished rows leave the batch of our searches (greedy and beam): at once.
    `finished` is a mask over the rows in the batch, or over its sentences (each as many rows). Gathering
    the rows that stay costs no more than computing finished rows for a step or two, and beam search
    gathers its self-attention cache at every step anyway (to reorder its beams)."""
    return bool(finished.any())


class PreallocatedLayer(DynamicLayer):
    """One decoder layer's self-attention keys and values, in buffers allocated once per `generate` call.

    transformers' dynamic layer grows by `torch.cat` every step and beam search reorders it with
    `index_select`: two fresh (rows, H, length, Dh) tensors per layer and step, which on a CPU mostly
    cost page faults. Here the buffers hold `max_length` positions from the start: a step writes its
    slot in place, and reordering beams (or dropping finished sentences) gathers the filled part into
    a spare pair of buffers, which then swap roles. `keys` and `values` are views of the filled part,
    so attention sees exactly what the dynamic layer would hold.
    """

    def __init__(self, max_length: int):
        super().__init__()
        self.max_length = max_length
        self.length = 0

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        rows, heads, _, head_dim = key_states.shape
        shape = (rows, heads, self.max_length, head_dim)
        self._buffers = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(4)]  # K, V, spares
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, start, end = key_states.size(0), self.length, self.length + key_states.size(-2)
        keys, values = self._buffers[0], self._buffers[1]
        if end > self.max_length or rows > keys.size(0) or (start and rows != self.keys.size(0)):
            raise ValueError(
                f"The cache holds {self.max_length} positions of {keys.size(0)} rows (batch x beams); "
                f"asked to store position {end} of {rows} rows. Let `generate` make the cache, or size yours for the call."
            )
        keys[:rows, :, start:end] = key_states
        values[:rows, :, start:end] = value_states
        self.length = end
        self.keys, self.values = keys[:rows, :, :end], values[:rows, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def _gather(self, rows: torch.Tensor) -> None:
        """Keep `rows` (reordered beams, or the rows of unfinished sentences), written into the spares."""
        spare_keys, spare_values = self._buffers[2][: rows.numel()], self._buffers[3][: rows.numel()]
        torch.index_select(self.keys, 0, rows, out=spare_keys[:, :, : self.length])
        torch.index_select(self.values, 0, rows, out=spare_values[:, :, : self.length])
        self._buffers = [self._buffers[2], self._buffers[3], self._buffers[0], self._buffers[1]]
        self.keys, self.values = spare_keys[:, :, : self.length], spare_values[:, :, : self.length]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.length:
            self._gather(beam_idx.to(self.device))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self._gather(torch.as_tensor(indices, device=self.device))

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions (a negative value removes that many from the end)."""
        self.length = max(0, self.length + max_length if max_length < 0 else min(max_length, self.length))
        if self.is_initialized:
            self.keys, self.values = self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row `repeats` times (contrastive search): new buffers of the larger batch."""
        if self.length:
            keys, values = self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0)
            self.is_initialized, self.length = False, 0
            self.update(keys, values)


def preallocated_cache(num_layers: int, max_length: int) -> EncoderDecoderCache:
    """The cache our `generate` uses unless told otherwise: preallocated self-attention layers holding
    `max_length` decoder positions, and transformers' dynamic cache for the cross-attention keys and
    values (computed once from the encoder output, never grown)."""
    self_attention = Cache(layers=[PreallocatedLayer(max_length) for _ in range(num_layers)])
    return EncoderDecoderCache(self_attention, DynamicCache())


__all__ = ["ONEDNN_LINEAR", "PreallocatedLayer", "enabled", "output_projection", "preallocated_cache", "rows_leave"]
