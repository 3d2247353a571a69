"""Time to the first training step, and peak memory, on a big synthetic corpus.

    python -m benchmarks.big_corpus                          # 2M pairs, two runs (the second reuses the caches)
    python -m benchmarks.big_corpus --pairs 20000 --runs 2   # a quick check that it works
    python -m benchmarks.big_corpus --pairs 200000,2000000   # memory against corpus size

The corpus is the embedded bible-en-es training pairs repeated, each copy numbered so that no two
lines are equal, up to `--pairs` pairs (a JSON-lines folder, as users' own data is). Each run is a
fresh process that calls `train` (tiny preset) on it and stops right after the first optimiser step;
it reports the seconds from the start of `train` to the end of that step, the peak resident memory
of the process and of its tokenising workers (`ru_maxrss`, which counts the mapped Arrow pages they
touched), and the anonymous memory the process holds at the first step (Linux `RssAnon`: without
mapped files). The first run trains the BPE tokenizer and fills the `Dataset.map` cache; a second
run on the same folder reads both back.

Targets: under 5 minutes to the first step on 2 cores; memory that does not grow with
the corpus beyond the length table (8 bytes a pair) and Arrow's memory-mapped files.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_corpus(folder: Path, pairs: int) -> Path:
    """`pairs` numbered copies of the embedded training pairs in folder/train.jsonl; small validation/test."""
    from vanilla_transformer.corpora import load_translation_dataset

    data = load_translation_dataset("bible-en-es")
    rows = [(r["translation"]["en"], r["translation"]["es"]) for r in data["train"]]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as f:
        for i in range(pairs):
            en, es = rows[i % len(rows)]
            copy = i // len(rows)
            f.write(json.dumps({"translation": {"en": f"{en} ({copy})", "es": f"{es} ({copy})"}}) + "\n")
    for split in ("validation", "test"):
        with open(folder / f"{split}.jsonl", "w") as f:
            for row in data[split].select(range(min(100, len(data[split])))):
                f.write(json.dumps({"translation": row["translation"]}) + "\n")
    return folder


class _FirstStep(Exception):
    pass


def measure(data: Path, output_dir: Path) -> dict:
    """In this process: `train` until the first optimiser step is done; seconds and peak memory."""
    from vanilla_transformer.training import loop
    from vanilla_transformer.training.arguments import TrainArguments

    step = loop.train_step

    def stop_after_first(*args, **kwargs):
        step(*args, **kwargs)
        raise _FirstStep

    loop.train_step = stop_after_first
    args = TrainArguments(
        output_dir=str(output_dir), dataset=str(data), source_lang="en", target_lang="es", preset="tiny",
        max_steps=1, max_tokens=4096, eval_samples=0, log_steps=1,
    )
    started = time.perf_counter()
    try:
        loop.train(args)
    except _FirstStep:
        pass
    seconds = time.perf_counter() - started
    held = _anonymous_mib()
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"seconds_to_first_step": round(seconds, 1), "peak_rss_mib": round(kib / 1024, 1),
            "peak_worker_rss_mib": round(children / 1024, 1), "anonymous_rss_at_first_step_mib": held}


def _anonymous_mib() -> float | None:
    """The process's resident memory that is not a mapped file (Linux `RssAnon`): what it holds itself, without
    the Arrow pages the kernel may drop again."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
    return round(int(fields["RssAnon"].split()[0]) / 1024, 1) if "RssAnon" in fields else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="2000000", help="corpus sizes, comma-separated (default 2000000)")
    parser.add_argument("--runs", type=int, default=2, help="runs per size on the same folder (the later ones reuse the caches)")
    parser.add_argument("--workdir", help="where the corpora, caches and runs go (default: a temporary folder)")
    parser.add_argument("--out", help="also write the results to this JSON file")
    parser.add_argument("--measure", nargs=2, metavar=("DATA", "OUTPUT_DIR"), help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.measure:
        print(json.dumps(measure(Path(options.measure[0]), Path(options.measure[1]))))
        return 0

    workdir = Path(options.workdir or tempfile.mkdtemp(prefix="big-corpus-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(workdir / "hf-datasets-cache")}
    results = []
    for pairs in (int(p) for p in options.pairs.split(",")):
        started = time.perf_counter()
        data = write_corpus(workdir / f"corpus-{pairs}", pairs)
        written = time.perf_counter() - started
        for run in range(1, options.runs + 1):
            done = subprocess.run([sys.executable, "-m", "benchmarks.big_corpus", "--measure", str(data),
                                   str(workdir / f"run-{pairs}")], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write(done.stderr[-5000:])
                return done.returncode
            result = {"pairs": pairs, "run": run, "corpus_write_seconds": round(written, 1),
                      **json.loads(done.stdout.strip().splitlines()[-1])}
            results.append(result)
            print(json.dumps(result), flush=True)
    if options.out:
        Path(options.out).write_text(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
