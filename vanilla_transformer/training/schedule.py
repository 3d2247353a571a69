"""§5.3: the Adam optimiser and the "Noam" learning-rate schedule.

    lrate = d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5)

The rate grows linearly for `warmup_steps` steps, then decays with the inverse
square root of the step. It peaks at d_model^-0.5 · warmup_steps^-0.5 (7e-4 for
the base model with 4000 warm-up steps). `scale` multiplies the whole curve (1 in
the paper; fairseq and tensor2tensor expose it as a "learning-rate factor").

Not in the paper: the schedule was built for 100k steps and never reaches zero. A run with a
budget of minutes stops while its rate is still high, so `BudgetSchedule` warms up the same way to
the same peak, then decays linearly or along a cosine to exactly zero where the budget ends. A
fine-tuning run names its peak instead (`peak_scale`): the curve keeps its shape, scaled to reach it.

`SCHEDULES` names every schedule (`lr_schedule`'s choices) and the function that builds it, whose docstring's
first line is what `--help`, the log and the model card say of it: adding a schedule is one function and one
entry there. torch is imported where an optimiser or schedule is built,
so that `train --help` reads the names without it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from ..choices import PAPER_WARMUP_STEPS
from ..errors import BadInput

if TYPE_CHECKING:
    import torch

__all__ = ["PAPER_WARMUP_STEPS", "SCHEDULES", "BudgetSchedule", "check_schedule", "make_optimizer", "make_scheduler",
           "noam_rate", "peak_scale",
           "schedule_summary"]


def check_schedule(warmup_steps, scale, schedule, names=("warmup_steps", "scale", "schedule")) -> None:
    """The schedule's options, checked in one place for `make_scheduler` and, before any data is read,
    for `TrainArguments` (whose `names` for them are warmup_steps, lr_scale and lr_schedule)."""
    from ..modeling.value_checks import is_finite_number  # the modeling package brings transformers

    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise BadInput(f"`{names[0]}` must be a positive integer; got {warmup_steps!r}.")
    if not (is_finite_number(scale) and scale > 0):
        raise BadInput(f"`{names[1]}` must be a positive number; got {scale!r}.")
    if schedule not in SCHEDULES:
        raise BadInput(f"`{names[2]}` must be one of {', '.join(map(repr, SCHEDULES))}; got {schedule!r}.")


def noam_rate(step: int, d_model: int, warmup_steps: int = PAPER_WARMUP_STEPS, scale: float = 1.0) -> float:
    """The learning rate of optimiser step `step` (counted from 1)."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def peak_scale(peak: float, d_model: int, warmup_steps: int = PAPER_WARMUP_STEPS) -> float:
    """The `scale` whose schedule peaks at `peak`: every schedule peaks at the end of the warm-up."""
    return peak / noam_rate(warmup_steps, d_model, warmup_steps)


