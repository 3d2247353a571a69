"""The training step compiled (`torch_compile`): the model's forward and §5.4's loss as one graph per batch shape.

`torch.compile` captures `criterion.batch_loss` (the forward and the loss, under the step's autocast or on
precision.py's bf16 weights, whichever the step runs with); AOTAutograd derives the backward from the same graph, so
backward is compiled too. The graphs are static (`dynamic=False`): one per batch shape, which the bucket shapes
(`bucket_shapes`, data.py) keep to a few. Dynamo's limit of recompilations is raised to the number of shapes and
reaching it is an error, never a silent fall back to eager. The optimiser, the gradient reduction and the checks of
strategy.py stay eager. Each shape's first step compiles: its time is logged and summed (`CompiledLoss.seconds`,
results.json's `compiled_step`); being wall-clock time of the run, `time_limit` counts it as any other.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from ..errors import BadInput
from . import criterion

__all__ = ["CompiledLoss", "compile_timing", "compiled_loss"]

logger = get_logger(__name__)

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # inductor's modes that replay CUDA graphs


class CompiledLoss:
    """`criterion.batch_loss(model, batch)` compiled, one graph per batch shape, at most `shapes` of them."""

    def __init__(self, shapes: int, backend: str = "inductor", mode: str | None = None):
        self.shapes, self.backend = shapes, backend
        self.mode = (mode or "default") if backend == "inductor" else None
        self.function = torch.compile(criterion.batch_loss, dynamic=False, backend=backend, mode=mode)
        self.seen: set[tuple] = set()  # the batch shapes compiled for
        self.seconds = 0.0  # the first steps of each shape, compiling

    def __call__(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode in CUDA_GRAPH_MODES:  # the last call's outputs are read: its CUDA graph's buffers may be reused
            torch.compiler.cudagraph_mark_step_begin()
        # Read when a shape is new, inside the call: the limit is this step's, not the process's for other callers.
        with torch._dynamo.config.patch(recompile_limit=self.shapes, fail_on_recompile_limit_hit=True):
            return self.function(model, batch)

    def record(self) -> dict:
        """What results.json says of the compiled step."""
        return {"backend": self.backend, "mode": self.mode, "shapes": len(self.seen),
                "compile_seconds": round(self.seconds, 2)}

    def describe(self) -> str:
        return self.backend + (f", mode {self.mode}" if self.backend == "inductor" else "")


def shape(batch: dict) -> tuple:
    return tuple(batch["input_ids"].shape) + tuple(batch["labels"].shape)


def compiled_loss(args, accelerator, shapes: list | None) -> CompiledLoss | None:
    """The compiled loss the run trains with where `torch_compile` asks for it, or None for the eager one.

    Off unless asked, on every device: whether a GPU's compile time (one graph per bucket shape) pays within a
    run is not yet measured (benchmarks/gpu_smoke.py's compiled part measures it)."""
    if not args.compile_asked():
        return None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise BadInput("`torch_compile` is not supported under DeepSpeed, whose engine runs the forward itself; "
                       "train without it, or with DDP or FSDP")
    why = "asked" + ("" if accelerator.distributed_type == DistributedType.NO else
                     f"; under {accelerator.distributed_type.value}, tested on CPU processes with DDP alone")
    compiled = CompiledLoss(len(shapes), args.torch_compile_backend or "inductor", args.torch_compile_mode)
    logger.info(f"compiled step: torch.compile ({compiled.describe()}) of the forward "
                f"and loss, one graph per batch shape, at most {len(shapes)}; each shape's first step compiles ({why})")
    return compiled


@contextmanager
def compile_timing(compiled: CompiledLoss | None, micro_batches: list, device: torch.device):
    """Around a training step: where it has a batch shape the compiled loss has not seen, the step's time (waited
    for on a GPU) is that shape's compile time, logged and added to `compiled.seconds`."""
    new = set() if compiled is None else {shape(batch) for batch, _ in micro_batches} - compiled.seen
    if not new:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    compiled.seen |= new
    compiled.seconds += seconds
    shapes = ", ".join("x".join(map(str, s[:2])) for s in sorted(new))
    logger.info(f"compiled step: batch shape {shapes} compiled in {seconds:.1f} s (its first step; "
                f"{len(compiled.seen)} shape(s) so far, {compiled.seconds:.1f} s compiling in all)")
