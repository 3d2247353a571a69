"""Tokenizer benchmark: vocabulary training time, encode throughput, sequence lengths, <unk> share.

    python -m benchmarks.tokenizer [--corpus bible-en-es] [--vocab-size 8000] [--json PATH]

A measurement, not a test: numbers depend on the machine (tokenizers uses
every core it can see). `run()` returns the same dict the command prints, for
an aggregating `python -m benchmarks`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import tokenizers
import transformers

from vanilla_transformer.corpora import EMBEDDED_CORPORA, iter_texts, load_translation_dataset, text_pairs
from vanilla_transformer.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer


def _timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of `repeats` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run(corpus: str = "bible-en-es", vocab_size: int = DEFAULT_VOCAB_SIZE, repeats: int = 3,
        train_pairs: int | None = None) -> dict:
    """Trained on and encoding the train split (or its first `train_pairs` pairs: a smoke run)."""
    corpus_info = EMBEDDED_CORPORA[corpus]
    src_lang, tgt_lang = corpus_info.source_lang, corpus_info.target_lang
    data = load_translation_dataset(corpus)
    if train_pairs is not None:
        data["train"] = data["train"].select(range(train_pairs))
    src, tgt = text_pairs(data["train"], src_lang, tgt_lang)
    texts = list(iter_texts(data))  # both sides of the train split

    train_s, tok = _timed(lambda: train_tokenizer(texts, vocab_size=vocab_size), repeats)
    sentences = src + tgt
    # The path training takes: the transformers tokenizer on one batch holding the whole split.
    encode_s, ids = _timed(lambda: tok(sentences, add_special_tokens=False)["input_ids"], repeats)
    # The Rust encoder alone, without building Python lists of ids.
    backend_s, _ = _timed(lambda: tok.backend_tokenizer.encode_batch_fast(sentences, add_special_tokens=False), repeats)

    src_ids, tgt_ids = ids[: len(src)], ids[len(src) :]
    n_tokens = sum(map(len, ids))
    return {
        "benchmark": "tokenizer",
        "corpus": corpus,
        "train_pairs": len(src),
        "vocab_size": len(tok),
        "train_seconds": round(train_s, 3),
        "encode_sentences_per_s": round(len(sentences) / encode_s),
        "backend_encode_sentences_per_s": round(len(sentences) / backend_s),
        f"mean_tokens_per_sentence_{src_lang}": round(sum(map(len, src_ids)) / len(src_ids), 2),
        f"mean_tokens_per_sentence_{tgt_lang}": round(sum(map(len, tgt_ids)) / len(tgt_ids), 2),
        "unk_share": sum(row.count(tok.unk_token_id) for row in ids) / n_tokens,
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="bible-en-es", choices=sorted(EMBEDDED_CORPORA))
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is reported")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    results = run(args.corpus, args.vocab_size, args.repeats)
    for key, value in results.items():
        print(f"{key:>36}: {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
