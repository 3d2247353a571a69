"""Two training processes on one device: DDP trains, saves, resumes and averages where one GPU is lent.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.ddp_one_device --device cuda --output-dir $OUT
    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.ddp_one_device --device cpu    # two CPU processes, gloo

`accelerate launch --multi_gpu --num_processes 2` starts `vanilla-transformer train` twice, through this
module's `--worker` entry, on a slice of the embedded bible-en-es: 4 steps with checkpoints every 2, then
`--resume` to 6 with `--average-last 2`, then the finished run's results (steps, averaged checkpoints, every
process's weight checksum, which must agree).

On a GPU both processes train on GPU 0: the worker tells each that it is its machine's first process
(LOCAL_RANK=0), where Accelerate would put the second on a GPU that is not there. NCCL refuses two ranks on
one device, so NCCL is tried first and gloo (which all-reduces CUDA tensors through the host) after it; the
report says which ran and why the other did not. On a CPU the processes use gloo, as `train` does there.
Writes `benchmarks/results/ddp-one-device-<date>-<device>.json` and `.md` (or under --output-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from datetime import date
from pathlib import Path

from .common import write_atomically
from .gpu_smoke import RESULTS, ROOT, run_command

BACKEND_ENV = "VANILLA_TRANSFORMER_DDP_BACKEND"  # the worker's process-group backend


def worker(argv: list[str]) -> int:
    """One process of the run: on GPU 0 whatever its rank, with BACKEND_ENV's backend, then `train`."""
    import torch.distributed

    os.environ["LOCAL_RANK"] = "0"  # Accelerate's device is cuda:LOCAL_RANK
    backend, init = os.environ.get(BACKEND_ENV), torch.distributed.init_process_group

    def init_process_group(*args, **kwargs):
        if backend:
            kwargs["backend"] = backend
        return init(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group
    from vanilla_transformer.cli import main

    return main(["train", *argv]) or 0


def write_data(folder: Path) -> Path:
    from vanilla_transformer.corpora import load_translation_dataset

    corpus = load_translation_dataset("bible-en-es")
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 2000), ("validation", 16), ("test", 8)):
        corpus[split].select(range(n)).to_json(folder / f"{split}.jsonl", force_ascii=False)
    return folder


def attempt(folder: Path, device: str, backend: str, timeout: int) -> dict:
    """The two launches (train, then resume and average) with `backend`; the finished run's results."""
    cuda = device.startswith("cuda")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "bf16" if cuda else "no", "--dynamo_backend", "no",
              "-m", "benchmarks.ddp_one_device", "--worker",
              "--dataset", str(folder / "data"), "--output-dir", str(folder / backend), "--preset", "tiny",
              "--vocab-size", "1000", "--max-tokens", "1024", "--warmup-steps", "4", "--eval-steps", "2",
              "--eval-samples", "4", "--num-beams", "2", "--save-steps", "2", "--keep-checkpoints", "3"]
    env = {BACKEND_ENV: backend, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **({} if cuda else {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"})}
    first = run_command([*launch, "--max-steps", "4"], timeout, env)
    second = None
    if first["returncode"] == 0:
        second = run_command([*launch, "--max-steps", "6", "--resume", "--average-last", "2"], timeout, env)
    results_file = folder / backend / "results.json"
    results = None
    if second and second["returncode"] == 0 and results_file.is_file():
        saved = json.loads(results_file.read_text())
        results = {k: saved.get(k) for k in ("steps", "averaged_checkpoints", "replica_checksums", "bleu",
                                              "validation_loss", "mixed_precision")}
    return {"backend": backend, "first": first, "resumed": second, "results": results,
            "passed": bool(results and results["steps"] == 6 and len(set(results["replica_checksums"])) == 1)}


def markdown(report: dict) -> str:
    lines = [f"# Two DDP processes on one device, {report['date']}, {report['device']}", ""]
    for run in report["attempts"]:
        verdict = "passed" if run["passed"] else "FAILED"
        lines.append(f"- {run['backend']}: {verdict} (train 4 steps, --resume to 6, --average-last 2)"
                     + (f": {run['results']}" if run["results"] else ""))
        for stage in ("first", "resumed"):
            if run[stage] and run[stage]["returncode"] != 0:
                tail = run[stage]["output_tail"].strip().splitlines()[-3:]
                lines.append(f"  - {stage} launch exited {run[stage]['returncode']}: " + " / ".join(tail))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp_one_device", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--output-dir", type=Path, default=RESULTS, help="where the report goes (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds each launch may take (default: %(default)s)")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (use --device cpu)")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report = {"date": date.today().isoformat(), "device": name, "torch": torch.__version__, "attempts": []}
    with tempfile.TemporaryDirectory() as tmp:
        write_data(Path(tmp) / "data")
        for backend in ("nccl", "gloo") if args.device == "cuda" else ("gloo",):
            report["attempts"].append(attempt(Path(tmp), args.device, backend, args.timeout))
            if report["attempts"][-1]["passed"]:
                break
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    stem = args.output_dir / f"ddp-one-device-{report['date']}-{slug}"
    write_atomically(stem.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    write_atomically(stem.with_suffix(".md"), markdown(report))
    print(markdown(report))
    return 0 if report["attempts"][-1]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
