"""`vanilla-transformer evaluate`: BLEU and chrF of a model on a data set split or on two files."""

from __future__ import annotations

import argparse
import sys

from ..errors import BadInput
from .options import (
    add_bounded_int,
    add_data_options,
    add_decoding_options,
    add_model_option,
    add_threads_option,
    decoding_options,
    apply_threads_option,
)
from .streams import read_lines


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="BLEU and chrF of a model on a data set split (sacrebleu)",
        description="Translate the source side of a data set split and score it against the target side with "
        "sacrebleu's corpus BLEU and chrF (its command line's defaults: 13a tokenisation, detokenised text), "
        "printing the scores and their signatures. The same numbers come from "
        "`sacrebleu REFERENCES -i HYPOTHESES -m bleu chrf` on the files that --hypotheses-out and --references-out write.",
    )
    add_model_option(p, engines=True)
    data = add_data_options(p, reads="its --split is translated and scored", dataset=None,
                            languages="the model's, for its own data set; else the corpus pair, or the two keys there are")
    data.add_argument("--split", help="split to score: train, validation (or valid, dev), test (default: test)")
    data.add_argument("--source-file", help="instead of --dataset: UTF-8 text file of sources, one a line")
    data.add_argument("--reference-file", help="with --source-file: their reference translations, line by line")
    add_bounded_int(data, "--max-samples", help="score only the first N pairs (a quick look)")
    files = p.add_argument_group("output files (for the sacrebleu command line)")
    files.add_argument("--hypotheses-out", help="write the translations here, one per line")
    files.add_argument("--references-out", help="write the references here, one per line")
    add_decoding_options(p)
    add_threads_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    from ..inference import score_translations
    from ..staging import write_file_whole
    from .translators import translator
    from ..modeling.pipeline_vanilla_transformer import language_pair_mismatch

    options = decoding_options(args)  # bad options fail before the data set is read
    _check_evaluation_options(args)
    apply_threads_option(args)
    what, source_lang, target_lang, pairs = _evaluation_pairs(args)
    sources, references = _complete_pairs(args, pairs, what)
    translate, config = translator(args.model, args.engine, args.device, args.threads, options)
    mismatch = config is not None and source_lang and language_pair_mismatch(config, source_lang, target_lang)
    if mismatch:
        print(f"warning: {mismatch}; scoring {what} ({source_lang}->{target_lang}) anyway", file=sys.stderr)
    start = time.perf_counter()
    hypotheses = translate(sources)
    seconds = time.perf_counter() - start
    scores = score_translations(hypotheses, references)
    for path, lines in ((args.hypotheses_out, hypotheses), (args.references_out, references)):
        if path:  # a temporary file renamed into place: a full disk leaves no partial file
            write_file_whole(path, "".join(line + "\n" for line in lines))
    pair = f" {source_lang}->{target_lang}" if source_lang else ""
    threads = f"{args.threads} CPU thread{'s' * (args.threads != 1)}"
    print(f"{what}{pair}: {len(sources)} segments translated in {seconds:.1f} s on {threads} ({args.engine})")
    print(scores["bleu_text"])
    print(f"  signature: {scores['bleu_signature']}")
    print(scores["chrf_text"])
    print(f"  signature: {scores['chrf_signature']}")
    return 0


