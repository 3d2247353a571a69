"""Side-by-side benchmarks in one run: ours against the implementations people would otherwise use.

    python -m benchmarks                      # tiny,base on CPU; base,big on a GPU
    python -m benchmarks --sizes tiny --quick # the CI smoke run: seconds, numbers meaningless
    python -m benchmarks --out DIR            # DIR/benchmarks-<date>-<device>[-<run>].{json,md}
    python -m benchmarks --docs-from REPORT.json   # only docs/benchmarks.md, from a report
    python -m benchmarks --sizes none --generation-model runs/quickstart   # a trained model's generation only

Training: ours vs transformers' MarianMTModel of the same shape (benchmarks/training.py).
Generation: ours vs MarianMTModel and CTranslate2 with the same weights (benchmarks/generation.py).
Tokenizer: benchmarks/tokenizer.py. A full run (not --quick) also writes docs/benchmarks.md from its
report (`render_docs`). Ratios are measured in the same run, contenders interleaved,
so they hold under a changing machine load; absolute numbers do not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import generation, tokenizer as tokenizer_benchmark, training
from .common import benchmark_tokenizer, environment, write_atomically
from .mfu import matmul_tflops, rated_peak_tflops

# Per size and device: target tokens per training batch, test sentences generated, and training
# steps before generating. On the CPU there is no time for training that changes the outputs (200
# steps of tiny still repeat one phrase), so the weights stay random and every sentence decodes to
# the length cap: a fixed-length workload. Chosen so that `--sizes tiny,base` on 2 CPU cores takes
# under 10 minutes on a quiet machine.
SETTINGS = {
    "cpu": {
        "tiny": dict(train_tokens=2048, sentences=128, generation_train_steps=0),
        "base": dict(train_tokens=512, sentences=32, generation_train_steps=0),
        "big": dict(train_tokens=512, sentences=32, generation_train_steps=0),
    },
    "cuda": {
        "tiny": dict(train_tokens=8192, sentences=634, generation_train_steps=400),
        "base": dict(train_tokens=16384, sentences=634, generation_train_steps=400),
        "big": dict(train_tokens=16384, sentences=634, generation_train_steps=400),
    },
}
QUICK = dict(train_tokens=256, sentences=32, generation_train_steps=0)
PRECISION_NAMES = {"fp32": "fp32", "bf16": "bf16 autocast"}
# A trained model's outputs end at their own lengths; the cap only stops runaway repetition.
TRAINED = {"cpu": dict(sentences=300, max_new_tokens=128), "cuda": dict(sentences=634, max_new_tokens=128)}
TRAINED_QUICK = dict(sentences=32, max_new_tokens=32)


def _parse_sizes(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SETTINGS["cpu"]]
    if not sizes or unknown:
        raise argparse.ArgumentTypeError(f"--sizes takes a comma-separated subset of tiny,base,big, or none; got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_parse_sizes,
                        help="default: tiny,base on CPU, base,big on a GPU; none: only --generation-model")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny only, few repeats, small inputs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch and CTranslate2 threads")
    parser.add_argument("--generation-model", type=Path, metavar="DIR",
                        help="also time generation with this trained model folder (e.g. from `vanilla-transformer "
                             "train`) and its tokenizer: outputs that end at their own lengths")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and Markdown")
    parser.add_argument("--docs-from", type=Path, metavar="REPORT.json",
                        help=f"run nothing: write {DOCS_PAGE.name} in docs/ from this report (and the .md beside it)")
    args = parser.parse_args(argv)
    if args.docs_from:
        try:
            print(f"wrote {render_docs(args.docs_from)}")
        except (OSError, ValueError, KeyError) as err:
            parser.error(f"--docs-from: {err}")
        return {}
    if args.generation_model and not (args.generation_model / "config.json").is_file():
        parser.error(f"--generation-model must be a model folder with a config.json; got {args.generation_model}")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1; got {args.threads}")
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    if args.sizes == [] and not args.generation_model:
        parser.error("--sizes none leaves nothing to run without --generation-model")
    sizes = ["tiny"] if args.quick else args.sizes if args.sizes is not None else (
        ["base", "big"] if kind == "cuda" else ["tiny", "base"])
    if args.quick and args.sizes and args.sizes != ["tiny"]:
        parser.error("--quick runs the tiny size only")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    repeats = dict(warmup=1, steps=2, rounds=1, generation_repeats=1, max_new_tokens=16) if args.quick else dict(
        warmup=3, steps=8, rounds=3, generation_repeats=3, max_new_tokens=32 if kind == "cpu" else 64
    )
    vocab_size, tokenizer_pairs = (1000, 2000) if args.quick else (8000, None)
    tokenizer = benchmark_tokenizer(vocab_size, tokenizer_pairs)
    report = {
        "environment": environment(args.device, args.threads),
        "settings": {
            "sizes": sizes,
            "quick": args.quick,
            "vocab_size": len(tokenizer),
            "per_size": {size: QUICK if args.quick else SETTINGS[kind][size] for size in sizes},
            "generation_model": str(args.generation_model) if args.generation_model else None,
            **repeats,
            "training_precision": " and ".join(PRECISION_NAMES[p] for p in training.precisions(args.device)),
            "generation_precision": "bf16 (agreement checked in fp32)" if kind == "cuda" else "fp32",
            "generation_batch_size": generation.BATCH_SIZE,
            "length_penalty": generation.LENGTH_PENALTY,
        },
    }
    if kind == "cuda":
        report["environment"]["matmul_bf16_tflops"] = matmul_tflops(args.device)
        report["environment"]["rated_bf16_tflops"] = rated_peak_tflops(torch.cuda.get_device_name(args.device), "bf16")

    report["training"], report["generation"], report["part_seconds"] = {}, {}, {}

    def timed(part, fn):
        start = time.perf_counter()
        result = fn()
        report["part_seconds"][part] = round(time.perf_counter() - start, 1)
        print(f"{part}: {report['part_seconds'][part]:.0f} s", file=sys.stderr, flush=True)  # progress
        return result

    for size in sizes:
        settings = QUICK if args.quick else SETTINGS[kind][size]
        report["training"].update(timed(f"training {size}", lambda: training.run(
            tokenizer, [size], args.device, args.threads, settings["train_tokens"], repeats["warmup"],
            repeats["steps"], repeats["rounds"], report["environment"].get("matmul_bf16_tflops"),
            report["environment"].get("rated_bf16_tflops"),
        )))
        report["generation"].update(timed(f"generation {size}", lambda: generation.run(
            tokenizer, [size], args.device, args.threads, settings["sentences"], repeats["max_new_tokens"],
            repeats["generation_repeats"], {size: settings["generation_train_steps"]},
        )))
    if args.generation_model:
        from transformers import AutoTokenizer

        trained = TRAINED_QUICK if args.quick else TRAINED[kind]
        report["settings"]["per_size"]["trained"] = trained
        report["generation"].update(timed("generation trained", lambda: generation.run(
            AutoTokenizer.from_pretrained(args.generation_model), ["trained"], args.device, args.threads,
            trained["sentences"], trained["max_new_tokens"], repeats["generation_repeats"], {},
            model_dir=str(args.generation_model),
        )))
    report["tokenizer"] = timed("tokenizer", lambda: tokenizer_benchmark.run(
        vocab_size=vocab_size, repeats=1 if args.quick else 3, train_pairs=tokenizer_pairs))
    report["seconds"] = time.perf_counter() - started
    report["environment"]["load_average_end"] = os.getloadavg()
    json_path, md_path = write_report(report, args.out)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    if not args.quick and json_path.resolve().parent == RESULTS:  # a smoke run's numbers mean nothing
        print(f"wrote {render_docs(json_path)}")
    return report


def write_report(report: dict, out: Path) -> tuple[Path, Path]:
    env = report["environment"]
    device = env.get("gpu", "cpu").replace(" ", "-").lower()
    first = f"benchmarks-{env['date']}-{device}" + ("-quick" if report["settings"]["quick"] else "")
    stem, run = first, 1  # a later run on the same day and device writes beside the first, never over it
    while (out / f"{stem}.json").exists() or (out / f"{stem}.md").exists():
        run += 1
        stem = f"{first}-{run}"
    return write_atomically(out / f"{stem}.json", json.dumps(report, indent=2) + "\n"), write_atomically(
        out / f"{stem}.md", markdown(report))


def _rate(r: dict, spec: str = ",.0f") -> str:
    return f"{r['median']:{spec}} [{r['min']:{spec}}–{r['max']:{spec}}]"


def _load(average) -> str:
    return "unknown" if average is None else ", ".join(f"{value:.2f}" for value in average)


def _ratio(r: dict) -> str:
    return f"{r['median']:.2f}× [{r['min']:.2f}–{r['max']:.2f}]"


def markdown(report: dict) -> str:
    env, settings = report["environment"], report["settings"]
    lines = [
        f"# Benchmarks, {env['date']}, {env.get('gpu') or env['cpu']}",
        "",
        f"Machine: {env['cpu']}, {env['cpu_count']} cores, {env['threads']} threads; {env['platform']}; load "
        f"average (1, 5, 15 min) {_load(env.get('load_average_start'))} at the start, "
        f"{_load(env.get('load_average_end'))} at the end. "
        f"Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"CTranslate2 {env['ctranslate2']}" + (f", CUDA {env['cuda']}, bf16 rated peak "
                                                f"{env.get('rated_bf16_tflops') or '(not listed)'} TFLOP/s, bf16 matmul "
                                                f"measured {env['matmul_bf16_tflops']:.0f} TFLOP/s" if "gpu" in env else "")
        + f". Vocabulary {settings['vocab_size']} (joint BPE, en-es). Run took {report['seconds']:.0f} s ("
        + ", ".join(f"{part} {seconds:.0f} s" for part, seconds in report["part_seconds"].items()) + ")"
        + (" (--quick: smoke run, numbers meaningless)" if settings["quick"] else "") + ".",
        "",
        f"Values are median [min–max]; ratios are paired per round (contenders interleaved). "
        f"Training: forward + backward + Adam, {settings['training_precision']}, {settings['warmup']} warm-up "
        f"and {settings['steps']} timed steps per process × {settings['rounds']} rounds, on one batch of pairs of "
        "the median length (batched by length, as the training loop does); tokens are non-padding target "
        "tokens. Memory: peak resident memory of the contender's own process above the interpreter with "
        "torch imported (CPU), or `torch.cuda.max_memory_allocated` (GPU). MFU = the step's FLOPs (weights and "
        "attention, forward and backward: benchmarks/mfu.py) per second / the GPU's rated bf16 peak; in brackets, "
        "/ the bf16 matmul rate this device reaches." + (
            " Share of matmul rate = the step's FLOPs per second / the rate measured in the same run and precision on "
            "the step's own matrix products (every weight matrix's forward product and its two gradient products, the "
            "output projection's included; their FLOPs / their time). Ours trains on the attention implementation "
            "the training loop chooses (the fastest on the batch here, forward and backward), Marian on its default."
            if any("precisions" in r for r in report["training"].values()) else ""),
        "",
        "## Training",
        "",
    ]
    lines += [
        "| size | precision | contender | tokens/batch | target tokens/s | vs Marian | share of matmul rate "
        "| peak memory (MB) | MFU | attention |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ] if report["training"] else ["Not run (`--sizes none`)."]
    for size, r in report["training"].items():
        for precision, p in _by_precision(r, settings).items():
            for name in training.CONTENDERS:
                lines.append(_training_row(size, precision, name, p))
    notes = [_training_note(size, precision, p) for size, r in report["training"].items()
             for precision, p in _by_precision(r, settings).items() if "matmul_gflops_per_s" in p]
    if notes:
        lines += ["", "Per size and precision: the matmul rate on the step's own products, the step's share of it, the "
                      "attention implementation chosen for ours (forward and backward on the batch, each timed), and "
                      f"where ours' step goes on a CPU (a profile of {training.PROFILED_STEPS} steps after the timed "
                      "ones: self CPU time by operator, as shares of the step):", "", *notes]
    lines += [
        "",
        f"## Generation (en-es test split, batch {settings['generation_batch_size']}, "
        f"max {settings['max_new_tokens']} new tokens"
        + (f" ({settings['per_size']['trained']['max_new_tokens']} for the trained model)"
           if "trained" in settings["per_size"] else "")
        + f", {settings['generation_precision']})",
        "",
        "Beam 4 uses transformers' scoring (length penalty 0.6 as |Y|^α, early stopping) for ours and Marian, "
        "and CTranslate2's search is the same (exported by `vanilla-transformer export`, and run in a process of "
        "its own, as deployed: where torch has run, it runs several times slower); ours-gnmt is our "
        "search with the GNMT penalty ((5+|Y|)/6)^α. 'agrees' is the share of sentences with the same tokens "
        "as ours in fp32; BLEU (a trained model only) is sacrebleu's on the same sentences. Peak memory is "
        "what decoding the sentences needs beyond the loaded model: resident memory (CPU) or torch's "
        "allocated memory (GPU) above the start. Rows 'ours, …' are ours with its decoding changes undone one "
        "more per row ('rows stay': our loop keeps finished sentences in the batch instead of letting them leave; "
        "'plain products': the decoder's products and the output projection on torch's default kernel (MKL on a "
        "CPU) instead of oneDNN's on the weights packed for the call, for the shapes where that is faster here; "
        "'transformers' loop': transformers' own search loop, which keeps "
        "them too), to show what each buys.",
        "",
        "| size | sentences | mode | contender | generated tokens/s | sentences/s | vs Marian | agrees | BLEU "
        "| peak memory (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, r in report["generation"].items():
        n = settings["per_size"][size]["sentences"]
        for mode, m in r["modes"].items():
            contenders = m["contenders"]
            marian_rate = contenders["marian"]["tokens_per_s"]["median"]
            for name, c in contenders.items():
                if name == "speedup_vs_marian":
                    continue
                versus = _ratio(contenders["speedup_vs_marian"]) if name == "ours" else (
                    f"{c['tokens_per_s']['median'] / marian_rate:.2f}×")
                bleu = f"{c['bleu']:.2f}" if "bleu" in c else "–"
                memory = "–" if c.get("peak_memory_mb") is None else f"{c['peak_memory_mb']:,.0f}"
                lines.append(f"| {size} | {n} | {mode} | {name} | {_rate(c['tokens_per_s'])} | "
                             f"{_rate(c['sentences_per_s'], '.1f')} | {versus} | {c['agrees_with_ours']:.1%} | {bleu} "
                             f"| {memory} |")
    lines += ["", "Generation checks (fp32, before timing):", ""]
    for size, r in report["generation"].items():
        for mode, m in r["modes"].items():
            lines.append(
                f"- {size} {mode}: ours = Marian on {m['ours_equals_marian']:.0%} of sentences; "
                f"{m['distinct_outputs']} distinct outputs, mean {m['mean_output_tokens']:.1f} tokens, "
                f"{m['ended_with_eos']:.0%} end in </s>, {m['mean_distinct_tokens_per_output']:.1f} distinct tokens "
                f"per output (weights: {r['weights']})."
            )
        kernels = r["attention_kernels"]
        lines.append(f"- {size} attention kernels in generation: ours {', '.join(kernels['ours'])}; "
                     f"Marian {', '.join(kernels['marian'])}.")
        lines.append(f"- CTranslate2 conversion: {r['ctranslate2_conversion']}.")
    tok = report["tokenizer"]
    lines += [
        "",
        "## Tokenizer",
        "",
        f"{tok['corpus']}, vocabulary {tok['vocab_size']}: trained in {tok['train_seconds']} s on "
        f"{tok['train_pairs']} pairs; encodes {tok['encode_sentences_per_s']:,} sentences/s (transformers "
        f"tokenizer, one batch), {tok['backend_encode_sentences_per_s']:,} sentences/s (Rust backend alone).",
        "",
    ]
    return "\n".join(lines)


# --- docs/benchmarks.md: the current report, for readers, generated from benchmarks/results ---

ROOT = Path(__file__).resolve().parents[1]
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
_OTHER_REPORTS = {  # the other benchmarks of this folder, each with its current report linked from the page
    "score-functions": "six attention score functions trained side by side (`python -m benchmarks.score_functions`)",
    "big-corpus": "time to the first step and peak memory on a two-million-pair corpus (`python -m benchmarks.big_corpus`)",
}


def current_report(results: Path, prefix: str) -> Path | None:
    """The newest `<prefix>-<date>-<device>[-<run>].json` in `results` (dates sort as text; then the run number)."""
    def order(path: Path) -> tuple:
        stem = path.stem[len(prefix) + 1:]
        run = stem.rsplit("-", 1)[-1]
        return stem[:10], int(run) if run.isdigit() else 1

    reports = [p for p in results.glob(f"{prefix}-*.json") if not p.stem.endswith("-quick")]
    return max(reports, key=order, default=None)


def render_docs(report_json: Path, docs: Path = DOCS_PAGE) -> Path:
    """Write `docs` from a `python -m benchmarks` report's JSON: how the numbers are measured, the report's
    tables (as `markdown` writes them), and how to reproduce them. Generated, never edited by hand."""
    report_json = Path(report_json).resolve()
    if not report_json.is_file() or report_json.parent != RESULTS:
        raise FileNotFoundError(f"no report at {report_json}; the page links reports in {RESULTS.relative_to(ROOT)}/")
    report = json.loads(report_json.read_text(encoding="utf-8"))
    body = markdown(report).partition("\n")[2]  # without its title: the file name dates the report
    results = report_json.parent

    def link(path: Path) -> str:
        return f"[`{path.relative_to(ROOT).as_posix()}`](../{path.relative_to(ROOT).as_posix()})"

    others = [f"- {text}: {link(path.with_suffix('.md') if path.with_suffix('.md').is_file() else path)}"
              for prefix, text in _OTHER_REPORTS.items() if (path := current_report(results, prefix))]
    sizes = ",".join(report["settings"]["sizes"]) or "none"
    lines = [
        "# Benchmarks",
        "",
        f"<!-- Generated by `python -m benchmarks` from {report_json.relative_to(ROOT).as_posix()}: "
        "do not edit; rerun the benchmark or `python -m benchmarks --docs-from REPORT.json`. -->",
        "",
        "## Method",
        "",
        "Each contender runs the same work in the same run, interleaved round by round, so ratios hold while "
        "the machine's load changes and absolute numbers do not. Training: ours against transformers' "
        "`MarianMTModel` of the same shape (forward, backward and Adam on one batch of the median length). "
        "Generation: ours against `MarianMTModel` and CTranslate2 with the same weights, greedy and beam 4, "
        "after checking that ours and Marian produce the same tokens. Tokenizer: training and encoding speed. "
        "The code is in `benchmarks/` (`training.py`, `generation.py`, `tokenizer.py`); each report records "
        "the machine, the versions and the load average.",
        "",
        "## Current results",  # the report's file name, linked below, dates it
        "",
        f"From {link(report_json.with_suffix('.md'))} (data: {link(report_json)}).",
        body.replace("\n## ", "\n### "),
        "## How to reproduce",
        "",
        "```bash",
        f"python -m benchmarks --sizes {sizes}{' --quick' if report['settings']['quick'] else ''}"
        f"      # writes benchmarks/results/benchmarks-<date>-<device>.{{json,md}} and this page",
        f"python -m benchmarks --docs-from {report_json.relative_to(ROOT).as_posix()}   # this page alone",
        "```",
        "",
        "`benchmarks/results/` holds dated reports, among them those the docs cite; others are in the git history.",
    ]
    if others:
        lines += ["", "## Other benchmarks", "", *others]
    return write_atomically(docs, "\n".join(lines).rstrip("\n") + "\n")


def _by_precision(r: dict, settings: dict) -> dict:
    """A size's training results by precision (a report before precisions were rows holds one, unnamed)."""
    return {PRECISION_NAMES[p]: results for p, results in r["precisions"].items()} if "precisions" in r else {
        settings["training_precision"]: r}


