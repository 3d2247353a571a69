"""Kernels per training step, counted on any device: ours (the training loop's own step) beside MarianMTModel's.

    python -m benchmarks.kernels                              # base shape, bf16 autocast, on the CPU
    python -m benchmarks.kernels --quick                      # the tiny shape: seconds
    python -m benchmarks.kernels --device cuda --precision fp32
    python -m benchmarks.kernels --bf16-weights 1             # ours on bf16 weights, as a one-process GPU run

On a GPU every aten operator that is not a view launches at least one kernel, and the host's time per step
grows with their number: `count_kernels` counts them under a `TorchDispatchMode` (below autograd, so the
backward's operators are counted too), without views, without operators that only read or set metadata,
without allocations (`empty`: memory from the caching allocator, no kernel) and outside aten (the profiler's
markers). The counts are the same on
every machine of the same torch: a CPU measures what a GPU would launch.

One step is what the training loop runs: ours through `train_step` (training/step.py) with the loop's Adam
(training/schedule.py's `make_optimizer`, fused where torch has the kernel) and its Accelerator's autocast, or
its bf16 weights (training/compute.py's `Bf16Weights`: a one-process bf16 run's default on a GPU, chosen for
the CPU with `--bf16-weights 1`);
MarianMTModel of the same shape (export/marian.py's `marian_config`) on the same batch, its forward,
backward and torch's fused AdamW under the same autocast. Both on sdpa. Each is counted on its second step
(the first makes Adam's state). The batch is synthetic (seeded ids, rows of varied length, padded):
the count depends on its shape, not its values.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KernelCount", "count_kernels", "count_step", "main", "synthetic_batch"]

# Operators that run no kernel: they read or set a tensor's metadata, or take memory from the allocator.
NO_KERNEL = frozenset({
    "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset", "aten.is_same_size",
    "aten._has_compatible_shallow_copy_type", "aten.lift_fresh", "aten.set_", "aten.resize_",
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
})
CATEGORIES = {  # the table's columns, by operator name; everything else is "other"
    "matmul": ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.addmv", "aten.mv", "aten.linear",
               "aten._addmm_activation"),
    "attention": ("aten._scaled_dot_product_flash_attention_for_cpu",
                  "aten._scaled_dot_product_flash_attention_for_cpu_backward",
                  "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward",
                  "aten._scaled_dot_product_efficient_attention",
                  "aten._scaled_dot_product_efficient_attention_backward",
                  "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_cudnn_attention_backward",
                  "aten._softmax", "aten._softmax_backward_data"),
    "layer norm": ("aten.native_layer_norm", "aten.native_layer_norm_backward"),
    "loss": ("aten._log_softmax", "aten.log_softmax", "aten._log_softmax_backward_data", "aten.nll_loss_forward",
             "aten.nll_loss_backward", "aten.gather", "aten.scatter_add_", "aten.scatter_add"),
    "optimiser": ("aten._fused_adam_", "aten._fused_adamw_", "aten._foreach_add_", "aten._foreach_mul_",
                  "aten._foreach_lerp_", "aten._foreach_addcmul_", "aten._foreach_addcdiv_", "aten._foreach_sqrt",
                  "aten._foreach_div_", "aten._foreach_norm", "aten._foreach_zero_"),
    "dropout": ("aten.native_dropout", "aten.native_dropout_backward", "aten.bernoulli_"),
}
TOKENS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, label_smoothing=0.1)
CATEGORY_OF = {op: name for name, ops in CATEGORIES.items() for op in ops}


def _is_view(func) -> bool:
    """An operator whose output aliases its input without writing to it (view, transpose, detach, ...)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class KernelCount(collections.Counter):
    """{operator name: calls}; `casts` is how many of the calls changed a tensor's dtype (`_to_copy`, and
    `copy_` from one dtype into another)."""

    casts: int = 0

    @property
    def total(self) -> int:
        return sum(self.values())

    def by_category(self) -> dict[str, int]:
        counts = dict.fromkeys([*CATEGORIES, "casts", "other"], 0)
        for op, calls in self.items():
            counts[CATEGORY_OF.get(op, "other")] += calls
        counts["casts"] = self.casts
        counts["other"] -= self.casts  # casts are `_to_copy` and `copy_`, both "other" by name
        return counts


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = KernelCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func._opname}"
        if func.namespace == "aten" and name not in NO_KERNEL and not _is_view(func):
            self.counts[name] += 1
            if _is_cast(name, args, kwargs):
                self.counts.casts += 1
        return func(*args, **kwargs)


def _is_cast(name: str, args, kwargs) -> bool:
    if name == "aten._to_copy":
        dtype = kwargs.get("dtype")
        return dtype is not None and dtype != args[0].dtype
    if name == "aten.copy_":
        return isinstance(args[1], torch.Tensor) and args[0].dtype != args[1].dtype
    return False


def count_kernels(fn) -> KernelCount:
    """The aten operators one call of `fn()` runs that launch kernels (views, metadata and allocations left out),
    backward's included: {"aten.mm": calls, ...}, with `.casts`, `.total` and `.by_category()`."""
    with _Counting() as mode:
        fn()
    return mode.counts


