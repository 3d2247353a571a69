"""What runs fastest on the machine at hand, decided when a run starts and never tuned to one machine.

- **Precision.** bf16 autocast (weights, optimiser and loss stay fp32) where the processor multiplies
  bf16 in hardware: every GPU that reports it, and CPUs with AVX-512 BF16 or AMX (x86) or the BF16
  extension (Arm), whose bf16 matrix products run at several times their fp32 rate. Elsewhere bf16 is
  emulated and slower than fp32, so the run stays fp32. `VANILLA_TRANSFORMER_CPU_BF16=1` (or `0`) overrides
  the CPU's answer, so that a test suite or a comparison runs either way on any machine.
- **bf16 weights.** Autocast casts every weight to bf16 where it is used and every gradient back, and the
  activations between fp32 and bf16 around each product: hundreds of casts a step, each a kernel launch,
  which on a GPU is host time. `Bf16Weights` instead runs forward and backward on bf16 copies of the
  weights, made once a step, and hands their gradients to the model's own fp32 parameters, which the
  optimiser, the checkpoints and the saved model keep: two casts a step. On by default for a one-process
  bf16 run on a GPU; on a CPU the products are as fast either way (benchmarks/cpu_precision.py's
  "bf16-weights"), so autocast stays. `VANILLA_TRANSFORMER_BF16_WEIGHTS=1` (or `0`) decides instead.
- **Attention.** transformers' attention implementations compute the same function (tested) at very
  different speeds from one machine and precision to another (on some CPUs the fused "sdpa" kernel's
  bf16 backward is slower than the plain "eager" one). `fastest_attention` times each on the run's own
  first batch, forward and backward, and keeps the fastest. After its first run it goes on only while
  the runs to the end of its next round fit in `TIMING_SHARE` of what is left of the run: a short run (a
  learner's few minutes) keeps the configured implementation, untimed, rather than spend a sixth of its
  budget choosing. On a GPU, transformers' "sdpa" leaves torch
  to pick the fused kernel, and torch may pick cuDNN's, which builds an execution plan on the host for
  every new shape of batch: training's token batches come in many shapes, so `training_attention` keeps
  a run on flash and memory-efficient attention, which need no plan.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import criterion

__all__ = ["BF16_CPU_FLAGS", "BF16_WEIGHTS_VARIABLE", "CPU_BF16_VARIABLE", "TIMING_SHARE", "TRAINING_SDPA_BACKENDS",
           "Bf16Weights", "attention_choice", "bf16_weights", "choose_attention", "cpu_computes_bf16", "cpu_flags",
           "fastest_attention", "set_attention", "training_attention"]

# /proc/cpuinfo's names for bf16 arithmetic in hardware: x86's AVX-512 BF16 and AMX, Arm's BF16 extension.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# Set to 1 or 0, it answers for the CPU: the suite's premises can then be checked with bf16 on and off anywhere.
CPU_BF16_VARIABLE = "VANILLA_TRANSFORMER_CPU_BF16"
# Set to 1 or 0, it decides whether a bf16 run trains on bf16 copies of the weights (Bf16Weights), on any device.
BF16_WEIGHTS_VARIABLE = "VANILLA_TRANSFORMER_BF16_WEIGHTS"
ATTENTION_CANDIDATES = ("sdpa", "eager")  # timed: the others are slower where they run at all (flex on a CPU)
MARGIN = 0.05  # another implementation replaces the configured one only when it is at least this much faster
TIMING_SHARE = 0.03  # of what is left of a run, the most the attention timing takes after its warm-up round
# One process, or DDP; FSDP's sharded forward and DeepSpeed's engine (which steps inside backward) keep sdpa.
TIMED_UNDER = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
# sdpa's kernels for a training run on a GPU: not cuDNN's, whose per-shape plan costs milliseconds of host time.
TRAINING_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

logger = get_logger(__name__)  # logs on the main process only


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
        raise ValueError(f"{variable} must be 0 or 1 (or unset); got {forced!r}.")
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


def training_attention(device):
    """While it lasts, sdpa on a CUDA `device` runs on TRAINING_SDPA_BACKENDS alone; elsewhere it changes nothing.
    torch's switches are the process's, so it belongs around a training run or step, not a server's requests."""
    return sdpa_kernel(TRAINING_SDPA_BACKENDS) if torch.device(device).type == "cuda" else nullcontext()


