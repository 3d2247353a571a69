"""A saved model card read back and pointed at the Hub repository it is pushed to: its snippets, title and
`model-index` name. The card's Python is read with `ast`, never run."""

from __future__ import annotations

import ast
import re

from huggingface_hub import ModelCard

__all__ = ["card_repo_id", "retarget_card"]


def card_repo_id(card: ModelCard) -> str | None:
    """The repository id the card's usage snippet loads: the first `from_pretrained` argument of its first
    Python block, read with `ast` (never run)."""
    block = re.search(r"^```python\n(.*?)^```", card.text, re.MULTILINE | re.DOTALL)
    if block is None:
        return None
    for node in ast.walk(ast.parse(block.group(1))):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained" and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            return node.args[0].value
    return None


def retarget_card(card: ModelCard, repo_id: str) -> ModelCard:
    """The card of the same model as it reads in the Hub repository `repo_id` (a checked id): its snippets
    load `repo_id`, and its title and `model-index` name are the repository's name. A card whose snippets
    load no repository is returned as it is."""
    old = card_repo_id(card)
    if old is None or old == repo_id:
        return card
    old_name, new_name = old.split("/")[-1], repo_id.split("/")[-1]
    text = re.sub(rf"(?<![\w./-]){re.escape(old)}(?![\w/-]|\.\w)", repo_id, card.text)
    text = re.sub(rf"^# {re.escape(old_name)}$", f"# {new_name}", text, count=1, flags=re.MULTILINE)
    data = card.data
    if data.model_name in (old_name, None):
        data.model_name = new_name  # the name `model-index` is written under
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{text}")
