"""`vanilla-transformer attention`: heat maps and the HTML explorer of one sentence's attention."""

from __future__ import annotations

import argparse

from .options import add_decoding_options, add_model_option, add_threads_option, decoding_options, apply_threads_option


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "attention",
        help="translate a sentence and show every attention layer and head (PNG heat maps, an HTML explorer)",
        description="Translate one sentence and show its attention. --output-dir (the default) writes heat maps of "
        "encoder self-attention, decoder self-attention and cross-attention: <kind>_layer<N>.png (every head of one "
        "layer in a grid), overview.png (every layer, mean of heads), and bertviz.pt for bertviz in a notebook: "
        "`model_view(**torch.load('bertviz.pt'))` (bertviz's pages fetch their scripts from the network). --html "
        "writes one self-contained page to explore every layer and head in a browser, offline: lines and heat maps, "
        "stepping through the translation. In every picture a decoder row is the token read, whose output predicts "
        "the next token; colours run from 0 to 1.",
    )
    p.add_argument("text", help="the sentence to translate")
    add_model_option(p)
    p.add_argument("--output-dir", help="folder for the images (default: attention, unless only --html is given)")
    p.add_argument("--html", metavar="FILE", help="write the interactive explorer to this .html file")
    add_decoding_options(p, batches=False)
    add_threads_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import signal

    from ..visualize.attention_maps import BERTVIZ_NOTE, collect_attentions, save_attention_maps
    from ..inference import load_model

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: the staging folder is removed
    options = decoding_options(args)
    if args.html:
        from ..visualize.explorer import explorer_record, html_path, save_explorer

        html_path(args.html, "--html")  # before a translation that may take a while
    apply_threads_option(args)
    model, tokenizer = load_model(args.model, args.device)
    collect = explorer_record if args.html else collect_attentions  # the neuron view's numbers for the page alone
    record = collect(model, tokenizer, args.text, **options)
    written = []
    if args.html:
        written.append(save_explorer(record, args.html))
    if args.output_dir or not args.html:
        written += save_attention_maps(record, args.output_dir or "attention")
    print(f"{record.source}\n-> {record.translation}")
    print(f"{len(written)} files written:", " ".join(str(path) for path in written))
    if any(path.name == "bertviz.pt" for path in written):
        print(BERTVIZ_NOTE)
    return 0
