"""Decoding as the paper does it (§6.1) against transformers' beam scoring, on a trained model.

    python -m benchmarks.decoding --model DIR [--split validation] [--limit N] [--batch-size 32]

DIR is a folder written by `vanilla-transformer train` (model and tokenizer). Every row translates
the same sentences (the en-es validation split by default), sorted by length and batched as a
translator would, each sentence capped at its source length + 50 new tokens (§6.1):

    greedy                 num_beams=1
    beam 4, transformers   log P / len^0.6, transformers' default stopping (early_stopping=False)
    beam 4, transformers   the same with early_stopping=True (stop at 4 finished hypotheses)
    beam 4, GNMT α 0.6     log P / ((5 + len) / 6)^0.6, the paper's (generation.py)
    beam 4, GNMT α 1.0

The transformers rows run transformers' own beam search loop (which `generate` hands that ranking to);
greedy and the GNMT rows run ours.

BLEU and chrF are sacrebleu's (corpus level, default tokenisation); length ratio is hypothesis
tokens / reference tokens as BLEU counts them (its brevity penalty is exp(1 - 1/ratio) below 1).
Speed is sentences and generated tokens (</s> included) per second of wall time, with the
process's torch threads; numbers move with the machine's load, ratios between rows less.
"""

from __future__ import annotations

import argparse
import time

import sacrebleu
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from vanilla_transformer.choices import TRANSLATION_BATCH_SIZE
from vanilla_transformer.corpora import load_translation_dataset, resolve_languages, text_pairs

from .generation import generated_lengths

ROWS = {
    "greedy": dict(num_beams=1),
    "beam 4, transformers len^0.6": dict(num_beams=4, length_penalty=0.6, length_penalty_style="transformers",
                                         early_stopping=False),
    "beam 4, transformers len^0.6, early_stopping": dict(num_beams=4, length_penalty=0.6,
                                                         length_penalty_style="transformers", early_stopping=True),
    "beam 4, GNMT α 0.6": dict(num_beams=4, length_penalty=0.6, length_penalty_style="gnmt"),
    "beam 4, GNMT α 1.0": dict(num_beams=4, length_penalty=1.0, length_penalty_style="gnmt"),
}


def translate(model, tokenizer, sources: list[str], batch_size: int, options: dict) -> tuple[list[str], float, int]:
    """Translations in input order, seconds taken, tokens generated."""
    order = sorted(range(len(sources)), key=lambda i: len(tokenizer(sources[i])["input_ids"]))
    outputs, generated = [None] * len(sources), 0
    started = time.perf_counter()
    for start in range(0, len(order), batch_size):
        indices = order[start : start + batch_size]
        batch = tokenizer([sources[i] for i in indices], padding=True, return_tensors="pt")
        with torch.inference_mode():
            tokens = model.generate(**batch, do_sample=False, **options)
        generated += int(generated_lengths(tokens, tokenizer.eos_token_id, tokenizer.pad_token_id).sum())
        for i, text in zip(indices, tokenizer.batch_decode(tokens, skip_special_tokens=True)):
            outputs[i] = text
    return outputs, time.perf_counter() - started, generated


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder with its tokenizer")
    parser.add_argument("--dataset", default="bible-en-es", help="data set (default: %(default)s)")
    parser.add_argument("--source-lang", help="source language key (default: the pair's first)")
    parser.add_argument("--target-lang", help="target language key (default: the other one)")
    parser.add_argument("--split", default="validation", help="split to translate (default: %(default)s)")
    parser.add_argument("--limit", type=int, help="first N sentences only")
    parser.add_argument("--batch-size", type=int, default=TRANSLATION_BATCH_SIZE, help="sentences per batch (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be a positive integer; got {args.batch_size}")

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).eval()
    split = load_translation_dataset(args.dataset)[args.split]
    source_lang, target_lang = resolve_languages(split, args.source_lang, args.target_lang)
    sources, references = text_pairs(split, source_lang, target_lang)
    if args.limit:
        sources, references = sources[: args.limit], references[: args.limit]

    print(f"{len(sources)} {source_lang}-{target_lang} sentences ({args.dataset} {args.split}), batches of "
          f"{args.batch_size}, {torch.get_num_threads()} torch threads\n")
    print("| decoding | BLEU | chrF | length ratio | sentences/s | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, options in ROWS.items():
        hypotheses, seconds, generated = translate(model, tokenizer, sources, args.batch_size, options)
        bleu = sacrebleu.corpus_bleu(hypotheses, [references])
        chrf = sacrebleu.corpus_chrf(hypotheses, [references])
        print(f"| {name} | {bleu.score:.2f} | {chrf.score:.2f} | {bleu.sys_len / bleu.ref_len:.3f} | "
              f"{len(sources) / seconds:.1f} | {generated / seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
