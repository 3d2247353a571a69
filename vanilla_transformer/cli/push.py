"""`vanilla-transformer push`: a saved model folder to the Hugging Face Hub."""

from __future__ import annotations

import argparse



def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..hub import push_folder

    url = push_folder(args.folder, args.repo_id, private=args.private)
    print(f"uploaded {args.folder} to {url}")
    return 0
