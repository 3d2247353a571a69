"""The distributed side of a training run: start Accelerate, refuse launches that cannot work, say what runs; what
the step does differently under each distributed strategy, and with a step that is not finite.

`start_accelerator(**kwargs)` is `Accelerator(**kwargs)` with a timeout for collectives (`ddp_timeout`),
TF32 for fp32 products on a GPU, and three additions, all before the run writes anything (the output
folder, its lock, the tokenizer):

- A launcher that started N processes (`WORLD_SIZE`, set by `accelerate launch` / torchrun) whose
  Accelerate state counts another number is refused with one error naming the fix. The common
  case: `accelerate launch --multi_gpu` on a machine without GPUs and without `ACCELERATE_USE_CPU=1`;
  Accelerate then finds no GPU and runs each process alone ("1 process(es)"), and the processes
  race on the output folder.
- FSDP asked for where it cannot run (no accelerator, or `ACCELERATE_USE_CPU`) is a usage error that
  says to use DDP on CPU instead, decided from the launch's settings before Accelerate is started; FSDP
  asked for but not active (an Accelerate version that falls back to DDP) is a warning.
- One line on the main process says what runs: the distributed type, the world size, the machines
  and processes per machine, the mixed precision and the device type; then each process logs its
  own rank and device.

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
import os
from contextlib import nullcontext

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from ..errors import BadInput
from .arguments import DEFAULT_DDP_TIMEOUT
from ..threads import environment_number

__all__ = [
    "DEFAULT_DDP_TIMEOUT",
    "NonFiniteGuard",
    "StepStrategy",
    "configure_deepspeed",
    "default_mixed_precision",
    "check_strategy_has_devices",
    "describe",
    "end_training",
    "launched_world_size",
    "on_main",
    "requested_strategy",
    "start_accelerator",
]

logger = get_logger(__name__)

# The flags `accelerate launch --use_fsdp / --use_deepspeed` (or a config file) set for the processes.
_STRATEGY_FLAGS = {"FSDP": "ACCELERATE_USE_FSDP", "DEEPSPEED": "ACCELERATE_USE_DEEPSPEED"}
_CPU_FIX = "set ACCELERATE_USE_CPU=1 (or `accelerate launch --cpu`) on a machine without GPUs"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def requested_strategy() -> str | None:
    """'FSDP' or 'DEEPSPEED' when the launcher asked for one, else None (DDP or a single process)."""
    for strategy, flag in _STRATEGY_FLAGS.items():
        if _flag(flag):
            return strategy
    return None


def launched_world_size() -> int | None:
    """The number of processes the launcher started (torchrun's WORLD_SIZE), or None without a launcher."""
    value = os.environ.get("WORLD_SIZE")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def default_mixed_precision() -> str | None:
    """`mixed_precision` when the run does not say: None (Accelerate's choice) under a launcher that set one
    (`accelerate launch`, its config), else bf16 autocast on a GPU that has it, fp16 (with Accelerate's loss
    scaler) on one that does not, and on a CPU bf16 where it multiplies bf16 in hardware (compute.py), else none."""
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None
    import torch

    from .compute import cpu_computes_bf16

    if _flag("ACCELERATE_USE_CPU") or not torch.cuda.is_available():
        return "bf16" if cpu_computes_bf16() else None
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def start_accelerator(ddp_timeout: float = DEFAULT_DDP_TIMEOUT, **kwargs) -> Accelerator:
    """`Accelerator(**kwargs)`, refusing (ValueError) a launch whose processes would not train together.

    `ddp_timeout` (seconds) is how long a process waits in a collective; fp32 matrix products on a GPU
    use TF32 (what stays fp32 under autocast: the optimiser's arithmetic is elementwise and stays exact).
    """
    from datetime import timedelta

    import torch
    from accelerate.utils import InitProcessGroupKwargs

    strategy = requested_strategy()
    check_strategy_has_devices(strategy)
    handlers = [*kwargs.pop("kwargs_handlers", []), InitProcessGroupKwargs(timeout=timedelta(seconds=ddp_timeout))]
    accelerator = Accelerator(kwargs_handlers=handlers, **kwargs)
    check_world_size(accelerator)
    if accelerator.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    logger.info(describe(accelerator))
    if strategy is not None and accelerator.distributed_type.name != strategy:
        logger.warning(
            f"{strategy} was asked for ({_STRATEGY_FLAGS[strategy]}) but Accelerate runs {accelerator.distributed_type.name}"
            + (" (on CPU Accelerate falls back to DDP: no sharding)" if accelerator.device.type == "cpu" else "")
        )
    if accelerator.num_processes > 1:
        logger.info(
            f"process {accelerator.process_index} (local {accelerator.local_process_index}): {accelerator.device}",
            main_process_only=False,
        )
    return accelerator


def check_strategy_has_devices(strategy: str | None) -> None:
    """Refuse FSDP where there is no accelerator to shard on, from the launch's own settings, before Accelerate
    builds its plugin (whose error for this differs from one Accelerate release to the next)."""
    import torch

    if strategy != "FSDP" or not (_flag("ACCELERATE_USE_CPU") or not torch.accelerator.is_available()):
        return
    raise BadInput(
        "FSDP was asked for (ACCELERATE_USE_FSDP), but this launch has no GPU to shard the model on "
        + ("(ACCELERATE_USE_CPU is set). " if _flag("ACCELERATE_USE_CPU") else "(torch finds no accelerator). ")
        + "On CPU train with DDP instead: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ..."
    )


def check_world_size(accelerator) -> None:
    """Refuse a launch whose launcher and Accelerate disagree on the number of processes."""
    launched = launched_world_size()
    if launched is None or launched == accelerator.num_processes:
        return
    if accelerator.distributed_type.name == "DEEPSPEED" and accelerator.device.type == "cpu":
        # Accelerate (1.15) joins DeepSpeed's processes only on an accelerator; with `--cpu` it runs DDP instead.
        raise BadInput(
            f"the launcher started {launched} DeepSpeed processes (WORLD_SIZE={launched}) but Accelerate runs each "
            "alone: it starts DeepSpeed's process group only on GPUs (or other accelerators), not on a CPU. "
            "Fix: on a machine without GPUs train with DDP: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
            "--num_processes N ... (no ZeRO sharding); run DeepSpeed on a GPU machine."
        )
    raise BadInput(
        f"the launcher started {launched} processes (WORLD_SIZE={launched}) but Accelerate runs "
        f"{accelerator.num_processes} ({accelerator.distributed_type.name} on {accelerator.device.type}): "
        "each process would train alone and they would race on the output folder. "
        f"Fix: {_CPU_FIX}; on a GPU machine, check that every process sees a GPU (CUDA_VISIBLE_DEVICES, nvidia-smi)."
    )


def describe(accelerator) -> str:
    """One line: distributed type, world size, machines and processes per machine, mixed precision, devices."""
    world = accelerator.num_processes
    per_machine = environment_number("LOCAL_WORLD_SIZE", world)
    machines = max(world // max(per_machine, 1), 1)
    device = accelerator.device
    tf32 = ""
    if device.type == "cuda":
        import torch

        devices = f"{world} x cuda ({torch.cuda.get_device_name(device)})"
        tf32 = ", fp32 matmuls in TF32" if torch.backends.cuda.matmul.allow_tf32 else ""
    else:
        devices = f"{world} x {device.type}"
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        kind_text = f"FSDP{getattr(plugin, 'fsdp_version', 1)}"
    elif kind == DistributedType.DEEPSPEED:
        stage = accelerator.state.deepspeed_plugin.zero_stage
        kind_text = f"DEEPSPEED (ZeRO-{stage})"
    elif kind in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        kind_text = f"DDP ({kind.name})"
    else:
        kind_text = "none (one process)" if kind == DistributedType.NO else kind.name
    return (
        f"distributed: {kind_text}, world size {world} ({machines} machine(s) x {per_machine} process(es)), "
        f"mixed precision {accelerator.mixed_precision}, devices {devices}{tf32}"
    )


def end_training(accelerator) -> None:
    """`accelerator.end_training()`, after freeing the DDP wrapper while the process group still exists: the
    caller has let go of it first (it keeps the unwrapped model only).

    Accelerate's `end_training` destroys the process group; the DDP wrapper's reducer still held it, and
    freeing the wrapper afterwards (when `train` returns) ran the gloo group's destructor with the GIL held,
    which joins gloo's worker threads while one of them waits for the GIL to free a finished all-gather:
    rank 1 of a 2-process CPU run then hangs at exit, after the run had written everything.
    """
    import gc

    accelerator.free_memory()  # Accelerate's own references to the prepared model and optimiser
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()


def configure_deepspeed(accelerator, args) -> None:
    """Give DeepSpeed what `accelerator.prepare` asks of it, from our arguments, without pretending batches
    have a fixed size.

    The loop never prepares a DataLoader: its batches hold at most `max_tokens` tokens, however many
    pairs that is. DeepSpeed wants `train_micro_batch_size_per_gpu` (which it only uses to count and
    report samples): one micro-batch is one of our batches, so 1, and `train_batch_size` = world size.
    Gradient clipping is DeepSpeed's own (`accelerator.clip_grad_norm_` does nothing under it): it
    gets `max_grad_norm` (0: off). Values the user's DeepSpeed config sets are kept, unless they
    contradict ours. Gradient accumulation stays 1: DeepSpeed would divide the loss by its own count
    and step on its own boundary, which the loop's token-normalised steps (whose last batch of an
    epoch may come alone) do not match; more than one is refused until that is done.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    if args.gradient_accumulation_steps not in (None, 1):  # None: left unset, so one batch per micro-step
        raise BadInput(
            f"`gradient_accumulation_steps` {args.gradient_accumulation_steps} is not supported under DeepSpeed yet; "
            "use 1 and raise `max_tokens`, or use DDP/FSDP"
        )
    wanted = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": accelerator.num_processes,
        "gradient_clipping": float(args.max_grad_norm or 0.0),
    }
    for key, value in wanted.items():
        given = config.get(key, "auto")
        if given == "auto":
            config[key] = value
        elif key != "gradient_clipping" and given != value:
            raise BadInput(
                f"the DeepSpeed config sets {key}={given!r}; this loop's batches are token-budgeted (one batch of "
                f"at most `max_tokens` tokens per micro-step), so it must be {value} or 'auto'"
            )
    logger.info(
        f"DeepSpeed: ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}, one batch of <= {args.max_tokens} tokens "
        f"per micro-step and process (train_micro_batch_size_per_gpu 1, train_batch_size {config['train_batch_size']}), "
        f"gradient clipping {config['gradient_clipping'] or 'off'}"
    )


# What the other processes raise when the main process's work failed: an error of its kind, so that the command line
# ends every process alike (a usage error, the machine's, or a bug's), none left waiting for the main one.
FORWARDED_ERRORS = (BadInput, OSError, RuntimeError)


def on_main(accelerator, decide, doing: str = "start this run") -> int | None:
    """Run `decide()`, which returns an int or None, on the main process only, before the other processes
    can race it; every process gets the answer, or stops: the main process with its error, the others with one of
    its kind, "the main process could not <doing>; its error says why"."""
    answer, error = None, None
    if accelerator.is_main_process:
        try:
            answer = decide()
        except Exception as err:
            error = err
    # [failed, answer] as a tensor reduction, as the step's own (torch's broadcast_object_list left the gloo
    # processes hanging at exit); failed: 1 + the index of the error's kind in FORWARDED_ERRORS
    if accelerator.num_processes > 1:
        kind = 0 if error is None else 1 + next((i for i, forwarded in enumerate(FORWARDED_ERRORS)
                                                 if isinstance(error, forwarded)), len(FORWARDED_ERRORS) - 1)
        sent = [kind, -1 if answer is None else answer] if accelerator.is_main_process else [0, 0]
        failed, answer = accelerator.reduce(torch.tensor(sent, device=accelerator.device), "sum").tolist()
        answer = None if answer == -1 else answer
        if failed and error is None:
            error = FORWARDED_ERRORS[failed - 1](f"the main process could not {doing}; its error says why")
    if error is not None:
        raise error
    return answer


# The step under each strategy


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
