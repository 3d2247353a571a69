"""§5.4's training objective, as fairseq's criterion: the batch's label-smoothed loss, for the step and evaluation."""

from __future__ import annotations

import torch

__all__ = ["batch_loss"]


def batch_loss(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's label-smoothed loss and NLL, each summed over its target tokens (§5.4): the model's own loss
    from `labels` (summed: `num_items_in_batch=1`; `train_step` divides by the step's target tokens over every
    micro-batch and process), for training and evaluation alike."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                num_items_in_batch=1)
    return out.loss, out.nll
