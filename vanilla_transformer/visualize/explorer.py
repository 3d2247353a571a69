"""One self-contained HTML page that shows the attention behind a translation: every layer and head.

    record = explorer_record(model, tokenizer, "In the beginning God created the heavens and the earth.")
    save_explorer(record, "explorer.html")     # or: vanilla-transformer attention --model M "..." --html explorer.html

The page is one file with its script, styles and data inline; a Content-Security-Policy tag forbids it
every request, so it works offline, from disk, attached to a mail or inside the `serve` app. In it:
the sentence and its translation as readable pieces (sub-word pieces joined to their word), the kind of
attention (cross, decoder self, encoder self), layer and head (or their mean), a lines view (keys on
the left, the tokens attending on the right, a line's opacity its weight; hovering a token shows its
lines and weights), a heat map, a step-through of the translation that shows, one output token at
a time, what the decoder attended to while writing it, and the neuron view (`neuron_view`): for one
head and query token, q, each key, their elementwise product (or the score function's own terms), the
score the model computed and the weight it gave, in bertviz's colours (blue positive, orange negative).
A decoder row (query) is the token the decoder read, as in the PNGs and bertviz (`DECODER_ROWS`, written on
the page); the step-through names both the token read and the token written. The page's address keeps what
it shows (kind, layer, head, view, step and query, in its hash), so that a reload or a link shows it again.

Weights are stored as bytes (weight × 255, rounded: steps of 0.004), base64-encoded: 20 source and
22 target tokens on the base model (6 + 6 layers, 8 heads) take 110 KB. A page would grow with the
square of the length, so past `MAX_BYTES` each query keeps only its strongest keys, as many as fit (at
least `MIN_KEEP`); the page says so and how much of the weight they hold. The neuron view's numbers
are float16 (3 significant digits) in their own share, `NEURON_BYTES`: the same sentence's, every head
and token of the base model, take another 1.4 MB. Past it the neuron view keeps the first query tokens
of each kind, as many as fit (at least `NEURON_MIN_QUERIES`), then the heads that fit, layer by layer;
the page says so. A sentence of 1,000 tokens a side on a small model (3 + 3 layers, 4 heads) keeps 23
keys per query and the neuron view of 8 query tokens in 9 of the 36 heads: 5.3 MB, the cap of a page
without the neuron view. The page then draws the 4,000 strongest lines until a token is hovered or a
step chosen, and the neuron view shows the 64 keys a query weights most.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import replace
from importlib import resources
from pathlib import Path

import torch

from ..errors import BadInput
from ..checks.files import check_plain_file
from ..staging import write_file_whole
from .attention_maps import DECODER_ROWS, KINDS, AttentionRecord, collect_attentions
from .neuron_view import Neurons, NeuronTensors, neuron_tensors

__all__ = ["MAX_BYTES", "explorer_data", "explorer_html", "explorer_record", "html_path", "save_explorer"]

MAX_BYTES = 2_500_000  # stored weights in one page, before base64 (x 4/3)
MIN_KEEP = 4  # keys kept per query, however long the sentence
NEURON_BYTES = 1_500_000  # the neuron view's own share: with the weights, 4 MB at most before base64
NEURON_MIN_QUERIES = 8  # query tokens of each kind the neuron view keeps, however long the sentence
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


def _neuron_fields(tensors: NeuronTensors, per_query) -> list[tuple[str, torch.Tensor, bool]]:
    """The arrays of one kind's neuron view, (layers, heads, rows, columns) each, and whether they have a row per query
    (the terms named in `per_query`)."""
    fields = [("query", tensors.queries, True)]
    if tensors.keys is not None:
        fields.append(("key", tensors.keys, False))
    fields += [(name, term, name in per_query) for name, term in tensors.terms.items()]
    return fields + [("score", tensors.scores, True), ("weight", tensors.weights, True)]


def _neuron_unit(fields, allowed, layer: int, head: int, queries: int) -> dict:
    """One head's neuron view: its arrays as float16 (little-endian), one after the other, base64-encoded, and
    its mask as bits (1: the key was allowed), first key of the first query in the top bit of the first byte."""
    values = torch.cat([array[layer, head, :queries if per_query else None].reshape(-1) for _, array, per_query in fields])
    bits = allowed[layer, head, :queries].reshape(-1)
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8).to(torch.uint8)
    packed = (bits << torch.arange(7, -1, -1, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    return {"values": _base64(values.half()), "allowed": _base64(packed)}


def _neuron_cost(fields, keys: int, queries: int) -> int:
    per_head = sum((queries if per_query else array.size(2)) * array.size(3) for _, array, per_query in fields)
    return 2 * per_head + -(-queries * keys // 8)


def _neuron_data(neurons: Neurons | None) -> dict | None:
    """The neuron view's numbers. Past `NEURON_BYTES` it keeps the first query tokens of each kind, as many as
    fit (at least `NEURON_MIN_QUERIES`), and then the heads that fit, layer by layer, head by head, each kind in turn."""
    if neurons is None:
        return None
    fields = {kind: _neuron_fields(tensors, neurons.drawing["per_query"]) for kind, tensors in neurons.kinds.items()}
    shape = {kind: tuple(tensors.scores.shape[2:]) for kind, tensors in neurons.kinds.items()}  # (queries, keys)
    heads = sorted((layer, head, kind) for kind, tensors in neurons.kinds.items()
                   for layer in range(tensors.scores.size(0)) for head in range(tensors.scores.size(1)))

    def cost(kind, queries):
        return _neuron_cost(fields[kind], shape[kind][1], min(queries, shape[kind][0]))

    def fits(queries):
        return sum(cost(kind, queries) for *_, kind in heads) <= NEURON_BYTES

    queries = max(queries for queries, _ in shape.values())
    if not fits(queries):  # the most queries that fit, by bisection (at least NEURON_MIN_QUERIES)
        low, high = NEURON_MIN_QUERIES, queries
        while low + 1 < high:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        queries = low
    kept, total = [], 0
    for layer, head, kind in heads:
        total += cost(kind, queries)
        if kept and total > NEURON_BYTES:
            break
        kept.append((layer, head, kind))
    kinds = {}
    for kind, tensors in neurons.kinds.items():
        rows = min(queries, shape[kind][0])
        kinds[kind] = {
            "queries": rows, "of": shape[kind][0], "keys": shape[kind][1],
            "fields": [[name, rows if per_query else array.size(2), array.size(3)] for name, array, per_query in fields[kind]],
            "heads": {f"{layer},{head}": _neuron_unit(fields[kind], tensors.allowed, layer, head, rows)
                      for layer, head, unit_kind in kept if unit_kind == kind},
        }
    return {"score": neurons.score, "normalization": neurons.normalization, "hard": neurons.hard,
            "local_attention": neurons.local_attention, "window": neurons.window,
            "kept": len(kept), "of": len(heads), "kinds": kinds, "drawing": neurons.drawing}


def explorer_record(model, tokenizer, text: str, **options) -> AttentionRecord:
    """`collect_attentions(model, tokenizer, text, **options)` with what the explorer shows beside the weights: the
    neuron view's numbers (`neuron_view.neuron_tensors`), for the package's models (a Marian model has none)."""
    record = collect_attentions(model, tokenizer, text, **options)
    if getattr(model.config, "model_type", None) != "vanilla_transformer":
        return record
    device = next(model.parameters()).device
    source, output = (torch.tensor([ids], device=device) for ids in (record.source_ids, record.target_ids))
    return replace(record, neurons=neuron_tensors(model, source, None, output[:, :-1]))


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
        "decoder_rows": DECODER_ROWS,
        "weights": {kind: _pack(record.weights(kind), keep) for kind in KINDS},
        "neurons": _neuron_data(record.neurons),
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
        raise BadInput(f"`{name}` is a folder; give a file name such as {str(path / 'explorer.html')!r}")
    if path.suffix.lower() not in (".html", ".htm"):
        raise BadInput(f"`{name}` must name an .html file; got {str(path)!r}")
    check_plain_file(path, f"`{name}` {str(path)!r}")
    return path


def save_explorer(record: AttentionRecord, path: str | os.PathLike) -> Path:
    """Write the explorer page to `path` (an .html file, replaced if there); nothing is left half-written."""
    path = html_path(path)
    page = explorer_html(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_file_whole(path, lambda staging: staging.write_text(page, encoding="utf-8"))
