"""Training throughput and peak memory: ours against transformers' MarianMTModel of the same shape.

One step is forward + backward + Adam step (§5.3's optimiser; torch's fused kernel, as our training
loop and transformers' Trainer use it) on a fixed token batch of real en-es pairs of similar length
(as the training loop batches them); throughput counts non-padding target tokens. Each contender
runs in its own process, so that its peak resident memory (CPU) is its own, and contenders
alternate (ABBA...) so that a change in machine load hits both.

Precision as the training loop takes it (vanilla_transformer/training/compute.py): on a CPU every size runs in
fp32 and, where the CPU multiplies bf16 in hardware, again under bf16 autocast, both contenders alike; on a
GPU, bf16 autocast. Ours runs on the attention implementation the training loop chooses (`fastest_attn_implementation`:
the fastest on this batch here, forward and backward; on a GPU, sdpa kept off cuDNN as `training_sdpa_backends`
keeps it), Marian on its own default. Beside each step: the rate the
device reaches on the step's own matrix products in the same precision (mfu.model_matmul_rate) and the step's
share of it; on a CPU, a profile of ours by operator (self CPU time as shares of the step). On a GPU:
synchronised timing, `torch.cuda.max_memory_allocated`, and model FLOPs utilisation (mfu.py: attention
counted) against the GPU's rated bf16 peak, with the bf16 matmul rate it reaches beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

from vanilla_transformer.training.compute import training_sdpa_backends

from .common import (Timer, attention_kernels, by_length, model_config, operator_profile, pairs, peak_rss_mb,
                     reset_peak_rss, summary, token_batch)
from .mfu import mfu, model_matmul_rate, step_products, training_flops

CONTENDERS = ("ours", "marian")
PROFILED_STEPS = 3


def precisions(device: str) -> list[str]:
    """The precisions the training loop would take here: bf16 autocast on a GPU; fp32 on a CPU, and bf16
    autocast too where it multiplies bf16 in hardware."""
    from vanilla_transformer.training.compute import cpu_computes_bf16

    if torch.device(device).type == "cuda":
        return ["bf16"]
    return ["fp32", "bf16"] if cpu_computes_bf16() else ["fp32"]


def _config(config_dict: dict):
    from vanilla_transformer import VanillaTransformerConfig

    return VanillaTransformerConfig(**config_dict)


def _build(contender: str, config_dict: dict):
    from transformers import MarianMTModel

    from vanilla_transformer import VanillaTransformerForConditionalGeneration
    from vanilla_transformer.export.marian import marian_config

    config = _config(config_dict)
    torch.manual_seed(0)
    if contender == "ours":
        return VanillaTransformerForConditionalGeneration(config)
    return MarianMTModel(marian_config(config))


def worker(spec: dict) -> dict:
    """One contender's training loop, in a fresh process, in `spec["precision"]` ("fp32", or "bf16" autocast).
    Returns its step times and memory; with `loop_attention`, on the attention implementation the training loop
    would choose; with `diagnostics`, also the matmul rate of the step's products and a profile by operator."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    batch = {name: tensor.to(device) for name, tensor in torch.load(spec["batch"]).items()}
    rss_before_model = reset_peak_rss()  # the interpreter with torch and transformers imported, and the batch
    model = _build(spec["contender"], spec["config"]).to(device).train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    bf16 = spec["precision"] == "bf16"
    # Ours as the training loop runs it (on a GPU, sdpa kept off cuDNN); Marian as transformers runs it.
    kernels = (lambda: training_sdpa_backends(device)) if spec["contender"] == "ours" else contextlib.nullcontext
    with kernels():
        attention_seconds = _choose_attention(model, batch, spec["device"], bf16) if spec.get("loop_attention") else {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), kernels():
            return model(**batch).loss

    def step():
        forward().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(spec["warmup"]):
        step()
    times = []
    for _ in range(spec["steps"]):
        with Timer(device) as timer:
            step()
        times.append(timer.seconds)
    result = {
        "step_seconds": times,
        "target_tokens": int((batch["labels"] != -100).sum()),
        "source_tokens": int(batch["attention_mask"].sum()),
        "parameters": sum(p.numel() for p in parameters),
        "flops_per_step": training_flops(_config(spec["config"]), batch),  # the same shapes for both contenders
        "peak_rss_mb": peak_rss_mb(),
        "rss_before_model_mb": rss_before_model,
    }
    if cuda:
        result["peak_gpu_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    with torch.no_grad():
        result["attention_kernels"] = attention_kernels(forward)
    if spec.get("loop_attention"):
        result["attention_seconds"] = attention_seconds
        result["attention_chosen"] = model.config._attn_implementation  # the margin may keep sdpa in a near tie
    if spec.get("diagnostics"):
        products = step_products(_config(spec["config"]), batch)
        result["matmul_flops_per_s"] = model_matmul_rate(products, spec["device"], torch.bfloat16 if bf16 else torch.float32)
        if not cuda:  # self CPU time is the step's time only where the CPU computes it
            result["profile"] = operator_profile(step, PROFILED_STEPS)
    return result


def _choose_attention(model, batch: dict, device: str, bf16: bool) -> dict[str, float]:
    from accelerate import Accelerator

    from vanilla_transformer.training.compute import fastest_attn_implementation

    accelerator = Accelerator(cpu=torch.device(device).type == "cpu", mixed_precision="bf16" if bf16 else "no")
    return fastest_attn_implementation(accelerator, model, batch, lambda m, b: m(**b).loss)


def _spawn(spec: dict) -> dict:
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.training", json.dumps(spec)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if completed.returncode != 0:
        raise RuntimeError(f"training worker for {spec['contender']} failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def run(tokenizer, sizes, device: str, threads: int, target_tokens: int, warmup: int, steps: int, rounds: int,
        matmul_tflops: float | None = None, rated_tflops: float | None = None) -> dict:
    # Pairs of the median length, batched as the training loop batches them: random pairs would
    # make half of every batch padding, which neither contender trains on.
    source, target = by_length(tokenizer, *pairs("train"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            config = model_config(size, tokenizer)
            batch_path = os.path.join(tmp, f"{size}.pt")
            torch.save(token_batch(tokenizer, source, target, target_tokens, start=len(source) // 2), batch_path)
            results[size] = {"config": {k: getattr(config, k) for k in (
                "d_model", "encoder_layers", "decoder_layers", "num_heads", "d_ff", "vocab_size", "dropout")},
                "precisions": {}}
            for precision in precisions(device):
                runs = {name: [] for name in CONTENDERS}
                for round_index in range(rounds):
                    order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
                    for contender in order:
                        # Ours as the training loop runs it; the matmul rate, the same for both, measured beside it.
                        ours = contender == "ours"
                        spec = dict(contender=contender, config=config.to_dict(), batch=batch_path, device=device,
                                    threads=threads, warmup=warmup, steps=steps, precision=precision,
                                    loop_attention=ours, diagnostics=ours)
                        runs[contender].append(_spawn(spec))
                results[size]["precisions"][precision] = _summarise(runs, matmul_tflops, rated_tflops)
    return results


def _summarise(runs: dict, matmul_tflops, rated_tflops) -> dict:
    # The rate of the step's own products, measured beside ours in every round, and each step's share of it.
    matmul_rates = [run["matmul_flops_per_s"] for run in runs["ours"]]
    out = {"matmul_gflops_per_s": summary([rate / 1e9 for rate in matmul_rates])}
    round_medians = {}
    for contender, worker_runs in runs.items():
        tokens = worker_runs[0]["target_tokens"]
        times = [t for run in worker_runs for t in run["step_seconds"]]
        round_medians[contender] = [summary(run["step_seconds"])["median"] for run in worker_runs]
        step = summary(times)
        entry = {
            "target_tokens_per_batch": tokens,
            "source_tokens_per_batch": worker_runs[0]["source_tokens"],
            "parameters": worker_runs[0]["parameters"],
            "step_seconds": step,
            "tokens_per_s": {"median": tokens / step["median"], "min": tokens / step["max"],
                             "max": tokens / step["min"]},
            "peak_rss_mb": max(run["peak_rss_mb"] for run in worker_runs),
            # What the model, its optimiser and activations added to the interpreter with torch imported.
            "peak_rss_above_imports_mb": max(run["peak_rss_mb"] - run["rss_before_model_mb"] for run in worker_runs),
            "attention_kernels": worker_runs[0]["attention_kernels"],
        }
        if "peak_gpu_memory_mb" in worker_runs[0]:
            entry["peak_gpu_memory_mb"] = max(run["peak_gpu_memory_mb"] for run in worker_runs)
        flops_per_second = worker_runs[0]["flops_per_step"] / step["median"]
        entry["tflops_per_s"] = flops_per_second / 1e12
        entry["share_of_matmul_rate"] = flops_per_second / statistics.median(matmul_rates)
        if rated_tflops:  # against the GPU's rated bf16 peak, and beside it against the matmul rate it reaches
            entry["mfu"] = mfu(flops_per_second, rated_tflops)
        if matmul_tflops:
            entry["mfu_of_measured_matmul"] = mfu(flops_per_second, matmul_tflops)
        if contender == "ours":  # the first round's timings, and what each round chose
            entry["attention_seconds"] = worker_runs[0]["attention_seconds"]
            entry["attention_chosen"] = [run["attention_chosen"] for run in worker_runs if run["attention_seconds"]]
            if "profile" in worker_runs[0]:
                entry["profile"] = worker_runs[0]["profile"]
        out[contender] = entry
    # Paired per round: both contenders ran back to back under the same load.
    paired = [m / o for o, m in zip(round_medians["ours"], round_medians["marian"])]
    out["speedup_vs_marian"] = summary(paired)
    memory_key = "peak_gpu_memory_mb" if "peak_gpu_memory_mb" in out["ours"] else "peak_rss_above_imports_mb"
    out["memory_ratio_vs_marian"] = out["ours"][memory_key] / out["marian"][memory_key]
    return out


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
