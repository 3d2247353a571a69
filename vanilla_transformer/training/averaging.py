"""An exponential moving average of the weights (Polyak averaging), kept beside training.

Not in the paper, whose §6.1 averages the last checkpoints of a 100k-step run instead. A run of a
few minutes has no good old checkpoints to average; the average of every step, old steps weighing
less, smooths the last updates' noise the same way. `decay` says how fast old steps are forgotten
(0.999: over about 1,000 steps); early on it is lowered to (1 + n) / (10 + n) after n updates, so
that the random initial weights are forgotten fast (tensor2tensor's and TensorFlow's rule).
The averaged weights become the final model only when they score better on validation (finish.py's `_compare_weight_average`).
"""

from __future__ import annotations

import torch

from ..errors import BadInput

__all__ = ["WeightAverage"]


class WeightAverage:
    """The average of a model's floating-point parameters, in float32, updated after each optimiser step.

    It holds no module, only tensors: `state_dict` and `load_state_dict` let Accelerate checkpoint it,
    and `copy_to(model)` puts the averaged weights into a model of the same shape.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0 < decay < 1:
            raise BadInput(f"`decay` must be in (0, 1), e.g. 0.999; got {decay!r}.")
        self.decay = decay
        self.updates = 0
        self.names = [name for name, _ in self._parameters(model)]
        self.average = [p.detach().float().clone() for _, p in self._parameters(model)]

    @staticmethod
    def _parameters(model: torch.nn.Module):
        return [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]  # in self.names' order

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        """average += (1 - decay) * (weights - average); named as torch's `AveragedModel` names it."""
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for (_, p), average in zip(self._parameters(model), self.average):
            average.lerp_(p.detach().float(), 1.0 - decay)

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        for (_, p), average in zip(self._parameters(model), self.average):
            p.copy_(average.to(p.dtype))

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "average": dict(zip(self.names, self.average))}

    def load_state_dict(self, state: dict) -> None:
        saved = [(name, tuple(tensor.shape)) for name, tensor in state["average"].items()]
        if saved != [(name, tuple(average.shape)) for name, average in zip(self.names, self.average)]:
            # Shapes too: copying a tensor of another shape would broadcast, not fail.
            raise BadInput("the saved weight average does not fit this model: its parameters differ")
        self.updates = state["updates"]
        for average, saved in zip(self.average, state["average"].values()):
            average.copy_(saved)
