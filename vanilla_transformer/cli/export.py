"""`vanilla-transformer export`: a CTranslate2 folder that works on its own."""

from __future__ import annotations

import argparse

from ..choices import QUANTIZATIONS
from .options import add_model_option, add_threads_option, apply_threads_option


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a model for deployment with CTranslate2",
        description="Convert a model folder (or Hub id) into a CTranslate2 folder that works on its own: the "
        "CTranslate2 model, the tokenizer (tokenizer.json), the decoding defaults (translation_options.json) and "
        "a README with a Python example. Needs `pip install 'vanilla-transformer[ctranslate2]'`.",
    )
    add_model_option(p)
    p.add_argument("--format", required=True, choices=("ctranslate2",), help="what to export to")
    p.add_argument("--output-dir", required=True, help="new folder for the export (it must not exist, or be empty)")
    p.add_argument(
        "--quantization", default="float32", choices=QUANTIZATIONS,
        help="weight precision: int8 weights are 4x smaller and usually faster on CPUs; float16 and bfloat16 "
        "are for GPUs (CTranslate2 converts on loading where a type is not supported) (default: %(default)s)",
    )
    add_threads_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shlex

    from ..export.ctranslate2 import export_ctranslate2
    from ..inference import load_model

    apply_threads_option(args)
    model, tokenizer = load_model(args.model, "cpu")
    folder = export_ctranslate2(model, tokenizer, args.output_dir, args.quantization)
    size = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
    print(f"exported {args.model} to {folder} ({args.quantization} weights, {size:.1f} MB); try it with\n"
          f"  vanilla-transformer translate --engine ctranslate2 --model {shlex.quote(str(folder))} \"Jesus wept.\"")
    return 0
