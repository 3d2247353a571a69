"""One self-contained HTML page that shows the attention behind a translation: every layer and head.

    record = collect_attentions(model, tokenizer, "In the beginning God created the heavens and the earth.")
    save_explorer(record, "explorer.html")     # or: vanilla-transformer attention --model M "..." --html explorer.html

The page is one file with its script, styles and data inline; a Content-Security-Policy tag forbids it
every request, so it works offline, from disk, attached to a mail or inside the `serve` app. In it:
the sentence and its translation as readable pieces (sub-word pieces joined to their word), the kind of
attention (cross, decoder self, encoder self), layer and head (or their mean), a lines view (keys on
the left, the tokens attending on the right, a line's opacity its weight; hovering a token shows its
lines and weights), a heat map, and a step-through of the translation that shows, one output token at
a time, what the decoder attended to while writing it.

Weights are stored as bytes (weight × 255, rounded: steps of 0.004), base64-encoded: 20 source and
22 target tokens on the base model (6 + 6 layers, 8 heads) make a page of 110 KB. A page would grow
with the square of the length, so past `MAX_BYTES` each query keeps only its strongest keys, as many
as fit (at least `MIN_KEEP`); the page says so and how much of the weight they hold. A sentence of
1,000 tokens a side on a small model (3 + 3 layers, 4 heads) keeps 37 keys per query: 5.4 MB. The
page then draws the 4,000 strongest lines until a token is hovered or a step chosen.
"""

from __future__ import annotations

import base64
import json
import os
from importlib import resources
from pathlib import Path

import torch

from .attention_maps import KINDS, AttentionRecord

__all__ = ["MAX_BYTES", "explorer_data", "explorer_html", "html_path", "save_explorer"]

MAX_BYTES = 4_000_000  # stored weights in one page, before base64 (x 4/3)
MIN_KEEP = 4  # keys kept per query, however long the sentence
_PLACEHOLDER = "__EXPLORER_DATA__"


def _base64(array) -> str:
    return base64.b64encode(array.numpy().tobytes()).decode("ascii")


def _quantize(weights: torch.Tensor) -> torch.Tensor:
    return (weights * 255).round().clamp(0, 255).to(torch.uint8)


def _pack(weights: torch.Tensor, keep: int | None) -> dict:
    """(layers, heads, queries, keys) weights as base64 bytes: all of them, or each query's `keep` strongest
    keys with their indices (little-endian uint16)."""
    layers, heads, queries, keys = weights.shape
    packed = {"layers": layers, "heads": heads, "queries": queries, "keys": keys, "keep": None}
    if keep is None or keep >= keys:
        return {**packed, "values": _base64(_quantize(weights))}
    top = weights.topk(keep, dim=-1)
    return {
        **packed,
        "keep": keep,
        "values": _base64(_quantize(top.values)),
        "indices": _base64(top.indices.to(torch.int16)),  # keys < 32,768: the model reads at most 1,024
        "kept_weight": round(float(top.values.sum(-1).mean()), 4),
    }


def _keep(record: AttentionRecord) -> int | None:
    """None when every weight fits in `MAX_BYTES`, else how many keys each query keeps (3 bytes each)."""
    weights = [record.weights(kind) for kind in KINDS]
    if sum(w.numel() for w in weights) <= MAX_BYTES:
        return None
    rows = sum(w[..., 0].numel() for w in weights)
    return max(MIN_KEEP, MAX_BYTES // (3 * rows))


def explorer_data(record: AttentionRecord) -> dict:
    """What the page shows, as JSON-ready values: texts, settings, both token axes and the packed weights."""
    keep = _keep(record)
    return {
        "model": record.model,
        "sentence": record.source,
        "translation": record.translation,
        "settings": record.settings,
        "source": {"ids": record.source_ids, "tokens": record.source_tokens, "pieces": record.source_pieces},
        "target": {"ids": record.target_ids, "tokens": record.target_tokens, "pieces": record.target_pieces},
        "special_ids": record.special_ids,
        "weights": {kind: _pack(record.weights(kind), keep) for kind in KINDS},
    }


def explorer_html(record: AttentionRecord) -> str:
    """The explorer page for `record`, as one HTML string."""
    if not isinstance(record, AttentionRecord):
        raise TypeError(f"`record` must be an AttentionRecord (from collect_attentions); got {type(record).__name__}")
    template = resources.files(__package__).joinpath("templates/explorer.html").read_text(encoding="utf-8")
    # JSON inside <script>: escape what could end the element or start markup.
    data = json.dumps(explorer_data(record), ensure_ascii=False, separators=(",", ":"))
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return template.replace(_PLACEHOLDER, data)


def html_path(path: str | os.PathLike, name: str = "path") -> Path:
    """`path` if it can take a page (an .html file name, not a folder), else a ValueError naming `name`."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"`{name}` is a folder; give a file name such as {str(path / 'explorer.html')!r}")
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"`{name}` must name an .html file; got {str(path)!r}")
    return path


def save_explorer(record: AttentionRecord, path: str | os.PathLike) -> Path:
    """Write the explorer page to `path` (an .html file, replaced if there); nothing is left half-written."""
    path = html_path(path)
    page = explorer_html(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        staging.write_text(page, encoding="utf-8")
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return path
