"""The `vanilla-transformer` command line: one sub-command per job.

Each sub-command has an `_add_<name>` function that declares its arguments and
points `func` at the code that runs it; heavy imports happen inside the
runners so that `vanilla-transformer --help` stays instant. `train`'s options
are generated from the fields of `TrainingArguments` (training/arguments.py,
which imports no torch); an option other commands share with it takes its
default and help from there (`_add_data_options`, `_add_vocab_size`,
`_add_beam_options`), and one several other commands take is declared once
(`_add_model_option`, `_add_decoding_options`).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import NoReturn

from .training.arguments import add_arguments, argparse_options


def _refuse(parser: argparse.ArgumentParser, err: Exception) -> NoReturn:
    """A bad value or file: one line naming it, exit status 2; a full disk is no usage error: status 1.
    (argparse's own `error`, which also prints the usage, is for arguments that are malformed.)"""
    full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
    parser.exit(1 if full else 2, f"{parser.prog}: error: {err}\n")


def _add_data_options(
    p: argparse.ArgumentParser, reads: str, languages: str = "the corpus pair, or the two keys there are",
    text_files: bool = False, dataset: str | None = "bible-en-es",
) -> argparse._ArgumentGroup:
    """The data set and its two language keys, as `train`, `evaluate` and `train-tokenizer` read them
    (`reads`: what the command reads of it; `text_files`: or plain text files instead; `dataset`: the
    default, None for the model's own). Returns the group, for the command's own data options."""
    data = p.add_argument_group("data")
    source = data.add_mutually_exclusive_group() if text_files else data
    shown = "%(default)s" if dataset else "the data set recorded in the model's config.json"
    options = argparse_options("dataset", default=dataset, shown_default=shown)
    source.add_argument("--dataset", **{**options, "help": f"{options['help']}; {reads}"})
    if text_files:
        source.add_argument("--text-files", nargs="+", metavar="FILE",
                            help="plain UTF-8 text files, one text per line, instead of --dataset")
    data.add_argument("--dataset-config", **argparse_options("dataset_config"))
    data.add_argument("--source-lang", help=f"source language key (default: {languages})")
    data.add_argument("--target-lang", help="target language key")
    return data


def _add_vocab_size(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--vocab-size", **argparse_options("vocab_size"))


def _add_train_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-tokenizer",
        help="learn a joint BPE (or unigram) vocabulary for both languages",
        description="Learn one byte-level BPE (or unigram) vocabulary shared by the source and target languages "
        "(lossless: decode(encode(x)) == x for any text) and save it as a transformers tokenizer folder.",
    )
    _add_data_options(p, reads="both language sides of its train split are read",
                      languages="the corpus pair, or all keys of the data set", text_files=True)
    vocabulary = p.add_argument_group("vocabulary")
    _add_vocab_size(vocabulary)
    vocabulary.add_argument(
        "--model-type", choices=("bpe", "unigram"), default="bpe",  # tokenizer.MODEL_TYPES
        help="bpe: merges of frequent pairs (the paper's byte-pair encoding, §5.1); unigram: SentencePiece's unigram "
        "language model, over the same bytes (default: %(default)s)",
    )
    vocabulary.add_argument("--min-frequency", type=int, default=2,
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

    def run(args: argparse.Namespace) -> int:
        import time

        from .tokenizer import train_tokenizer

        try:  # bad input is a usage error: one clear line, exit status 2, nothing written
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
        except (OSError, ValueError) as err:
            _refuse(p, err)
        seconds = time.perf_counter() - start
        lengths = ", ".join(
            f"{lang} {sum(map(len, tokenizer(texts, add_special_tokens=False)['input_ids'])) / max(len(texts), 1):.1f}"
            for lang, texts in sides.items()
        )
        print(f"vocabulary of {len(tokenizer)} tokens learnt in {seconds:.1f} s, saved to {args.output_dir}")
        print(f"mean tokens per sentence (without </s>): {lengths}")
        return 0

    p.set_defaults(func=run)


def _check_no_model(output_dir: str) -> None:
    """A trained model's tokenizer is part of the model: train-tokenizer never replaces it."""
    from pathlib import Path

    from .inference import WEIGHT_FILES

    weights = [name for name in WEIGHT_FILES if (Path(output_dir) / name).exists()]
    if weights:
        raise ValueError(f"--output-dir {output_dir} holds a trained model ({', '.join(weights)}) whose tokenizer a new "
                         "vocabulary would replace; give another --output-dir")


def _texts_by_language(args: argparse.Namespace) -> dict[str, list[str]]:
    """train-tokenizer's texts by language key ("text" for --text-files), for the lengths it reports."""
    from .corpora import iter_texts, language_keys, load_translation_dataset, resolve_languages
    from .tokenizer import read_text_files

    if args.text_files:
        return {"text": list(read_text_files(args.text_files))}
    data = load_translation_dataset(
        args.dataset, args.dataset_config, source_lang=args.source_lang, target_lang=args.target_lang
    )
    train = data["train"] if "train" in data else next(iter(data.values()))
    langs = (
        resolve_languages(train, args.source_lang, args.target_lang)
        if args.source_lang or args.target_lang
        else language_keys(train)
    )
    return {lang: list(iter_texts(data, [lang])) for lang in langs}


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        # Every option in the usage line would fill a screen; they follow, by group.
        usage="%(prog)s --output-dir OUTPUT_DIR [option ...]",
        help="train a model from scratch, fine-tune one, or resume a run (also under `accelerate launch`)",
        description="Train the paper's Transformer with its recipe (§5): token-count batches, Adam with the "
        "warm-up / inverse-square-root schedule, label smoothing, checkpoint averaging, beam-search BLEU. "
        "Runs on one CPU or GPU as is, and on several processes under `accelerate launch -m "
        "vanilla_transformer.cli train ...`. The output folder ends as a complete Hub repository.",
    )
    add_arguments(p)  # one option per TrainingArguments field

    def run(args: argparse.Namespace) -> int:
        from .training.arguments import TrainingArguments
        from .training.loop import train
        from .training.run_folder import TrainingInterrupted, restore_options

        options = {k: v for k, v in vars(args).items() if k not in ("command", "func", "argv")}
        options["config_overrides"] = _parse_overrides(p, args.config_overrides)
        try:  # bad input is a usage error: one clear line, exit status 2
            if args.resume:  # the options not typed are the run's own
                given = _typed_options(args.argv)
                options = restore_options(args.output_dir, {k: v for k, v in options.items() if k in given})
            train(TrainingArguments(**options))
        except (OSError, ValueError) as err:
            _refuse(p, err)
        except FloatingPointError as err:
            print(f"vanilla-transformer train: error: {err}", file=sys.stderr)
            return 1
        except TrainingInterrupted as err:  # SIGINT/SIGTERM: the last step is saved; one line, 128 + signal
            print(f"vanilla-transformer train: {err}", file=sys.stderr)
            return err.exit_code
        return 0

    p.set_defaults(func=run)


def _typed_options(argv: list[str]) -> set[str]:
    """The `train` options typed on the command line `argv` (abbreviated or not), as TrainingArguments names them."""
    import dataclasses

    from .training.arguments import TrainingArguments, argparse_options

    parser = argparse.ArgumentParser(add_help=False)
    for f in dataclasses.fields(TrainingArguments):
        parser.add_argument("--" + f.name.replace("_", "-"),
                            **argparse_options(f.name, default=argparse.SUPPRESS, required=False))
    return set(vars(parser.parse_known_args(argv)[0]))


def _parse_overrides(p: argparse.ArgumentParser, text: str) -> dict:
    """--config-overrides as a dict, each value read as JSON where it is JSON, else kept as a string."""
    import json

    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            p.error(f"--config-overrides: expected KEY=VALUE pairs separated by commas; got {item!r}")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value.strip()  # a bare string such as position_encoding=learned
    return overrides


def _add_model_option(p: argparse.ArgumentParser, engines: bool = False) -> None:
    """--model, the folder or Hub id to load; `engines`: or, with --engine ctranslate2, an exported folder."""
    exported = "; with --engine ctranslate2, a folder written by `export`" if engines else ""
    p.add_argument("--model", required=True,
                   help=f"model folder (written by training or save_for_hub) or Hub id user/name{exported}")


def _add_translate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "translate",
        help="translate text from arguments, a file or standard input",
        description="Translate each text (each argument, or each line of --input-file or standard input) and "
        "write one line per input line to standard output (--nbest N: N lines, best first). Blank lines stay "
        "blank. Standard input is line in, line out: a line is translated as soon as it arrives, with the lines "
        "already waiting behind it. Uses the GPU when there is one.",
    )
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to translate (default: read lines from --input-file or standard input)")
    _add_model_option(p, engines=True)
    p.add_argument("--input-file", help="UTF-8 text file, one text per line ('-' = standard input)")
    output = p.add_argument_group("output")
    output.add_argument("--nbest", type=int, default=1, metavar="N",
                        help="write the N best translations of each text, best first, one a line (the beam is widened "
                        "to N where it is narrower) (default: %(default)s)")
    output.add_argument("--with-scores", action="store_true",
                        help="start each line with the translation's score and a tab: the log-probability the search "
                        "ranks it by (beam search's divided by its length penalty)")
    _add_decoding_options(p)

    def run(args: argparse.Namespace) -> int:
        try:
            if args.texts and args.input_file:
                raise ValueError("give texts as arguments or --input-file, not both")
            _decoding_options(args)  # bad options fail before reading the input
            _check_nbest_options(args)
            texts = args.texts or _read_lines(args.input_file or "-", "--input-file")
            translate = _translator(args)[0]
        except (OSError, ValueError, TypeError, ImportError) as err:
            _refuse(p, err)
        stdin = not args.texts and args.input_file in (None, "-")
        batches = _batches_as_they_come(texts, args.batch_size) if stdin else _batches_of(texts, args.batch_size)
        # Batch by batch, each written as it is done: a pipe sees lines at once, an interrupt keeps them.
        for translations in _translated_batches(p, batches, translate):
            print("\n".join(translations), flush=True)
        return 0

    p.set_defaults(func=run)


