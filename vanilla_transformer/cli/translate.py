"""`vanilla-transformer translate`: texts from arguments, a file or standard input, one output line per input line."""

from __future__ import annotations

import argparse

from ..errors import BadInput
from ..checks.bounds import max_num_beams
from .options import add_bounded_int, add_decoding_options, add_model_option, add_threads_option, decoding_options, apply_threads_option
from .streams import batches_as_they_come, batches_of, read_lines


LENGTH_WINDOW = 8  # batches of a file sorted by length together: fewer lines padded to a longer one, little memory


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "translate",
        help="translate text from arguments, a file or standard input",
        description="Translate each text (each argument, or each line of --input-file or standard input) and "
        "write one line per input line to standard output. Blank lines stay blank. Standard input is line in, line "
        "out: a line is translated as soon as it arrives, with the lines already waiting behind it. With --nbest "
        "above 1 or --with-scores, each line is INDEX<TAB>SCORE<TAB>TEXT (INDEX<TAB>TEXT without --with-scores), "
        "the N lines of a text best first; INDEX counts the texts from 0, as fairseq's H-INDEX, and a blank text's "
        "lines have an empty score and text. Uses the GPU when there is one.",
    )
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to translate (default: read lines from --input-file or standard input)")
    add_model_option(p, engines=True)
    p.add_argument("--input-file", help="UTF-8 text file, one text per line ('-' = standard input)")
    output = p.add_argument_group("output")
    add_bounded_int(output, "--nbest", high=max_num_beams, why=" (the beam holds N hypotheses)", default=1,
                    metavar="N", help="write the N best translations of each text, best first, one a line, each as "
                    "INDEX<TAB>TEXT where INDEX is the text's, from 0 (the beam is widened to N where it is "
                    "narrower) (default: %(default)s)")
    output.add_argument("--with-scores", action="store_true",
                        help="write each translation as INDEX<TAB>SCORE<TAB>TEXT: the text's index, from 0, and the "
                        "log-probability the search ranks it by (beam search's divided by its length penalty)")
    add_decoding_options(p)
    add_threads_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.texts and args.input_file:
        raise BadInput("give texts as arguments or --input-file, not both")
    options = decoding_options(args)  # bad options fail before reading the input
    _check_nbest_options(args)
    apply_threads_option(args)
    texts = args.texts or read_lines(args.input_file or "-", "--input-file")
    from .translators import translator

    translate = translator(args.model, args.engine, args.device, args.threads, options,
                           nbest=args.nbest, with_scores=args.with_scores)[0]
    stdin = not args.texts and args.input_file in (None, "-")
    # A file is read LENGTH_WINDOW batches at a time, which are sorted by length: little padding in each batch.
    batches = batches_as_they_come(texts, args.batch_size) if stdin else batches_of(texts, args.batch_size * LENGTH_WINDOW)
    # Batch by batch, each written as it is done: a pipe sees lines at once, an interrupt keeps them. A bad line
    # met on the way (one that is not UTF-8) is refused once the lines before it are out.
    for first_line, batch in batches:
        print("\n".join(translate(batch, first_line=first_line)), flush=True)
    return 0


def _check_nbest_options(args: argparse.Namespace) -> None:
    if (args.nbest > 1 or args.with_scores) and args.engine == "ctranslate2":
        raise BadInput("--nbest and --with-scores are for --engine transformers; CTranslate2 gives one translation")

