"""The first GPU run in one go (issue #47): `python -m benchmarks.gpu_smoke` on a CUDA machine, no network.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.gpu_smoke            # all parts
    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.gpu_smoke --skip fsdp tests   # the measurements only

It needs what `make install` puts in the venv (torch with CUDA, transformers, accelerate, datasets,
sacrebleu, pytest) and nothing from the network.

It writes `benchmarks/results/gpu-smoke-<date>-<device>.json` and `.md`, naming the device, with:

- the GPU tests (`make test-gpu`: tests/test_gpu.py and the compiled static-cache test), passed or not;
- CUDA synchronisations per training step (`torch.cuda.set_sync_debug_mode`), the training loop's step
  (`train_step` fed by `PrefetchedBatches`) beside a bare forward, backward and fused Adam step of
  the same model and batch: what the loop adds is the difference;
- target tokens/s of the base model through the loop's step in fp32 (TF32 matmuls) and in bf16 autocast,
  one after the other in this process, with MFU against the device's rated peak (benchmarks/mfu.py) and
  the matmul rate measured on it beside;
- a one-GPU FSDP2 run of `vanilla-transformer train` (accelerate_configs/fsdp_8gpu.yaml with one
  process): beam-search evaluation, checkpoints, `--resume` and `--average-last 2`.

`--quick` shortens every part (a check that the script runs, e.g. on a CPU with `--device cpu`: no
synchronisation counts, FSDP or GPU tests there).
"""

from __future__ import annotations

import argparse
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


def loop_step(model, pairs: list, pad_token_id: int, device: str, mixed_precision: str, max_tokens: int):
    """A callable that runs one training step as `train` runs it: the next batch from `PrefetchedBatches`
    (over `pairs`, (source ids, target ids), again and again), then `train_step`; it returns the
    step's target tokens and its batch. The Accelerator is made here, with `mixed_precision`, on `device`."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    import datasets

    from vanilla_transformer.training.data import PadCollator, PrefetchedBatches, TokenBatchSampler, TokenizedSplit
    from vanilla_transformer.training.run_folder import Budget, RunState
    from vanilla_transformer.training.schedule import make_optimizer, make_scheduler
    from vanilla_transformer.training.setup import Components, prepare
    from vanilla_transformer.training.step import train_step

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=device == "cpu")
    model = model.to(accelerator.device)
    optimizer = make_optimizer(model, accelerator.device)
    scheduler = make_scheduler(optimizer, model.config.d_model, 4000)
    model, optimizer = prepare(accelerator, model, optimizer)
    rows = {"input_ids": [s for s, _ in pairs], "labels": [t for _, t in pairs],
            "length": [max(len(s), len(t)) for s, t in pairs]}
    split = TokenizedSplit(datasets.Dataset.from_dict(rows), len(pairs), 0, 0)
    sampler = TokenBatchSampler(split.lengths, max_tokens, seed=0)
    parts = Components(accelerator, model, optimizer, scheduler, checkpoint_root=Path("unused"))
    state = RunState()
    budget = Budget(progress=state)  # no limit: the caller says how many steps
    source = {"batches": None}

    def step() -> tuple[int, dict]:
        batch = next(source["batches"], None) if source["batches"] else None
        if batch is None:
            sampler.set_epoch(state.step)
            source["batches"] = PrefetchedBatches(split, sampler, PadCollator(pad_token_id), accelerator.device)
            batch = next(source["batches"])
        tokens, _ = train_step(parts, [batch], state.step, budget)
        state.count_step(1, tokens)
        return tokens, batch[0]

    return step


def bare_step(model, batch: dict, dtype):
    """One forward, backward and fused Adam step of `model` on `batch` under autocast in `dtype`, nothing else."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

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
    from vanilla_transformer.training.data import PadCollator

    pairs = _pairs(tokenizer, 400)
    step = loop_step(_model("tiny", tokenizer), pairs, tokenizer.pad_token_id, device, "bf16", 2048)
    for _ in range(3):  # the first steps allocate and initialise
        step()
    loop = synchronisations_per_call(step, steps)
    bare_model = _model("tiny", tokenizer).to(device).train()
    batch = {k: v.to(device) for k, v in PadCollator(tokenizer.pad_token_id)(
        {"input_ids": [s for s, _ in pairs[:32]], "labels": [t for _, t in pairs[:32]]}).items()}
    bare = bare_step(bare_model, batch, torch.bfloat16)
    for _ in range(3):
        bare()
    return {"loop_step": loop, "bare_step": synchronisations_per_call(bare, steps), "steps": steps,
            "what": "CUDA synchronisations torch reports per step (set_sync_debug_mode); the loop's one event "
                    "wait for its counts' reduction is not one of them"}


