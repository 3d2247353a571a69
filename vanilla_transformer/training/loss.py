"""§5.4: label-smoothed cross-entropy, summed over target tokens that are not padding.

The loss of one optimiser step is normalised by the number of non-padding target
tokens in the *whole* step, i.e. over every micro-batch of gradient accumulation and
every process: each micro-batch contributes sum(token losses) / total_tokens. A
per-batch mean would weigh a token in a short batch more than one in a long batch
and make the result depend on how the step was split.

Smoothing follows Szegedy et al. (2016), as torch implements it: the target
distribution is (1 - ε) on the reference token plus ε / V spread over the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..modeling import fast_modeling_vanilla_transformer as fast_modeling

__all__ = ["IGNORE_INDEX", "label_smoothed_loss"]

IGNORE_INDEX = -100  # label value of padding positions (transformers' convention)


def label_smoothed_loss(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float = 0.1, fast: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (smoothed loss summed over tokens, plain NLL summed over tokens).

    `logits` (B, T, V), `labels` (B, T) with IGNORE_INDEX at padding. The NLL (no smoothing) is what
    perplexity is computed from; it carries no gradient. `fast` (pass the model's `config.fast_paths`)
    takes both from one log-softmax with the gradient in closed form (fast_modeling_vanilla_transformer.py);
    False computes them with torch's cross-entropy, the same numbers.
    """
    if fast:
        return fast_modeling.smoothed_cross_entropy(logits, labels, epsilon)
    flat_logits, flat_labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_labels, label_smoothing=epsilon, reduction="sum")
    nll = F.cross_entropy(flat_logits.detach(), flat_labels, reduction="sum")
    return loss, nll
