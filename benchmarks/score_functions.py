"""Six score functions inside one Transformer: which learns, how fast, what it costs, what it attends to.

    python -m benchmarks.score_functions              # all six, 400 steps each (see DEFAULT_STEPS): about an hour on 2 CPU cores
    python -m benchmarks.score_functions --steps 20 --score-functions scaled_dot,location --test-samples 16
    python -m benchmarks.score_functions --preset tiny --steps 100 --test-samples 16   # the tiny model: shorter
    python -m benchmarks.score_functions --append-to benchmarks/results/score-functions-DATE-cpu.json \
        --score-functions scaled_dot --variants hard,local-m,local-p,relu,sparsemax \
        --figure docs/score-functions-variants.png     # more rows in an existing report, its settings reused

The quickstart's small model (quickstart.PRESET_SETTINGS["small"], or the `--preset` named: each report records the shape it trained)
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

`--variants` crosses each score function with other attention options (VARIANTS: hard attention by
either estimator, local-m, local-p, ReLU, sparsemax), one row each. `--append-to REPORT.json` trains
only the new rows, with the report's model, schedule, steps, seed and test settings, and rewrites the
report (JSON and Markdown) with every row; each added row records its own machine, versions and command.

Writes <out>/score-functions-<date>-<device>.json and .md (or the appended report) after every row, and
the figure (default: beside the report, <report>.png) of every row whose attention the report holds: rows record
their panel (`figure_attention`) since variants were added, so a figure can be redrawn without the models.
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

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.visualize.attention_maps import AttentionRecord, collect_attentions, plot_models
from vanilla_transformer.modeling.configuration_vanilla_transformer import ATTENTION_SCORES, PRESETS
from vanilla_transformer.quickstart import PRESET_SETTINGS, training_arguments
from vanilla_transformer.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer
from vanilla_transformer.training.loop import train

from . import training as training_benchmark
from .common import by_length, environment, load_text, model_config, pairs, peak_memory_mb, summary, token_batch, write_atomically
from .decoding import ROWS, translate

# Steps, not minutes, so that every score function sees the same updates; additive, which builds a
# (B, H, T, S, Dh) tensor in every block, takes several times as long a step as the others.
DEFAULT_STEPS = 400
CURVE_POINTS = 5  # validation perplexity every steps / CURVE_POINTS steps
TIMING_TOKENS = 2048  # target tokens of the fixed batch the training speed is timed on
TIMING_WARMUP, TIMING_STEPS = 2, 8
DECODE_BATCH = 32
DECODING = ROWS["beam 4, GNMT α 0.6"]  # the paper's search (§6.1), the training script's test scoring
FIGURE_VERSE = 2  # the test verse of the figure: "Yahweh God made garments of animal skins for Adam and ..."
# Other attention options, crossed with each score function: name -> (config fields, the row's label).
VARIANTS = {
    "none": ({}, ""),
    "hard": ({"attention_hardness": "hard"}, "hard (straight-through Gumbel)"),
    "local-m": ({"local_attention": "local-m"}, "local-m (D={window})"),
    "local-p": ({"local_attention": "local-p"}, "local-p (D={window})"),
    "relu": ({"attention_normalization": "relu"}, "relu"),
    "sparsemax": ({"attention_normalization": "sparsemax"}, "sparsemax"),
}
# Options an appended row takes from the report instead: its rows must have been trained alike.
FROM_REPORT = ("steps", "test_samples", "decode_sentences", "timing_steps", "preset")


def _subset(option: str, allowed):
    def parse(text: str) -> list[str]:
        chosen = [s.strip() for s in text.split(",") if s.strip()]
        if not chosen or any(c not in allowed for c in chosen) or len(set(chosen)) != len(chosen):
            raise argparse.ArgumentTypeError(f"{option} takes a comma-separated subset of {','.join(allowed)}; got {text!r}")
        return chosen
    return parse


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return int(text)


def row_name(score: str, variant: str, config) -> str:
    """A row's name in the table: the score function, then the variant ("scaled_dot + local-m (D=8)")."""
    label = VARIANTS[variant][1].format(window=config.attention_window)
    return f"{score} + {label}" if label else score


