"""The `vanilla-transformer` command line: one sub-command per job.

Each sub-command has an `_add_<name>` function that declares its arguments and
points `func` at the code that runs it; heavy imports happen inside the
runners so that `vanilla-transformer --help` stays instant. An option several
commands take is declared once (`_add_model_option`, `_add_data_options`,
`_add_vocab_size`, `_add_beam_options`, `_add_decoding_options`); `train`'s
options come in argument groups, one function each (`_train_<what>_group`).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
from typing import NoReturn


def _refuse(parser: argparse.ArgumentParser, err: Exception) -> NoReturn:
    """A bad value or file: one line naming it, exit status 2; a full disk is no usage error: status 1.
    (argparse's own `error`, which also prints the usage, is for arguments that are malformed.)"""
    full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
    parser.exit(1 if full else 2, f"{parser.prog}: error: {err}\n")


def _add_data_options(
    p: argparse.ArgumentParser, reads: str, languages: str = "the corpus pair, or the two keys there are",
    text_files: bool = False,
) -> argparse._ArgumentGroup:
    """The data set and its two language keys, as `train`, `evaluate` and `train-tokenizer` read them
    (`reads`: what the command reads of it; `text_files`: or plain text files instead). Returns the group,
    for the command's own data options."""
    data = p.add_argument_group("data")
    source = data.add_mutually_exclusive_group() if text_files else data
    source.add_argument(
        "--dataset", default="bible-en-es",
        help="embedded corpus (bible-en-es, bible-en-fr), local .json/.jsonl/.csv/.tsv/.parquet file (optionally .gz) "
        "or folder of split files ({'translation': {lang: text}} rows or one column per language), save_to_disk "
        f"folder, or Hub data set name (default: %(default)s); {reads}",
    )
    if text_files:
        source.add_argument("--text-files", nargs="+", metavar="FILE",
                            help="plain UTF-8 text files, one text per line, instead of --dataset")
    data.add_argument("--dataset-config", help="Hub data set configuration, e.g. de-en")
    data.add_argument("--source-lang", help=f"source language key (default: {languages})")
    data.add_argument("--target-lang", help="target language key")
    return data


def _add_vocab_size(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--vocab-size",
        type=int,
        default=8000,  # DEFAULT_VOCAB_SIZE, not imported so that --help stays instant
        help="size of a new joint vocabulary (default: %(default)s). The paper's 37k was for 4.5M pairs; on the "
        "~29k-pair Bible corpora larger vocabularies shorten sequences little while many entries are too rare "
        "to train (docs/tokenizer.md)",
    )


def _add_train_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-tokenizer",
        help="learn a joint BPE vocabulary for both languages",
        description="Learn one byte-level BPE vocabulary shared by the source and target languages "
        "(lossless: decode(encode(x)) == x for any text) and save it as a transformers tokenizer folder.",
    )
    _add_data_options(p, reads="both language sides of its train split are read",
                      languages="the corpus pair, or all keys of the data set", text_files=True)
    vocabulary = p.add_argument_group("vocabulary")
    _add_vocab_size(vocabulary)
    vocabulary.add_argument("--min-frequency", type=int, default=2,
                            help="least count of a pair to merge (default: %(default)s)")
    vocabulary.add_argument(
        "--special-tokens", nargs="*", default=[], metavar="TOKEN",
        help="extra special tokens after <pad> <s> </s> <unk>, e.g. language tags",
    )
    p.add_argument(
        "--output-dir", required=True,
        help="folder to write tokenizer.json and tokenizer_config.json into (a model folder is fine)",
    )

    def run(args: argparse.Namespace) -> int:
        import time

        from .tokenizer import train_tokenizer

        try:  # bad input is a usage error: one clear line, exit status 2, nothing written
            sides = _texts_by_language(args)
            start = time.perf_counter()
            tokenizer = train_tokenizer(
                [text for texts in sides.values() for text in texts],
                vocab_size=args.vocab_size,
                min_frequency=args.min_frequency,
                special_tokens=args.special_tokens,
                output_dir=args.output_dir,
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
    # One option per TrainingArguments field, with its default written out (importing it would slow --help);
    # tests/training/test_options.py holds the two equal.
    for add_group in (
        _train_data_group, _train_tokenizer_group, _train_model_group, _train_steps_group,
        _train_optimisation_group, _train_checkpoints_group, _train_evaluation_group, _train_output_group,
    ):
        add_group(p)

    def run(args: argparse.Namespace) -> int:
        from .training.arguments import TrainingArguments
        from .training.loop import train
        from .training.run_folder import TrainingInterrupted

        options = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
        options["config_overrides"] = _parse_overrides(p, args.config_overrides)
        try:  # bad input is a usage error: one clear line, exit status 2
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


def _train_data_group(p: argparse.ArgumentParser) -> None:
    data = _add_data_options(p, reads="without a validation split 2%% of train (at most 1000 pairs) is held out")
    data.add_argument("--max-length", type=int, default=256, help="tokens per side, </s> included (default: %(default)s)")
    data.add_argument("--truncate", action="store_true", help="cut longer training pairs to --max-length instead of dropping them")


def _train_tokenizer_group(p: argparse.ArgumentParser) -> None:
    tokenizer = p.add_argument_group("tokenizer")
    tokenizer.add_argument(
        "--tokenizer",
        help="tokenizer folder (default: the one in --output-dir, else the fine-tuned model's, else a new joint BPE "
        "learnt on the train split and saved to --output-dir)",
    )
    _add_vocab_size(tokenizer)


def _train_model_group(p: argparse.ArgumentParser) -> None:
    model = p.add_argument_group("model")
    model.add_argument(
        "--preset", default="tiny", choices=("tiny", "base", "big"),
        help="architecture trained from scratch (default: %(default)s, which trains in minutes on a CPU; "
        "base and big are Table 3's)",
    )
    model.add_argument(
        "--config-overrides", default="", metavar="KEY=VALUE,...",
        help="config fields to change, e.g. 'd_model=256,encoder_layers=3,decoder_layers=3,d_ff=1024,dropout=0.1'",
    )
    model.add_argument("--model-name-or-path", help="saved model folder to fine-tune instead of a preset")


def _train_steps_group(p: argparse.ArgumentParser) -> None:
    steps = p.add_argument_group("batches and steps (training stops at the first limit reached)")
    steps.add_argument(
        "--max-tokens", type=int, default=4096,
        help="tokens per batch and process, per side, padding included (the paper: ~25000) (default: %(default)s)",
    )
    steps.add_argument("--gradient-accumulation-steps", type=int, default=1, help="batches per optimiser step (default: %(default)s)")
    steps.add_argument("--max-steps", type=int, default=100_000, help="optimiser steps (the paper's base: %(default)s)")
    steps.add_argument("--num-epochs", type=int, help="passes over the training data")
    steps.add_argument("--time-limit", type=float, metavar="MINUTES", help="stop (with a checkpoint) after this long")
    steps.add_argument("--seed", type=int, default=0, help="seeds weights, data order and dropout (default: %(default)s)")


def _train_optimisation_group(p: argparse.ArgumentParser) -> None:
    optim = p.add_argument_group("optimisation and schedule (§5.3, §5.4)")
    optim.add_argument(
        "--warmup-steps", type=int, default=4000,
        help="linear warm-up steps (the paper: %(default)s; a short CPU run wants a few hundred)",
    )
    optim.add_argument("--lr-scale", type=float, default=1.0, help="factor on d_model^-0.5 * min(...) (default: %(default)s)")
    optim.add_argument(
        "--lr-schedule", choices=("noam", "linear", "cosine"), default="noam",
        help="noam: the paper's inverse square root; linear/cosine: the same warm-up and peak, then down to 0 at the "
        "end of --max-steps/--time-limit/--num-epochs, whichever comes first (default: %(default)s)",
    )
    optim.add_argument(
        "--ema-decay", type=float, metavar="DECAY",
        help="keep a moving average of the weights (e.g. 0.999); it becomes the final model if its validation "
        "perplexity is lower (not in the paper; default: off)",
    )
    optim.add_argument("--label-smoothing", type=float, default=0.1, help="epsilon_ls (default: %(default)s)")
    optim.add_argument("--max-grad-norm", type=float, help="clip the gradient norm (not in the paper; default: off)")
    optim.add_argument(
        "--mixed-precision", choices=("no", "fp16", "bf16"),
        help="default: what `accelerate launch`/`accelerate config` say, else bf16 where the GPU or CPU computes it "
        "(fp16 on a GPU without it), else no",
    )
    optim.add_argument(
        "--attn-implementation", choices=("eager", "sdpa", "flex_attention", "flash_attention_2"),  # kernels.py's
        help="transformers' attention implementation to train with (default: sdpa or eager, whichever trains the "
        "first batch faster here)",
    )


def _train_checkpoints_group(p: argparse.ArgumentParser) -> None:
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--save-steps", type=int, default=1000, help="checkpoint every N steps (default: %(default)s)")
    ckpt.add_argument("--keep-checkpoints", type=int, default=5, help="newest checkpoints kept (default: %(default)s)")
    ckpt.add_argument(
        "--average-last", type=int, default=1,
        help="final weights = mean of the last K checkpoints (the paper: 5 for base models) (default: %(default)s)",
    )
    ckpt.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")


def _train_evaluation_group(p: argparse.ArgumentParser) -> None:
    evaluation = p.add_argument_group("evaluation (validation perplexity, then beam-search BLEU/chrF)")
    evaluation.add_argument("--eval-steps", type=int, default=1000, help="validate every N steps (default: %(default)s)")
    evaluation.add_argument(
        "--eval-samples", type=int, default=500,
        help="validation pairs translated for BLEU/chrF at each evaluation, and at the end when there is a test "
        "split; 0 for none (default: %(default)s)",
    )
    evaluation.add_argument("--test-samples", type=int,
                            help="test pairs translated for the final BLEU/chrF (default: the whole test split)")
    _add_beam_options(evaluation, num_beams=4, length_penalty=0.6)


def _train_output_group(p: argparse.ArgumentParser) -> None:
    output = p.add_argument_group("output and logging")
    output.add_argument("--output-dir", required=True, help="the run's folder: checkpoints/ while training, then a Hub repository")
    output.add_argument("--push-to-hub", metavar="USER/NAME",
                        help="upload the finished folder to this Hub model repository (token from HF_TOKEN or `hf auth login`)")
    output.add_argument("--log-steps", type=int, default=50, help="tracker logging interval (default: %(default)s)")
    output.add_argument("--report-to", choices=("tensorboard",), help="tracker, logging under OUTPUT_DIR/runs")
    output.add_argument(
        "--ddp-timeout", type=int, default=10800, metavar="SECONDS",
        help="how long a process waits for the others in a collective, e.g. while the main process learns the "
        "vocabulary and tokenises (default: %(default)s)",
    )


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
        "write one line per input line to standard output. Blank lines stay blank. Uses the GPU when there is one.",
    )
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to translate (default: read lines from --input-file or standard input)")
    _add_model_option(p, engines=True)
    p.add_argument("--input-file", help="UTF-8 text file, one text per line ('-' = standard input)")
    _add_decoding_options(p)

    def run(args: argparse.Namespace) -> int:
        try:
            if args.texts and args.input_file:
                raise ValueError("give texts as arguments or --input-file, not both")
            _decoding_options(args)  # bad options fail before reading the input
            texts = args.texts or _read_lines(args.input_file or "-")
            translate = _translator(args)[0]
        except (OSError, ValueError, TypeError, ImportError) as err:
            _refuse(p, err)
        # Batch by batch, each written as it is done: a pipe sees lines at once, an interrupt keeps them.
        for translations in _translated_batches(p, _batches_of(texts, args.batch_size), translate):
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


