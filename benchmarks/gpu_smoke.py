"""The first GPU run in one go: `python -m benchmarks.gpu_smoke` on a CUDA machine, no network.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.gpu_smoke            # all parts
    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.gpu_smoke --skip fsdp tests   # the measurements only

It needs what `make install` puts in the venv (torch with CUDA, transformers, accelerate, datasets,
sacrebleu, pytest) and nothing from the network.

It writes `benchmarks/results/gpu-smoke-<date>-<device>.json` and `.md`, naming the device, with:

- the GPU tests (`make test-gpu`: tests/gpu/test_gpu.py and the compiled static-cache test), passed or not;
- CUDA synchronisations per training step (`torch.cuda.set_sync_debug_mode`), the training loop's step
  (`train_step` fed by `PrefetchedBatches`) beside a bare forward, backward and fused Adam step of
  the same model and batch: what the loop adds is the difference;
- the base and big models (`--presets`), each in fp32 (TF32 matmuls) and in bf16 autocast: the loop's step
  beside MarianMTModel's bare step of the same shape (forward, backward, fused AdamW) on the same batches,
  padded to 16 bucket shapes, one after the other in this process, with the batch the training loop takes
  on the device by default (the paper's ~25,000 tokens where they fit): target tokens/s, MFU against the
  device's rated peak (benchmarks/mfu.py), kernels per step (aten operators, benchmarks/kernels.py, and the
  kernels the profiler saw launched), host and GPU time per step from the profiler, peak memory;
- the compiled step: the first preset's bf16 loop step eager, then compiled as `train --torch-compile` compiles
  it in each of `--compile-modes`, over the batches of `--compile-shapes` shapes, with the compile time (each
  shape's first step) and the graphs compiled (one per shape is the aim), so that the mode is chosen by measurement;
- a one-GPU FSDP2 run of `vanilla-transformer train` (accelerate_configs/fsdp_8gpu.yaml with one
  process): beam-search evaluation, checkpoints, `--resume` and `--average-last 2`.

`--quick` shortens every part (a check that the script runs, e.g. on a CPU with `--device cpu`: the tiny
model on 1,024-token batches of 4 shapes; no synchronisation counts, FSDP or GPU tests there, and no compiling
unless `--compile-shapes` says so: slow on a CPU). The report is written again after each part (and each
compile mode), so that a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from datetime import date
from pathlib import Path

import torch

from .common import Timer, write_atomically
from .mfu import matmul_tflops, mfu, rated_peak_tflops, training_flops

ROOT = Path(__file__).resolve().parents[1]
# The compiled step's modes measured by default: inductor's kernels, and the same replayed as CUDA graphs; max-autotune's
# search of kernel configurations multiplies the compile time of every shape.
COMPILE_MODES = ("default", "reduce-overhead")
BATCHES_PER_SHAPE = 3  # the compiled part's batches of each shape, taken in turn: a graph is a shape's, not a batch's
ALL_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
RESULTS = ROOT / "benchmarks" / "results"


# torch's warning for each synchronising call; not its once-per-process notice that sync debug mode is a prototype,
# which would count against whichever measurement comes first.
SYNC_WARNING = "called a synchronizing CUDA operation"


def synchronisations_per_call(fn, calls: int) -> float:
    """The CUDA synchronisations torch reports (`set_sync_debug_mode("warn")`) per call of `fn`."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in caught) / calls


def token_batches(pairs: list, max_tokens: int, buckets: int):
    """`pairs` ((source ids, target ids)) as a split, one epoch of its training batches (index lists, in the
    sampler's order) and their bucket shapes (`buckets` of them; None for batches as long as their longest pair)."""
    import datasets

    from vanilla_transformer.training.batches import TokenBatchSampler, bucket_shapes
    from vanilla_transformer.training.task import TokenizedSplit

    rows = {"input_ids": [s for s, _ in pairs], "labels": [t for _, t in pairs],
            "length": [max(len(s), len(t)) for s, t in pairs]}
    split = TokenizedSplit(datasets.Dataset.from_dict(rows), len(pairs), 0, 0)
    shapes = bucket_shapes(split.lengths, max_tokens, buckets) if buckets else None
    batches = [batch.tolist() for batch in TokenBatchSampler(split.lengths, max_tokens, seed=0, shapes=shapes)
               .global_batches(0)]
    return split, batches, shapes


