"""`vanilla-transformer serve`: the Gradio app of one model, within limits."""

from __future__ import annotations

import argparse
import sys
from functools import partial

from .options import add_model_option, add_threads_option, refuse, use_threads


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="a local web app to try a model: translation, decoding options, attention explorer (Gradio)",
        description="Serve a Gradio app for one model: a text box, its translation, decoding options and the "
        "attention explorer of the sentence typed. It loads nothing from other hosts. Needs the serve extra: "
        "pip install 'vanilla-transformer[serve]'. The same code runs as a Hub Space: see vanilla_transformer/visualize/app.py.",
    )
    add_model_option(p)
    p.add_argument("--host", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, help="port (default: 7860, or the next free one)")
    p.add_argument("--device", help="cpu, cuda, mps (default: the GPU when there is one)")
    add_threads_option(p)
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
                        help="time a client may take to send a request, headers and body; a slower one is answered 408 and "
                        "closed (30)")
    p.set_defaults(func=partial(run, p))


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        if args.port is not None and not 0 < args.port < 65536:
            raise ValueError(f"--port must be in 1..65535; got {args.port}")
        from ..visualize.app import Limits, serve

        limits = Limits.from_environment(**{name: getattr(args, name) for name in (
            "max_input_tokens", "max_new_tokens", "max_beams", "max_concurrent", "max_queued", "request_timeout")})
        print(use_threads(args), file=sys.stderr)
        serve(args.model, args.host, args.port, args.device, limits)
    except (OSError, ValueError, ImportError) as err:
        refuse(p, err)
    return 0