def _add_beam_options(
    group: argparse._ArgumentGroup, num_beams: int | None = None, length_penalty: float | None = None
) -> None:
    """--num-beams and --length-penalty: `train` gives the values its scoring uses; the decoding commands
    leave them None, which decodes with the model's own."""
    default = "the model's" if num_beams is None else "%(default)s"
    group.add_argument("--num-beams", type=int, default=num_beams,
                       help=f"beam size (the paper: 4, §6.1; default: {default})")
    group.add_argument("--length-penalty", type=float, default=length_penalty,
                       help=f"beam length penalty alpha (the paper: 0.6; default: {default})")


def _decoding_options(args: argparse.Namespace) -> dict:
    """The decoding options given (and --batch-size where the command has it), checked."""
    from .inference import MAX_LENGTH_PENALTY, MAX_NEW_TOKENS, MAX_NUM_BEAMS

    names = [name for name in ("batch_size", "num_beams", "length_penalty", "max_new_tokens") if hasattr(args, name)]
    for name in names:
        value = getattr(args, name)
        if name != "length_penalty" and value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1; got {value}")
    if args.length_penalty is not None and not math.isfinite(args.length_penalty):
        raise ValueError(f"--length-penalty must be a finite number (the paper's: 0.6); got {args.length_penalty}")
    if args.length_penalty is not None and abs(args.length_penalty) > MAX_LENGTH_PENALTY:
        raise ValueError(f"--length-penalty must be between -{MAX_LENGTH_PENALTY} and {MAX_LENGTH_PENALTY} (the paper's: "
                         f"0.6; larger ones overflow the beam scores); got {args.length_penalty}")
    if getattr(args, "max_new_tokens", None) is not None and args.max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens must be at most {MAX_NEW_TOKENS} (its cache is allocated up front); "
                         f"got {args.max_new_tokens}")
    if args.num_beams is not None and args.num_beams > MAX_NUM_BEAMS:
        raise ValueError(f"--num-beams must be at most {MAX_NUM_BEAMS} (the paper's: 4; each beam holds a copy of the "
                         f"search's state); got {args.num_beams}")
    if getattr(args, "device", None) is not None and getattr(args, "engine", "transformers") != "ctranslate2":
        check_device(args.device)  # CTranslate2 names the devices it takes itself
    return {name: getattr(args, name) for name in names}


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


