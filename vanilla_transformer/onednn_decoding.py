"""Decoding on oneDNN: the decoder's linear maps and the output projection run on weights packed for oneDNN's
kernels, once per call of our decoding loops (modeling/search.py), where that was timed faster when the model was
loaded.

A decoding step multiplies a few rows (one per sentence or beam) by every weight matrix of the decoder and by the
output projection. In float32 on a CPU torch runs these products on MKL; oneDNN, also inside torch, can take each
weight laid out ("packed") for its kernels once per call (the weights cannot change meanwhile). Both give the same
numbers; which is faster depends on the CPU and on the shape (MKL can win narrow products while oneDNN wins the
output projection), so `choose_onednn_decoding` times both on each of the model's own decoder shapes and gives the
model an `OnednnDecoding` of the shapes oneDNN wins, as its `decoding_context`: the hook search.py's loops enter
once a call. inference.py's `load_model` calls it; nothing is timed inside `generate`.

The ops are those torch.compile uses when it freezes weights on a CPU; their names are private, so they are looked
up, and without them nothing is packed. They stay here, in the package: a saved folder's files hold no private torch
op, and a folder loaded without the package decodes on torch's own kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from .choices import TRANSLATION_BATCH_SIZE

__all__ = ["ONEDNN_LINEAR", "OnednnDecoding", "PackedLinear", "choose_onednn_decoding", "current_packed_weights",
           "onednn_is_faster", "onednn_linear", "pack_weight", "packed_weights"]

MARGIN = 0.05  # oneDNN replaces torch's kernel only when it is at least this much faster
ROUNDS = 5  # timings of each kernel, interleaved; the fastest of each counts

ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and all(
    hasattr(torch.ops.mkldnn, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` laid out for oneDNN's kernels (`onednn_linear`'s `packed`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    """nn.Linear's product on oneDNN, with the weight packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# The packed weights of the decoding call running in this thread (or asyncio task), {nn.Linear: weight}: held per
# call, never on the module, so that other callers of a shared model, and copies of it, see none of them.
_PACKED = contextvars.ContextVar("packed_weights", default=types.MappingProxyType({}))
# How many calls pack each linear map now: its class is PackedLinear while one does.
_PACKING: dict = {}
_PACKING_LOCK = threading.Lock()


@contextlib.contextmanager
def packed_weights(weights: dict):
    """While it lasts, and in this thread (or task) only, each nn.Linear in `weights` runs its product on oneDNN with
    the packed weight given for it. Meanwhile its class is PackedLinear, whose forward finds this call's weight;
    outside every call that packs them they are nn.Linear, with nothing to look up."""
    token = _PACKED.set(types.MappingProxyType(weights))
    _count_packing(weights, 1)
    try:
        yield
    finally:
        _count_packing(weights, -1)
        _PACKED.reset(token)


def _count_packing(modules, step: int) -> None:
    """Make the first call that packs a map its PackedLinear, and the last one's end its nn.Linear again."""
    with _PACKING_LOCK:
        for module in modules:
            count = _PACKING.pop(module, 0) + step
            if count:
                _PACKING[module] = count
            if count == step == 1:  # the first call that packs it
                module.__class__ = PackedLinear
            elif not count:  # the last one has ended
                module.__class__ = nn.Linear


def current_packed_weights() -> types.MappingProxyType:
    """The packed weights this thread (or task) decodes with now: {nn.Linear: weight}, empty outside a call."""
    return _PACKED.get()


