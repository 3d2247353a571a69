"""Every choice and default that more than one place names, declared once.

The command line's `--help` reads them, so this module imports nothing: not torch, not transformers.
The presets are the configuration's `PRESETS` (modeling/, copied into every saved model folder, so it cannot
import this package): read here from its source, since importing it would bring transformers. The learning-rate
schedules are named where they are defined, training/schedule.py's `SCHEDULES` (torch-free too).
tests/test_choices.py fails on a list written twice.
"""

import ast
from pathlib import Path

__all__ = ["ATTENTION_IMPLEMENTATIONS", "BEST_METRICS", "DEFAULT_VOCAB_SIZE", "ENGINES", "FOLDER_TRACKERS", "PAPER_WARMUP_STEPS",
           "PRESETS", "PRESET_NAMES", "PRESET_SHAPES", "QUANTIZATIONS", "SERVE_LIMITS", "TOKENIZER_MODELS", "TRACKERS",
           "TRANSLATION_BATCH_SIZE"]

DEFAULT_VOCAB_SIZE = 8000  # docs/tokenizer.md: the paper's 37k was for 4.5M pairs, the Bible corpora have ~29k
PAPER_WARMUP_STEPS = 4000  # §5.3

# bpe: merges of frequent pairs (Sennrich et al.); unigram: SentencePiece's unigram language model (Kudo, 2018),
# which keeps the pieces that best explain the text by likelihood. Both read bytes, so both are lossless.
TOKENIZER_MODELS = ("bpe", "unigram")


def _config_presets() -> dict:
    """The configuration's PRESETS, {name: {field: value}}, as its source writes them (a literal)."""
    source = Path(__file__).parent / "modeling" / "configuration_vanilla_transformer.py"
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and [getattr(target, "id", None) for target in node.targets] == ["PRESETS"]:
            return ast.literal_eval(node.value)
    raise ImportError(f"{source} assigns no PRESETS")


PRESETS = _config_presets()
PRESET_NAMES = tuple(sorted(PRESETS, key=lambda name: PRESETS[name]["d_model"]))  # the narrowest first
# What `train --preset` and `quickstart --preset` say of each.
PRESET_SHAPES = ", ".join(
    "{name} (d_model {d_model}, {encoder_layers} encoder and {decoder_layers} decoder layers, d_ff {d_ff})".format(
        name=name, **PRESETS[name]) for name in PRESET_NAMES)

# CTranslate2's weight types an export may take.
QUANTIZATIONS = ("float32", "int8", "int8_float32", "float16", "int8_float16", "bfloat16")
# What decodes for `translate` and `evaluate` (--engine): the model's own generate, or CTranslate2 on an export.
ENGINES = ("transformers", "ctranslate2")
TRANSLATION_BATCH_SIZE = 32  # texts per batch when translating: --batch-size's default and the library's

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2")  # transformers' names
BEST_METRICS = {"bleu": max, "chrf": max, "loss": min}  # validation scores a checkpoint is chosen by, and which way
# Accelerate's trackers, each with the package it needs (an optional extra of this one, pyproject.toml).
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet_ml", "aim": "aim",
            "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio"}
# The trackers that write only under OUTPUT_DIR/runs: `resume` restores these, and says so (the others act outside
# the run's folder, and are taken from the command line alone).
FOLDER_TRACKERS = ("tensorboard",)

# What one visitor of `serve` (and of a Space) may ask, by default: visualize/app.py's `Limits`.
SERVE_LIMITS = {
    "max_input_tokens": 128,  # source tokens, </s> included: a long sentence
    "max_new_tokens": 256,  # output tokens a visitor may ask for
    "max_beams": 8,
    "max_texts": 32,  # texts in one request to the JSON endpoint, and in one batch of requests decoded together
    "max_concurrent": 1,  # requests translated at once; the others wait in the queue ...
    "max_queued": 8,  # ... which refuses more than this many
    "request_timeout": 30,  # seconds a client may take to send a request (headers and body): a slow one holds a connection
}
