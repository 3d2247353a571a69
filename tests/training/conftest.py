"""Helpers for the training tests: small synthetic translation data sets written as real files."""

import json
import random
from pathlib import Path

import pytest

LETTERS = [chr(c) for c in range(ord("a"), ord("a") + 12)]


def write_synthetic_task(folder: Path, n_train: int = 2000, n_eval: int = 100, seed: int = 0, reverse=False) -> Path:
    """train/validation/test.jsonl of {"translation": {"src": "g a e", "tgt": "g a e"}}: copy (or reverse) 3-8 letters."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("validation", n_eval), ("test", n_eval)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                words = [rng.choice(LETTERS) for _ in range(rng.randint(3, 8))]
                f.write(json.dumps({"translation": {"src": " ".join(words), "tgt": " ".join(words[::-1] if reverse else words)}}) + "\n")
    return folder


@pytest.fixture
def small_task(tmp_path):
    """A few hundred reversal pairs: enough for a handful of steps, fast to score."""
    return write_synthetic_task(tmp_path / "data", n_train=300, n_eval=12, reverse=True)


@pytest.fixture(name="write_synthetic_task", scope="session")
def write_synthetic_task_fixture():
    return write_synthetic_task


@pytest.fixture
def small_run():
    """A very small model and a short, cheap run, as command-line arguments."""
    return list(SMALL_RUN)


@pytest.fixture(scope="session")
def small_run_options():
    """The options of `small_run` for a fixture shared by several tests: a tuple, since tests change their list."""
    return tuple(SMALL_RUN)


SMALL_RUN = [
    "--vocab-size", "300", "--preset", "tiny",
    "--config-overrides", "d_model=32,d_ff=64,num_heads=2,encoder_layers=1,decoder_layers=1",
    "--max-tokens", "256", "--warmup-steps", "10", "--eval-steps", "1000", "--eval-samples", "0",
    "--num-beams", "1",
    # Runs compared with one another compute alike on every machine: fp32 and one attention kernel.
    "--mixed-precision", "no", "--attn-implementation", "eager",
]