def study_arguments(output_dir: Path, overrides: dict, settings: dict, tokenizer_dir: Path, on_gpu: bool):
    """The quickstart's schedule with the study's model (`settings["model"]`, the attention `overrides` on top),
    learning rate, batches, seed and a step count instead of minutes."""
    test_samples = None if settings["test_samples"] == "all" else settings["test_samples"]
    args = training_arguments(output_dir, minutes=15.0, preset="small", seed=settings["seed"], test_samples=test_samples)
    model = dict(settings["model"])
    steps = settings["steps"]
    return dataclasses.replace(
        args, preset=model.pop("preset"), config_overrides={**model, **overrides}, max_tokens=settings["max_tokens"],
        warmup_steps=settings["warmup_steps"], lr_scale=settings["lr_scale"], max_steps=steps, time_limit=None,
        tokenizer=str(tokenizer_dir), eval_steps=max(1, steps // CURVE_POINTS), save_steps=steps, keep_checkpoints=1,
        log_steps=max(1, steps // 10), mixed_precision="bf16" if on_gpu else "no",  # the study's runs compare in fp32 on a CPU
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


def figure_panel(record: AttentionRecord) -> dict:
    """What the figure draws of one model, kept in the report so that the figure can be redrawn without
    the model: the translation, the axes' pieces and every decoder layer's cross-attention, mean of the
    heads, one line of 4-decimal weights per query."""
    layers = record.cross_attention.mean(1).tolist()
    return {"source": record.source, "translation": record.translation, "source_pieces": record.source_pieces,
            "target_pieces": record.target_pieces,
            "cross_attention": [[" ".join(f"{w:.4f}" for w in query) for query in layer] for layer in layers]}


def panel_record(panel: dict) -> AttentionRecord:
    """An AttentionRecord holding what `plot_models` draws: the cross-attention (its one head the mean)."""
    cross = torch.tensor([[[float(w) for w in query.split()] for query in layer] for layer in panel["cross_attention"]])
    return AttentionRecord(
        source=panel["source"], translation=panel["translation"], source_ids=[], target_ids=[], source_tokens=[],
        target_tokens=[], source_pieces=panel["source_pieces"], target_pieces=panel["target_pieces"],
        encoder_attention=torch.empty(0), decoder_attention=torch.empty(0), cross_attention=cross.unsqueeze(1))


def run_one(name: str, overrides: dict, config, settings: dict, args, work: Path, tokenizer_dir: Path,
            batch_path: Path, device: str, verse: str, test_sources: list[str]) -> dict:
    """Train, score, time and draw one row (a score function and a variant); returns its results."""
    started = time.perf_counter()
    folder = work / "-".join(f"{value}" for value in overrides.values())
    results = train(study_arguments(folder, overrides, settings, tokenizer_dir, device != "cpu"))
    trained_seconds = time.perf_counter() - started
    model = VanillaTransformerForConditionalGeneration.from_pretrained(folder).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)

    decoded = {}

    def decode():
        decoded["outputs"], decoded["seconds"], decoded["tokens"] = translate(
            model, tokenizer, test_sources, DECODE_BATCH, DECODING)

    decode_memory = peak_memory_mb(decode, device)
    record = collect_attentions(model, tokenizer, verse)
    timing_steps = settings["timing"]["steps"]
    timing = training_benchmark._spawn(dict(
        contender="ours", config=config.to_dict(), batch=str(batch_path), device=device, threads=args.threads,
        warmup=min(TIMING_WARMUP, timing_steps), steps=timing_steps, precision="fp32" if device == "cpu" else "bf16",
    ))
    step = summary(timing["step_seconds"])
    entry = {
        "config": overrides,
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
        "figure_attention": figure_panel(record),
        # The training loop's own rate over the whole run, its validation passes included.
        "train_loop_tokens_per_s": results["tokens_per_second"],
        "train_minutes": results["train_minutes"],
        "seconds": round(time.perf_counter() - started, 1),
        "train_and_score_seconds": round(trained_seconds, 1),
    }
    _progress(f"{name}: {entry['seconds']:.0f} s; validation perplexity {entry['validation_perplexity']:.1f}, "
              f"test BLEU {entry['test']['bleu']:.2f}")
    return entry


def new_settings(args, command: str) -> dict:
    """The settings every row of a new report shares."""
    steps = args.steps or DEFAULT_STEPS
    timing_steps = args.timing_steps or TIMING_STEPS
    size = PRESET_SETTINGS[args.preset or "small"]
    return {
        "command": command,
        "score_functions": args.score_functions,
        "steps": steps,
        "curve_every": max(1, steps // CURVE_POINTS),
        "model": {"preset": size["preset"], **PRESETS[size["preset"]]},  # its shape, written out in the report
        "max_tokens": size["max_tokens"], "warmup_steps": size["warmup_steps"], "lr_scale": size.get("lr_scale", 1.0),
        "seed": 0,
        "test_samples": args.test_samples or "all",
        "decoding": {"num_beams": DECODING["num_beams"], "length_penalty": DECODING["length_penalty"],
                     "length_penalty_style": DECODING["length_penalty_style"], "batch_size": DECODE_BATCH,
                     "sentences": args.decode_sentences or 128},
        "timing": {"target_tokens": TIMING_TOKENS, "warmup": min(TIMING_WARMUP, timing_steps), "steps": timing_steps},
    }


def load_report(parser, path: Path, args, device: str) -> dict:
    """The report to add rows to, its rows told which figure holds their panel (older reports had one figure)."""
    try:
        report = json.loads(path.read_text())
        _, results = report["settings"], report["results"]  # a report has both
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"--append-to must name a score-functions report (JSON); {path} is not one ({error})")
    given = [f"--{option.replace('_', '-')}" for option in FROM_REPORT if getattr(args, option) is not None]
    if given:
        parser.error(f"--append-to takes the steps and test settings from the report; leave out {', '.join(given)}")
    if report["environment"]["device"] != device:
        parser.error(f"--append-to: the report was made on {report['environment']['device']}; this machine runs on {device}")
    for result in results.values():
        result.setdefault("figure", report.get("figure"))
    report.pop("figure", None)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.score_functions", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=_positive, help=f"training steps of every model (default: {DEFAULT_STEPS})")
    parser.add_argument("--score-functions", type=_subset("--score-functions", ATTENTION_SCORES),
                        default=list(ATTENTION_SCORES),
                        help=f"comma-separated subset of {','.join(ATTENTION_SCORES)} (default: all)")
    parser.add_argument("--variants", type=_subset("--variants", VARIANTS), default=["none"],
                        help=f"comma-separated subset of {','.join(VARIANTS)}, each crossed with every score function "
                             "(default: none, the plain score functions)")
    parser.add_argument("--append-to", type=Path, metavar="REPORT.json",
                        help="add the rows to this report, trained with its settings, and rewrite it with every row")
    parser.add_argument("--test-samples", type=_positive, help="score the first N test verses (default: all 634)")
    parser.add_argument("--decode-sentences", type=_positive, help="test verses whose decoding is timed (default: 128)")
    parser.add_argument("--timing-steps", type=_positive,
                        help=f"timed training steps on the fixed batch (default: {TIMING_STEPS})")
    parser.add_argument("--threads", type=_positive, default=os.cpu_count(), help="torch threads (default: all cores)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and Markdown")
    parser.add_argument("--preset", choices=list(PRESET_SETTINGS),
                        help="the quickstart's model size and schedule every row trains (default: small)")
    parser.add_argument("--figure", type=Path, help="the figure's path (default: beside the report, REPORT.png)")
    parser.add_argument("--work-dir", type=Path,
                        help="keep the trained models in DIR/<options> (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.work_dir and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir must be a new or empty folder; {args.work_dir} holds files")
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    command = "python -m benchmarks.score_functions " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.perf_counter()
    environment_now = environment(device, args.threads)
    if args.append_to:
        report = load_report(parser, args.append_to, args, device)
        json_path, md_path = args.append_to, args.append_to.with_suffix(".md")
    else:
        report = {"environment": environment_now, "settings": new_settings(args, command), "results": {}}
        stem = f"score-functions-{environment_now['date']}-{environment_now.get('gpu', 'cpu').replace(' ', '-').lower()}"
        json_path, md_path = args.out / f"{stem}.json", args.out / f"{stem}.md"
    args.figure = args.figure or json_path.with_suffix(".png")
    settings, results = report["settings"], report["results"]
    model = dict(settings["model"])
    preset = model.pop("preset")
    rows = {}  # name -> the attention options of the row
    for score in args.score_functions:
        for variant in args.variants:
            overrides = {"attention_score": score, **VARIANTS[variant][0]}
            rows[row_name(score, variant, VanillaTransformerConfig.from_preset(preset, **model, **overrides))] = overrides
    existing = [name for name in rows if name in results]
    if existing:
        parser.error(f"--append-to: the report already has the row(s) {', '.join(existing)}")
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work_dir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        tokenizer_dir = work / "tokenizer"
        _progress(f"training the {DEFAULT_VOCAB_SIZE}-token tokenizer all models share")
        source, target = pairs("train")
        tokenizer = train_tokenizer(source + target, vocab_size=DEFAULT_VOCAB_SIZE, output_dir=tokenizer_dir)
        plain = {name: r for name, r in results.items() if name in ATTENTION_SCORES}
        for name, r in plain.items():  # the report's models are the ones this tokenizer and these settings build
            rebuilt = parameter_count(model_config(preset, tokenizer, **model, attention_score=name))
            if rebuilt != r["parameters"]:
                parser.error(f"--append-to: the report's {name} model had {r['parameters']:,} parameters; its settings "
                             f"and this tokenizer build {rebuilt:,}: not the same models")
        batch_path = work / "timing-batch.pt"
        ordered = by_length(tokenizer, source, target)
        torch.save(token_batch(tokenizer, *ordered, TIMING_TOKENS, start=len(source) // 2), batch_path)
        test_sources, _ = pairs("test")
        verse = test_sources[FIGURE_VERSE]
        settings["figure_verse"] = verse
        baseline = parameter_count(model_config(preset, tokenizer, **model))
        for name, overrides in rows.items():
            _progress(f"{name}: training {settings['steps']} steps")
            config = model_config(preset, tokenizer, **model, **overrides)
            run = {**environment(device, args.threads), "command": command}
            entry = run_one(name, overrides, config, settings, args, work, tokenizer_dir, batch_path, device, verse,
                            test_sources[: settings["decoding"]["sentences"]])
            entry["parameters_added"] = entry["parameters"] - baseline
            if args.append_to:  # the row's own machine, versions and command, not the report's first run's
                entry["run"] = {**run, "load_average_end": os.getloadavg()}
            else:
                report["seconds"] = round(time.perf_counter() - started, 1)
                report["environment"]["load_average_end"] = os.getloadavg()
            results[name] = entry
            _write(report, results, args.figure, json_path, md_path)  # after every row: a long run's rows so far
    print(md_path.read_text())
    print(f"wrote {json_path}, {md_path} and {args.figure}")
    return report


def _write(report: dict, results: dict, figure: Path, json_path: Path, md_path: Path) -> None:
    """The report as it stands, after every row: the figure of every row that holds its panel, the JSON, the Markdown."""
    drawn = {name: panel_record(r["figure_attention"]) for name, r in results.items() if "figure_attention" in r}
    if drawn:
        plot_models(drawn, figure)
        for name in drawn:
            results[name]["figure"] = str(figure)
    write_atomically(json_path, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    write_atomically(md_path, markdown(report))


def markdown(report: dict) -> str:
    env, settings, results = report["environment"], report["settings"], report["results"]
    steps = [point["step"] for point in next(iter(results.values()))["curve"]]
    model = settings["model"]
    lines = [
        f"# Score functions, {env['date']}, {env.get('gpu') or env['cpu']}",
        "",
        f"Machine: {env['cpu']}, {env['cpu_count']} cores, {env['threads']} threads; {env['platform']}; load average "
        f"(1, 5, 15 min) {load_text(env['load_average_start'])} at the start, {load_text(env['load_average_end'])} at the end. "
        f"Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}. "
        f"`{settings['command'].strip()}` took {report['seconds'] / 60:.1f} min.",
        "",
        f"Each model: the quickstart's small Transformer (d_model {model['d_model']}, {model['encoder_layers']} + "
        f"{model['decoder_layers']} layers, {model['num_heads']} heads, d_ff {model['d_ff']}) with `attention_score` "
        f"set (and a row's other attention options), in every attention block; {settings['steps']} steps of at most "
        f"{settings['max_tokens']} tokens on the "
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
        "| model | " + " | ".join(f"val. ppl @{step}" for step in steps)
        + " | test BLEU | test chrF | train tokens/s | decode sentences/s | train peak memory (MB) "
          "| parameters added | fused kernel |",
        "|---|" + "---:|" * len(steps) + "---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        curve = " | ".join(f"{point['perplexity']:,.1f}" for point in r["curve"])
        kernel = ("yes" if r["fused_kernel"] else "no") + f" ({', '.join(r['attention_kernels'])})"
        lines.append(
            f"| {name} | {curve} | {r['test']['bleu']:.2f} | {r['test']['chrf']:.2f} | {r['train_tokens_per_s']:,.0f} | "
            f"{r['decode_sentences_per_s']:.1f} | {r['train_peak_memory_mb']:,.0f} | {r['parameters_added']:+,} | {kernel} |")
    added = {name: r["run"] for name, r in results.items() if "run" in r}
    if added:
        lines += ["", "Rows added to the report later (`--append-to`), with the settings above, each on its own run:", ""]
        lines += [f"- {name}: {run['date']}, {run['cpu']}, {run['threads']} threads, load average {load_text(run['load_average_start'])} "
                  f"at the start, {load_text(run['load_average_end'])} at the end; torch {run['torch']}, transformers "
                  f"{run['transformers']}; `{run['command'].strip()}`." for name, run in added.items()]
    lines += [
        "",
        f"What so short a run can show: {settings['steps']} steps of one seed is early training (the paper trains "
        "100,000), and every model is still weak. The table tells which options learn at all and how fast they start, "
        "and what each costs in speed and memory. It cannot tell which would translate best trained to the end; how "
        "far another seed or data order would move a row is not measured, so differences of a few perplexity points "
        "are no ranking; and rows added later ran on later code and library versions.",
    ]
    figures = {}
    for name, r in results.items():
        figures.setdefault(r.get("figure"), []).append(name)
    for figure, names in figures.items():
        lines += [
            "",
            f"Figure: `{figure}`, the last layer's cross-attention (mean of the heads) for the test verse "
            f"\"{settings['figure_verse']}\", each model translating it with beam 4:",
            "",
        ]
        lines += [f"- {name}: {results[name]['figure_translation']}" for name in names]
    lines += ["", f"sacrebleu {next(iter(results.values()))['test']['bleu_signature']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
