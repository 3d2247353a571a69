"""A run's precision, decided when it starts from what the machine computes in hardware, never tuned to one machine.

bf16 autocast (weights, optimiser and loss stay fp32) where the processor multiplies
bf16 in hardware: every GPU that reports it, and CPUs with AVX-512 BF16 or AMX (x86) or the BF16
extension (Arm), whose bf16 matrix products run at several times their fp32 rate. Elsewhere bf16 is
emulated and slower than fp32, so the run stays fp32. `VANILLA_TRANSFORMER_CPU_BF16=1` (or `0`) overrides
the CPU's answer, so that a test suite or a comparison runs either way on any machine.

bf16 weights: autocast casts every weight to bf16 where it is used and every gradient back, and the
activations between fp32 and bf16 around each product: hundreds of casts a step, each a kernel launch,
which on a GPU is host time. `Bf16Weights` instead runs forward and backward on bf16 copies of the
weights, made once a step, and hands their gradients to the model's own fp32 parameters, which the
optimiser, the checkpoints and the saved model keep: two casts a step. On by default for a one-process
bf16 run on a GPU; on a CPU the products are as fast either way (benchmarks/cpu_precision.py's
"bf16-weights"), so autocast stays. `VANILLA_TRANSFORMER_BF16_WEIGHTS=1` (or `0`) decides instead.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from ..errors import BadInput

__all__ = ["BF16_CPU_FLAGS", "BF16_WEIGHTS_VARIABLE", "CPU_BF16_VARIABLE", "Bf16Weights", "bf16_weights",
           "cpu_computes_bf16", "cpu_flags"]

# /proc/cpuinfo's names for bf16 arithmetic in hardware: x86's AVX-512 BF16 and AMX, Arm's BF16 extension.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# Set to 1 or 0, it answers for the CPU: the suite's premises can then be checked with bf16 on and off anywhere.
CPU_BF16_VARIABLE = "VANILLA_TRANSFORMER_CPU_BF16"
# Set to 1 or 0, it decides whether a bf16 run trains on bf16 copies of the weights (Bf16Weights), on any device.
BF16_WEIGHTS_VARIABLE = "VANILLA_TRANSFORMER_BF16_WEIGHTS"


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The feature flags the kernel lists for this CPU (x86's `flags`, Arm's `Features`); empty where unreadable."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def cpu_computes_bf16(flags: set[str] | None = None) -> bool:
    """Whether this CPU (or one with `flags`) multiplies bf16 in hardware.

    For this CPU, `VANILLA_TRANSFORMER_CPU_BF16` set to 1 or 0 is the answer instead of its flags."""
    if flags is None:
        forced = _forced(CPU_BF16_VARIABLE)
        if forced is not None:
            return forced
        flags = cpu_flags()
    return bool(BF16_CPU_FLAGS & flags)


def _forced(variable: str) -> bool | None:
    forced = os.environ.get(variable, "").strip()
    if forced and forced not in ("0", "1"):
        raise BadInput(f"{variable} must be 0 or 1 (or unset); got {forced!r}.")
    return None if not forced else forced == "1"


def bf16_weights(accelerator, model) -> Bf16Weights | None:
    """The bf16 copies a bf16 run of one process trains `model` (unwrapped) on: by default on a GPU only, or as
    `VANILLA_TRANSFORMER_BF16_WEIGHTS` says. None for fp32 or fp16, several processes (DDP reduces the
    parameters' own gradients), DeepSpeed and FSDP (their own precision)."""
    if accelerator.mixed_precision != "bf16" or accelerator.distributed_type != DistributedType.NO:
        return None
    forced = _forced(BF16_WEIGHTS_VARIABLE)
    wanted = accelerator.device.type == "cuda" if forced is None else forced
    return Bf16Weights(model) if wanted else None


class Bf16Weights:
    """Forward and backward on bf16 copies of `model`'s floating-point parameters, its own (fp32) parameters the
    masters. Tied parameters stay tied (one copy). See `swapped`."""

    def __init__(self, model: torch.nn.Module):
        self.places = [(module, name, parameter) for module in model.modules()
                       for name, parameter in module._parameters.items()
                       if parameter is not None and parameter.is_floating_point()]
        self.masters = list({id(p): p for _, _, p in self.places}.values())
        self.copies = {id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=p.requires_grad)
                       for p in self.masters}
        # fp32 gradient buffers, reused every step (the optimiser's zero_grad only lets go of them)
        self.buffers = {id(p): torch.empty_like(p) for p in self.masters if p.requires_grad}

    @contextmanager
    def swapped(self):
        """While it lasts, the modules hold the bf16 copies, refreshed from the masters in one cast: a forward and
        its backward (with any recomputation of gradient checkpointing) belong inside. On leaving, the copies'
        gradients are added to the masters' in fp32 (micro-batches accumulate in fp32)."""
        with torch.no_grad():
            torch._foreach_copy_([self.copies[id(p)] for p in self.masters], self.masters)
        for module, name, parameter in self.places:
            module._parameters[name] = self.copies[id(parameter)]
        try:
            yield
        finally:
            for module, name, parameter in self.places:
                module._parameters[name] = parameter
        self._to_masters()

    def _to_masters(self) -> None:
        trained = [p for p in self.masters if p.requires_grad and self.copies[id(p)].grad is not None]
        first = [p for p in trained if p.grad is None]
        later = [p for p in trained if p.grad is not None]
        if first:
            torch._foreach_copy_([self.buffers[id(p)] for p in first], [self.copies[id(p)].grad for p in first])
            for p in first:
                p.grad = self.buffers[id(p)]
        if later:
            torch._foreach_add_([p.grad for p in later], [self.copies[id(p)].grad for p in later])
        for p in trained:
            self.copies[id(p)].grad = None
