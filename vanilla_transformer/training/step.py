"""§5's training step: `train_step`, one Adam update on a step's micro-batches.

One optimiser step (§5.2) takes `gradient_accumulation_steps` batches of at most `max_tokens` tokens on
every process, sums the label-smoothed loss (§5.4, the model's own: criterion.py's `batch_loss`) over their
non-padding target tokens and divides by the number of those tokens in the whole step, over every
process; Adam and the learning rate's schedule are §5.3's (schedule.py).

Except where the guard against a non-finite step must look (DeepSpeed, FSDP2, an Adam that is not fused:
distributed.py's `NonFiniteGuard`), the host never waits for the device within a step: the step's counts are one reduction whose result the
host reads only once the step's work is queued behind it, and the losses are summed on the device and
read (logs.py's `Losses.read`) every `log_steps` and before every checkpoint.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import criterion

if TYPE_CHECKING:
    from .budget import Budget
    from .setup import Components

__all__ = ["StepCounts", "StepDone", "next_rate", "train_step"]


class StepDone(NamedTuple):
    """What an optimiser step computed, for the loop to apply: the budget's clock and stop signal come from it."""

    tokens: int  # target tokens over all processes
    lr: float  # the learning rate it used
    elapsed_seconds: float  # the main process's training seconds as the step began (alike on every process)
    stop_signal: int  # SIGINT or SIGTERM received by the main process (alike on every process)
    updated: bool  # False where fp16's scaler skipped the update, whose gradients overflowed


def train_step(components: Components, micro_batches: list[tuple[dict, int]], step: int, budget: Budget,
               max_grad_norm: float | None = None) -> StepDone:
    """Optimiser step `step + 1` on `micro_batches` (each batch with its target-token count), its losses summed into
    `components.losses`; `budget` is read, never written. The rate of the next step is `next_rate`'s, once the loop
    has counted this step in the run's state and budget. Call it under `compute.training_sdpa_backends`, as the
    training loop does for the whole run."""
    accelerator, model, strategy, guard = components.accelerator, components.model, components.strategy, components.guard
    model.train()
    counts = StepCounts(accelerator, sum(n for _, n in micro_batches), budget)  # over every process, not waited for
    step_loss, step_nll = (torch.zeros((), dtype=torch.float64, device=accelerator.device) for _ in range(2))
    # bf16 copies of the weights (compute.Bf16Weights), or autocast casting them at every use
    copies = components.bf16_weights.swapped if components.bf16_weights is not None else nullcontext
    autocast = nullcontext if components.bf16_weights is not None else accelerator.autocast
    batch_loss = components.compiled or criterion.batch_loss  # compute.py's compiled graphs, one per batch shape, or eager
    for i, (batch, _) in enumerate(micro_batches):
        with strategy.accumulating(model, last=i == len(micro_batches) - 1), copies():
            with autocast():
                loss, nll = batch_loss(model, batch)  # label-smoothed, summed over target tokens (§5.4)
            guard.before_backward(loss, step)
            # Per target token of the whole step; DDP averages over processes, which * num_processes makes a sum.
            accelerator.backward(loss * accelerator.num_processes / counts.tokens)
        step_loss += loss.detach().double()
        step_nll += nll.double()
    components.losses.add(step_loss, step_nll)
    norm = strategy.clip_grad_norm(model, max_grad_norm)
    guard.before_update(step_loss, norm, step)
    lr = components.scheduler.get_last_lr()[0]
    components.optimizer.step()  # Adam (§5.3)
    total_tokens, elapsed_seconds, stop_signal = counts.read()
    updated = not accelerator.optimizer_step_was_skipped  # fp16's scaler skips a step whose gradients overflowed
    if updated and components.average is not None:
        components.average.update_parameters(accelerator.unwrap_model(model))
    components.optimizer.zero_grad(set_to_none=True)
    components.losses.add_tokens(total_tokens)
    return StepDone(total_tokens, lr, elapsed_seconds, stop_signal, updated)


def next_rate(components: Components, done: StepDone) -> None:
    """The rate of the step after `done` (§5.3), set once the run's state and budget count `done`: a schedule that
    decays over the budget asks it for the steps left. A skipped update leaves the rate as it was."""
    if done.updated:
        components.scheduler.step()


class StepCounts:
    """The step's one reduction, started and not waited for: [target tokens, the main process's elapsed ms, its
    stop signal], summed over processes. `tokens` (on the device) divides each micro-batch's loss; `read` waits
    for the sums on the host, after the update: by then the device has long finished this reduction, queued
    ahead of the step's forward and backward passes."""

    def __init__(self, accelerator, local_tokens: int, budget: Budget):
        main = accelerator.is_main_process
        elapsed_ms = int(budget.training_seconds() * 1000) if main else 0
        counts = torch.tensor([local_tokens, elapsed_ms, budget.requested_signal() if main else 0], dtype=torch.float64)
        if accelerator.device.type == "cuda":
            counts = counts.pin_memory()
        counts = accelerator.reduce(counts.to(accelerator.device, non_blocking=True), "sum")
        self.tokens = counts[0].float()
        self._read = _read_later(counts)

    def read(self) -> tuple[int, float, int]:
        """The step's target tokens, and the main process's elapsed seconds and stop signal (alike everywhere)."""
        total_tokens, elapsed_ms, stop_signal = self._read()
        return int(total_tokens), elapsed_ms / 1000, int(stop_signal)


def _read_later(tensor: torch.Tensor):
    """Start copying `tensor` to the host; the returned function waits for that copy alone (a CUDA event), not
    for the work queued after it, and returns the values as a list."""
    if tensor.device.type != "cuda":
        return tensor.tolist
    host = tensor.to("cpu", non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> list:
        copied.synchronize()
        return host.tolist()

    return read
