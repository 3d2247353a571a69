"""Hard attention's two training estimators side by side: straight-through Gumbel-softmax against REINFORCE.

    python -m benchmarks.hard_attention                 # 1000 steps each
    python -m benchmarks.hard_attention --steps 5 --out /tmp/hard    # smoke

A task that cannot be solved without attending to the right source position: reverse a random sequence
of 6 to 12 symbols. The tiny model (d_model 64, 2 + 2 layers, 4 heads, no dropout) is trained from the
same initialisation on the same batches (seed 0, 64 sequences a step, Adam, lr 1e-3 after 50 warm-up steps)
with soft attention (the reference), `attention_hardness="hard"` (the model's straight-through
Gumbel-softmax, Jang et al. 2017), REINFORCE with a moving-average baseline (Williams 1992; `Reinforce`
below: it did not train, so it lives here and not in the model), and a control: hard attention whose scores
get no gradient (REINFORCE's samples without its loss term).
At CURVE_POINTS evenly spaced steps, 512 held-out sequences are scored in evaluation mode (hard attention
then takes the argmax): perplexity and the share of target tokens predicted right under teacher forcing.

Writes <out>/hard-attention-<date>-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.modeling import attention_variants

from .common import environment, load_text, write_atomically

# Row -> (attention_hardness, the estimator in training, its label). The last row is the control: REINFORCE's
# sampling without its term in the loss, so that the scores get no gradient; REINFORCE must learn beyond it.
ESTIMATORS = {"soft": ("soft", None, "soft attention (reference)"),
              "hard": ("hard", None, "hard, straight-through Gumbel-softmax"),
              "hard-reinforce": ("hard", "reinforce", "hard, REINFORCE with a baseline"),
              "hard-untrained-scores": ("hard", "samples only", "hard, no estimator (control: the scores get no gradient)")}
BASELINE_DECAY = 0.9  # REINFORCE's baseline follows the loss of about the last ten batches
DEFAULT_STEPS = 1000  # straight-through reaches soft attention's accuracy by then; 300 steps leave it halfway
CURVE_POINTS = 6
VOCAB, SYMBOLS = 32, range(3, 32)  # 0 <pad>, 1 <s>, 2 </s>
LENGTHS = (6, 12)
BATCH, HELD_OUT = 64, 512
LEARNING_RATE, WARMUP = 1e-3, 50


def reversal_batch(size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """`size` random sequences (lengths in LENGTHS, right-padded) and their reversals as labels, both ending in </s>."""
    longest = LENGTHS[1] + 1
    input_ids = torch.zeros(size, longest, dtype=torch.long)
    labels = torch.full((size, longest), -100, dtype=torch.long)
    lengths = torch.randint(LENGTHS[0], LENGTHS[1] + 1, (size,), generator=generator)
    symbols = torch.randint(SYMBOLS.start, SYMBOLS.stop, (size, LENGTHS[1]), generator=generator)
    for row, length in enumerate(lengths.tolist()):
        sequence = symbols[row, :length]
        input_ids[row, : length + 1] = torch.cat([sequence, torch.tensor([2])])
        labels[row, : length + 1] = torch.cat([sequence.flip(0), torch.tensor([2])])
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "labels": labels}


@torch.no_grad()
def evaluate(model, held_out: dict) -> dict:
    model.eval()
    out = model(**held_out)
    counted = held_out["labels"] != -100
    accuracy = (out.logits.argmax(-1) == held_out["labels"])[counted].float().mean()
    model.train()
    return {"perplexity": round(out.loss.exp().item(), 3), "accuracy": round(accuracy.item(), 4)}


class Reinforce:
    """REINFORCE with a baseline (Williams 1992) for hard attention's sampled keys (Xu et al. 2015, §4.1).

    While `installed`, every hard attention block in training samples its key from the softmax of the scores
    with no gradient through the sample, and the sample's log-probability is kept. `term` then estimates the
    scores' gradient as (L - b) · ∇ log p(samples): each sentence's loss L (its mean token NLL) against b, the
    moving average of the batches' mean loss, times the log-probability of every key sampled for that sentence
    (every layer, head and query). The term is 0 in value, so the reported loss stays the task's.
    """

    def __init__(self):
        self.log_probs, self.baseline = [], None

    def sample(self, module, scores):
        if not module.training:
            return F.one_hot(scores.argmax(dim=-1), scores.size(-1)).float()
        samples = torch.distributions.Categorical(logits=scores.float())
        choice = samples.sample()
        self.log_probs.append(samples.log_prob(choice).sum(dim=(1, 2)))  # (B,)
        return F.one_hot(choice, scores.size(-1)).float()

    def installed(self):
        return mock.patch.object(attention_variants, "hard_attention", self.sample)

    def term(self, logits, labels):
        log_prob, self.log_probs = sum(self.log_probs), []
        with torch.no_grad():
            token_loss = F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")  # (B, T); 0 at -100
            sentence_loss = token_loss.sum(-1) / (labels != -100).sum(-1).clamp_min(1)
            baseline = sentence_loss.mean() if self.baseline is None else self.baseline
            self.baseline = BASELINE_DECAY * baseline + (1 - BASELINE_DECAY) * sentence_loss.mean()
        surrogate = ((sentence_loss - baseline) * log_prob).mean()
        return surrogate - surrogate.detach()


def train_one(row: str, steps: int, seed: int) -> dict:
    """Train one model from the seed's initialisation on the seed's batches; its held-out curve and speed."""
    torch.manual_seed(seed)
    hardness, estimator, _ = ESTIMATORS[row]
    config = VanillaTransformerConfig.from_preset("tiny", vocab_size=VOCAB, dropout=0.0, attention_hardness=hardness)
    reinforce = Reinforce() if estimator else None
    model = VanillaTransformerForConditionalGeneration(config).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
    data, held_out = torch.Generator().manual_seed(seed), reversal_batch(HELD_OUT, torch.Generator().manual_seed(seed + 1))
    scored = {max(1, steps * point // CURVE_POINTS) for point in range(1, CURVE_POINTS + 1)}  # the last is `steps`
    curve, losses, started = [], [], time.perf_counter()
    for step in range(1, steps + 1):
        batch = reversal_batch(BATCH, data)
        with reinforce.installed() if reinforce else nullcontext():
            out = model(**batch)
        loss = out.loss
        if estimator == "reinforce":
            loss = loss + reinforce.term(out.logits, batch["labels"])
        elif reinforce:  # the control: the samples' log-probabilities are dropped, the scores learn nothing
            reinforce.log_probs = []
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step in scored:
            curve.append({"step": step, "train_loss": round(sum(losses) / len(losses), 4), **evaluate(model, held_out)})
            losses = []
            print(f"[hard attention] {row} step {step}: {curve[-1]}", file=sys.stderr, flush=True)
    return {"curve": curve, "seconds": round(time.perf_counter() - started, 1),
            "finite": all(torch.isfinite(p).all().item() for p in model.parameters())}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hard_attention", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps of every model (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; the tiny model gains nothing from more "
                                                              "(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and Markdown")
    args = parser.parse_args(argv)
    for option in ("steps", "threads"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be a positive integer; got {getattr(args, option)}")
    torch.set_num_threads(args.threads)
    env = environment("cpu", args.threads)
    results = {row: train_one(row, args.steps, args.seed) for row in ESTIMATORS}
    env["load_average_end"] = os.getloadavg()
    report = {"environment": env, "settings": {
        "command": "python -m benchmarks.hard_attention " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": args.steps, "seed": args.seed, "batch": BATCH, "held_out": HELD_OUT, "lengths": LENGTHS,
        "learning_rate": LEARNING_RATE, "warmup": WARMUP}, "results": results}
    stem = f"hard-attention-{env['date']}-cpu"
    json_path = write_atomically(args.out / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    md_path = write_atomically(args.out / f"{stem}.md", markdown(report))
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return report


def markdown(report: dict) -> str:
    env, settings, results = report["environment"], report["settings"], report["results"]
    steps = [point["step"] for point in results["soft"]["curve"]]
    lines = [
        f"# Hard attention's estimators, {env['date']}, {env['cpu']}",
        "",
        f"Machine: {env['cpu']}, {env['threads']} threads, load average {load_text(env['load_average_start'])} at the start, "
        f"{load_text(env['load_average_end'])} at the end; torch {env['torch']}, transformers {env['transformers']}. "
        f"`{settings['command'].strip()}`.",
        "",
        f"Task: reverse a random sequence of {settings['lengths'][0]} to {settings['lengths'][1]} symbols (29 symbols). "
        f"The tiny model, no dropout, from one initialisation on the same batches (seed {settings['seed']}, "
        f"{settings['batch']} sequences a step, Adam lr {settings['learning_rate']}, {settings['warmup']} warm-up "
        f"steps), {settings['steps']} steps per estimator. Held out: {settings['held_out']} sequences scored in "
        "evaluation mode (hard attention takes the argmax); perplexity and teacher-forced token accuracy.",
        "",
        "| attention | " + " | ".join(f"ppl / acc. @{step}" for step in steps) + " | seconds |",
        "|---|" + "---:|" * (len(steps) + 1),
    ]
    for row, r in results.items():
        points = " | ".join(f"{p['perplexity']:,.2f} / {p['accuracy']:.2f}" for p in r["curve"])
        lines.append(f"| {ESTIMATORS[row][2]} | {points} | {r['seconds']:.0f} |")
    lines += ["", "Training loss (mean over each interval): " + "; ".join(
        f"{row}: " + ", ".join(f"{p['train_loss']:.2f}" for p in r["curve"]) for row, r in results.items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