def _evaluation_pairs(args: argparse.Namespace) -> tuple[str, str | None, str | None, list[tuple[str, str]]]:
    """(what is scored, its source and target language keys, its (source, reference) pairs): the two files,
    else the --split of --dataset, else of the data set the model records."""
    if args.source_file or args.reference_file:
        if not (args.source_file and args.reference_file):
            raise BadInput("--source-file and --reference-file go together: give both")
        if args.dataset:
            raise BadInput("give --dataset or --source-file and --reference-file, not both")
        if args.split:
            raise BadInput("--split picks a split of --dataset; --source-file and --reference-file are scored whole")
        sides = [list(read_lines(path, option)) for path, option in ((args.source_file, "--source-file"),
                                                                     (args.reference_file, "--reference-file"))]
        if len(sides[0]) != len(sides[1]):
            raise BadInput(f"--source-file {args.source_file} has {len(sides[0])} lines and --reference-file "
                           f"{args.reference_file} {len(sides[1])}; they must translate each other line by line")
        return f"{args.source_file} against {args.reference_file}", args.source_lang, args.target_lang, \
            list(zip(*sides))
    from ..corpora import SPLIT_NAMES, load_translation_dataset, resolve_languages, text_pairs

    dataset, source_lang, target_lang = args.dataset, args.source_lang, args.target_lang
    dataset_config, columns = args.dataset_config, args.columns
    if dataset is None:
        dataset, source_lang, target_lang, recorded = _recorded_data(args.model, source_lang, target_lang)
        dataset_config, columns = dataset_config or recorded["dataset_config"], columns or recorded["dataset_columns"]
    data = load_translation_dataset(dataset, dataset_config, source_lang=source_lang, target_lang=target_lang,
                                    columns=columns)
    asked = args.split or "test"
    split = next((name for name, names in SPLIT_NAMES.items() if asked in names), asked)
    if split not in data:
        raise BadInput(f"--split {asked!r} is not in {dataset}; it has {', '.join(data)}")
    source_lang, target_lang = resolve_languages(data[split], source_lang, target_lang)
    return f"{dataset} {asked}", source_lang, target_lang, \
        list(zip(*text_pairs(data[split], source_lang, target_lang)))


def _recorded_data(model: str, source_lang: str | None, target_lang: str | None) -> tuple[str, str, str, dict]:
    """The data set and language pair that the model's config.json records (training writes them), the
    languages given on the command line taking precedence, and what else reads the data set again: its
    `dataset_config` and `dataset_columns` (each a string or None)."""
    import glob
    import os

    from ..checks.model_folder import check_model_folder
    from ..inference import local_folder

    # through the gate, as every model folder: a damaged or hostile one is refused before its records are read
    config = check_model_folder(local_folder(model)).config.to_dict()
    if not config.get("dataset_name"):
        raise BadInput(f"--dataset: {model} records no data set (its config.json has no dataset_name); name one with "
                       "--dataset, or give --source-file and --reference-file")
    dataset = config["dataset_name"]
    if os.path.isabs(dataset) and not (os.path.exists(dataset) or glob.glob(glob.escape(dataset) + ".*")):
        raise BadInput(f"--dataset: {model} records the data set {dataset}, which is not on this machine; give its "
                       "path here with --dataset, or give --source-file and --reference-file")
    recorded = {name: config.get(name) if isinstance(config.get(name), str) else None
                for name in ("dataset_config", "dataset_columns")}
    return dataset, source_lang or config.get("source_lang"), target_lang or config.get("target_lang"), recorded


def _check_evaluation_options(args: argparse.Namespace) -> None:
    """The output files, before the translating."""
    from ..checks.files import check_output_file, check_outputs_apart

    check_output_file("--hypotheses-out", args.hypotheses_out)
    check_output_file("--references-out", args.references_out)
    check_outputs_apart({"--hypotheses-out": args.hypotheses_out, "--references-out": args.references_out},
                        inputs=[args.dataset, args.source_file, args.reference_file, args.model])


def _complete_pairs(args: argparse.Namespace, pairs: list[tuple[str, str]], what: str) -> tuple[list[str], list[str]]:
    """(sources, references) of the first --max-samples pairs with text on both sides: as training scores a
    split, pairs with a missing or blank side are left out, and counted."""
    incomplete = [row for row, pair in enumerate(pairs, 1) if not all(text and text.strip() for text in pair)]
    if incomplete:
        rows = ", ".join(map(str, incomplete[:10])) + (" ..." if len(incomplete) > 10 else "")
        print(f"note: {len(incomplete)} of {len(pairs)} pairs left out: a side is missing or blank (rows {rows})",
              file=sys.stderr)
    pairs = [pair for pair in pairs if all(text and text.strip() for text in pair)][: args.max_samples]
    if not pairs:
        raise BadInput(f"{what} has no pair with text on both sides")
    sources, references = map(list, zip(*pairs))
    # sacrebleu reads one segment per line: a newline inside a reference would shift every line after it.
    return sources, [" ".join(text.splitlines()) for text in references]