def _add_decoding_options(p: argparse.ArgumentParser, batches: bool = True) -> None:
    """Decoding options; `batches`: also the engine and --batch-size (commands translating many texts)."""
    decoding = p.add_argument_group("decoding")
    if batches:
        decoding.add_argument(
            "--engine", choices=("transformers", "ctranslate2"), default="transformers",
            help="transformers: a model folder or Hub id, decoded by its own generate (the paper's search); "
            "ctranslate2: a folder written by `export --format ctranslate2`, decoded by CTranslate2 with the "
            "folder's defaults (its length penalty and stopping differ slightly: see the folder's README) "
            "(default: %(default)s)",
        )
        decoding.add_argument("--batch-size", type=int, default=32, help="texts per batch (default: %(default)s)")
    _add_beam_options(decoding)
    decoding.add_argument("--max-new-tokens", type=int, help="longest translation in tokens (default: input length + 50, §6.1)")
    decoding.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: the GPU when there is one)")


def _add_beam_options(group: argparse._ArgumentGroup) -> None:
    """--num-beams and --length-penalty as `train` declares them, but None by default: the model's own."""
    for name in ("num_beams", "length_penalty"):
        group.add_argument("--" + name.replace("_", "-"),
                           **argparse_options(name, default=None, shown_default="the model's"))