def loop_step(model, split, batches: list, shapes, pad_token_id: int, device: str, mixed_precision: str,
              compile_mode: str | None = None):
    """A callable that runs one training step as `train` runs it: the next of `batches` (index lists into
    `split`, again and again) from `PrefetchedBatches`, padded to `shapes`, then `train_step`; it returns the
    step's target tokens and its batch. The Accelerator is made here, with `mixed_precision`, on `device`;
    `compile_mode`: the step compiled as `train --torch-compile-mode` compiles it (training/compute.py), once per
    batch shape, each shape's first step timed as `train` times it (the callable's `compiled.seconds`)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from vanilla_transformer.training.budget import Budget
    from vanilla_transformer.training.compute import CompiledLoss, compile_timing, training_sdpa_backends
    from vanilla_transformer.training.batches import PadCollator, PrefetchedBatches
    from vanilla_transformer.training.run_state import RunState
    from vanilla_transformer.training.schedule import make_optimizer, make_scheduler
    from vanilla_transformer.training.arguments import TrainArguments
    from vanilla_transformer.training.setup import Components, prepare
    from vanilla_transformer.training.step import next_rate, train_step

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=device == "cpu")
    model = model.to(accelerator.device)
    optimizer = make_optimizer(model, accelerator.device)
    scheduler = make_scheduler(optimizer, model.config.d_model, 4000)
    model, optimizer = prepare(accelerator, model, optimizer)
    compiled = CompiledLoss(len(shapes), mode=compile_mode) if compile_mode is not None else None
    components = Components(accelerator, model, optimizer, scheduler, Path("unused"), TrainArguments(output_dir="unused"),
                            compiled=compiled)
    state = RunState()
    budget = Budget(state=state)  # no limit: the caller says how many steps
    source = {"batches": None}

    def step() -> tuple[int, dict]:
        batch = next(source["batches"], None) if source["batches"] else None
        if batch is None:
            source["batches"] = PrefetchedBatches(split, batches, PadCollator(pad_token_id, shapes), accelerator.device)
            batch = next(source["batches"])
        with (training_sdpa_backends(accelerator.device),
              compile_timing(components.compiled, [batch], accelerator.device)):
            done = train_step(components, [batch], state.step, budget)  # as the training loop runs every step
        next_rate(components, done)
        state.count_step(1, done.tokens)
        return done.tokens, batch[0]

    step.compiled, step.losses = components.compiled, components.losses
    return step


def marian_model(config, device: str):
    """MarianMTModel of `config`'s shape (export/marian.py's `marian_config`), on sdpa as ours, seeded alike."""
    from transformers import MarianMTModel

    from vanilla_transformer.export.marian import marian_config

    torch.manual_seed(0)
    model = MarianMTModel(marian_config(config)).to(device).train()
    model.set_attn_implementation("sdpa")
    return model


def bare_step(model, batches: list, dtype):
    """A callable: one forward, backward and fused AdamW step (the paper's betas) of `model` on the next of
    `batches` (on the device, again and again) under autocast in `dtype`, nothing else; it returns the step's
    target tokens and its batch, as `loop_step`'s does."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    device_type = next(model.parameters()).device.type
    position = {"next": 0}

    def step() -> tuple[int, dict]:
        batch = batches[position["next"] % len(batches)]
        position["next"] += 1
        with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return int((batch["labels"] != -100).sum()), batch

    return step


def _pairs(tokenizer, count: int) -> list:
    from vanilla_transformer.corpora import load_translation_dataset

    train = load_translation_dataset("bible-en-es")["train"].select(range(count))
    source = tokenizer([row["translation"]["en"] for row in train])["input_ids"]
    target = tokenizer([row["translation"]["es"] for row in train])["input_ids"]
    return [(s[:128], t[:128]) for s, t in zip(source, target)]


def _model(preset: str, tokenizer, **overrides):
    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    torch.manual_seed(0)
    config = VanillaTransformerConfig.from_preset(
        preset, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **overrides,
    )
    return VanillaTransformerForConditionalGeneration(config)


def synchronisations(tokenizer, device: str, steps: int) -> dict:
    """Synchronisations per step of the loop's bf16 step and of a bare step of the same model and batch."""
    from vanilla_transformer.training.batches import PadCollator

    pairs = _pairs(tokenizer, 400)
    split, batches, shapes = token_batches(pairs, 2048, buckets=0)
    step = loop_step(_model("tiny", tokenizer), split, batches, shapes, tokenizer.pad_token_id, device, "bf16")
    for _ in range(3):  # the first steps allocate and initialise
        step()
    loop = synchronisations_per_call(step, steps)
    bare_model = _model("tiny", tokenizer).to(device).train()
    batch = {k: v.to(device) for k, v in PadCollator(tokenizer.pad_token_id)(
        {"input_ids": [s for s, _ in pairs[:32]], "labels": [t for _, t in pairs[:32]]}).items()}
    bare = bare_step(bare_model, [batch], torch.bfloat16)
    for _ in range(3):
        bare()
    return {"loop_step": loop, "bare_step": synchronisations_per_call(bare, steps), "steps": steps,
            "what": "CUDA synchronisations torch reports per step (set_sync_debug_mode); the loop's one event "
                    "wait for its counts' reduction is not one of them"}


def profiled(step, steps: int, cuda: bool) -> dict:
    """Per step, from torch's profiler over `steps` calls: the host's time in operators (their self CPU time),
    the GPU's time in kernels and the kernels launched (None off a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"host_ms": sum(e.self_cpu_time_total for e in events) / steps / 1000,
            "gpu_ms": sum(e.self_device_time_total for e in on_gpu) / steps / 1000 if cuda else None,
            "launched_kernels": sum(e.count for e in on_gpu) / steps if cuda else None}


def measure(step, config, device: str, rated_peak, warmup: int, steps: int, compiled: bool = False) -> dict:
    """Tokens/s, MFU, kernels, profile and peak memory of `step` (a `loop_step` or `bare_step`) after `warmup`
    calls (a `compiled` step compiles in them)."""
    from .kernels import count_kernels

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step()
    with Timer(device) as timer:
        done = [step() for _ in range(steps)]
    flops_per_s = sum(training_flops(config, batch) for _, batch in done) / timer.seconds
    kernels = None if compiled else count_kernels(step)  # aten operators; a compiled graph runs its own kernels
    return {
        "target_tokens_per_s": sum(tokens for tokens, _ in done) / timer.seconds,
        "tflops_per_s": flops_per_s / 1e12,
        "rated_peak_tflops": rated_peak,
        "mfu": mfu(flops_per_s, rated_peak),
        "step_ms": 1000 * timer.seconds / steps,
        "kernels_per_step": None if kernels is None else kernels.total,
        "casts_per_step": None if kernels is None else kernels.casts,
        **profiled(step, min(steps, 3), cuda),
        "compile_seconds": None,  # a compiled step's: `compiled_runs`
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    }


def preset_batches(preset: str, tokenizer, pairs: list, device: str, max_tokens: int | None, buckets: int):
    """`preset`'s config, its batch's tokens (on a GPU by default the training loop's: `gpu_batch`), and one epoch of
    `pairs` in batches padded to `buckets` shapes: (config, max_tokens, split, index lists, shapes, batches on
    `device`)."""
    from vanilla_transformer.training.batches import PadCollator
    from vanilla_transformer.training.batches import gpu_batch

    probe = _model(preset, tokenizer, dropout=0.1)
    config, parameters = probe.config, sum(p.numel() for p in probe.parameters())
    del probe
    tokens = max_tokens
    if tokens is None:
        memory = torch.cuda.get_device_properties(device).total_memory
        tokens = gpu_batch(memory, config, parameters, 1, 128, accumulation=1)[0]
    split, batches, shapes = token_batches(pairs, tokens, buckets)
    collate = PadCollator(tokenizer.pad_token_id, shapes)
    ready = [{k: v.to(device) for k, v in collate(split.dataset[b]).items()} for b in batches]
    return config, tokens, split, batches, shapes, ready


def side_by_side(tokenizer, device: str, presets: list, warmup: int, steps: int, buckets: int,
                 max_tokens: int | None = None) -> dict:
    """Each preset in TF32 and bf16: the loop's step (`loop_step`) beside MarianMTModel's bare step of the same
    shape on the same batches (bucketed, so that both see `buckets` shapes at most), one after the other; on a
    GPU `max_tokens` is the training loop's default there (`gpu_batch`: the paper's ~25,000 tokens a step if
    they fit).
    On a GPU, the rate of a plain matmul is measured after them."""
    cuda = device.startswith("cuda")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    pairs = _pairs(tokenizer, 8000)
    out = {"device": name, "warmup_steps": warmup, "timed_steps": steps, "buckets": buckets, "presets": {}}
    for preset in presets:
        config, tokens, split, batches, shapes, ready = preset_batches(preset, tokenizer, pairs, device, max_tokens,
                                                                       buckets)
        result = out["presets"][preset] = {"max_tokens": tokens, "shapes": shapes, "batches": len(batches)}
        for precision, mixed, dtype in (("tf32", "no", torch.float32), ("bf16", "bf16", torch.bfloat16)):
            peak = rated_peak_tflops(name, precision)
            ours = loop_step(_model(preset, tokenizer, dropout=0.1), split, batches, shapes, tokenizer.pad_token_id,
                             device, mixed)
            runs = {"ours": measure(ours, config, device, peak, warmup, steps)}
            del ours
            runs["marian"] = measure(bare_step(marian_model(config, device), ready, dtype), config, device, peak,
                                     warmup, steps)
            runs["speedup_vs_marian"] = runs["ours"]["target_tokens_per_s"] / runs["marian"]["target_tokens_per_s"]
            result[precision] = runs
            gc.collect()  # the steps' models and optimisers, before the next one's peak memory is measured
            if cuda:
                torch.cuda.empty_cache()
        result["bf16_over_tf32"] = result["bf16"]["ours"]["target_tokens_per_s"] / result["tf32"]["ours"]["target_tokens_per_s"]
    if cuda:
        out["measured_matmul_tflops"] = {"bf16": matmul_tflops(device, torch.bfloat16),
                                         "tf32": matmul_tflops(device, torch.float32)}
    return out


def compiled_steps(tokenizer, device: str, preset: str, steps: int, buckets: int, max_tokens: int | None,
                   compile_shapes: int, modes: tuple, out: dict, save) -> None:
    """`preset`'s bf16 loop step over BATCHES_PER_SHAPE batches of each of the first `compile_shapes` of `buckets`
    shapes, the shapes in turn: eager, then compiled as `train --torch-compile` compiles it in each of `modes`, into
    `out` (saved after each). Without dropout, from the same weights: the first pass over the batches (each shape
    compiles in it) is also each step's loss, against the eager step's (`loss_vs_eager`: the largest relative
    difference); then a warm-up step and the timed ones."""
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    config, tokens, split, batches, shapes, ready = preset_batches(preset, tokenizer, _pairs(tokenizer, 8000), device,
                                                                   max_tokens, buckets)
    first = list(dict.fromkeys(tuple(b["input_ids"].shape) for b in ready))[:compile_shapes]
    chosen = [[b for b, r in zip(batches, ready) if tuple(r["input_ids"].shape) == shape][:BATCHES_PER_SHAPE]
              for shape in first]
    chosen = [b for pair in zip(*chosen) for b in pair]  # the shapes in turn
    out.update(device=name, preset=preset, max_tokens=tokens, shapes=[list(s) for s in first], batches=len(chosen),
               timed_steps=steps, runs={})
    peak = rated_peak_tflops(name, "bf16")
    for mode in ("eager", *modes):
        torch._dynamo.reset()  # each mode compiles afresh, within its own limit of graphs
        step = loop_step(_model(preset, tokenizer, dropout=0.0), split, chosen, shapes, tokenizer.pad_token_id,
                         device, "bf16", compile_mode=None if mode == "eager" else mode)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        losses = []
        for number in range(len(chosen)):
            step()
            losses.append(step.losses.read(number)[0])
        measured = {"losses": losses, **measure(step, config, device, peak, 1, steps, compiled=mode != "eager")}
        if mode != "eager":  # compile time as `train` logs it: each new shape's first step
            eager = out["runs"]["eager"]["losses"]
            measured.update(compile_seconds=step.compiled.seconds,
                            graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
                            loss_vs_eager=max(abs(a - b) / abs(b) for a, b in zip(losses, eager)))
        out["runs"][mode] = measured
        del step
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        save()


def compiled_table(c: dict) -> list[str]:
    lines = [f"The loop's bf16 step of the {c['preset']} model on {c['device']}, eager and compiled (`train "
             f"--torch-compile`), over {c['batches']} batches of {len(c['shapes'])} shapes ({c['max_tokens']:,} tokens): "
             f"{c['timed_steps']} steps after one pass over them; compile: each shape's first step, as `train` logs it; "
             "loss vs eager: the largest relative difference of the first pass's losses (no dropout, same weights).",
             "", "| step | target tokens/s | MFU | host ms | GPU ms | step ms | compile s | graphs | loss vs eager | "
             "peak GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, r in c["runs"].items():
        lines.append(f"| {mode} | {r['target_tokens_per_s']:,.0f} | {_number(r['mfu'], '.1%')} | {r['host_ms']:.1f} | "
                     f"{_number(r['gpu_ms'], '.1f')} | {r['step_ms']:.1f} | {_number(r['compile_seconds'], '.1f')} | "
                     f"{r.get('graphs', '-')} | {_number(r.get('loss_vs_eager'), '.1e')} | "
                     f"{_number(r['peak_memory_gib'], '.1f')} |")
    return lines


def run_command(command: list, timeout: int, env=None) -> dict:
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, output = None, f"timed out after {timeout} s: {(err.stdout or '')[-2000:]}"
    return {"command": " ".join(map(str, command)), "returncode": code, "seconds": round(time.perf_counter() - start, 1),
            "output_tail": output[-4000:]}


def gpu_tests(timeout: int) -> dict:
    """`make test-gpu` with this Python; where there is no make, the same tests (the Makefile's GPU_TESTS)."""
    if shutil.which("make"):
        command = ["make", "test-gpu", f"GPU_PYTHON={sys.executable}"]
    else:
        tests = re.search(r"^GPU_TESTS = (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1).split()
        command = [sys.executable, "-m", "pytest", "-q", *tests]
    result = run_command(command, timeout)
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?)\s*=*$", result["output_tail"], re.MULTILINE)
    return {**result, "summary": summary[-1] if summary else None}


def fsdp_run(folder: Path, timeout: int) -> dict:
    """`train` under FSDP2 on one GPU: 4 steps with beam-search evaluation and checkpoints, then --resume to 6
    with --average-last 2; the second run's results."""
    data = folder / "data"
    from vanilla_transformer.corpora import load_translation_dataset

    corpus = load_translation_dataset("bible-en-es")
    data.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 2000), ("validation", 16), ("test", 8)):
        corpus[split].select(range(n)).to_json(data / f"{split}.jsonl", force_ascii=False)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "accelerate_configs" / "fsdp_8gpu.yaml"), "--num_processes", "1", "-m", "vanilla_transformer.cli",
              "train", "--dataset", str(data), "--output-dir", str(folder / "out"), "--vocab-size", "1000",
              "--max-tokens", "2048", "--warmup-steps", "4", "--eval-steps", "2", "--eval-samples", "8",
              "--num-beams", "4", "--save-steps", "2", "--keep-checkpoints", "3", "--average-last", "2"]
    first = run_command([*launch, "--max-steps", "4"], timeout)
    second = run_command([*launch, "--max-steps", "6", "--resume"], timeout) if first["returncode"] == 0 else None
    results = folder / "out" / "results.json"
    summary = None
    if second and second["returncode"] == 0 and results.is_file():
        saved = json.loads(results.read_text())
        summary = {k: saved.get(k) for k in ("steps", "averaged_checkpoints", "bleu", "validation_loss", "replica_checksums")}
    return {"first": first, "resumed": second, "results": summary}


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def throughput_table(t: dict) -> list[str]:
    """The side-by-side measurements as a table, one row per preset, precision and contender, and their ratios."""
    lines = [f"Target tokens/s on {t['device']}: {t['timed_steps']} steps after {t['warmup_steps']}, batches padded to "
             f"at most {t['buckets']} shapes; MFU against the rated peak; kernels: aten operators per step "
             "(benchmarks/kernels.py) and, on a GPU, kernels launched (profiler); host: self CPU time of the "
             "operators; compile: each shape's first step, as `train --torch-compile` logs it; ours-N-shapes: "
             "the eager step on the batches the compiled ones take.", "",
             "| model | precision | step | max tokens | target tokens/s | MFU | kernels (aten / launched) | casts | "
             "host ms | GPU ms | step ms | compile s | peak GiB |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = []
    for preset, result in t["presets"].items():
        for precision in ("tf32", "bf16"):
            for name, r in result[precision].items():
                if name == "speedup_vs_marian":
                    continue
                kernels = f"{_number(r['kernels_per_step'], ',')} / {_number(r['launched_kernels'], ',.0f')}"
                lines.append(
                    f"| {preset} | {precision} | {name} | {result['max_tokens']:,} | {r['target_tokens_per_s']:,.0f} | "
                    f"{_number(r['mfu'], '.1%')} | {kernels} | {_number(r['casts_per_step'], ',')} | "
                    f"{r['host_ms']:.1f} | {_number(r['gpu_ms'], '.1f')} | {r['step_ms']:.1f} | "
                    f"{_number(r['compile_seconds'], '.1f')} | {_number(r['peak_memory_gib'], '.1f')} |")
            ratios.append(f"{preset} {precision}: ours / Marian {result[precision]['speedup_vs_marian']:.2f}")
        ratios.append(f"{preset}: bf16 / TF32 (ours) {result['bf16_over_tf32']:.2f}")
    lines += ["", "; ".join(ratios) + "."]
    if "measured_matmul_tflops" in t:
        m = t["measured_matmul_tflops"]
        lines += [f"Matmul measured: bf16 {m['bf16']:.0f} TFLOP/s, TF32 {m['tf32']:.0f} TFLOP/s."]
    return lines


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU smoke run, {env['date']}, {env['device']}", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, transformers {env['transformers']}; "
             f"run took {report['seconds']:.0f} s" + (" (--quick: numbers meaningless)" if report["quick"] else "") + ".", ""]
    if "gpu_tests" in report:
        tests = report["gpu_tests"]
        lines += [f"- `make test-gpu`: {'passed' if tests['returncode'] == 0 else 'FAILED'} ({tests['summary']})"]
    if "synchronisations" in report:
        s = report["synchronisations"]
        lines += [f"- CUDA synchronisations per step: the loop's {s['loop_step']:g}, a bare step's {s['bare_step']:g}"]
    if "throughput" in report:
        lines += ["", *throughput_table(report["throughput"]), ""]
    if report.get("compiled", {}).get("runs"):
        lines += ["", *compiled_table(report["compiled"]), ""]
    if "fsdp" in report:
        f = report["fsdp"]
        ok = f["resumed"] is not None and f["resumed"]["returncode"] == 0
        lines += [f"- FSDP2 on one GPU (train, --resume, --average-last 2): {'passed' if ok else 'FAILED'}"
                  + (f" {f['results']}" if f["results"] else "")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output-dir", type=Path, default=RESULTS, help="where the report goes (default: %(default)s)")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=("tests", "synchronisations", "throughput", "compiled", "fsdp"))
    parser.add_argument("--presets", nargs="+", default=["base", "big"], choices=("tiny", "small", "base", "big"),
                        help="the models measured side by side (default: %(default)s; tiny with --quick)")
    parser.add_argument("--compile-shapes", type=int, default=None, metavar="N",
                        help="the compiled part: the first preset's bf16 step eager and compiled (--torch-compile), "
                        "over the batches of N shapes (0: none; default: 2 on a GPU, 0 elsewhere)")
    parser.add_argument("--compile-modes", nargs="+", default=list(COMPILE_MODES), choices=ALL_COMPILE_MODES,
                        help="inductor's modes the step is compiled in, one after the other (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.compile_shapes is not None and args.compile_shapes < 0:
        parser.error(f"--compile-shapes: expected a non-negative integer; got {args.compile_shapes}")
    import transformers
    from vanilla_transformer.tokenizer import train_tokenizer
    from vanilla_transformer.corpora import load_translation_dataset

    cuda = args.device.startswith("cuda")
    compile_shapes = args.compile_shapes if args.compile_shapes is not None else 2 if cuda else 0
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (use --device cpu --quick to check the script)")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as `train` sets it
    start = time.perf_counter()
    device_name = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    report = {"environment": {"date": date.today().isoformat(), "device": device_name, "torch": torch.__version__,
                              "cuda": torch.version.cuda, "transformers": transformers.__version__},
              "quick": args.quick}
    train = load_translation_dataset("bible-en-es")["train"].select(range(4000))
    tokenizer = train_tokenizer(train, languages=["en", "es"], vocab_size=1000 if args.quick else 8000)
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    stem = args.output_dir / f"gpu-smoke-{report['environment']['date']}-{slug}"

    def save() -> None:  # after each part: a run stopped by a time limit keeps what it measured
        report["seconds"] = time.perf_counter() - start
        write_atomically(stem.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
        write_atomically(stem.with_suffix(".md"), markdown(report))

    if cuda and "tests" not in args.skip:
        report["gpu_tests"] = gpu_tests(timeout=420)
        save()
    if cuda and "synchronisations" not in args.skip:
        report["synchronisations"] = synchronisations(tokenizer, args.device, steps=5)
        save()
    if "throughput" not in args.skip:
        for preset in ["tiny"] if args.quick else args.presets:
            measured = side_by_side(
                tokenizer, args.device, [preset], warmup=1 if args.quick else 3, steps=1 if args.quick else 10,
                buckets=4 if args.quick else 16, max_tokens=1024 if args.quick or not cuda else None)
            if "throughput" in report:
                report["throughput"]["presets"].update(measured["presets"])
            else:
                report["throughput"] = measured
            save()
    if compile_shapes and "compiled" not in args.skip:
        report["compiled"] = {}
        compiled_steps(tokenizer, args.device, "tiny" if args.quick else args.presets[0], steps=1 if args.quick else 10,
                       buckets=4 if args.quick else 16, max_tokens=1024 if args.quick or not cuda else None,
                       compile_shapes=compile_shapes, modes=tuple(args.compile_modes), out=report["compiled"], save=save)
    if cuda and "fsdp" not in args.skip:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            report["fsdp"] = fsdp_run(Path(tmp), timeout=300)
        save()
    save()
    print(markdown(report))
    print(f"wrote {stem}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