def fastest_attention(accelerator, model, batch: dict, loss, rounds: int = 3, allowance=None) -> dict[str, float]:
    """Leave `model` on the attention implementation that runs forward and backward on `batch` fastest.

    `loss(model, batch)` returns the batch's loss. Each implementation the model accepts runs `rounds` times,
    interleaved; the first round warms up and the fastest later one counts. The configured implementation
    (transformers' default, sdpa) stays unless another is `MARGIN` faster. Every process times its own and
    the sums decide, so that all keep the same. Gradients are cleared and the random state restored: the run
    goes on as if nothing had run. Returns {implementation: seconds}, empty when there was no choice.

    `allowance(seconds_per_run)`, where given, is how many seconds the timing may take, from what one forward and
    backward takes: after each run, the timing goes on only while the runs to its next round's end fit. Stopped
    before a round past the warm-up is done (on a short run, after its first forward and backward), it keeps the
    configured implementation and says so in one line; it returns {}.
    """
    unwrapped = accelerator.unwrap_model(model)
    configured = unwrapped.config._attn_implementation
    usable = [name for name in ATTENTION_CANDIDATES if _accepts(unwrapped, name)]
    if len(usable) < 2 or accelerator.distributed_type not in TIMED_UNDER:
        unwrapped.set_attn_implementation(configured)
        return {}
    seconds = {name: [] for name in usable}
    start = time.perf_counter()
    order = [name for _ in range(rounds) for name in usable]  # interleaved: a round is one run of each
    with torch.random.fork_rng(devices=[accelerator.device] if accelerator.device.type == "cuda" else []):
        for i, name in enumerate(order):
            unwrapped.set_attn_implementation(name)
            seconds[name].append(_time_once(accelerator, model, batch, loss))
            if i + 1 < len(order) and allowance is not None and _past(accelerator, seconds, allowance, start):
                break
    rounds_done = min(len(runs) for runs in seconds.values())
    if rounds_done < 2:  # the warm-up alone pays one-time costs: no fair comparison
        unwrapped.set_attn_implementation(configured)
        logger.info(f"attention: {configured}, not timed: {sum(map(len, seconds.values()))} forward and backward "
                    f"took {time.perf_counter() - start:.1f} s, and the timing may take {TIMING_SHARE:.0%} of what is "
                    "left of the run")
        return {}
    own = torch.tensor([min(seconds[name][1:rounds_done]) for name in usable], device=accelerator.device)
    summed = accelerator.reduce(own, "sum").tolist()
    times = dict(zip(usable, summed))
    best = min(usable, key=times.get)
    if configured in times and times[best] > (1 - MARGIN) * times[configured]:
        best = configured  # a near tie: what the first batch measured is noise, not a reason to change
    unwrapped.set_attn_implementation(best)
    return {name: total / accelerator.num_processes for name, total in zip(usable, summed)}


def _time_once(accelerator, model, batch: dict, loss) -> float:
    """Seconds of one forward and backward of `batch`, its gradients then cleared."""
    cuda = accelerator.device.type == "cuda"
    no_sync = accelerator.no_sync(model) if accelerator.num_processes > 1 else nullcontext()
    if cuda:
        torch.cuda.synchronize(accelerator.device)
    began = time.perf_counter()
    with no_sync, accelerator.autocast():
        loss(model, batch).backward()
    if cuda:
        torch.cuda.synchronize(accelerator.device)
    seconds = time.perf_counter() - began
    model.zero_grad(set_to_none=True)
    return seconds


def _past(accelerator, seconds: dict[str, list[float]], allowance, start: float) -> bool:
    """Whether the runs to the end of the next round that decides (the second, or the one after this one) would end
    past `allowance`, at the slowest implementation's fastest run so far; on any process, so that all stop together."""
    candidates, done = len(seconds), sum(map(len, seconds.values()))
    goal = max(2 * candidates, done + candidates if done % candidates == 0 else -(-done // candidates) * candidates)
    per_run = max(min(runs) for runs in seconds.values() if runs)
    past = time.perf_counter() - start + (goal - done) * per_run > allowance(per_run)
    return accelerator.reduce(torch.tensor([float(past)], device=accelerator.device), "sum").item() > 0


def choose_attention(accelerator, model, chosen: str | None, batch: dict, budget) -> str:
    """Put the model (as prepared) on `chosen` (`attn_implementation`, or the one the resumed run chose), or on the
    one that trains the first `batch` fastest here (`fastest_attention`), timed within TIMING_SHARE of what is left
    of the `budget`; returns it, for checkpoints to record, so that a resumed run computes as it did."""
    unwrapped = accelerator.unwrap_model(model)
    started = time.perf_counter()
    if chosen:
        set_attention(unwrapped, chosen)
    elif seconds := fastest_attention(accelerator, model, batch, lambda m, b: criterion.batch_loss(m, b)[0],
                                      allowance=lambda step_seconds: TIMING_SHARE * budget.seconds_left(step_seconds)):
        logger.info(f"{attention_choice(unwrapped.config._attn_implementation, seconds)}; "
                    f"timed in {time.perf_counter() - started:.1f} s")
    return unwrapped.config._attn_implementation


def set_attention(model, implementation: str) -> None:
    """`model.set_attn_implementation`, its refusal (a missing kernel package, for one) as one ValueError naming the
    option."""
    try:
        model.set_attn_implementation(implementation)
    except (ValueError, ImportError) as err:
        raise ValueError(f"`attn_implementation` {implementation!r} cannot run this model: {err}") from None


def attention_choice(chosen: str, seconds: dict[str, float]) -> str:
    """What `fastest_attention` chose, in words that agree with its `seconds`: the fastest, or the configured
    one kept because the fastest was not `MARGIN` faster."""
    timings = ", ".join(f"{name} {1000 * s:.0f} ms" for name, s in seconds.items())
    fastest = min(seconds, key=seconds.get)
    if fastest == chosen:
        return f"attention: {chosen}, the fastest here on the first batch, forward and backward ({timings})"
    return (f"attention: {chosen}, kept: {fastest} was faster on the first batch, forward and backward, but by less "
            f"than {MARGIN:.0%} ({timings})")


def _accepts(model, name: str) -> bool:
    try:
        model.set_attn_implementation(name)
    except (ValueError, ImportError):  # refused by the model's variants, or not installed
        return False
    return True
