"""The whole mission in one command, on a fresh machine with no network and no GPU:

    vanilla-transformer quickstart                      # a 15-minute budget by default
    vanilla-transformer quickstart --minutes 3 --output-dir /tmp/quick

It trains a BPE tokenizer and a Transformer on the embedded English-Spanish Bible with the
training script (`training.loop.train`), scores the test split with sacrebleu, translates three
test verses with `pipeline("translation", trust_remote_code=True)` from the saved folder, draws
the attention heat maps of one of them, and leaves a complete Hub folder with a model card.

The model is sized for the time it gets: on a CPU a small Transformer (d_model 192, 2 encoder and
4 decoder layers, d_ff 256; bf16 where the CPU computes it in hardware) with a short warm-up, since the
paper's 4,000 warm-up steps alone would take longer than the whole budget; on a GPU the paper's base
model in bf16. Its learning rate warms up
as the paper's does and then falls linearly to zero when the budget ends (`lr_schedule="linear"`):
the paper's schedule, built for 100k steps, would stop a 15-minute run at a high rate
(docs/tuning.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .choices import PRESET_NAMES
from .errors import BadInput
from .metrics import repeated_phrase
from .staging import write_file_whole
from .training.arguments import TrainArguments
from .training.loop import train

CORPUS = "bible-en-es"
EXAMPLE = "In the beginning, God created the heavens and the earth."
SUMMARY_FILE = "quickstart.json"

# Each preset's schedule, and the minutes it keeps back from the budget for what follows training (scoring the
# test split with beam search, saving, the pipeline and the heat maps); a preset without one of its own takes
# base's. Why each departure from the paper in "small" is there: docs/tuning.md.
RECIPES = {
    # The paper's base model, for a GPU.
    "base": dict(max_tokens=8192, warmup_steps=1000, reserve_minutes=1.0),
    # The small preset, which learns in minutes on a CPU: small batches and a short warm-up (the paper's
    # 4,000 steps would outlast the budget); lr_scale keeps the peak learning rate of d_model 256
    # (docs/tuning.md, the recipe's table).
    "small": dict(max_tokens=2048, warmup_steps=250, lr_scale=0.433, reserve_minutes=1.5),
    # For tests: it learns little, but every step of the job runs.
    "tiny": dict(max_tokens=2048, warmup_steps=100, reserve_minutes=0.4),
}
# What the quickstart trains for each preset of the configuration: the preset and its recipe.
PRESET_SETTINGS = {name: dict(preset=name, **RECIPES.get(name, RECIPES["base"])) for name in PRESET_NAMES}


def training_arguments(
    output_dir, minutes: float, preset: str, seed: int = 0, test_samples: int | None = None, threads: int | None = None,
) -> TrainArguments:
    """What the quickstart trains: the model and schedule of `preset` for a budget of `minutes`."""
    if preset not in PRESET_SETTINGS:
        raise BadInput(f"`preset` must be one of {', '.join(map(repr, PRESET_SETTINGS))}; got {preset!r}.")
    settings = dict(PRESET_SETTINGS[preset])
    reserve = settings.pop("reserve_minutes")
    if not minutes > reserve:  # NaN too
        raise BadInput(f"`minutes` must be more than {reserve} for preset {preset!r} (the time scoring and saving "
                       f"take); got {minutes}.")
    if test_samples is not None and not test_samples >= 1:  # the summary reports the test split's scores
        raise BadInput(f"`test_samples` must be a positive integer or None; got {test_samples!r}.")
    return TrainArguments(
        output_dir=str(output_dir),
        dataset=CORPUS,
        max_length=128,
        max_steps=None,
        time_limit=minutes - reserve,
        seed=seed,
        eval_steps=10**9,  # the test split is scored at the end; no validation BLEU on the way
        eval_samples=0,  # validation: loss and perplexity only
        test_samples=test_samples,
        threads=threads,
        save_steps=250,
        keep_checkpoints=5,
        average_last=1,  # §6.1 averages the last 5 checkpoints of a 100k-step run; a short run has no good old ones
        lr_schedule="linear",  # to zero at the end of the time limit
        mixed_precision=None,  # bf16 where the device multiplies it in hardware (training/compute.py), else fp32
        **settings,
    )


def _translate_examples(output_dir: Path, count: int = 3) -> list[dict]:
    """Three test verses through the pipeline that ships in the folder, as a user would run it."""
    from transformers import pipeline

    from .corpora import load_translation_dataset

    test = load_translation_dataset(CORPUS)["test"]
    pairs = [row["translation"] for row in test.select(range(count))]
    translator = pipeline("translation", model=str(output_dir), trust_remote_code=True)
    outputs = translator([pair["en"] for pair in pairs])
    return [{"source": p["en"], "reference": p["es"], "translation": o["translation_text"],
             "repeats": repeated_phrase(o["translation_text"])} for p, o in zip(pairs, outputs)]


def _draw_attention(output_dir: Path) -> tuple[Path, int]:
    """Heat maps of one sentence, from the folder loaded as a user loads it; also counts parameters."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from .visualize.attention_maps import collect_attentions, save_attention_maps

    model = AutoModelForSeq2SeqLM.from_pretrained(output_dir, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir, trust_remote_code=True)
    folder = output_dir / "attention"
    save_attention_maps(collect_attentions(model, tokenizer, EXAMPLE), folder)
    return folder, sum(p.numel() for p in model.parameters())