def make_optimizer(
    model: torch.nn.Module,
    device: torch.device | str | None = None,
    betas: tuple[float, float] = (0.9, 0.98),
    eps: float = 1e-9,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """§5.3: Adam with β1 = 0.9, β2 = 0.98, ε = 1e-9, no weight decay, over the parameters that train.

    The base rate is 1: the scheduler's multiplier *is* the learning rate. On the `device` the
    model will train on (default: where its parameters are), CPUs and CUDA GPUs get torch's fused
    kernel (the default of transformers' Trainer): each tensor is updated in one pass, without the
    default loop's temporaries (faster: benchmarks/training.py).
    Other devices (MPS, XLA) get the default loop, which runs everywhere.
    With `weight_decay` (not in the paper) it is AdamW: decay decoupled from the gradient's moments, and,
    as in transformers' Trainer, not on biases and LayerNorm weights, which set offsets and scales.
    """
    import torch

    device = torch.device(device) if device is not None else next(model.parameters()).device
    fused = device.type in ("cpu", "cuda")
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not weight_decay:
        return torch.optim.Adam([p for _, p in trained], lr=1.0, betas=betas, eps=eps, fused=fused)
    undecayed = {id(p) for module in model.modules() if isinstance(module, torch.nn.LayerNorm) for p in module.parameters()}
    undecayed |= {id(p) for name, p in trained if name.endswith("bias")}
    groups = [{"params": [p for _, p in trained if id(p) not in undecayed], "weight_decay": weight_decay},
              {"params": [p for _, p in trained if id(p) in undecayed], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1.0, betas=betas, eps=eps, fused=fused)


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    d_model: int,
    warmup_steps: int = PAPER_WARMUP_STEPS,
    scale: float = 1.0,
    schedule: str = "noam",
    remaining_steps: Callable[[int], float] | None = None,
):
    """The learning-rate schedule named `schedule` (one of `SCHEDULES`); call `scheduler.step()` after each
    optimiser step. "linear" and "cosine" need `remaining_steps` (see `BudgetSchedule`)."""
    check_schedule(warmup_steps, scale, schedule)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = 1.0
    return SCHEDULES[schedule](optimizer, d_model, warmup_steps, scale, remaining_steps)


def noam(optimizer, d_model: int, warmup_steps: int, scale: float, remaining_steps=None):
    """The paper's: a linear warm-up, then the inverse square root of the step.

    A LambdaLR: it asks for the multiplier of step 0 when it is built and of step i after the
    i-th `scheduler.step()`; the paper counts the first update as step 1, hence `i + 1`."""
    from torch.optim.lr_scheduler import LambdaLR  # here, so that --help reads `SCHEDULES` without torch

    return LambdaLR(optimizer, lambda i: noam_rate(i + 1, d_model, warmup_steps, scale))


def linear(optimizer, d_model: int, warmup_steps: int, scale: float, remaining_steps=None) -> BudgetSchedule:
    """The paper's warm-up to its peak, then a linear decay to zero where the budget ends.

    `peak * (1 - p)`, p the fraction of the decay done (`BudgetSchedule`)."""
    return _budget_schedule(optimizer, d_model, warmup_steps, scale, remaining_steps, "linear", lambda p: 1.0 - p)


def cosine(optimizer, d_model: int, warmup_steps: int, scale: float, remaining_steps=None) -> BudgetSchedule:
    """The paper's warm-up to its peak, then a cosine decay to zero where the budget ends.

    `peak * (1 + cos(pi * p)) / 2`, p the fraction of the decay done (`BudgetSchedule`)."""
    return _budget_schedule(optimizer, d_model, warmup_steps, scale, remaining_steps, "cosine",
                            lambda p: 0.5 * (1.0 + math.cos(math.pi * p)))


# Every schedule, by the name `lr_schedule` takes: the one place a schedule is defined (the options read it).
SCHEDULES = {"noam": noam, "linear": linear, "cosine": cosine}


def schedule_summary(name: str) -> str:
    """What schedule `name` does, in words: the first line of its function's docstring (for `--help`, the
    training log and the model card, so that a new schedule describes itself)."""
    line = SCHEDULES[name].__doc__.split("\n", 1)[0].rstrip(".")
    return line[0].lower() + line[1:]


def _budget_schedule(optimizer, d_model, warmup_steps, scale, remaining_steps, name: str, decay) -> BudgetSchedule:
    if remaining_steps is None:
        raise BadInput(f"the {name!r} schedule decays to zero at the end of the budget: give `remaining_steps`.")
    peak = noam_rate(warmup_steps, d_model, warmup_steps, scale)
    return BudgetSchedule(optimizer, peak, warmup_steps, decay, remaining_steps)


class BudgetSchedule:
    """Warm-up to `peak` (the Noam schedule's: linear over `warmup_steps`), then `peak * decay(p)`, p being the
    fraction of the decay done, and `decay` falling from 1 at p = 0 to 0 at p = 1: zero where the budget ends.

    The budget may be minutes, whose steps are only known while training: after each step,
    `remaining_steps(step)` says how many steps are left (a step budget: max_steps - step; a time
    budget: the time left over the mean time of a step so far), and the step moves p by its share of
    what is left, (1 - p) / remaining. A fixed budget makes p exactly (step - warmup) / (max_steps -
    warmup); a changing estimate bends the line but never raises the rate. p is part of the state
    that checkpoints keep, so a resumed run continues with the rates it would have had.
    """

    def __init__(self, optimizer, peak: float, warmup_steps: int, decay: Callable[[float], float],
                 remaining_steps: Callable[[int], float]):
        self.optimizer, self.peak, self.warmup_steps, self.decay = optimizer, peak, warmup_steps, decay
        self.remaining_steps = remaining_steps
        self.steps_done = 0
        self.progress = 0.0  # of the decay: 0 at the end of the warm-up, 1 at the end of the budget
        self._apply()

    def rate(self) -> float:
        """The rate of the next optimiser step, step `steps_done + 1`."""
        step = self.steps_done + 1
        if step <= self.warmup_steps:
            return self.peak * step / self.warmup_steps
        return self.peak * self.decay(self.progress)

    def step(self) -> None:
        self.steps_done += 1
        if self.steps_done >= self.warmup_steps:
            # Steps left including the next one; the next step is the last when one or none is left.
            remaining = max(float(self.remaining_steps(self.steps_done)), 1.0)
            self.progress = min(1.0, self.progress + (1.0 - self.progress) / remaining)
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.rate()

    def state_dict(self) -> dict:
        return {"steps_done": self.steps_done, "progress": self.progress}  # the rest comes from the run's options

    def load_state_dict(self, state: dict) -> None:
        self.steps_done, self.progress = state["steps_done"], state["progress"]
        self._apply()
