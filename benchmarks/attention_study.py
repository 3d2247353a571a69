"""The notes' table in minutes: every score function and attention kind trained on a toy task, side by side.

    python -m benchmarks.attention_study --output-dir study            # all 11 rows: about 4 minutes on 2 CPU cores
    python -m benchmarks.attention_study --options scaled_dot,location --steps 50 --output-dir /tmp/study

The task is benchmarks/hard_attention.py's: reverse a random sequence of 6 to 12 symbols (29 symbols), which
cannot be solved without attending to the right source position. The package's tiny model (d_model 64,
2 + 2 layers, 4 heads, no dropout) is trained once per row with one config field changed (two for local
attention: the kind and its window D), from the same initialisation seed on the same batches. Rows: each
score function of the notes' table (`attention_score`), then the attention kinds on the paper's scaled dot:
local-m and local-p (Luong et al. 2015), hard (straight-through Gumbel), ReLU and sparsemax normalisation.

Each row is scored on held-out sequences in evaluation mode, under teacher forcing: token accuracy (chance: a
uniform guess among the symbols) and exact match (every token of the reversal right). The long form on
real text, with BLEU, is benchmarks/score_functions.py.

Writes <output-dir>/attention-study.md (the table) and <output-dir>/attention-study.png (the last decoder
layer's cross-attention, mean of the heads, of one held-out sequence under each row, one colour scale).
"""

from __future__ import annotations

import argparse
import os
import string
import sys
import time
from pathlib import Path

import torch

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.modeling.configuration_vanilla_transformer import ATTENTION_SCORES
from vanilla_transformer.visualize.attention_maps import AXIS_LABELS, DECODER_ROWS

from .common import write_atomically
from .hard_attention import BATCH, LENGTHS, SYMBOLS, VOCAB, reversal_batch

DEFAULT_STEPS = 200  # scaled dot reaches about 0.9 token accuracy by then; each row takes 10 to 30 s on one core
LEARNING_RATE, WARMUP = 3e-3, 30  # higher than hard_attention.py's 1e-3: a short run must learn fast
HELD_OUT = 256
WINDOW = 2  # local attention's D: small enough that a window in the wrong place shows
CHANCE = 1 / len(SYMBOLS)  # a uniform guess among the symbols
# The attention kinds, each on the paper's scaled dot: row name -> the config fields it changes.
KINDS = {
    "local-m": {"local_attention": "local-m", "attention_window": WINDOW},
    "local-p": {"local_attention": "local-p", "attention_window": WINDOW},
    "hard": {"attention_hardness": "hard"},
    "relu": {"attention_normalization": "relu"},
    "sparsemax": {"attention_normalization": "sparsemax"},
}
# Every row: the notes' score functions, then the kinds.
OPTIONS = {**{score: {"attention_score": score} for score in ATTENTION_SCORES}, **KINDS}
LETTERS = string.ascii_lowercase + "ABC"  # one letter per symbol id in SYMBOLS, for the figure's ticks


def config_for(option: str, **overrides) -> VanillaTransformerConfig:
    """The tiny model for the reversal task with the row's fields changed."""
    return VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, dropout=0.0, **OPTIONS[option], **overrides)


@torch.no_grad()
def score(model, held_out: dict) -> dict:
    """Token accuracy and exact match of the held-out reversals, under teacher forcing, in evaluation mode."""
    model.eval()
    predicted = model(**held_out).logits.argmax(-1)
    counted = held_out["labels"] != -100
    right = (predicted == held_out["labels"]) | ~counted  # padding counts as right, so a row is exact when its tokens are
    model.train()
    return {"accuracy": round(right[counted].float().mean().item(), 4),
            "exact_match": round(right.all(-1).float().mean().item(), 4)}


