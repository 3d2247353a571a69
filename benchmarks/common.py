"""What every benchmark shares: the data all contenders see, timing statistics, the machine."""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from vanilla_transformer import VanillaTransformerConfig
from vanilla_transformer.corpora import load_translation_dataset, text_pairs
from vanilla_transformer.tokenizer import train_tokenizer

CORPUS, SOURCE, TARGET = "bible-en-es", "en", "es"
MAX_TOKENS = 128  # longer sentences are cut: the few outliers would dominate padded batches


def pairs(split: str) -> tuple[list[str], list[str]]:
    return text_pairs(load_translation_dataset(CORPUS)[split], SOURCE, TARGET)


def benchmark_tokenizer(vocab_size: int, train_pairs: int | None = None):
    """The joint BPE vocabulary all models share, learned from (the first `train_pairs` of) the train split."""
    source, target = pairs("train")
    if train_pairs is not None:
        source, target = source[:train_pairs], target[:train_pairs]
    return train_tokenizer(source + target, vocab_size=vocab_size)


def model_config(size: str, tokenizer, **overrides) -> VanillaTransformerConfig:
    return VanillaTransformerConfig.from_preset(
        size,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )


def encode(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    return tokenizer(texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")


def token_batch(tokenizer, source: list[str], target: list[str], target_tokens: int, start: int = 0) -> dict:
    """Consecutive pairs from `start` until their targets hold `target_tokens` real tokens: the fixed
    token batch of §5.1 (which used ~25k source and ~25k target tokens per batch)."""
    end, count = start, 0
    while count < target_tokens:
        count += len(tokenizer(target[end % len(target)], truncation=True, max_length=MAX_TOKENS)["input_ids"])
        end += 1
    indices = [i % len(source) for i in range(start, end)]
    batch = encode(tokenizer, [source[i] for i in indices])
    labels = encode(tokenizer, [target[i] for i in indices])["input_ids"]
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels.masked_fill(labels == tokenizer.pad_token_id, -100),
    }


def by_length(tokenizer, source: list[str], target: list[str]) -> tuple[list[str], list[str]]:
    """The pairs sorted by (target, source) token count: consecutive pairs then have similar lengths,
    as in the batches the training loop makes (§5.1, training/batches.py), with little padding."""
    target_lengths = [len(ids) for ids in tokenizer(target)["input_ids"]]
    source_lengths = [len(ids) for ids in tokenizer(source)["input_ids"]]
    order = sorted(range(len(source)), key=lambda i: (target_lengths[i], source_lengths[i]))
    return [source[i] for i in order], [target[i] for i in order]


def summary(values: list[float]) -> dict:
    """Median and spread (min, max) of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def peak_rss_mb() -> float:
    """The process's peak resident memory since the last `reset_peak_rss`, or since it started."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB; never reset


def reset_peak_rss() -> float:
    """Start the peak from here (Linux: "5" to clear_refs resets VmHWM), so that what importing and
    loading took, and freed, does not hide a smaller model's peak. Returns the resident memory now.
    Memory the C allocator keeps after a free is handed back first (glibc's malloc_trim), or a second
    contender would reuse the first one's pages without its peak showing them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass
    return peak_rss_mb()


def peak_memory_mb(fn, device: str) -> float:
    """Memory `fn()` needs beyond what is already held (weights, inputs): peak resident memory above
    the start on a CPU, peak allocated above the start on a GPU (torch's allocator: PyTorch models only)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    before = reset_peak_rss()
    fn()
    return peak_rss_mb() - before


class Timer:
    """Wall time of a block, synchronising the GPU on both ends so that queued kernels are counted."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.seconds = time.perf_counter() - self.start


SDPA_KERNELS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "sdpa:flash(cpu)",
    "aten::_scaled_dot_product_flash_attention": "sdpa:flash",
    "aten::_scaled_dot_product_efficient_attention": "sdpa:efficient",
    "aten::_scaled_dot_product_cudnn_attention": "sdpa:cudnn",
    "aten::_scaled_dot_product_attention_math": "sdpa:math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "sdpa:overrideable",
}


def attention_kernels(fn) -> list[str]:
    """Which attention kernels `fn()` ran, read from the profiler's op names. "explicit" is the
    softmax path (no fused kernel), seen as a softmax op outside any SDPA call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        fn()
    names = {event.key for event in prof.key_averages()}
    kernels = sorted({label for op, label in SDPA_KERNELS.items() if op in names})
    if not kernels and ("aten::softmax" in names or "aten::_softmax" in names):
        kernels = ["explicit"]
    return kernels


def operator_profile(fn, runs: int, top: int = 8) -> dict:
    """Where the CPU time of `runs` calls of `fn` goes: the `top` operators by self CPU time (time in the operator
    and not in the operators it calls), then all the others, then the time outside any operator (Python, the
    autograd engine's bookkeeping), each as a share of the wall time of the calls under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, Timer("cpu") as timer:
        for _ in range(runs):
            fn()
    ranked = sorted(((event.key, event.self_cpu_time_total / 1e6) for event in prof.key_averages()),
                    key=lambda item: item[1], reverse=True)
    shares = {name: seconds / timer.seconds for name, seconds in ranked[:top]}
    shares["other operators"] = sum(seconds for _, seconds in ranked[top:]) / timer.seconds
    shares["outside operators"] = max(0.0, 1 - sum(shares.values()))
    return {"runs": runs, "seconds_per_run": timer.seconds / runs, "shares": shares}


# What a copy (aten::copy_) is for, by the operator that called it.
COPY_CAUSES = {"aten::_to_copy": "casts", "aten::clone": "layout", "aten::addmm": "bias into addmm's output"}


def copied_elements(fn) -> dict[str, dict[str, int]]:
    """The tensor elements one call of `fn` copies, by cause: dtype casts (autocast's among them), layout
    (a non-contiguous tensor made contiguous), a bias broadcast into a product's output, or the operator or
    autograd function that copied. Counts, not times: they are the same on every CPU."""
    import math

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    causes = {}
    for event in prof.events():
        if event.name != "aten::copy_" or not event.input_shapes or not event.input_shapes[0]:
            continue
        parent = event.cpu_parent.name if event.cpu_parent is not None else "no operator"
        cause = causes.setdefault(COPY_CAUSES.get(parent, parent), {"elements": 0, "calls": 0})
        cause["elements"] += math.prod(event.input_shapes[0])
        cause["calls"] += 1
    return dict(sorted(causes.items(), key=lambda item: item[1]["elements"], reverse=True))


def environment(device: str, threads: int) -> dict:
    info = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "load_average_start": os.getloadavg(),  # 1, 5, 15 minutes: other processes on the machine
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import ctranslate2

        info["ctranslate2"] = ctranslate2.__version__
    except ImportError:
        info["ctranslate2"] = None
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def load_text(average) -> str:
    """A load average (1, 5, 15 minutes) as the reports print it."""
    return ", ".join(f"{value:.2f}" for value in average)


def write_atomically(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file beside it: never a half-written report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    os.chmod(tmp.name, 0o644)  # as a plain write would make it (a temporary file is private to its owner)
    os.replace(tmp.name, path)
    return path

