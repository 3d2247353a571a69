"""Six score functions inside one Transformer: which learns, how fast, what it costs, what it attends to.

    python -m benchmarks.score_functions              # all six, 400 steps each (see DEFAULT_STEPS): 66 minutes on 2 CPU cores
    python -m benchmarks.score_functions --steps 20 --score-functions scaled_dot,location --test-samples 16

The quickstart's small model (quickstart.SIZES["small"]: 4 heads, 8k joint BPE; d_model 256, 3 + 3 layers
and d_ff 1024 in the 2026-11-23 results, 2 encoder + 4 decoder layers and d_ff 512 from 2026-11-24, d_ff 256 since,
d_model 192 since docs/tuning.md K)
is trained once per score function (`attention_score`, which applies in every attention block) with the
training script on the embedded English–Spanish Bible: one tokenizer, and the same data order, seed,
schedule (250 warm-up steps, batches of 2,048 tokens) and number of steps for every model,
so that the rows compare learning per step, not per minute. For each score function:

- validation perplexity at CURVE_POINTS evenly spaced steps: the learning curve;
- test BLEU and chrF of the final weights, as the training script scores them (the whole test split,
  or its first `--test-samples` verses; beam 4, GNMT length penalty 0.6, at most source length + 50: §6.1);
- training speed and peak memory: forward + backward + Adam on one fixed batch of median-length pairs
  (TIMING_TOKENS target tokens), in a fresh process per score function (benchmarks/training.py's worker),
  so that every model is timed on the same batch and its memory is its own;
- decoding speed: the first `--decode-sentences` test verses, batches of 32, beam 4 with the GNMT penalty;
- the parameters the score function adds to the scaled_dot model (location adds W_a and has no key
  projection W^K, so it can add fewer than it holds);
- which attention kernel a training forward ran (torch's profiler): the fused `scaled_dot_product_attention`
  ("sdpa:...") or the explicit softmax path.

And a figure: the last decoder layer's cross-attention, mean of the heads, for one test verse under each
model, side by side on one colour scale (`attention_maps.plot_models`).

Writes <out>/score-functions-<date>-<device>.json and .md and the figure (default docs/score-functions.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.visualize.attention_maps import collect_attentions, plot_models
from vanilla_transformer.modeling.configuration_vanilla_transformer import ATTENTION_SCORES
from vanilla_transformer.quickstart import SIZES, training_arguments
from vanilla_transformer.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer
from vanilla_transformer.training.loop import train

from . import training as training_benchmark
from .common import by_length, environment, model_config, pairs, peak_memory_mb, summary, token_batch, write_atomically
from .decoding import ROWS, translate

# Steps, not minutes. 400 steps for all six took 66.0 minutes on 2 CPU cores (AMD EPYC, 2026-11-23): about
# 0.8-0.9 s/step for scaled_dot, dot, general, cosine and location, 3.7 s/step for additive, which builds a
# (B, H, T, S, Dh) tensor in every block (28 of the 66 minutes), and 1-2 minutes per model of validation, test
# scoring (634 verses, beam 4) and timing.
DEFAULT_STEPS = 400
CURVE_POINTS = 5  # validation perplexity every steps / CURVE_POINTS steps
TIMING_TOKENS = 2048  # target tokens of the fixed batch the training speed is measured on
TIMING_WARMUP, TIMING_STEPS = 2, 8
DECODE_BATCH = 32
DECODING = ROWS["beam 4, GNMT α 0.6"]  # the paper's search (§6.1), the training script's test scoring
FIGURE_VERSE = 2  # the test verse of the figure: "Yahweh God made garments of animal skins for Adam and ..."
SMALL = SIZES["small"]


def _parse_scores(text: str) -> list[str]:
    scores = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in scores if s not in ATTENTION_SCORES]
    if not scores or unknown or len(set(scores)) != len(scores):
        raise argparse.ArgumentTypeError(
            f"--score-functions takes a comma-separated subset of {','.join(ATTENTION_SCORES)}; got {text!r}")
    return scores


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return int(text)


def study_arguments(output_dir: Path, score: str, steps: int, tokenizer_dir: Path, test_samples: int | None,
                    on_gpu: bool, seed: int = 0):
    """The quickstart's small model and schedule, with `attention_score` set and a step count instead of minutes."""
    args = training_arguments(output_dir, minutes=15.0, size="small", on_gpu=on_gpu, seed=seed, test_samples=test_samples)
    return dataclasses.replace(
        args, max_steps=steps, time_limit=None, tokenizer=str(tokenizer_dir),
        config_overrides={**args.config_overrides, "attention_score": score},
        eval_steps=max(1, steps // CURVE_POINTS), save_steps=steps, keep_checkpoints=1, log_steps=max(1, steps // 10),
    )


def parameter_count(config) -> int:
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        return sum(p.numel() for p in VanillaTransformerForConditionalGeneration(config).parameters())


def _curve(history: list[dict]) -> list[dict]:
    """Validation perplexity by step (the final scoring repeats the last step: it is kept once)."""
    points = {entry["step"]: entry["perplexity"] for entry in history if entry["split"] == "validation"}
    return [{"step": step, "perplexity": perplexity} for step, perplexity in sorted(points.items())]


def _progress(message: str) -> None:
    print(f"[score functions {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_one(score: str, config, args, work: Path, tokenizer_dir: Path, batch_path: Path, device: str, verse: str,
            test_sources: list[str]) -> tuple[dict, object]:
    """Train, score, time and draw one score function; returns its results and its attention record."""
    started = time.perf_counter()
    train_args = study_arguments(work / score, score, args.steps, tokenizer_dir, args.test_samples, device != "cpu")
    results = train(train_args)
    trained_seconds = time.perf_counter() - started
    model = VanillaTransformerForConditionalGeneration.from_pretrained(work / score).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(work / score)

    decoded = {}

    def decode():
        decoded["outputs"], decoded["seconds"], decoded["tokens"] = translate(
            model, tokenizer, test_sources, DECODE_BATCH, DECODING)

    decode_memory = peak_memory_mb(decode, device)
    record = collect_attentions(model, tokenizer, verse)
    timing = training_benchmark._spawn(dict(
        contender="ours", config=config.to_dict(), batch=str(batch_path), device=device, threads=args.threads,
        warmup=min(TIMING_WARMUP, args.timing_steps), steps=args.timing_steps,
    ))
    step = summary(timing["step_seconds"])
    entry = {
        "curve": _curve(results["history"]),
        "validation_perplexity": results["validation_perplexity"],
        "test": {"bleu": results["bleu"], "chrf": results["chrf"], "translated": results["test"]["translated"],
                 "bleu_signature": results["sacrebleu_signature"], "chrf_signature": results["chrf_signature"]},
        "parameters": parameter_count(config),
        "train_tokens_per_s": timing["target_tokens"] / step["median"],
        "train_step_seconds": step,
        "train_peak_memory_mb": timing.get("peak_gpu_memory_mb", timing["peak_rss_mb"] - timing["rss_before_model_mb"]),
        "attention_kernels": timing["attention_kernels"],
        "fused_kernel": any(kernel.startswith("sdpa") for kernel in timing["attention_kernels"]),
        "decode_sentences_per_s": len(test_sources) / decoded["seconds"],
        "decode_tokens_per_s": decoded["tokens"] / decoded["seconds"],
        "decode_peak_memory_mb": decode_memory,
        "figure_translation": record.translation,
        # The training loop's own rate over the whole run, its validation passes included.
        "train_loop_tokens_per_s": results["tokens_per_second"],
        "train_minutes": results["train_minutes_this_session"],
        "seconds": round(time.perf_counter() - started, 1),
        "train_and_score_seconds": round(trained_seconds, 1),
    }
    _progress(f"{score}: {entry['seconds']:.0f} s; validation perplexity {entry['validation_perplexity']:.1f}, "
              f"test BLEU {entry['test']['bleu']:.2f}")
    return entry, record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.score_functions", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=_positive, default=DEFAULT_STEPS,
                        help="training steps of every model (default: %(default)s)")
    parser.add_argument("--score-functions", type=_parse_scores, default=list(ATTENTION_SCORES),
                        help=f"comma-separated subset of {','.join(ATTENTION_SCORES)} (default: all)")
    parser.add_argument("--test-samples", type=_positive, help="score the first N test verses (default: all 634)")
    parser.add_argument("--decode-sentences", type=_positive, default=128,
                        help="test verses whose decoding is timed (default: %(default)s)")
    parser.add_argument("--timing-steps", type=_positive, default=TIMING_STEPS,
                        help="timed training steps on the fixed batch (default: %(default)s)")
    parser.add_argument("--threads", type=_positive, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and Markdown")
    parser.add_argument("--figure", type=Path, default=Path("docs/score-functions.png"), help="the figure's path")
    parser.add_argument("--work-dir", type=Path,
                        help="keep the trained models in DIR/<score function> (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.work_dir and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir must be a new or empty folder; {args.work_dir} holds files")
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    report = {
        "environment": environment(device, args.threads),
        "settings": {
            "command": "python -m benchmarks.score_functions " + " ".join(argv if argv is not None else sys.argv[1:]),
            "score_functions": args.score_functions,
            "steps": args.steps,
            "curve_every": max(1, args.steps // CURVE_POINTS),
            "model": {"preset": SMALL["preset"], **SMALL["config_overrides"]},
            "max_tokens": SMALL["max_tokens"], "warmup_steps": SMALL["warmup_steps"], "lr_scale": SMALL["lr_scale"],
            "seed": 0,
            "test_samples": args.test_samples or "all",
            "decoding": {"num_beams": DECODING["num_beams"], "length_penalty": DECODING["length_penalty"],
                         "length_penalty_style": DECODING["length_penalty_style"], "batch_size": DECODE_BATCH,
                         "sentences": args.decode_sentences},
            "timing": {"target_tokens": TIMING_TOKENS, "warmup": min(TIMING_WARMUP, args.timing_steps),
                       "steps": args.timing_steps},
        },
    }
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work_dir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        tokenizer_dir = work / "tokenizer"
        _progress(f"training the {DEFAULT_VOCAB_SIZE}-token tokenizer all models share")
        source, target = pairs("train")
        tokenizer = train_tokenizer(source + target, vocab_size=DEFAULT_VOCAB_SIZE, output_dir=tokenizer_dir)
        batch_path = work / "timing-batch.pt"
        ordered = by_length(tokenizer, source, target)
        torch.save(token_batch(tokenizer, *ordered, TIMING_TOKENS, start=len(source) // 2), batch_path)
        test_sources, _ = pairs("test")
        verse = test_sources[FIGURE_VERSE]
        report["settings"]["figure_verse"] = verse
        results, records = {}, {}
        baseline = parameter_count(model_config(SMALL["preset"], tokenizer, **SMALL["config_overrides"]))
        for score in args.score_functions:
            _progress(f"{score}: training {args.steps} steps")
            config = model_config(SMALL["preset"], tokenizer, **SMALL["config_overrides"], attention_score=score)
            results[score], records[score] = run_one(
                score, config, args, work, tokenizer_dir, batch_path, device, verse, test_sources[: args.decode_sentences])
            results[score]["parameters_added"] = results[score]["parameters"] - baseline
    report["results"] = results
    report["figure"] = str(plot_models(records, args.figure))
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["environment"]["load_average_end"] = os.getloadavg()
    env = report["environment"]
    stem = f"score-functions-{env['date']}-{env.get('gpu', 'cpu').replace(' ', '-').lower()}"
    json_path = write_atomically(args.out / f"{stem}.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    md_path = write_atomically(args.out / f"{stem}.md", markdown(report))
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {report['figure']}")
    return report


def markdown(report: dict) -> str:
    env, settings, results = report["environment"], report["settings"], report["results"]
    steps = [point["step"] for point in next(iter(results.values()))["curve"]]
    model = settings["model"]
    load = lambda average: ", ".join(f"{value:.2f}" for value in average)  # noqa: E731
    lines = [
        f"# Score functions, {env['date']}, {env.get('gpu') or env['cpu']}",
        "",
        f"Machine: {env['cpu']}, {env['cpu_count']} cores, {env['threads']} threads; {env['platform']}; load average "
        f"(1, 5, 15 min) {load(env['load_average_start'])} at the start, {load(env['load_average_end'])} at the end. "
        f"Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}. "
        f"`{settings['command'].strip()}` took {report['seconds'] / 60:.1f} min.",
        "",
        f"Each model: the quickstart's small Transformer (d_model {model['d_model']}, {model['encoder_layers']} + "
        f"{model['decoder_layers']} layers, {model['num_heads']} heads, d_ff {model['d_ff']}) with `attention_score` "
        f"set, in every attention block; {settings['steps']} steps of at most {settings['max_tokens']} tokens on the "
        f"embedded en-es Bible, {settings['warmup_steps']} warm-up steps, lr scale {settings['lr_scale']}, seed "
        f"{settings['seed']}, one tokenizer: the same data in the same order for all. Validation perplexity every "
        f"{settings['curve_every']} steps; test BLEU and chrF (sacrebleu) of the final weights on "
        f"{settings['test_samples']} test verses, beam 4, GNMT length penalty 0.6. Training tokens/s: target tokens "
        f"per second of forward + backward + Adam on one fixed batch of {settings['timing']['target_tokens']} target "
        f"tokens (median of {settings['timing']['steps']} steps, a fresh process per model); its peak memory is what "
        f"the model, optimiser and activations added to the process. Decoding: the first "
        f"{settings['decoding']['sentences']} test verses, batches of {settings['decoding']['batch_size']}, beam 4 GNMT. "
        "Parameters added: the model's count minus the scaled_dot model's. Fused kernel: whether a training forward ran "
        "torch's `scaled_dot_product_attention` (the profiler's op names) rather than the explicit softmax.",
        "",
        "| score function | " + " | ".join(f"val. ppl @{step}" for step in steps)
        + " | test BLEU | test chrF | train tokens/s | decode sentences/s | train peak memory (MB) "
          "| parameters added | fused kernel |",
        "|---|" + "---:|" * len(steps) + "---:|---:|---:|---:|---:|---:|---|",
    ]
    for score, r in results.items():
        curve = " | ".join(f"{point['perplexity']:,.1f}" for point in r["curve"])
        kernel = ("yes" if r["fused_kernel"] else "no") + f" ({', '.join(r['attention_kernels'])})"
        lines.append(
            f"| {score} | {curve} | {r['test']['bleu']:.2f} | {r['test']['chrf']:.2f} | {r['train_tokens_per_s']:,.0f} | "
            f"{r['decode_sentences_per_s']:.1f} | {r['train_peak_memory_mb']:,.0f} | {r['parameters_added']:+,} | {kernel} |")
    lines += [
        "",
        f"Figure: `{report['figure']}`, the last layer's cross-attention (mean of the heads) for the test verse "
        f"\"{settings['figure_verse']}\", each model translating it with beam 4:",
        "",
    ]
    lines += [f"- {score}: {r['figure_translation']}" for score, r in results.items()]
    lines += ["", f"sacrebleu {next(iter(results.values()))['test']['bleu_signature']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