def _training_note(size: str, precision: str, r: dict) -> str:
    ours = r["ours"]
    text = (f"- {size}, {precision}: products at {_rate(r['matmul_gflops_per_s'])} GFLOP/s; the step at "
            f"{ours['share_of_matmul_rate']:.0%} of it (ours), {r['marian']['share_of_matmul_rate']:.0%} (Marian).")
    if ours.get("attention_chosen"):
        timings = ", ".join(f"{name} {1000 * s:.1f} ms" for name, s in ours["attention_seconds"].items())
        chosen = sorted(set(ours["attention_chosen"]))
        text += (f" Attention chosen: {', '.join(chosen)}" + (" (varied by round)" if len(chosen) > 1 else "")
                 + f", forward and backward in the first round: {timings}.")
    if "profile" in ours:
        text += " Ours' step: " + ", ".join(f"{name.removeprefix('aten::')} {share:.0%}"
                                            for name, share in ours["profile"]["shares"].items()) + "."
    return text


def _training_row(size: str, precision: str, name: str, r: dict) -> str:
    c = r[name]
    gpu = "peak_gpu_memory_mb" in c
    memory = c["peak_gpu_memory_mb"] if gpu else c["peak_rss_above_imports_mb"]
    memory_text = f"{memory:,.0f}" + (f" ({r['memory_ratio_vs_marian']:.2f}×)" if name == "ours" else "")
    versus = _ratio(r["speedup_vs_marian"]) if name == "ours" else "1"
    mfu = f"{c['mfu']:.1%}" if c.get("mfu") else "–"
    if c.get("mfu_of_measured_matmul"):
        mfu += f" ({c['mfu_of_measured_matmul']:.1%})"
    share = f"{c['share_of_matmul_rate']:.0%}" if "share_of_matmul_rate" in c else "–"
    return (f"| {size} | {precision} | {name} | {c['target_tokens_per_batch']} | {_rate(c['tokens_per_s'])} | {versus} "
            f"| {share} | {memory_text} | {mfu} | {', '.join(c['attention_kernels'])} |")


if __name__ == "__main__":
    main()