def throughput(tokenizer, device: str, warmup: int, steps: int, max_tokens: int, preset: str = "base") -> dict:
    """Target tokens/s of the `preset` model through the loop's step, fp32 then bf16, with MFU."""
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    pairs = _pairs(tokenizer, 4000)
    out = {"device": name, "preset": preset, "max_tokens": max_tokens, "warmup_steps": warmup, "timed_steps": steps}
    for precision, rated in (("no", "tf32"), ("bf16", "bf16")):
        model = _model(preset, tokenizer, dropout=0.1)
        config = model.config
        step = loop_step(model, pairs, tokenizer.pad_token_id, device, precision, max_tokens)
        for _ in range(warmup):
            step()
        with Timer(device) as timer:
            done = [step() for _ in range(steps)]
        tokens = sum(count for count, _ in done)
        per_second = sum(training_flops(config, batch) for _, batch in done) / timer.seconds
        peak = rated_peak_tflops(name, rated)
        out["fp32" if precision == "no" else "bf16"] = {
            "target_tokens_per_s": tokens / timer.seconds,
            "tflops_per_s": per_second / 1e12,
            "rated_peak_tflops": peak,
            "mfu": mfu(per_second, peak),
        }
    if device.startswith("cuda"):
        out["measured_matmul_tflops"] = {"bf16": matmul_tflops(device, torch.bfloat16),
                                         "tf32": matmul_tflops(device, torch.float32)}
    return out


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
        t = report["throughput"]
        for precision in ("fp32", "bf16"):
            r = t[precision]
            mfu_text = f"{r['mfu']:.1%} of the rated {r['rated_peak_tflops']} TFLOP/s" if r["mfu"] else "no rated peak listed"
            lines += [f"- {t['preset']} model, {precision}{' (TF32 matmuls)' if precision == 'fp32' else ''}: "
                      f"{r['target_tokens_per_s']:,.0f} target tokens/s, {r['tflops_per_s']:.1f} TFLOP/s, MFU {mfu_text}"]
        if "measured_matmul_tflops" in t:
            m = t["measured_matmul_tflops"]
            lines += [f"- matmul measured: bf16 {m['bf16']:.0f} TFLOP/s, TF32 {m['tf32']:.0f} TFLOP/s"]
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
    parser.add_argument("--skip", nargs="*", default=[], choices=("tests", "synchronisations", "throughput", "fsdp"))
    args = parser.parse_args(argv)
    import transformers
    from vanilla_transformer.tokenizer import train_tokenizer
    from vanilla_transformer.corpora import load_translation_dataset

    cuda = args.device.startswith("cuda")
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
    if cuda and "tests" not in args.skip:
        report["gpu_tests"] = gpu_tests(timeout=420)
    if cuda and "synchronisations" not in args.skip:
        report["synchronisations"] = synchronisations(tokenizer, args.device, steps=5)
    if "throughput" not in args.skip:
        report["throughput"] = throughput(tokenizer, args.device, warmup=1 if args.quick else 5, steps=1 if args.quick else 20,
                                          max_tokens=1024 if args.quick else 8192, preset="tiny" if args.quick else "base")
    if cuda and "fsdp" not in args.skip:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            report["fsdp"] = fsdp_run(Path(tmp), timeout=300)
    report["seconds"] = time.perf_counter() - start
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    stem = args.output_dir / f"gpu-smoke-{report['environment']['date']}-{slug}"
    write_atomically(stem.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    write_atomically(stem.with_suffix(".md"), markdown(report))
    print(markdown(report))
    print(f"wrote {stem}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
