"""`vanilla-transformer serve`: the Gradio app of one model and its JSON endpoint, within limits."""

from __future__ import annotations

import argparse
import sys

from ..choices import SERVE_LIMITS
from .options import NEW_TOKENS_BOUND, add_bounded_int, add_device_option, add_model_option, add_threads_option, apply_threads_option


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="a local web app to try a model (translation, decoding options, attention explorer; Gradio) and a JSON "
        "endpoint for programs, its requests batched",
        description="Serve a Gradio app for one model: a text box, its translation, decoding options and the "
        "attention explorer of the sentence typed. It loads nothing from other hosts. Needs the serve extra: "
        "pip install 'vanilla-transformer[serve]'. The same code runs as a Hub Space: see vanilla_transformer/visualize/app.py. "
        "Programs call POST /v1/translate with a JSON object: {\"texts\": [...], \"num_beams\": 4, \"max_new_tokens\": 64, "
        "\"length_penalty\": 0.6, \"with_scores\": true, \"attention\": false} (all but texts optional) gives "
        "{\"translations\": [...], \"scores\": [...]}; the requests waiting together are translated as one batch. "
        "Example: curl -s http://127.0.0.1:7860/v1/translate -H 'Content-Type: application/json' -d "
        "'{\"texts\": [\"Jesus wept.\"]}'. A request beyond a limit is answered 400 with {\"error\": \"...\"}, "
        "one with more than max-queued requests waiting 429.",
    )
    add_model_option(p)
    p.add_argument("--host", help="address to listen on (default: 127.0.0.1, this machine only)")
    add_bounded_int(p, "--port", "port", help="port (default: 7860, or the next free one)")
    add_device_option(p)
    add_threads_option(p)
    limits = p.add_argument_group(
        "limits", "what one visitor may ask; a request beyond them is refused with a message naming the limit. "
        "Each defaults to its VANILLA_TRANSFORMER_<NAME> environment variable (as a Space sets it), else the value shown")
    helps = {"max_input_tokens": "longest sentence in tokens", "max_new_tokens": "longest output in tokens",
             "max_beams": "largest beam size", "max_concurrent": "requests translated at once",
             "max_texts": "texts in one request to the JSON endpoint, and in one batch of requests decoded together",
             "max_queued": "requests waiting their turn; more are refused",
             "request_timeout": "time a client may take to send a request, headers and body; a slower one is answered "
             "408 and closed"}
    for name, default in SERVE_LIMITS.items():  # the defaults of visualize/app.py's Limits
        bound = NEW_TOKENS_BOUND if name == "max_new_tokens" else {}
        add_bounded_int(limits, "--" + name.replace("_", "-"), **bound,
                        metavar="SECONDS" if name == "request_timeout" else "N", help=f"{helps[name]} ({default})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..visualize.app import Limits, serve

    limits = Limits.from_environment(**{name: getattr(args, name) for name in SERVE_LIMITS})
    print(apply_threads_option(args), file=sys.stderr)
    serve(args.model, args.host, args.port, args.device, limits)
    return 0
