"""How a run computes on the machine in hand, decided when it starts and never tuned to one machine: its precision, its
attention implementation and, where asked, its compiled step.

Precision. bf16 autocast (weights, optimiser and loss stay fp32) where the processor multiplies
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

Attention. transformers' attention implementations compute the same function (tested) at very
different speeds from one machine and precision to another (on some CPUs the fused "sdpa" kernel's
bf16 backward is slower than the plain "eager" one). `fastest_attn_implementation` times each on the run's own
first batch, forward and backward, and keeps the fastest. After its first run it goes on only while
the runs to the end of its next round fit in `TIMING_SHARE` of what is left of the run: a short run (a
learner's few minutes) keeps the configured implementation, untimed, rather than spend a sixth of its
budget choosing. On a GPU, transformers' "sdpa" leaves torch
to pick the fused kernel, and torch may pick cuDNN's, which builds an execution plan on the host for
every new shape of batch: training's token batches come in many shapes, so `training_sdpa_backends` keeps
a run on flash and memory-efficient attention, which need no plan.

The compiled step (`torch_compile`): the model's forward and §5.4's loss as one graph per batch shape.
`torch.compile` captures `criterion.batch_loss` (the forward and the loss, under the step's autocast or on the bf16
weights, whichever the step runs with); AOTAutograd derives the backward from the same graph, so backward is compiled
too. The graphs are static (`dynamic=False`): one per batch shape, which the bucket shapes
(`bucket_shapes`, batches.py) keep to a few. Dynamo's limit of recompilations is raised to the number of shapes and
reaching it is an error, never a silent fall back to eager. The optimiser, the gradient reduction and the checks of
distributed.py's `NonFiniteGuard` stay eager. Each shape's first step compiles: its time is logged and summed
(`CompiledLoss.seconds`, results.json's `compiled_step`); being wall-clock time of the run, `time_limit` counts it as
any other.
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

from ..errors import BadInput
from . import criterion

__all__ = ["BF16_CPU_FLAGS", "BF16_WEIGHTS_VARIABLE", "CPU_BF16_VARIABLE", "TIMING_SHARE", "TRAINING_SDPA_BACKENDS",
           "Bf16Weights", "CompiledLoss", "attn_implementation_choice", "bf16_weights", "choose_attn_implementation",
           "compile_timing", "compiled_loss", "cpu_computes_bf16", "cpu_flags", "fastest_attn_implementation",
           "set_attn_implementation", "training_sdpa_backends"]

logger = get_logger(__name__)  # logs on the main process only


# Precision

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


# Attention

ATTENTION_CANDIDATES = ("sdpa", "eager")  # timed: the others are slower where they run at all (flex on a CPU)
MARGIN = 0.05  # another implementation replaces the configured one only when it is at least this much faster
TIMING_SHARE = 0.03  # of what is left of a run, the most the attention timing takes after its warm-up round
# One process, or DDP; FSDP's sharded forward and DeepSpeed's engine (which steps inside backward) keep sdpa.
TIMED_UNDER = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
# sdpa's kernels for a training run on a GPU: not cuDNN's, whose per-shape plan costs milliseconds of host time.
TRAINING_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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


# The compiled step

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