def _decoding_options(args: argparse.Namespace) -> dict:
    """The decoding options given (and --batch-size where the command has it), checked."""
    from .modeling.checks_vanilla_transformer import check_decoding_options

    batches = {"batch_size": args.batch_size} if hasattr(args, "batch_size") else {}
    if batches and args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1; got {args.batch_size}")
    decoding = {name: getattr(args, name) for name in ("num_beams", "length_penalty", "max_new_tokens")}
    check_decoding_options(**decoding, names={name: "--" + name.replace("_", "-") for name in decoding})
    if getattr(args, "device", None) is not None and getattr(args, "engine", "transformers") != "ctranslate2":
        check_device(args.device)  # CTranslate2 names the devices it takes itself
    return {**batches, **decoding}


def check_device(device: str) -> None:
    """--device names a device this machine has, or a ValueError says which it has."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device; expected cpu, cuda, cuda:N or mps") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(kind, True):
        raise ValueError(f"--device {device}: this machine has no {kind.upper()} device; use --device cpu")


def _check_nbest_options(args: argparse.Namespace) -> None:
    from .modeling.checks_vanilla_transformer import MAX_NUM_BEAMS

    if not 1 <= args.nbest <= MAX_NUM_BEAMS:
        raise ValueError(f"--nbest must be between 1 and {MAX_NUM_BEAMS} (the beam holds N hypotheses); got {args.nbest}")
    if (args.nbest > 1 or args.with_scores) and args.engine == "ctranslate2":
        raise ValueError("--nbest and --with-scores are for --engine transformers; CTranslate2 gives one translation")


def _translator(args: argparse.Namespace):
    """(texts -> output lines, the model's config or None for an export), with the engine, model and
    decoding options the command line names; with --nbest or --with-scores, each text's output is its
    N best translations on N lines, each after its score and a tab with --with-scores."""
    options = _decoding_options(args)
    nbest, with_scores = getattr(args, "nbest", 1), getattr(args, "with_scores", False)
    if nbest > 1 or with_scores:
        from .inference import load_model, translate_nbest

        model, tokenizer = load_model(args.model, args.device)

        def translate(texts, first_line=1):
            # A blank line stays blank, without a score: nothing was translated.
            return ["\n".join(f"{score:.4f}\t{text}" if with_scores and source.strip() else text for text, score in hypotheses)
                    for source, hypotheses in zip(texts, translate_nbest(model, tokenizer, texts, nbest=nbest, **options))]

        return translate, model.config
    if args.engine == "ctranslate2":
        from .export.ctranslate2 import CTranslate2Translator

        translator = CTranslate2Translator(args.model, args.device)
        return (lambda texts, first_line=1: translator.translate(texts, first_line=first_line, **options)), None
    from .inference import load_model, translate_texts

    model, tokenizer = load_model(args.model, args.device)
    return (lambda texts, first_line=1: translate_texts(model, tokenizer, texts, first_line=first_line, **options)), \
        model.config


def _translated_batches(p: argparse.ArgumentParser, batches, translate):
    """The translations of each batch; bad input met on the way (a line that is not UTF-8) is refused as if
    met first. (Writing them is the caller's: a full disk or a closed pipe is no input error.)"""
    while True:
        try:
            first_line, batch = next(batches)
            translations = translate(batch, first_line=first_line)
        except StopIteration:
            return
        except (OSError, ValueError, TypeError, ImportError) as err:
            _refuse(p, err)
        yield translations


def _batches_of(texts, size: int):
    """(line number of the first, list of up to `size` texts) for each batch of an iterable of texts."""
    batch, first = [], 1
    for number, text in enumerate(texts, 1):
        batch.append(text)
        if len(batch) == size:
            yield first, batch
            batch, first = [], number + 1
    if batch:
        yield first, batch


def _batches_as_they_come(texts, size: int):
    """As `_batches_of`, for lines that arrive one by one (a person typing): a batch is the next line and
    those already waiting behind it, so that each line is answered as soon as it comes."""
    import queue
    import threading

    waiting = queue.Queue(maxsize=4 * size)  # a fast pipe waits for the translations instead of filling memory
    end = object()

    def read():
        try:
            for text in texts:
                waiting.put(text)
        except (OSError, ValueError) as err:  # a line that is not UTF-8: refused once the lines before it are out
            waiting.put(err)
            return
        waiting.put(end)

    threading.Thread(target=read, daemon=True).start()  # daemon: a reader blocked on a terminal does not hold the exit
    first, last = 1, None
    while last is None:
        batch, item = [], waiting.get()
        while True:
            if item is end or isinstance(item, Exception):
                last = item
                break
            batch.append(item)
            if len(batch) == size or waiting.empty():
                break
            item = waiting.get()
        if batch:
            yield first, batch
            first += len(batch)
    if last is not end:
        raise last


def _read_lines(path: str, option: str):
    """The lines of a file or of standard input ("-"), read as they are used; a file that cannot be opened
    fails here, before the model is loaded, in an error naming `option`."""
    from .file_checks import utf8_lines

    if path != "-":
        try:
            file = open(path, "rb")
        except OSError as err:
            raise ValueError(f"{option} {path}: {err.strerror or err}") from None
        return _lines_of(file, path)
    closed = ValueError("standard input is closed; give the texts as arguments or with --input-file")
    if sys.stdin is None or sys.stdin.closed:  # started with it closed (`<&-`)
        raise closed

    def stdin_lines():
        try:
            yield from utf8_lines(sys.stdin.buffer, "standard input")
        except OSError as err:
            if err.errno == errno.EBADF:
                raise closed from None
            raise

    return stdin_lines()


def _lines_of(file, path: str):
    from .file_checks import utf8_lines

    with file:
        yield from utf8_lines(file, path)


def _check_output_file(option: str, path: str | None) -> None:
    """Before the work whose result goes there, not after it."""
    import os
    from pathlib import Path

    from .file_checks import check_plain_file

    if path is None:
        return
    folder = Path(path).parent
    if Path(path).is_dir():
        raise ValueError(f"{option} {path} is a folder; give the name of a file to write")
    check_plain_file(path, f"{option} {path}")
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: there is no folder {folder} to write it in")
    if not os.access(folder, os.W_OK) or (Path(path).exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{option} {path}: not allowed to write there")


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="BLEU and chrF of a model on a data set split (sacrebleu)",
        description="Translate the source side of a data set split and score it against the target side with "
        "sacrebleu's corpus BLEU and chrF (its command line's defaults: 13a tokenisation, detokenised text), "
        "printing the scores and their signatures. The same numbers come from "
        "`sacrebleu REFERENCES -i HYPOTHESES -m bleu chrf` on the files that --hypotheses-out and --references-out write.",
    )
    _add_model_option(p, engines=True)
    data = _add_data_options(p, reads="its --split is translated and scored", dataset=None,
                             languages="the model's, for its own data set; else the corpus pair, or the two keys there are")
    data.add_argument("--split", help="split to score: train, validation (or valid, dev), test (default: test)")
    data.add_argument("--source-file", help="instead of --dataset: UTF-8 text file of sources, one a line")
    data.add_argument("--reference-file", help="with --source-file: their reference translations, line by line")
    data.add_argument("--max-samples", type=int, help="score only the first N pairs (a quick look)")
    files = p.add_argument_group("output files (for the sacrebleu command line)")
    files.add_argument("--hypotheses-out", help="write the translations here, one per line")
    files.add_argument("--references-out", help="write the references here, one per line")
    _add_decoding_options(p)

    def run(args: argparse.Namespace) -> int:
        import time

        from .file_checks import write_text_file
        from .inference import score_translations
        from .modeling.pipeline_vanilla_transformer import language_pair_mismatch

        try:
            _decoding_options(args)  # bad options fail before the data set is read
            _check_evaluation_options(args)
            what, source_lang, target_lang, pairs = _evaluation_pairs(args)
            sources, references = _complete_pairs(args, pairs, what)
            translate, config = _translator(args)
            mismatch = config is not None and source_lang and language_pair_mismatch(config, source_lang, target_lang)
            if mismatch:
                print(f"warning: {mismatch}; scoring {what} ({source_lang}->{target_lang}) anyway", file=sys.stderr)
            start = time.perf_counter()
            hypotheses = translate(sources)
            seconds = time.perf_counter() - start
            scores = score_translations(hypotheses, references)
            for path, lines in ((args.hypotheses_out, hypotheses), (args.references_out, references)):
                if path:  # a temporary file renamed into place: a full disk leaves no partial file
                    write_text_file(path, "".join(line + "\n" for line in lines))
        except (OSError, ValueError, TypeError, ImportError) as err:
            _refuse(p, err)
        pair = f" {source_lang}->{target_lang}" if source_lang else ""
        print(f"{what}{pair}: {len(sources)} segments translated in {seconds:.1f} s ({args.engine})")
        print(scores["bleu_text"])
        print(f"  signature: {scores['bleu_signature']}")
        print(scores["chrf_text"])
        print(f"  signature: {scores['chrf_signature']}")
        return 0

    p.set_defaults(func=run)


def _evaluation_pairs(args: argparse.Namespace) -> tuple[str, str | None, str | None, list[tuple[str, str]]]:
    """(what is scored, its source and target language keys, its (source, reference) pairs): the two files,
    else the --split of --dataset, else of the data set the model records."""
    if args.source_file or args.reference_file:
        if not (args.source_file and args.reference_file):
            raise ValueError("--source-file and --reference-file go together: give both")
        if args.dataset:
            raise ValueError("give --dataset or --source-file and --reference-file, not both")
        if args.split:
            raise ValueError("--split picks a split of --dataset; --source-file and --reference-file are scored whole")
        sides = [list(_read_lines(path, option)) for path, option in ((args.source_file, "--source-file"),
                                                                      (args.reference_file, "--reference-file"))]
        if len(sides[0]) != len(sides[1]):
            raise ValueError(f"--source-file {args.source_file} has {len(sides[0])} lines and --reference-file "
                             f"{args.reference_file} {len(sides[1])}; they must translate each other line by line")
        return f"{args.source_file} against {args.reference_file}", args.source_lang, args.target_lang, \
            list(zip(*sides))
    from .corpora import SPLIT_NAMES, load_translation_dataset, resolve_languages, text_pairs

    dataset, source_lang, target_lang = args.dataset, args.source_lang, args.target_lang
    if dataset is None:
        dataset, source_lang, target_lang = _recorded_data(args.model, source_lang, target_lang)
    data = load_translation_dataset(dataset, args.dataset_config, source_lang=source_lang, target_lang=target_lang)
    asked = args.split or "test"
    split = next((name for name, names in SPLIT_NAMES.items() if asked in names), asked)
    if split not in data:
        raise ValueError(f"--split {asked!r} is not in {dataset}; it has {', '.join(data)}")
    source_lang, target_lang = resolve_languages(data[split], source_lang, target_lang)
    return f"{dataset} {asked}", source_lang, target_lang, \
        list(zip(*text_pairs(data[split], source_lang, target_lang)))


def _recorded_data(model: str, source_lang: str | None, target_lang: str | None) -> tuple[str, str, str]:
    """The data set and language pair that the model's config.json records (training writes them), the
    languages given on the command line taking precedence."""
    from pathlib import Path

    from .file_checks import read_json
    from .inference import check_config_file

    path = Path(model) / "config.json"
    if path.is_file():
        check_config_file(path)
        config = read_json(path)
    else:  # a Hub id: its config, or an OSError saying why not
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model, trust_remote_code=False).to_dict()  # never a question
    if not config.get("dataset_name"):
        raise ValueError(f"--dataset: {model} records no data set (its config.json has no dataset_name); name one with "
                         "--dataset, or give --source-file and --reference-file")
    return config["dataset_name"], source_lang or config.get("source_lang"), target_lang or config.get("target_lang")


def _check_evaluation_options(args: argparse.Namespace) -> None:
    """--max-samples and the output files, before the translating."""
    from .file_checks import check_outputs_apart

    if args.max_samples is not None and args.max_samples < 1:
        raise ValueError(f"--max-samples must be at least 1; got {args.max_samples}")
    _check_output_file("--hypotheses-out", args.hypotheses_out)
    _check_output_file("--references-out", args.references_out)
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
        raise ValueError(f"{what} has no pair with text on both sides")
    sources, references = map(list, zip(*pairs))
    # sacrebleu reads one segment per line: a newline inside a reference would shift every line after it.
    return sources, [" ".join(text.splitlines()) for text in references]


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a model for deployment with CTranslate2",
        description="Convert a model folder (or Hub id) into a CTranslate2 folder that works on its own: the "
        "CTranslate2 model, the tokenizer (tokenizer.json), the decoding defaults (translation_options.json) and "
        "a README with a Python example. Needs `pip install 'vanilla-transformer[ctranslate2]'`.",
    )
    _add_model_option(p)
    p.add_argument("--format", required=True, choices=("ctranslate2",), help="what to export to")
    p.add_argument("--output-dir", required=True, help="new folder for the export (it must not exist, or be empty)")
    p.add_argument(
        "--quantization", default="float32",
        # QUANTIZATIONS, not imported so that --help stays instant
        choices=("float32", "int8", "int8_float32", "float16", "int8_float16", "bfloat16"),
        help="weight precision: int8 weights are 4x smaller and usually faster on CPUs; float16 and bfloat16 "
        "are for GPUs (CTranslate2 converts on loading where a type is not supported) (default: %(default)s)",
    )

    def run(args: argparse.Namespace) -> int:
        import shlex

        from .export.ctranslate2 import export_ctranslate2
        from .inference import load_model

        try:
            model, tokenizer = load_model(args.model, "cpu")
            folder = export_ctranslate2(model, tokenizer, args.output_dir, args.quantization)
        except (OSError, ValueError, ImportError) as err:
            _refuse(p, err)
        size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
        print(f"exported {args.model} to {folder} ({args.quantization} weights, {size:.1f} MB); try it with\n"
              f"  vanilla-transformer translate --engine ctranslate2 --model {shlex.quote(str(folder))} \"Jesus wept.\"")
        return 0

    p.set_defaults(func=run)


