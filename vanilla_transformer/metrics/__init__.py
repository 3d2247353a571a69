"""The package's `evaluate` metrics, shipped as scripts so that they load offline from a local path.

    import evaluate
    from vanilla_transformer.metrics import BLEU_CHRF

    metric = evaluate.load(BLEU_CHRF)   # sacrebleu's corpus BLEU and chrF (its command line's defaults)
    metric.compute(predictions=translations, references=references)
    # {"bleu": 27.3, "chrf": 52.1, "bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|...", ...}

`evaluate.load("sacrebleu")` would fetch its script from the Hub; this one is a file in the package.
`load_bleu_chrf()` gives the module our command line and training loop score with, loaded once per process.
`repeated_phrase` finds the loops a young model falls into ("y de su mujer, y de su mujer").
"""

import re
from functools import cache
from pathlib import Path

__all__ = ["BLEU_CHRF", "load_bleu_chrf", "repeated_phrase"]

BLEU_CHRF = str(Path(__file__).parent / "bleu_chrf" / "bleu_chrf.py")  # a str: evaluate.load takes no Path


@cache
def load_bleu_chrf():
    """The BLEU/chrF metric, loaded on first use and then shared: one load per process. It keeps its
    inputs in memory (no cache files, so processes of one training run cannot collide); give `compute`
    all predictions at once, or use your own `evaluate.load(BLEU_CHRF)` to `add_batch` step by step."""
    import evaluate

    return evaluate.load(BLEU_CHRF, keep_in_memory=True)


def repeated_phrase(text: str, words: int = 3) -> str | None:
    """The first phrase of `words` words that `text` holds twice (a translation that loops: "y de su mujer, y de
    su mujer"), or None. Words are compared lower-cased, without punctuation."""
    tokens = re.findall(r"\w+", text.lower())
    seen = set()
    for i in range(len(tokens) - words + 1):
        phrase = " ".join(tokens[i : i + words])
        if phrase in seen:
            return phrase
        seen.add(phrase)
    return None
