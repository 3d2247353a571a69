"""`translate --input-file` against transformers' pipeline on the saved folder: the same lines, threads and
decoding, in one process run.

    python -m benchmarks.cli_translate --model runs/quickstart            # 1,000 test lines, greedy, one thread
    python -m benchmarks.cli_translate --model runs/quickstart --num-beams 4 --threads 2 --repeats 3

Both run in this process, interleaved `--repeats` times so that both see the same machine load, each timed
from loading the folder to its last line written: the command as `main(["translate", ...])`, its output in a
file, and the pipeline as a user of the folder writes it without this package,
`pipeline("translation", model=folder, trust_remote_code=True)(lines, batch_size=32, ...)`. The outputs are
compared line by line.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import warnings
from pathlib import Path

import torch

from vanilla_transformer.cli import main as cli

from .common import environment, pairs


def run_cli(model: str, lines: Path, threads: int, num_beams: int, out: Path) -> list[str]:
    beams = ["--num-beams", str(num_beams)] if num_beams else []
    with open(out, "w", encoding="utf-8") as output, contextlib.redirect_stdout(output):
        cli(["translate", "--model", model, "--input-file", str(lines), "--threads", str(threads), "--device", "cpu", *beams])
    return out.read_text(encoding="utf-8").splitlines()


def run_pipeline(model: str, lines: Path, threads: int, num_beams: int, out: Path) -> list[str]:
    from transformers import pipeline

    torch.set_num_threads(threads)
    translate = pipeline("translation", model=model, trust_remote_code=True, device="cpu")
    options = {"num_beams": num_beams} if num_beams else {}
    texts = lines.read_text(encoding="utf-8").splitlines()
    with open(out, "w", encoding="utf-8") as output:
        for result in translate(texts, batch_size=32, **options):
            output.write(" ".join(result["translation_text"].splitlines()) + "\n")
    return out.read_text(encoding="utf-8").splitlines()


def run(model: str, count: int, threads: int, num_beams: int, repeats: int) -> dict:
    """Seconds of each repeat per contender, and how many output lines differ."""
    source = pairs("test")[0]
    texts = (source * (count // len(source) + 1))[:count]
    times: dict[str, list[float]] = {"cli": [], "pipeline": []}
    outputs = {}
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pipeline's warning for each blank line
        lines = Path(folder) / "lines.txt"
        lines.write_text("\n".join(texts) + "\n", encoding="utf-8")
        for _ in range(repeats):
            for name, contender in (("cli", run_cli), ("pipeline", run_pipeline)):
                started = time.perf_counter()
                outputs[name] = contender(model, lines, threads, num_beams, Path(folder) / name)
                times[name].append(time.perf_counter() - started)
    differing = sum(a != b for a, b in zip(outputs["cli"], outputs["pipeline"]))
    return {"times": times, "lines": count, "different_lines": differing + abs(len(outputs["cli"]) - len(outputs["pipeline"]))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a saved model folder")
    parser.add_argument("--lines", type=int, default=1000, help="test-split lines, repeated as needed (%(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each (%(default)s)")
    parser.add_argument("--num-beams", type=int, default=1, help="beam size, 0 for the folder's default (%(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, interleaved (%(default)s)")
    args = parser.parse_args(argv)
    result = run(args.model, args.lines, args.threads, args.num_beams, args.repeats)
    machine = environment("cpu", args.threads)
    print(f"{result['lines']} lines, beams {args.num_beams or 'default'}, {args.threads} thread(s), {machine['cpu']} "
          f"({machine['cpu_count']} CPUs, load {machine['load_average_start'][0]:.1f}); outputs differing: "
          f"{result['different_lines']}")
    for name, seconds in result["times"].items():
        print(f"{name:>8}: " + ", ".join(f"{s:.1f} s" for s in seconds))


if __name__ == "__main__":
    main()