def train_option(option: str, steps: int = DEFAULT_STEPS, seed: int = 0, **overrides) -> dict:
    """Train one row from the seed's initialisation on the seed's batches; its scores, time and model.
    `overrides` are further config fields (the walkthrough's `fast_paths=False`, `attn_implementation="eager"`)."""
    torch.manual_seed(seed)
    model = VanillaTransformerForConditionalGeneration(config_for(option, **overrides)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
    data = torch.Generator().manual_seed(seed)
    held_out = reversal_batch(HELD_OUT, torch.Generator().manual_seed(seed + 1))
    started = time.perf_counter()
    for _ in range(steps):
        loss = model(**reversal_batch(BATCH, data)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    seconds = time.perf_counter() - started
    return {"option": option, "steps": steps, "seconds": round(seconds, 1), "loss": round(loss.item(), 4),
            **score(model, held_out), "model": model.eval()}


def example(seed: int = 0) -> dict:
    """The held-out sequence every panel of the figure shows (the first of the held-out set)."""
    held_out = reversal_batch(HELD_OUT, torch.Generator().manual_seed(seed + 1))
    length = int(held_out["attention_mask"][0].sum())
    return {key: value[:1, :length] for key, value in held_out.items()}


@torch.no_grad()
def cross_attention(model, sequence: dict) -> torch.Tensor:
    """The last decoder layer's cross-attention, mean of the heads: (target positions, source positions)."""
    out = model(**sequence, output_attentions=True)
    return out.cross_attentions[-1][0].mean(0).float()


def study(options=None, steps: int = DEFAULT_STEPS, seed: int = 0, progress=None) -> list[dict]:
    """Train every row of `options` (default: all of OPTIONS); each row's scores, time and its figure panel."""
    sequence = example(seed)
    rows = []
    for option in options or OPTIONS:
        row = train_option(option, steps, seed)
        row["attention"] = cross_attention(row.pop("model"), sequence)
        rows.append(row)
        if progress:
            progress(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table, with the chance level stated."""
    lines = [f"Reversal of {LENGTHS[0]} to {LENGTHS[1]} symbols, the tiny model, {HELD_OUT} held-out sequences under "
             f"teacher forcing. Chance token accuracy: {CHANCE:.3f} (a uniform guess among {len(SYMBOLS)} symbols); "
             f"chance exact match: about 0. Seconds are wall time on {os.cpu_count()} cores, "
             f"torch threads: {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} when written.",
             "",
             "| option | config fields changed | token accuracy | exact match | steps | seconds |",
             "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        fields = ", ".join(f"{key}={value!r}" for key, value in OPTIONS[row["option"]].items())
        lines.append(f"| {row['option']} | `{fields}` | {row['accuracy']:.3f} | {row['exact_match']:.3f} | "
                     f"{row['steps']} | {row['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


SPECIALS = {0: "<pad>", 1: "<s>", 2: "</s>"}  # reversal_batch's ids below SYMBOLS


def letters(ids) -> list[str]:
    """Readable tokens of ids: one letter per symbol."""
    return [LETTERS[i - SYMBOLS.start] if i in SYMBOLS else SPECIALS[i] for i in ids]


def encode(texts: list[str]) -> dict[str, torch.Tensor]:
    """Sequences of LETTERS as the model reads them: the symbols' ids and </s>, right-padded, with their mask."""
    longest = max(len(text) for text in texts) + 1
    input_ids = torch.zeros(len(texts), longest, dtype=torch.long)
    for row, text in enumerate(texts):
        input_ids[row, : len(text) + 1] = torch.tensor([SYMBOLS.start + LETTERS.index(c) for c in text] + [2])
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long()}


def plot(rows: list[dict], path: str | os.PathLike, seed: int = 0) -> Path:
    """One PNG: each row's cross-attention on the same held-out sequence, one colour scale (0 to 1)."""
    from matplotlib.figure import Figure  # not pyplot: a notebook's backend stays as it is

    sequence = example(seed)
    keys = letters(sequence["input_ids"][0].tolist())
    # Row t is the token the decoder read there (the start token, then the reversal so far), as in every picture.
    queries = ["<start>", *letters(sequence["labels"][0].tolist())[:-1]]
    columns = min(len(rows), 4)
    grid_rows = -(-len(rows) // columns)
    fig = Figure(figsize=(3.2 * columns, 3.4 * grid_rows + 1.0), layout="constrained")
    axes = fig.subplots(grid_rows, columns, squeeze=False)
    for ax, row in zip(axes.flat, rows):
        image = ax.imshow(row["attention"].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"{row['option']}\ntoken acc. {row['accuracy']:.2f}, exact {row['exact_match']:.2f}", fontsize=9)
        ax.set_xticks(range(len(keys)), keys, fontsize=7)
        ax.set_yticks(range(len(queries)), queries, fontsize=7)
        ax.set_ylabel(AXIS_LABELS["cross"][0], fontsize=8)
        ax.set_xlabel(AXIS_LABELS["cross"][1], fontsize=8)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    fig.suptitle(f"Cross-attention of the last decoder layer, mean of the heads: reversing {''.join(keys[:-1])}\n"
                 f"{DECODER_ROWS}\n"
                 f"tiny model, {rows[0]['steps']} steps per option; chance token accuracy {CHANCE:.2f}", fontsize=11)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight (one scale for all panels)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _options(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    if not chosen or any(c not in OPTIONS for c in chosen) or len(set(chosen)) != len(chosen):
        raise argparse.ArgumentTypeError(f"takes a comma-separated subset of {','.join(OPTIONS)}; got {text!r}")
    return chosen


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_study", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True, help="folder for attention-study.md and .png")
    parser.add_argument("--options", type=_options, default=list(OPTIONS),
                        help=f"rows to train, comma-separated (default: all of {','.join(OPTIONS)})")
    parser.add_argument("--steps", type=_positive, default=DEFAULT_STEPS, help="training steps per row (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed (default: %(default)s)")
    parser.add_argument("--threads", type=_positive, default=1,
                        help="torch threads; the tiny model gains little from more (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.output_dir.exists() and not args.output_dir.is_dir():
        parser.error(f"--output-dir {args.output_dir} is a file; expected a folder")
    torch.set_num_threads(args.threads)
    rows = study(args.options, args.steps, args.seed, progress=lambda row: print(
        f"[attention study] {row['option']}: token accuracy {row['accuracy']:.3f}, exact match {row['exact_match']:.3f}, "
        f"{row['seconds']:.1f} s", file=sys.stderr, flush=True))
    text = table(rows)
    md_path = write_atomically(args.output_dir / "attention-study.md", text)
    png_path = plot(rows, args.output_dir / "attention-study.png", args.seed)
    print(text)
    print(f"wrote {md_path} and {png_path}")
    return rows


if __name__ == "__main__":
    main()
