"""`vanilla-transformer train-tokenizer`: a joint vocabulary for both languages."""

from __future__ import annotations

import argparse

from ..choices import TOKENIZER_MODELS
from ..errors import BadInput
from .options import add_bounded_int, add_data_options, add_vocab_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-tokenizer",
        help="learn a joint BPE (or unigram) vocabulary for both languages",
        description="Learn one byte-level BPE (or unigram) vocabulary shared by the source and target languages "
        "(lossless: decode(encode(x)) == x for any text) and save it as a transformers tokenizer folder.",
    )
    add_data_options(p, reads="both language sides of its train split are read",
                     languages="the corpus pair, or all keys of the data set", text_files=True)
    vocabulary = p.add_argument_group("vocabulary")
    add_vocab_size(vocabulary)
    vocabulary.add_argument(
        "--model-type", choices=TOKENIZER_MODELS, default="bpe",
        help="bpe: merges of frequent pairs (the paper's byte-pair encoding, §5.1); unigram: SentencePiece's unigram "
        "language model, over the same bytes (default: %(default)s)",
    )
    add_bounded_int(vocabulary, "--min-frequency", default=2,
                    help="least count of a pair to merge, for bpe (default: %(default)s)")
    vocabulary.add_argument(
        "--special-tokens", nargs="*", default=[], metavar="TOKEN",
        help="extra special tokens after <pad> <s> </s> <unk>, e.g. language tags",
    )
    p.add_argument(
        "--output-dir", required=True,
        help="folder to write tokenizer.json and tokenizer_config.json into (the --output-dir of a later `train` is "
        "fine; a folder that holds a trained model, whose tokenizer this would replace, is refused)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    from ..tokenizer import train_tokenizer, training_texts

    _check_no_model(args.output_dir)
    sides = _texts_by_language(args)
    start = time.perf_counter()
    tokenizer = train_tokenizer(
        [text for texts in sides.values() for text in texts],
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=args.special_tokens,
        output_dir=args.output_dir,
        model_type=args.model_type,
    )
    seconds = time.perf_counter() - start
    lengths = ", ".join(  # of the texts as the tokenizer learnt from them: a long line cut
        f"{lang} {sum(map(len, tokenizer(training_texts(texts), add_special_tokens=False)['input_ids'])) / max(len(texts), 1):.1f}"
        for lang, texts in sides.items()
    )
    print(f"vocabulary of {len(tokenizer)} tokens learnt in {seconds:.1f} s, saved to {args.output_dir}")
    print(f"mean tokens per sentence (without </s>): {lengths}")
    return 0


def _check_no_model(output_dir: str) -> None:
    """A trained model's tokenizer is part of the model: train-tokenizer never replaces it."""
    from pathlib import Path

    from ..checks.model_folder import WEIGHT_FILES

    weights = [name for name in WEIGHT_FILES if (Path(output_dir) / name).exists()]
    if weights:
        raise BadInput(f"--output-dir {output_dir} holds a trained model ({', '.join(weights)}) whose tokenizer a new "
                       "vocabulary would replace; give another --output-dir")


def _texts_by_language(args: argparse.Namespace) -> dict[str, list[str]]:
    """train-tokenizer's texts by language key ("text" for --text-files), for the lengths it reports."""
    from ..corpora import iter_texts, language_keys, load_translation_dataset, resolve_languages
    from ..tokenizer import read_text_files

    if args.text_files:
        return {"text": list(read_text_files(args.text_files))}
    data = load_translation_dataset(
        args.dataset, args.dataset_config, source_lang=args.source_lang, target_lang=args.target_lang,
        columns=args.columns,
    )
    train = data["train"] if "train" in data else next(iter(data.values()))
    langs = (
        resolve_languages(train, args.source_lang, args.target_lang)
        if args.source_lang or args.target_lang
        else language_keys(train)
    )
    return {lang: list(iter_texts(data, [lang])) for lang in langs}
