"""The attention implementation a training run computes with, chosen for the machine when the run starts.

transformers' attention implementations compute the same function (tested) at very
different speeds from one machine and precision to another (on some CPUs the fused "sdpa" kernel's
bf16 backward is slower than the plain "eager" one). `fastest_attn_implementation` times each on the run's own
first batch, forward and backward, and keeps the fastest. After its first run it goes on only while
the runs to the end of its next round fit in `TIMING_SHARE` of what is left of the run: a short run (a
learner's few minutes) keeps the configured implementation, untimed, rather than spend a sixth of its
budget choosing. On a GPU, transformers' "sdpa" leaves torch
to pick the fused kernel, and torch may pick cuDNN's, which builds an execution plan on the host for
every new shape of batch: training's token batches come in many shapes, so `training_sdpa_backends` keeps
a run on flash and memory-efficient attention, which need no plan.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import BadInput
from . import criterion

__all__ = ["TIMING_SHARE", "TRAINING_SDPA_BACKENDS", "attn_implementation_choice", "choose_attn_implementation",
           "fastest_attn_implementation",
           "set_attn_implementation", "training_sdpa_backends"]

ATTENTION_CANDIDATES = ("sdpa", "eager")  # timed: the others are slower where they run at all (flex on a CPU)
MARGIN = 0.05  # another implementation replaces the configured one only when it is at least this much faster
TIMING_SHARE = 0.03  # of what is left of a run, the most the attention timing takes after its warm-up round
# One process, or DDP; FSDP's sharded forward and DeepSpeed's engine (which steps inside backward) keep sdpa.
TIMED_UNDER = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
# sdpa's kernels for a training run on a GPU: not cuDNN's, whose per-shape plan costs milliseconds of host time.
TRAINING_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

logger = get_logger(__name__)  # logs on the main process only


def training_sdpa_backends(device):
    """While it lasts, sdpa on a CUDA `device` runs on TRAINING_SDPA_BACKENDS alone; elsewhere it changes nothing.
    torch's switches are the process's, so it belongs around a training run or step, not a server's requests."""
    return sdpa_kernel(TRAINING_SDPA_BACKENDS) if torch.device(device).type == "cuda" else nullcontext()


def fastest_attn_implementation(accelerator, model, batch: dict, loss, rounds: int = 3,
                                allowance=None) -> dict[str, float]:
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


def choose_attn_implementation(accelerator, model, chosen: str | None, batch: dict, budget) -> str:
    """Put the model (as prepared) on `chosen` (`attn_implementation`, or the one the resumed run chose), or on the
    one that trains the first `batch` fastest here (`fastest_attn_implementation`), timed within TIMING_SHARE of what
    is left of the `budget`; returns it, for checkpoints to record, so that a resumed run computes as it did."""
    unwrapped = accelerator.unwrap_model(model)
    started = time.perf_counter()
    if chosen:
        set_attn_implementation(unwrapped, chosen)
    elif seconds := fastest_attn_implementation(accelerator, model, batch, lambda m, b: criterion.batch_loss(m, b)[0],
                                      allowance=lambda step_seconds: TIMING_SHARE * budget.seconds_left(step_seconds)):
        logger.info(f"{attn_implementation_choice(unwrapped.config._attn_implementation, seconds)}; "
                    f"timed in {time.perf_counter() - started:.1f} s")
    return unwrapped.config._attn_implementation


def set_attn_implementation(model, implementation: str) -> None:
    """`model.set_attn_implementation`, its refusal (a missing kernel package, for one) as one ValueError naming the
    option."""
    try:
        model.set_attn_implementation(implementation)
    except (ValueError, ImportError) as err:
        raise BadInput(f"`attn_implementation` {implementation!r} cannot run this model: {err}") from None


def attn_implementation_choice(chosen: str, seconds: dict[str, float]) -> str:
    """What `fastest_attn_implementation` chose, in words that agree with its `seconds`: the fastest, or the configured
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
