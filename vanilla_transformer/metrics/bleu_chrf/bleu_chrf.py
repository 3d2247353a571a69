"""Corpus BLEU and chrF exactly as `sacrebleu REF -i HYP -m bleu chrf` computes them, with signatures.

An `evaluate` metric script that loads offline from its path (`evaluate.load("sacrebleu")` needs the
Hub). Defaults are sacrebleu's command line's: BLEU with 13a tokenisation, exponential smoothing and
case kept; chrF with character order 6, no word n-grams and beta 2.

    metric = evaluate.load(vanilla_transformer.metrics.BLEU_CHRF)
    metric.compute(predictions=["The cat sat."], references=["The cat sat down."])
    metric.compute(predictions=["The cat sat."], references=[["The cat sat down.", "A cat sat."]])

Only the standard library, evaluate, datasets and sacrebleu may be imported here, one module per
`import` line: evaluate's import scanner reads `import a, b` as a module named "a,".
"""

import datasets
import evaluate
import sacrebleu

_CITATION = """\
@inproceedings{post-2018-call,
    title = "A Call for Clarity in Reporting {BLEU} Scores",
    author = "Post, Matt",
    booktitle = "Proceedings of the Third Conference on Machine Translation: Research Papers",
    year = "2018",
    publisher = "Association for Computational Linguistics",
    url = "https://www.aclweb.org/anthology/W18-6319",
    pages = "186--191",
}
@inproceedings{popovic-2015-chrf,
    title = "chr{F}: character n-gram {F}-score for automatic {MT} evaluation",
    author = "Popovi{\\'c}, Maja",
    booktitle = "Proceedings of the Tenth Workshop on Statistical Machine Translation",
    year = "2015",
    publisher = "Association for Computational Linguistics",
    url = "https://aclanthology.org/W15-3049",
    pages = "392--395",
}
"""

_DESCRIPTION = """\
Corpus-level BLEU and chrF from sacrebleu with the defaults of its command line (BLEU: 13a
tokenisation, exp smoothing, mixed case; chrF: 6 character n-grams, beta 2), together with the
signatures that make the numbers reproducible. Texts must be detokenised, as for sacrebleu.
"""

_KWARGS_DESCRIPTION = """\
Args:
    predictions (list of str): one translation per segment.
    references (list of str, or list of lists of str): the reference of each segment, or several
        references per segment (the same number for every segment).
Returns:
    bleu (float): corpus BLEU, 0 to 100.
    chrf (float): corpus chrF, 0 to 100.
    bleu_signature (str): sacrebleu's BLEU signature, e.g. "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0".
    chrf_signature (str): sacrebleu's chrF signature, e.g. "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0".
    bleu_text (str): sacrebleu's score line with two decimals (`sacrebleu -f text -w 2` without the
        signature), e.g. "BLEU = 27.35 58.1/33.2/20.9/13.4 (BP = 1.000 ratio = 1.012 hyp_len = 1234 ref_len = 1219)".
    chrf_text (str): the same for chrF, e.g. "chrF2 = 52.10".
Examples:
    >>> metric = evaluate.load(vanilla_transformer.metrics.BLEU_CHRF)
    >>> result = metric.compute(predictions=["The cat sat on the mat."], references=["The cat sat on the mat."])
    >>> round(result["bleu"], 1), round(result["chrf"], 1)
    (100.0, 100.0)
"""

_STRING = datasets.Value("string")
_SHAPES = "give every segment one reference string, or every segment a list of reference strings"


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class BleuChrf(evaluate.Metric):
    """sacrebleu's corpus BLEU and chrF, with signatures; references may be one or several per segment."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features({"predictions": _STRING, "references": datasets.Sequence(_STRING)}),
                datasets.Features({"predictions": _STRING, "references": _STRING}),
            ],
            codebase_urls=["https://github.com/mjpost/sacrebleu"],
            reference_urls=["https://www.aclweb.org/anthology/W18-6319", "https://aclanthology.org/W15-3049"],
        )

    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """Check the inputs first, so that a mistake gets an error naming the argument (compute comes here too)."""
        _check_inputs(predictions, references)
        super().add_batch(predictions=predictions, references=references, **kwargs)

    def add(self, *, prediction=None, reference=None, **kwargs):
        """One segment: a batch of one, checked the same way."""
        self.add_batch(predictions=[prediction], references=[reference], **kwargs)

    def _compute(self, predictions, references):
        if isinstance(references[0], str):
            references = [[reference] for reference in references]
        # sacrebleu takes one stream per reference "file": the transpose of per-segment lists.
        streams = [list(stream) for stream in zip(*references)]
        bleu = sacrebleu.BLEU()
        chrf = sacrebleu.CHRF()
        bleu_score = bleu.corpus_score(predictions, streams)
        chrf_score = chrf.corpus_score(predictions, streams)
        return {
            "bleu": bleu_score.score,
            "chrf": chrf_score.score,
            "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature()),
            "bleu_text": str(bleu_score),
            "chrf_text": str(chrf_score),
        }


def _check_inputs(predictions, references):
    """Raise ValueError/TypeError, naming the argument, unless the inputs are strings that pair up."""
    for name, value in (("predictions", predictions), ("references", references)):
        if isinstance(value, str) or not hasattr(value, "__len__"):
            raise TypeError(f"`{name}` must be a list, one entry per segment; got {type(value).__name__}")
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} `predictions` but {len(references)} `references`; they must pair up")
    if not len(predictions):
        raise ValueError("nothing to score: `predictions` and `references` are empty")
    for i, prediction in enumerate(predictions):
        if not isinstance(prediction, str):
            raise TypeError(f"`predictions[{i}]` must be a string; got {type(prediction).__name__}")
    if isinstance(references[0], str):
        for i, reference in enumerate(references):
            if not isinstance(reference, str):
                raise TypeError(
                    f"`references[{i}]` is of type {type(reference).__name__}, but `references[0]` is a string: {_SHAPES}"
                )
        return
    for i, reference in enumerate(references):
        if not isinstance(reference, (list, tuple)):
            raise TypeError(f"`references[{i}]` is of type {type(reference).__name__}: {_SHAPES}")
        if not reference:
            raise ValueError(f"`references[{i}]` is an empty list: every segment needs at least one reference")
        if len(reference) != len(references[0]):
            raise ValueError(
                f"`references[{i}]` holds {len(reference)} references but `references[0]` {len(references[0])}: "
                "sacrebleu needs the same number of references for every segment"
            )
        for j, text in enumerate(reference):
            if not isinstance(text, str):
                raise TypeError(f"`references[{i}][{j}]` must be a string; got {type(text).__name__}")