class PackedLinear(nn.Linear):
    """The class of an nn.Linear while a call of our decoding loops packs it (`packed_weights`): the same parameters,
    its product on the calling thread's packed weight; nn.Linear's own where gradients are on, under autocast, in
    another thread's call (which packs nothing of its own) or while compiling."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled step packs nothing (and traces no context variable)
            return super().forward(x)
        packed = current_packed_weights().get(self)  # read once: this call's own, whatever other threads do meanwhile
        if packed is None or torch.is_grad_enabled() or x.dtype != torch.float32:
            return super().forward(x)
        return onednn_linear(x, packed, self.bias)

    def __reduce_ex__(self, protocol):
        """A copy (deepcopy, pickle, torch.save) made while a call packs this map is a plain nn.Linear."""
        _, _, *rest = super().__reduce_ex__(protocol)  # the state: parameters, buffers, hooks
        return (object.__new__, (nn.Linear,), *rest)


def decoding_linears(model) -> list[nn.Linear]:
    """The maps oneDNN decoding may pack: the decoder's nn.Linear (or PackedLinear, while a call packs it) and the
    output projection."""
    modules = (*model.get_decoder().modules(), model.get_output_embeddings())
    return [module for module in modules if type(module) in (nn.Linear, PackedLinear)]


class OnednnDecoding:
    """A model's `decoding_context`: the shapes (in, out) of its linear maps that decode on oneDNN (None: every
    shape). Called by search.py's loops once a call, with the model and the rows the call decodes."""

    def __init__(self, shapes=None):
        self.shapes = None if shapes is None else frozenset(shapes)

    def __call__(self, model, rows: int):
        """While it lasts, each nn.Linear of the decoder, and the output projection, that is `worth_packing` runs on
        its weight packed for oneDNN (the packed copies are memory for the call alone)."""
        return packed_weights({module: pack_weight(module.weight) for module in decoding_linears(model)
                               if self.worth_packing(model, module, rows)})

    def worth_packing(self, model, linear: nn.Linear, rows: int) -> bool:
        """Whether `linear`'s product for `rows` rows runs on oneDNN: one of the shapes, the model's `fast_paths` on,
        oneDNN present and enabled, no autocast (which would run the product in its own dtype), a float32 weight on
        the CPU (not offloaded) and more than one row (one sentence does not win the packing back)."""
        weight = linear.weight
        return (
            (self.shapes is None or (linear.in_features, linear.out_features) in self.shapes)
            and model.config.fast_paths
            and rows > 1
            and ONEDNN_LINEAR
            and torch.backends.mkldnn.enabled
            and not torch.is_autocast_enabled("cpu")
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
        )

    def __repr__(self) -> str:
        return f"OnednnDecoding({'every shape' if self.shapes is None else sorted(self.shapes)})"


def onednn_is_faster(shapes, rows: int = TRANSLATION_BATCH_SIZE) -> bool:
    """Whether oneDNN on packed weights computes the (rows, in) x (in, out) products of `shapes` at least MARGIN
    faster, in all, than torch's float32 kernel, with this process's threads."""
    numbers = torch.Generator().manual_seed(0)  # its own: the global random stream stays as it was
    kernels = ([], [])
    for in_features, out_features in shapes:
        x = torch.randn(rows, in_features, generator=numbers)
        weight, bias = torch.randn(out_features, in_features, generator=numbers), torch.zeros(out_features)
        packed = pack_weight(weight)
        kernels[0].append(lambda x=x, w=weight, b=bias: F.linear(x, w, b))
        kernels[1].append(lambda x=x, p=packed, b=bias: onednn_linear(x, p, b))
    seconds = [math.inf, math.inf]
    with torch.no_grad():
        for rounds in range(ROUNDS + 1):  # the first round sets the kernels up
            for i, products in enumerate(kernels):
                start = time.perf_counter()
                for product in products:
                    product()
                if rounds:
                    seconds[i] = min(seconds[i], time.perf_counter() - start)
    return seconds[1] < (1 - MARGIN) * seconds[0]


def choose_onednn_decoding(model) -> OnednnDecoding | None:
    """Give `model` as its `decoding_context` an `OnednnDecoding` of the (in, out) shapes of its decoder's linear maps
    that oneDNN computes faster here, where search.py's loops can use it at all (fast paths on, oneDNN present and
    enabled, float32 weights on the CPU); None where none. Return it. Another model (a Marian one, say) is left as it
    is: None."""
    if not hasattr(model, "decoding_context"):
        return None
    head = model.get_output_embeddings()
    usable = (model.config.fast_paths and ONEDNN_LINEAR and torch.backends.mkldnn.enabled
              and head.weight.device.type == "cpu" and head.weight.dtype == torch.float32)
    shapes = sorted({(m.in_features, m.out_features) for m in decoding_linears(model)}) if usable else []
    faster = [shape for shape in shapes if onednn_is_faster([shape])]
    model.decoding_context = OnednnDecoding(faster) if faster else None
    return model.decoding_context