def synthetic_batch(vocab_size: int, rows: int, length: int, pad_token_id: int, seed: int = 0) -> dict:
    """`rows` pairs of source and target ids, lengths between half of `length` and `length` (padded as the
    training loop pads them; the labels' padding -100), seeded."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, length // 2), length + 1, (2, rows), generator=generator)
    lengths[:, 0] = length  # one row sets the padded length
    ids = torch.randint(4, vocab_size, (2, rows, length), generator=generator)
    positions = torch.arange(length)
    source_kept, target_kept = (positions < lengths[i].unsqueeze(1) for i in range(2))
    return {"input_ids": ids[0].masked_fill(~source_kept, pad_token_id), "attention_mask": source_kept.long(),
            "labels": ids[1].masked_fill(~target_kept, -100)}


def _config(quick: bool):
    from vanilla_transformer import VanillaTransformerConfig

    # The paper's base model and its shared vocabulary of about 37,000 tokens (§5.1), label smoothing 0.1 as the
    # training loop sets it (§5.4); the tests' tiny one.
    if quick:
        return VanillaTransformerConfig.from_preset("tiny", vocab_size=256, **TOKENS)
    return VanillaTransformerConfig.from_preset("base", vocab_size=37000, **TOKENS)


def ours_step(config, batch: dict, device: str, precision: str):
    """One call: the training loop's step (`train_step`) of a new model on `batch`, as `train` builds it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from vanilla_transformer import VanillaTransformerForConditionalGeneration
    from vanilla_transformer.training.budget import Budget
    from vanilla_transformer.training.compute import training_sdpa_backends
    from vanilla_transformer.training.run_state import RunState
    from vanilla_transformer.training.schedule import make_optimizer, make_scheduler
    from vanilla_transformer.training.arguments import TrainArguments
    from vanilla_transformer.training.setup import Components, prepare
    from vanilla_transformer.training.step import next_rate, train_step

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="bf16" if precision == "bf16" else "no", cpu=device == "cpu")
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(config).to(accelerator.device)
    model.set_attn_implementation("sdpa")
    optimizer = make_optimizer(model, accelerator.device)
    scheduler = make_scheduler(optimizer, config.d_model, 4000)
    model, optimizer = prepare(accelerator, model, optimizer)
    components = Components(accelerator, model, optimizer, scheduler, Path("unused"), TrainArguments(output_dir="unused"))
    batch = {name: tensor.to(accelerator.device) for name, tensor in batch.items()}
    tokens = int((batch["labels"] != -100).sum())
    state = RunState()
    budget = Budget(state=state)

    def step():
        with training_sdpa_backends(accelerator.device):  # as the training loop runs every step
            next_rate(components, train_step(components, [(batch, tokens)], state.step, budget))
        state.count_step(1, tokens)

    step.components = components
    return step


def marian_step(config, batch: dict, device: str, precision: str):
    """One call: MarianMTModel of `config`'s shape, forward, backward and fused AdamW on `batch` under autocast."""
    from transformers import MarianMTModel

    from vanilla_transformer.export.marian import marian_config

    torch.manual_seed(0)
    model = MarianMTModel(marian_config(config)).to(device).train()
    model.set_attn_implementation("sdpa")
    fused = torch.device(device).type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=fused)
    batch = {name: tensor.to(device) for name, tensor in batch.items()}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def step():
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=precision == "bf16"):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def count_step(step) -> KernelCount:
    """The kernels of `step`'s second call: the first makes Adam's state and warms the caches."""
    step()
    return count_kernels(step)


def run(device: str, precision: str, quick: bool, rows: int | None = None, length: int | None = None,
        bf16_weights: str | None = None) -> dict:
    from vanilla_transformer.training.compute import BF16_WEIGHTS_VARIABLE

    if bf16_weights is not None:  # read by the loop's Components when it is built
        os.environ[BF16_WEIGHTS_VARIABLE] = bf16_weights
    config = _config(quick)
    rows, length = rows or (8 if quick else 64), length or (16 if quick else 32)
    batch = synthetic_batch(config.vocab_size, rows, length, config.pad_token_id)
    step = ours_step(config, batch, device, precision)
    ours = "ours, bf16 weights" if step.components.bf16_weights is not None else "ours"
    counts = {ours: count_step(step), "marian": count_step(marian_step(config, batch, device, precision))}
    return {"shape": "tiny" if quick else "base", "device": device, "precision": precision, "rows": rows,
            "length": length, "target_tokens": int((batch["labels"] != -100).sum()), "counts": counts}


def table(report: dict) -> str:
    counts = report["counts"]
    columns = ["total", *next(iter(counts.values())).by_category()]
    lines = [f"Kernels per training step: {report['shape']} shape, {report['precision']}, {report['device']}, "
             f"{report['rows']} rows x {report['length']} tokens ({report['target_tokens']} target tokens), "
             f"torch {torch.__version__}", "",
             "| | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, count in counts.items():
        row = {"total": count.total, **count.by_category()}
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:,}" for c in columns) + " |")
    ours, marian = next(iter(counts.values())).total, counts["marian"].total
    lines += ["", f"ours / marian: {ours / marian:.2f}"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="where the step runs (default cpu; the counts are the same)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="bf16 autocast or fp32")
    parser.add_argument("--quick", action="store_true", help="the tiny shape instead of the paper's base")
    parser.add_argument("--rows", type=int, help="sentences in the batch (default 64; 8 with --quick)")
    parser.add_argument("--length", type=int, help="padded length of source and target (default 32; 16 with --quick)")
    parser.add_argument("--bf16-weights", choices=("0", "1"),
                        help="1: ours on bf16 weights (a one-process GPU run's default); 0: on autocast; default: "
                             "as the training loop chooses on --device")
    parser.add_argument("--top", type=int, default=0, help="also list each contender's N most called operators")
    args = parser.parse_args(argv)
    for name in ("rows", "length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive integer")
    try:
        torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: expected a torch device such as cpu or cuda; got {args.device!r}")
    report = run(args.device, args.precision, args.quick, args.rows, args.length, args.bf16_weights)
    print(table(report))
    for name, count in report["counts"].items() if args.top else ():
        print(f"\n{name}: " + ", ".join(f"{op} {calls}" for op, calls in count.most_common(args.top)))
    return report


if __name__ == "__main__":
    sys.exit(main() and 0)