def quickstart(
    output_dir="runs/quickstart", minutes: float = 15.0, preset: str | None = None, seed: int = 0,
    test_samples: int | None = None, threads: int | None = None,
) -> dict:
    """Run the main job; returns the summary it prints (also written to output_dir/quickstart.json).

    `preset` defaults to "base" on a GPU and "small" on a CPU. `test_samples` scores only the first
    N test pairs (the default is the whole split); `threads`, torch's CPU threads (default: the CPUs this
    process may use, threads.py).
    """
    started = time.perf_counter()
    output_dir = Path(output_dir)
    if (output_dir / SUMMARY_FILE).exists():  # not this job's: train refuses a folder that holds a finished one
        raise BadInput(f"{output_dir} holds {SUMMARY_FILE}, which the quickstart's summary would replace; give "
                       "another output folder")
    on_gpu = torch.cuda.is_available()
    args = training_arguments(output_dir, minutes, preset or ("base" if on_gpu else "small"), seed, test_samples, threads)
    results = train(args)
    examples = _translate_examples(output_dir)
    attention, parameters = _draw_attention(output_dir)
    summary = {
        "model_dir": str(output_dir),
        "device": torch.cuda.get_device_name() if on_gpu else f"CPU ({torch.get_num_threads()} threads)",
        "precision": "fp32" if results["mixed_precision"] == "no" else results["mixed_precision"],
        "attention": results.get("attn_implementation"),
        "parameters": parameters,
        "steps": results["steps"],
        "split": results["split"],
        "scored_pairs": results[results["split"]]["translated"],
        "split_pairs": results[results["split"]]["pairs"],
        "repeating": results[results["split"]]["repeating"],
        "references_repeating": results[results["split"]]["references_repeating"],
        "bleu": results["bleu"],
        "chrf": results["chrf"],
        "bleu_signature": results["sacrebleu_signature"],
        "validation_perplexity": results["validation_perplexity"],
        "examples": examples,
        "attention_dir": str(attention),
        "model_card": str(output_dir / "README.md"),
        "wall_minutes": round((time.perf_counter() - started) / 60, 2),
    }
    write_file_whole(output_dir / SUMMARY_FILE, json.dumps(summary, indent=2, ensure_ascii=False))
    print(format_summary(summary))
    return summary


def _scored(summary: dict) -> str:
    """The pairs scored: all of the split's, or the first N of them (--test-samples)."""
    scored, total = summary["scored_pairs"], summary.get("split_pairs", summary["scored_pairs"])
    return f"all {scored} pairs" if scored >= total else f"the first {scored} of {total} pairs"


def format_summary(summary: dict) -> str:
    lines = [
        "",
        "=" * 72,
        f"Done in {summary['wall_minutes']:.1f} min on {summary['device']}: {summary['steps']} training steps in "
        f"{summary.get('precision', 'fp32')} with {summary.get('attention') or 'the default'} attention, "
        f"{summary['parameters'] / 1e6:.1f}M parameters.",
        f"{summary['split']} split ({_scored(summary)}): BLEU {summary['bleu']:.2f}, chrF {summary['chrf']:.2f} "
        f"(validation perplexity {summary['validation_perplexity']:.1f})",
        f"  sacrebleu {summary['bleu_signature']}",
        f"  repeating a phrase of 3 words: {summary['repeating']} of {summary['scored_pairs']} translations "
        f"({summary['references_repeating']} of the references)",
        "",
        "Three test verses, through pipeline('translation', model=folder, trust_remote_code=True):",
    ]
    for example in summary["examples"]:
        lines += [f"  EN   {example['source']}", f"  OURS {example['translation']}", f"  REF  {example['reference']}"]
        if example.get("repeats"):
            lines.append(f"  (the translation repeats itself: {example['repeats']!r} twice)")
        lines.append("")
    lines += [
        f"Model folder (weights, code, tokenizer, pipeline): {summary['model_dir']}",
        f"Model card: {summary['model_card']}",
        f"Attention heat maps: {summary['attention_dir']}/overview.png and one PNG per layer",
        "=" * 72,
    ]
    return "\n".join(lines)