def _translator(args: argparse.Namespace):
    """(texts -> translations, the model's config or None for an export), with the engine, model and
    decoding options the command line names."""
    options = _decoding_options(args)
    if args.engine == "ctranslate2":
        from .export.ctranslate2 import CTranslate2Translator

        translator = CTranslate2Translator(args.model, args.device)
        return (lambda texts, first_line=1: translator.translate(texts, **options)), None
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


def _read_lines(path: str):
    """The lines of a file or of standard input ("-"), read as they are used; a file that cannot be opened
    fails here, before the model is loaded."""
    from .file_checks import utf8_lines

    if path != "-":
        return _lines_of(open(path, "rb"), path)
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

    if path is None:
        return
    folder = Path(path).parent
    if Path(path).is_dir():
        raise ValueError(f"{option} {path} is a folder; give the name of a file to write")
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
    data = _add_data_options(p, reads="its --split is translated and scored")
    data.add_argument("--split", default="test", help="split to score (default: %(default)s)")
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
            split, source_lang, target_lang = _evaluation_split(args)
            _check_evaluation_options(args)
            sources, references = _complete_pairs(args, split, source_lang, target_lang)
            translate, config = _translator(args)
            mismatch = config is not None and language_pair_mismatch(config, source_lang, target_lang)
            if mismatch:
                print(f"warning: {mismatch}; scoring {args.dataset} {args.split} ({source_lang}->{target_lang}) anyway",
                      file=sys.stderr)
            start = time.perf_counter()
            hypotheses = translate(sources)
            seconds = time.perf_counter() - start
            scores = score_translations(hypotheses, references)
            for path, lines in ((args.hypotheses_out, hypotheses), (args.references_out, references)):
                if path:  # a temporary file renamed into place: a full disk leaves no partial file
                    write_text_file(path, "".join(line + "\n" for line in lines))
        except (OSError, ValueError, TypeError, ImportError) as err:
            _refuse(p, err)
        print(f"{args.dataset} {args.split} {source_lang}->{target_lang}: {len(sources)} segments translated in "
              f"{seconds:.1f} s ({args.engine})")
        print(scores["bleu_text"])
        print(f"  signature: {scores['bleu_signature']}")
        print(scores["chrf_text"])
        print(f"  signature: {scores['chrf_signature']}")
        return 0

    p.set_defaults(func=run)