def _add_attention(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "attention",
        help="translate a sentence and show every attention layer and head (PNG heat maps, an HTML explorer)",
        description="Translate one sentence and show its attention. --output-dir (the default) writes heat maps of "
        "encoder self-attention, decoder self-attention and cross-attention: <kind>_layer<N>.png (every head of one "
        "layer in a grid), overview.png (every layer, mean of heads), and bertviz.pt for bertviz in a notebook: "
        "`model_view(**torch.load('bertviz.pt'))`. --html writes one self-contained page to explore every layer and "
        "head in a browser, offline: lines and heat maps, stepping through the translation.",
    )
    p.add_argument("text", help="the sentence to translate")
    _add_model_option(p)
    p.add_argument("--output-dir", help="folder for the images (default: attention, unless only --html is given)")
    p.add_argument("--html", metavar="FILE", help="write the interactive explorer to this .html file")
    _add_decoding_options(p, batches=False)

    def run(args: argparse.Namespace) -> int:
        import signal

        from .visualize.attention_maps import collect_attentions, save_attention_maps
        from .inference import load_model

        signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: the staging folder is removed
        try:
            options = _decoding_options(args)
            if args.html:
                from .visualize.explorer import html_path, save_explorer

                html_path(args.html, "--html")  # before a translation that may take a while
            model, tokenizer = load_model(args.model, args.device)
            record = collect_attentions(model, tokenizer, args.text, **options)
            written = []
            if args.html:
                written.append(save_explorer(record, args.html))
            if args.output_dir or not args.html:
                written += save_attention_maps(record, args.output_dir or "attention")
        except (OSError, ValueError, TypeError) as err:
            _refuse(p, err)
        print(f"{record.source}\n-> {record.translation}")
        print(f"{len(written)} files written:", " ".join(str(path) for path in written))
        return 0

    p.set_defaults(func=run)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="a local web app to try a model: translation, decoding options, attention explorer (Gradio)",
        description="Serve a Gradio app for one model: a text box, its translation, decoding options and the "
        "attention explorer of the sentence typed. It loads nothing from other hosts. Needs the serve extra: "
        "pip install 'vanilla-transformer[serve]'. The same code runs as a Hub Space: see vanilla_transformer/visualize/app.py.",
    )
    _add_model_option(p)
    p.add_argument("--host", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, help="port (default: 7860, or the next free one)")
    p.add_argument("--device", help="cpu, cuda, mps (default: the GPU when there is one)")
    limits = p.add_argument_group(
        "limits", "what one visitor may ask; a request beyond them is refused with a message naming the limit. "
        "Each defaults to its VANILLA_TRANSFORMER_<NAME> environment variable (as a Space sets it), else the value shown")
    # The defaults are Limits' (vanilla_transformer/visualize/app.py), written out so that --help stays instant.
    limits.add_argument("--max-input-tokens", type=int, metavar="N", help="longest sentence in tokens (128)")
    limits.add_argument("--max-new-tokens", type=int, metavar="N", help="longest output in tokens (256)")
    limits.add_argument("--max-beams", type=int, metavar="N", help="largest beam size (8)")
    limits.add_argument("--max-concurrent", type=int, metavar="N", help="requests translated at once (1)")
    limits.add_argument("--max-queued", type=int, metavar="N", help="requests waiting their turn; more are refused (8)")
    limits.add_argument("--request-timeout", type=int, metavar="SECONDS",
                        help="time a client may take to send a request's body; a slower one is answered 408 (30)")

    def run(args: argparse.Namespace) -> int:
        try:
            if args.port is not None and not 0 < args.port < 65536:
                raise ValueError(f"--port must be in 1..65535; got {args.port}")
            from .visualize.app import Limits, serve

            limits = Limits.from_environment(**{name: getattr(args, name) for name in (
                "max_input_tokens", "max_new_tokens", "max_beams", "max_concurrent", "max_queued", "request_timeout")})
            serve(args.model, args.host, args.port, args.device, limits)
        except (OSError, ValueError, ImportError) as err:
            _refuse(p, err)
        return 0

    p.set_defaults(func=run)


