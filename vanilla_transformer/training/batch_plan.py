"""The batches of a run: how many tokens each holds and how many make an optimiser step (`size_batches`), and the
sampler that cuts the training split into them (`training_sampler`).

§5.1 trains on batches of about 25,000 source and 25,000 target tokens. Given `max_tokens`, a run takes it; on a
GPU without it, the paper's step sized to the device's memory (`gpu_batch`); elsewhere CPU_MAX_TOKENS, one batch a
step. The plan is returned, and the run's options take it (`set_up`): nothing here changes the options given.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from ..errors import BadInput
from .arguments import CPU_MAX_TOKENS, TrainArguments
from .data import TokenBatchSampler, TokenizedSplit, bucket_shapes

__all__ = ["GPU_BUCKETS", "PAPER_STEP_TOKENS", "BatchPlan", "gpu_batch", "size_batches", "training_sampler"]

logger = get_logger(__name__)

PAPER_STEP_TOKENS = 25_000  # §5.1: "approximately 25000 source tokens and 25000 target tokens" per batch
GPU_BUCKETS = 16  # batch shapes on a GPU by default: each is one compilation of a compiled step


def gpu_batch(memory: int, config, parameters: int, processes: int, max_length: int,
              accumulation: int | None = None) -> tuple[int, int]:
    """(max_tokens, gradient_accumulation_steps) of about the paper's 25000 tokens per optimiser step over
    `processes`, each batch fitting a device of `memory` bytes beside the model's `parameters`: with
    `accumulation` given, the batch it needs (within what fits); else the fewest batches whose largest fits.

    The estimate is coarse and errs towards less: 20 bytes a parameter (fp32 weights, gradients, Adam's two
    moments, autocast's bf16 copies), and per token of a batch what a layer keeps for backward in bf16
    autocast (about 30 d_model + 5 d_ff bytes, more in the decoder, which also attends to the source) and the
    output layer's logits with their fp32 log-softmax and gradients (12 bytes a vocabulary entry), doubled for
    the allocator's fragments and temporaries, within 80% of the memory."""
    d, d_ff = config.d_model, config.d_ff
    per_token = (config.encoder_layers * (30 * d + 5 * d_ff) + config.decoder_layers * (44 * d + 5 * d_ff)
                 + 12 * config.vocab_size)
    fits = int((0.8 * memory - 20 * parameters) / (2 * per_token))
    if fits < max_length:
        raise BadInput(f"a batch of `max_length` ({max_length}) tokens does not fit the device's "
                       f"{memory / 2**30:.1f} GiB beside the model's {parameters:,} parameters; lower `max_length` "
                       "or give `max_tokens`")
    if accumulation is None:
        accumulation = -(-PAPER_STEP_TOKENS // (processes * fits))  # rounded up
    wanted = -(-PAPER_STEP_TOKENS // (processes * accumulation))
    return max(min(wanted, fits), max_length), accumulation


class BatchPlan(NamedTuple):
    """The batches of every optimiser step: `max_tokens` tokens each, `gradient_accumulation_steps` of them a process."""

    max_tokens: int
    gradient_accumulation_steps: int


def size_batches(args: TrainArguments, accelerator, model) -> BatchPlan:
    """`max_tokens` and `gradient_accumulation_steps`, those given or, where left unset, on a GPU the paper's batch
    sized to its memory (`gpu_batch`), elsewhere CPU_MAX_TOKENS and one batch per step; one line says what was chosen."""
    accumulation = args.gradient_accumulation_steps
    if args.max_tokens is not None or accelerator.distributed_type == DistributedType.DEEPSPEED:
        accumulation = accumulation or 1  # DeepSpeed: one batch a step
    if args.max_tokens is not None:
        return BatchPlan(args.max_tokens, accumulation)
    processes = accelerator.num_processes
    if accelerator.device.type == "cuda":
        memory = torch.cuda.get_device_properties(accelerator.device).total_memory
        parameters = sum(p.numel() for p in model.parameters())
        plan = BatchPlan(*gpu_batch(memory, model.config, parameters, processes, args.max_length, accumulation))
        why = (f"the paper's ~{PAPER_STEP_TOKENS} per step, sized to the GPU's {memory / 2**30:.1f} GiB and "
               f"{parameters:,} parameters")
    else:
        plan, why = BatchPlan(CPU_MAX_TOKENS, accumulation or 1), "the default off a GPU"
    step_tokens = plan.max_tokens * plan.gradient_accumulation_steps * processes
    logger.info(f"batch: {plan.max_tokens} tokens x {plan.gradient_accumulation_steps} batch(es) x {processes} "
                f"process(es) = {step_tokens} tokens per optimiser step ({why}; --max-tokens and "
                "--gradient-accumulation-steps choose them)")
    return plan


def training_sampler(accelerator, split: TokenizedSplit, epoch: int, max_tokens: int, seed: int, *,
                     shape_count: int | None, compiled: bool) -> TokenBatchSampler:
    """The training batches of at most `max_tokens` tokens, shuffled by `seed`, padded to `shape_count` shapes (by
    default GPU_BUCKETS on a GPU or for a `compiled` step, none elsewhere); one line says the shapes and the padding
    they waste beside that of batches as long as their longest pair."""
    count = shape_count
    if count is None:
        count = GPU_BUCKETS if accelerator.device.type == "cuda" or compiled else 0
    shapes = bucket_shapes(split.lengths, max_tokens, count) if count else None
    shard = dict(seed=seed, num_replicas=accelerator.num_processes, rank=accelerator.process_index)
    sampler = TokenBatchSampler(split.lengths, max_tokens, shapes=shapes, **shard)
    if shapes is None:
        logger.info(f"batches: each as long as its longest pair; {sampler.padding(epoch):.1%} of their slots pad")
    else:
        plain = TokenBatchSampler(split.lengths, max_tokens, **shard).padding(epoch)
        logger.info(f"batches: {len(shapes)} shapes (rows x length: {', '.join(f'{r}x{n}' for r, n in shapes)}); "
                    f"{sampler.padding(epoch):.1%} of their slots pad (as long as their longest pair: {plain:.1%})")
    return sampler
