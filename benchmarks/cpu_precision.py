"""The quickstart's training step on a CPU, by precision: what each candidate for a faster bf16 step buys.

    python -m benchmarks.cpu_precision                     # 2 threads, 2,048 target tokens, sdpa, all variants
    python -m benchmarks.cpu_precision --attention eager --tokens 2048,8192 --variants fp32,bf16-autocast

The model is the quickstart's (the "small" preset, its vocabulary of 8,000), the batch real en-es pairs of
similar length, the step forward + backward + fused Adam. Variants, each in its own process, interleaved
round by round (ABAB...) so that a change in the machine's load hits all of them:

- `fp32`: no autocast;
- `bf16-autocast`: what the training loop does where the CPU computes bf16 (weights, Adam and the loss's
  softmax in fp32; autocast casts the weights and activations for every product);
- `bf16-weights`: the model's weights and activations in bf16, Adam on fp32 master copies of the weights
  (each step copies the gradients up and the updated weights down); the loss's softmax in fp32 as ever;
- `bf16-autocast-compiled`: `bf16-autocast` on `torch.compile(model)`, its compile time reported apart.

Beside each: target tokens/s, the rate the CPU reaches on the step's own matrix products in that precision
(mfu.model_matmul_rate) and the step's share of it (FLOPs counted as mfu.training_flops counts them), a profile
by operator, the elements the step copies by cause (casts, layout, ...: counts, the same on any CPU), and the loss over the timed steps (every variant starts from the same weights and batch). The
attention implementation is fixed for all (`--attention`): the training loop times both on its first batch. It
reports numbers, not whether a variant computes the same step: a variant kept for training needs its own test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .common import (Timer, benchmark_tokenizer, by_length, copied_elements, environment, model_config,
                     operator_profile, pairs, summary, token_batch, write_atomically)
from .mfu import model_matmul_rate, step_products, training_flops

VARIANTS = ("fp32", "bf16-autocast", "bf16-weights", "bf16-autocast-compiled")
PROFILED_STEPS = 3


def worker(spec: dict) -> dict:
    """One variant's steps in this process: times, loss, matmul rate, profile."""
    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    torch.set_num_threads(spec["threads"])
    variant = spec["variant"]
    batch = torch.load(spec["batch"])
    config = VanillaTransformerConfig(**spec["config"])
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(config).train()
    model.set_attn_implementation(spec["attention"])
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = variant.startswith("bf16-autocast")
    if variant == "bf16-weights":
        masters = [p.detach().clone() for p in params]  # fp32, what Adam updates
        for m in masters:
            m.grad = torch.zeros_like(m)
        model.to(torch.bfloat16)
        optimizer = torch.optim.Adam(masters, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    else:
        optimizer = torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    forward_model = torch.compile(model) if variant.endswith("compiled") else model

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = forward_model(**batch, num_items_in_batch=1).loss
        (loss / spec["target_tokens"]).backward()
        if variant == "bf16-weights":
            with torch.no_grad():
                for p, m in zip(params, masters):
                    m.grad.copy_(p.grad)
                optimizer.step()
                for p, m in zip(params, masters):
                    p.copy_(m)
            model.zero_grad(set_to_none=True)
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach().float() / spec["target_tokens"]

    start = time.perf_counter()
    losses = [float(step())]  # the first step (a compile's time is in it)
    first_step_seconds = time.perf_counter() - start
    for _ in range(spec["warmup"]):
        losses.append(float(step()))
    times = []
    for _ in range(spec["steps"]):
        with Timer("cpu") as timer:
            losses.append(float(step()))
        times.append(timer.seconds)
    products = step_products(config, batch)
    dtype = torch.float32 if variant == "fp32" else torch.bfloat16
    return {"variant": variant, "step_seconds": times, "first_step_seconds": first_step_seconds, "losses": losses,
            "flops_per_step": training_flops(config, batch),
            "matmul_flops_per_s": model_matmul_rate(products, "cpu", dtype),
            "profile": operator_profile(step, PROFILED_STEPS), "copies": copied_elements(step)}


def _spawn(spec: dict, timeout: float) -> dict:
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_precision", "--worker", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    except subprocess.TimeoutExpired:
        return {"variant": spec["variant"], "error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"variant": spec["variant"], "error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(threads: int, token_counts: list[int], variants: list[str], attention: str, rounds: int, warmup: int,
        steps: int, timeout: float) -> dict:
    tokenizer = benchmark_tokenizer(8000)
    source, target = by_length(tokenizer, *pairs("train"))
    config = model_config("small", tokenizer)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in token_counts:
            path = os.path.join(tmp, f"{tokens}.pt")
            batch = token_batch(tokenizer, source, target, tokens, start=len(source) // 2)
            torch.save(batch, path)
            target_tokens = int((batch["labels"] != -100).sum())
            runs = {v: [] for v in variants}
            for r in range(rounds):
                for variant in (variants if r % 2 == 0 else variants[::-1]):
                    if variant.endswith("compiled") and runs[variant]:
                        continue  # one compile is enough to see what it costs and buys
                    spec = dict(variant=variant, config=config.to_dict(), batch=path, threads=threads, warmup=warmup,
                                steps=steps, attention=attention, target_tokens=target_tokens)
                    runs[variant].append(_spawn(spec, timeout))
            results[tokens] = {v: _summarise(rs, target_tokens) for v, rs in runs.items()}
    return results


def _summarise(runs: list[dict], tokens: int) -> dict:
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[0]["error"]}
    times = [t for r in good for t in r["step_seconds"]]
    median = statistics.median(times)
    rate = statistics.median(r["matmul_flops_per_s"] for r in good)
    return {"target_tokens": tokens, "tokens_per_s": tokens / median, "step_seconds": summary(times),
            "first_step_seconds": good[0]["first_step_seconds"], "gflops_per_s": good[0]["flops_per_step"] / median / 1e9,
            "matmul_gflops_per_s": rate / 1e9, "share_of_matmul_rate": good[0]["flops_per_step"] / median / rate,
            "loss_first_last": [good[0]["losses"][0], good[0]["losses"][-1]], "profile": good[0]["profile"],
            "copies": good[0]["copies"]}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# The quickstart's CPU step by precision, {env['date']}", "",
             f"CPU: {report['cpu_model']} ({report['bf16_flags'] or 'no bf16 flags'}); {env['threads']} threads of "
             f"{env['cpu_count']}; torch {torch.__version__}; attention {report['attention']}. Load average at the start: {env['load_average_start']}.", ""]
    for tokens, variants in report["results"].items():
        lines += [f"## {tokens} target tokens a step", "",
                  "| variant | tokens/s | GFLOP/s | matmul rate (GFLOP/s) | share | first step (s) | loss first → last |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for name, r in variants.items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'].splitlines()[-1][:80] if r['error'] else '?'} | | | | | |")
                continue
            lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['gflops_per_s']:.0f} | {r['matmul_gflops_per_s']:.0f} | "
                         f"{r['share_of_matmul_rate']:.0%} | {r['first_step_seconds']:.1f} | "
                         f"{r['loss_first_last'][0]:.4f} → {r['loss_first_last'][1]:.4f} |")
        lines.append("")
        for name, r in variants.items():
            if "profile" in r:
                shares = ", ".join(f"{op} {share:.0%}" for op, share in r["profile"]["shares"].items())
                lines.append(f"- {name} profile: {shares}")
        for name, r in variants.items():
            if "copies" in r:
                copies = ", ".join(f"{cause} {c['elements'] / 1e6:.1f} M ({c['calls']} calls)"
                                   for cause, c in r["copies"].items())
                lines.append(f"- {name} elements copied per step, by cause: {copies}")
        lines.append("")
    return "\n".join(lines)


def _cpu_model() -> tuple[str, list[str]]:
    from vanilla_transformer.training.compute import BF16_CPU_FLAGS, cpu_flags

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    return model, sorted(BF16_CPU_FLAGS & cpu_flags())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_precision", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", default="2048", help="comma-separated target tokens per step")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"), help="the model's attention, for all")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300, help="seconds for one variant's process")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants takes a comma-separated subset of {','.join(VARIANTS)}; got {unknown}")
    cpu_model, flags = _cpu_model()
    report = {"environment": environment("cpu", args.threads), "cpu_model": cpu_model, "bf16_flags": flags,
              "attention": args.attention,
              "results": run(args.threads, [int(t) for t in args.tokens.split(",")], variants, args.attention, args.rounds,
                             args.warmup, args.steps, args.timeout)}
    stem = args.out / (f"cpu-precision-{report['environment']['date']}-{args.threads}threads-{args.attention}-"
                       f"{args.tokens.replace(',', '-')}")
    write_atomically(stem.with_suffix(".json"), json.dumps(report, indent=1))
    write_atomically(stem.with_suffix(".md"), markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