def _add_push(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "push",
        help="upload a saved model folder to the Hugging Face Hub",
        description="Check that a folder written by training (or save_for_hub) is complete, then upload all of "
        "it (weights, code, tokenizer, pipeline, card, images) to a Hub model repository in one commit. The "
        "token comes from HF_TOKEN or `hf auth login`.",
    )
    p.add_argument("--folder", required=True, help="the model folder")
    p.add_argument("--repo-id", required=True, help="Hub repository, user-or-org/name (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repository as private")

    def run(args: argparse.Namespace) -> int:
        from .hub import push_folder

        try:
            url = push_folder(args.folder, args.repo_id, private=args.private)
        except (OSError, ValueError) as err:
            _refuse(p, err)
        print(f"uploaded {args.folder} to {url}")
        return 0

    p.set_defaults(func=run)


def _add_quickstart(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quickstart",
        help="train, score, translate and draw attention on the embedded corpus in one go",
        description="Train a tokenizer and a Transformer on the embedded English-Spanish Bible, score the test "
        "split (BLEU, chrF), translate three verses with the saved pipeline, draw attention heat maps and leave "
        "a Hub-ready folder with a model card. Needs no network; uses the GPU when there is one.",
    )
    p.add_argument("--output-dir", default="runs/quickstart", help="where the model folder goes (default: %(default)s)")
    p.add_argument("--minutes", type=float, default=15.0,
                   help="time budget for the whole job; training gets all but what scoring and saving need (default: %(default)s)")
    p.add_argument("--size", choices=["tiny", "small", "base"],
                   help="model size: the paper's base model (default on a GPU), a d_model 192 model with 2 encoder "
                   "and 4 decoder layers and d_ff 256 (default on a CPU), or tiny (for tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test-samples", type=int, help="score only the first N test pairs (default: all 634)")

    def run(args: argparse.Namespace) -> int:
        from .quickstart import quickstart

        try:  # bad input is a usage error: one clear line, exit status 2
            quickstart(args.output_dir, args.minutes, args.size, args.seed, args.test_samples)
        except (OSError, ValueError) as err:
            _refuse(p, err)
        return 0

    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vanilla-transformer",
        description="Train, translate with and look inside the Transformer of 'Attention Is All You Need'.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_train_tokenizer, _add_train, _add_translate, _add_evaluate, _add_export, _add_attention, _add_serve,
                _add_push, _add_quickstart):
        add(sub)
    return parser


