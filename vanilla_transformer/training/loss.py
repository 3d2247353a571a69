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

from ..modeling.modeling_vanilla_transformer import smoothed_cross_entropy

__all__ = ["IGNORE_INDEX", "label_smoothed_loss"]

IGNORE_INDEX = -100  # label value of padding positions (transformers' convention)


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, epsilon: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (smoothed loss summed over tokens, plain NLL summed over tokens).

    `logits` (B, T, V), `labels` (B, T) with IGNORE_INDEX at padding. The NLL (no
    smoothing) is what perplexity is computed from; it carries no gradient. Both come from
    one log-softmax (the model's `smoothed_cross_entropy`).
    """
    return smoothed_cross_entropy(logits, labels, epsilon)
