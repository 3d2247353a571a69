"""What the step does differently under each distributed strategy, and what it does with a step that is not finite.

`StepStrategy` names, once, where DeepSpeed, FSDP2 and fp16's loss scaler change §5's step: DeepSpeed clips and
updates the weights inside its own backward; FSDP2's gradient norm is a DTensor; fp16's scaler skips
the update of a step whose gradients overflowed, and fused Adam can skip one on the device
(`found_inf`, as the scaler uses it) without the host waiting for it.

`NonFiniteGuard` is the rule for a step whose loss or gradients are not finite: it leaves the weights
and Adam's state as they were, its number is recorded on the device, and the next read of the losses
(logging, every checkpoint) stops the run, before any checkpoint after it. Where the optimiser cannot
skip on the device (DeepSpeed updates inside backward; a non-fused Adam; FSDP2's DTensors), the guard
waits for the device before the update instead and stops the run at once.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from accelerate.utils import DistributedType

__all__ = ["NonFiniteGuard", "StepStrategy"]


class StepStrategy:
    """The accelerator's distributed strategy (DDP, FSDP2, DeepSpeed) and precision as §5's step meets them."""

    def __init__(self, accelerator, optimizer):
        self.accelerator = accelerator
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        fsdp = accelerator.distributed_type == DistributedType.FSDP  # its parameters are DTensors: checked on the host
        self.scales_loss = accelerator.scaler is not None  # fp16: the scaler finds overflows and skips those steps
        self.skips_on_device = getattr(optimizer.optimizer, "_step_supports_amp_scaling", False) and not fsdp

    def accumulating(self, model, last: bool):
        """Gradients of every micro-batch but the step's last stay local: they are all-reduced once per step."""
        return nullcontext() if last else self.accelerator.no_sync(model)

    def clip_grad_norm(self, model, max_norm: float | None) -> torch.Tensor | None:
        """Clip the gradients to `max_norm` (0 or None: only measure them); their norm, or None under DeepSpeed,
        which clips inside its own step."""
        if self.deepspeed:
            return None
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm or math.inf)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


class NonFiniteGuard:
    """A step that is not finite leaves the weights as they were, and the run stops at the next read of the losses."""

    def __init__(self, strategy: StepStrategy, optimizer, losses):
        self.strategy, self.optimizer, self.losses = strategy, optimizer, losses

    def before_backward(self, loss: torch.Tensor, step: int) -> None:
        """Under DeepSpeed, whose engine updates inside backward: stop every process now, before any update,
        when this micro-batch's loss is not finite on any of them."""
        if not self.strategy.deepspeed:
            return
        bad = self.strategy.accelerator.reduce((~torch.isfinite(loss.detach())).float().reshape(1), "sum")
        if bad.item():
            self.optimizer.zero_grad(set_to_none=True)
            self.losses.mark_bad(torch.tensor(True, device=loss.device), step)
            self.losses.add(loss.detach().double())  # the message names it
            self.losses.check_finite(step)

    def before_update(self, step_loss: torch.Tensor, norm: torch.Tensor | None, step: int) -> None:
        """Record the step as bad when its loss or its (all-reduced, so alike on every process) gradient norm is
        not finite, and have the optimiser skip it: on the device where it can, else on the host now."""
        bad = ~torch.isfinite(step_loss)
        skip = None if norm is None or self.strategy.scales_loss else ~torch.isfinite(norm)
        if skip is not None:
            bad |= skip
        self.losses.mark_bad(bad, step)
        if skip is None:
            return
        if self.strategy.skips_on_device:
            self.optimizer.optimizer.found_inf = skip.float()
        elif skip.item():
            self.optimizer.zero_grad(set_to_none=True)
            self.losses.check_finite(step)
