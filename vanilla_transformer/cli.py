"""The `vanilla-transformer` command line: one sub-command per job.

Each sub-command has an `_add_<name>` function that declares its arguments and
points `func` at the code that runs it; heavy imports happen inside the
runners so that `vanilla-transformer --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys


def _add_train_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-tokenizer",
        help="learn a joint BPE vocabulary for both languages",
        description="Learn one byte-level BPE vocabulary shared by the source and target languages "
        "(lossless: decode(encode(x)) == x for any text) and save it as a transformers tokenizer folder.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--dataset",
        default="bible-en-es",
        help="embedded corpus (bible-en-es, bible-en-fr), local .json/.jsonl/.csv/.tsv/.parquet file "
        "(optionally .gz), folder of split files or save_to_disk folder, or Hub data set name "
        "(default: %(default)s); both language sides of its train split are read",
    )
    source.add_argument(
        "--text-files", nargs="+", metavar="FILE", help="plain UTF-8 text files, one text per line, instead of --dataset"
    )
    p.add_argument("--dataset-config", help="Hub data set configuration, e.g. de-en")
    p.add_argument("--source-lang", help="source language key (default: the corpus pair, or all keys of the data set)")
    p.add_argument("--target-lang", help="target language key")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=8000,  # DEFAULT_VOCAB_SIZE, not imported so that --help stays instant
        help="joint vocabulary size (default: %(default)s). The paper's 37k was for 4.5M pairs; on the "
        "~29k-pair Bible corpora 8k is the knee: 16k shortens sequences by only 5-8%% while a quarter of its "
        "entries are seen fewer than 10 times in training",
    )
    p.add_argument("--min-frequency", type=int, default=2, help="least count of a pair to merge (default: %(default)s)")
    p.add_argument(
        "--special-tokens", nargs="*", default=[], metavar="TOKEN",
        help="extra special tokens after <pad> <s> </s> <unk>, e.g. language tags",
    )
    p.add_argument(
        "--output-dir", required=True,
        help="folder to write tokenizer.json and tokenizer_config.json into (a model folder is fine)",
    )

    def run(args: argparse.Namespace) -> int:
        import time

        from .corpora import iter_texts, language_keys, load_translation_dataset, resolve_languages
        from .tokenization_vanilla_transformer import read_text_files, train_tokenizer

        try:  # bad input is a usage error: one clear line, exit status 2, nothing written
            if args.text_files:
                sides = {"text": list(read_text_files(args.text_files))}
            else:
                data = load_translation_dataset(
                    args.dataset, args.dataset_config, source_lang=args.source_lang, target_lang=args.target_lang
                )
                train = data["train"] if "train" in data else next(iter(data.values()))
                langs = (
                    resolve_languages(train, args.source_lang, args.target_lang)
                    if args.source_lang or args.target_lang
                    else language_keys(train)
                )
                sides = {lang: list(iter_texts(data, [lang])) for lang in langs}
            start = time.perf_counter()
            tokenizer = train_tokenizer(
                [text for texts in sides.values() for text in texts],
                vocab_size=args.vocab_size,
                min_frequency=args.min_frequency,
                special_tokens=args.special_tokens,
                output_dir=args.output_dir,
            )
        except (OSError, ValueError) as err:
            p.error(str(err))
        seconds = time.perf_counter() - start
        lengths = ", ".join(
            f"{lang} {sum(map(len, tokenizer(texts, add_special_tokens=False)['input_ids'])) / max(len(texts), 1):.1f}"
            for lang, texts in sides.items()
        )
        print(f"vocabulary of {len(tokenizer)} tokens learnt in {seconds:.1f} s, saved to {args.output_dir}")
        print(f"mean tokens per sentence (without </s>): {lengths}")
        return 0

    p.set_defaults(func=run)


def _add_train(sub: argparse._SubParsersAction) -> None:
    pass  # issue 4


def _add_translate(sub: argparse._SubParsersAction) -> None:
    pass  # issue 5


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    pass  # issue 5


def _add_attention(sub: argparse._SubParsersAction) -> None:
    pass  # issue 5


def _add_push(sub: argparse._SubParsersAction) -> None:
    pass  # issue 5


def _add_quickstart(sub: argparse._SubParsersAction) -> None:
    pass  # issue 7


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vanilla-transformer",
        description="Train, translate with and look inside the Transformer of 'Attention Is All You Need'.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_train_tokenizer, _add_train, _add_translate, _add_evaluate, _add_attention, _add_push, _add_quickstart):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
