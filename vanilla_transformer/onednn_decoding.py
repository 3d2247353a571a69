"""The model's `onednn_decoding`, chosen once, when a model is loaded: which of the decoder's products our decoding
loops run on oneDNN with packed weights (fast_generation.py's `onednn_decoding_weights`) instead of torch's kernel.

torch's float32 linear and oneDNN on a packed weight give the same numbers; which is faster depends on the
CPU and on the shape (MKL can win narrow products), so `choose_onednn_decoding` times both on each of the model's
own decoder shapes and sets the model's `onednn_decoding` to those oneDNN wins, which the saved folder's code reads
(fast_generation.py) and which a user of a saved folder without this package may set by hand. The attribute is set
at load and never saved. inference.py's `load_model` calls it: the choice is the package's, so it stays out of
modeling/, whose files ship with every folder.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .choices import TRANSLATION_BATCH_SIZE
from .modeling.fast_modeling import ONEDNN_LINEAR, PackableLinear, onednn_linear, pack_weight

__all__ = ["choose_onednn_decoding", "onednn_is_faster"]

MARGIN = 0.05  # oneDNN replaces torch's kernel only when it is at least this much faster
ROUNDS = 5  # timings of each kernel, interleaved; the fastest of each counts


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


def choose_onednn_decoding(model):
    """Set `model.onednn_decoding` to the (in, out) shapes of its decoder's products that oneDNN computes faster
    here (MKL can win the narrow ones while oneDNN wins the output projection), where search.py's loops can use it at all
    (fast paths on, oneDNN present and enabled, float32 weights on the CPU); False where none. Return it.
    Another model (a Marian one, say) is left as it is: False."""
    if not hasattr(model, "onednn_decoding"):
        return False
    head = model.get_output_embeddings()
    usable = (model.config.fast_paths and ONEDNN_LINEAR and torch.backends.mkldnn.enabled
              and head.weight.device.type == "cpu" and head.weight.dtype == torch.float32)
    linears = [m for m in (*model.get_decoder().modules(), head) if isinstance(m, PackableLinear)]
    shapes = sorted({(m.in_features, m.out_features) for m in linears}) if usable else []
    model.onednn_decoding = frozenset(shape for shape in shapes if onednn_is_faster([shape])) or False
    return model.onednn_decoding