def _evaluation_split(args: argparse.Namespace):
    """(the --split to score, its source language key, its target language key)."""
    from .corpora import load_translation_dataset, resolve_languages

    data = load_translation_dataset(
        args.dataset, args.dataset_config, source_lang=args.source_lang, target_lang=args.target_lang
    )
    if args.split not in data:
        raise ValueError(f"--split {args.split!r} is not in {args.dataset}; it has {', '.join(data)}")
    split = data[args.split]
    return (split, *resolve_languages(split, args.source_lang, args.target_lang))


def _check_evaluation_options(args: argparse.Namespace) -> None:
    """--max-samples and the output files, before the translating."""
    from .file_checks import check_outputs_apart

    if args.max_samples is not None and args.max_samples < 1:
        raise ValueError(f"--max-samples must be at least 1; got {args.max_samples}")
    _check_output_file("--hypotheses-out", args.hypotheses_out)
    _check_output_file("--references-out", args.references_out)
    check_outputs_apart({"--hypotheses-out": args.hypotheses_out, "--references-out": args.references_out},
                        inputs=[args.dataset, args.model])


def _complete_pairs(args: argparse.Namespace, split, source_lang: str, target_lang: str) -> tuple[list[str], list[str]]:
    """(sources, references) of the first --max-samples pairs with text on both sides: as training scores a
    split, pairs with a missing or blank side are left out, and counted."""
    from .corpora import text_pairs

    pairs = list(zip(*text_pairs(split, source_lang, target_lang)))
    incomplete = [row for row, pair in enumerate(pairs, 1) if not all(text and text.strip() for text in pair)]
    if incomplete:
        rows = ", ".join(map(str, incomplete[:10])) + (" ..." if len(incomplete) > 10 else "")
        print(f"note: {len(incomplete)} of {len(pairs)} pairs left out: a side is missing or blank (rows {rows})",
              file=sys.stderr)
    pairs = [pair for pair in pairs if all(text and text.strip() for text in pair)][: args.max_samples]
    if not pairs:
        raise ValueError(f"the {args.split} split of {args.dataset} has no pair with text on both sides")
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

    def run(args: argparse.Namespace) -> int:
        try:
            if args.port is not None and not 0 < args.port < 65536:
                raise ValueError(f"--port must be in 1..65535; got {args.port}")
            from .visualize.app import Limits, serve

            limits = Limits.from_environment(**{name: getattr(args, name) for name in (
                "max_input_tokens", "max_new_tokens", "max_beams", "max_concurrent", "max_queued")})
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
    p.set_defaults(func=_run_quickstart)


def _run_quickstart(args: argparse.Namespace) -> int:
    from .quickstart import quickstart

    quickstart(args.output_dir, args.minutes, args.size, args.seed, args.test_samples)
    return 0


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