_TEXT_ARGUMENTS = {"texts": "TEXT", "text": "text", "special_tokens": "--special-tokens", "source_lang": "--source-lang",
                   "target_lang": "--target-lang"}


def _check_text_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Text given as an argument must be UTF-8: Python keeps another byte as a lone surrogate, which the
    tokenizer would refuse with a TypeError. (Paths may hold any bytes: they are left alone.)"""
    for name, shown in _TEXT_ARGUMENTS.items():
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            bad = next((i for i, c in enumerate(value or "") if "\udc80" <= c <= "\udcff"), None)
            if bad is not None:
                parser.exit(2, f"{parser.prog} {args.command}: error: argument {shown}: byte {ord(value[bad]) - 0xDC00:#04x} "
                               f"at character {bad + 1} is not UTF-8; give the text in UTF-8\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # `train --resume` tells typed options from defaults
    _check_text_arguments(parser, args)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # here, so that a failing write is reported below, not as a traceback at exit
        return code
    except KeyboardInterrupt:  # Ctrl-C outside a training loop: nothing to save, one line instead of a traceback
        print(f"vanilla-transformer {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        return 141
    except OSError as err:
        if sys.stdout is None or err.errno not in (errno.ENOSPC, errno.EBADF, errno.EIO):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"vanilla-transformer {args.command}: error: cannot write the output: {err.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
