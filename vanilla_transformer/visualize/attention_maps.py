"""Look inside a translation: heat maps of every attention layer and head.

    record = collect_attentions(model, tokenizer, "In the beginning God created the heavens.")
    paths = save_attention_maps(record, "maps/")    # one PNG per layer and kind, an overview, bertviz data

The model translates the sentence (beam search, as the pipeline does), then its decoder is run once,
teacher-forced, over the tokens it read while generating (see
`pipeline_vanilla_transformer.teacher_forced_attentions`). That gives the same weights as step-by-step
decoding, but decoder self-attention as a full lower-triangular square instead of one row per step,
and no per-beam bookkeeping.

Three kinds of attention (§3.2.3), each (layers, heads, queries, keys):

- "encoder": encoder self-attention, source tokens against source tokens;
- "decoder": masked decoder self-attention, target tokens against earlier target tokens;
- "cross": encoder-decoder attention, each target position over the source tokens.

Rows are queries and sum to 1. Decoder rows are labelled with the token the decoder read at that
position (`DECODER_ROWS`); that row's output predicts the next token. This is transformers' and bertviz's
convention (a row per decoder input), kept by every picture: the PNGs, bertviz's data and the explorer,
each of which says so on it. Tokens are labelled with the text they stand for (`readable_pieces`), not
with byte-level symbols; the record keeps the ids and raw tokens too. Colours run from 0 to 1 in every
PNG, so that a colour means one weight across layers and files.
`explorer.save_explorer(record, "explorer.html")` writes the same record as an interactive page.

`bertviz.pt` holds the same weights as bertviz's `model_view`/`head_view` take them for an
encoder-decoder model, with readable token labels, so in a notebook:

    from bertviz import model_view
    model_view(**torch.load("maps/bertviz.pt"))

bertviz's pages fetch their scripts (require.js, d3, jQuery) from the network and show nothing offline
(`BERTVIZ_NOTE`); the explorer is the offline view.
"""

from __future__ import annotations

import math
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import BadInput, as_bad_input
from ..modeling.generation import DEFAULT_MAX_LENGTH_OFFSET
from ..modeling.pipeline_vanilla_transformer import longest_source, readable_pieces, teacher_forced_attentions
from ..staging import staged_files, sweep_staging
from .neuron_view import Neurons

__all__ = [
    "AXIS_LABELS", "AttentionRecord", "BERTVIZ_NOTE", "DECODER_ROWS", "KINDS", "bertviz_data",
    "check_attention_support", "collect_attentions", "decoding_settings", "plot_layer", "plot_models", "plot_overview", "save_attention_maps",
]

KINDS = {"encoder": "encoder self-attention", "decoder": "decoder self-attention", "cross": "cross-attention"}
# Which token names a decoder row, written on every picture: transformers' and bertviz's, a row per decoder input.
DECODER_ROWS = "decoder rows: the token read (its output predicts the next token)"
# (rows, columns) of each kind's heat maps
AXIS_LABELS = {
    "encoder": ("source token (query)", "source token (key)"),
    "decoder": ("token read (query)", "token read (key)"),
    "cross": ("token read (query)", "source token (key)"),
}
# One line where bertviz's data is written: its pages are not offline, the explorer is.
BERTVIZ_NOTE = ("bertviz.pt: bertviz's pages fetch their scripts (require.js, d3, jQuery) from the network and show "
                f"nothing offline; the explorer (--html) is the offline view. In both, {DECODER_ROWS}.")


@dataclass
class AttentionRecord:
    """The attention weights behind one translation; tensors are (layers, heads, queries, keys).

    The decoder read `target_ids[:-1]` (the start token and all but the last output token): those
    are the decoder's queries and keys; the query at position t wrote `target_ids[t + 1]`.
    """

    source: str
    translation: str
    source_ids: list[int]  # what the encoder read, </s> included
    target_ids: list[int]  # what generate returned: the start token, the translation and usually </s>
    source_tokens: list[str]  # the raw tokens of those ids (byte-level symbols such as "ĠJesÃºs")
    target_tokens: list[str]
    source_pieces: list[str]  # the text each id stands for (`readable_pieces`); " x" starts a word
    target_pieces: list[str]
    encoder_attention: torch.Tensor
    decoder_attention: torch.Tensor
    cross_attention: torch.Tensor
    special_ids: list[int] = field(default_factory=list)  # the tokenizer's (<pad>, <s>, </s>, <unk>, ...)
    model: str = ""  # the folder or Hub id
    settings: dict = field(default_factory=dict)  # the decoding settings, as `decoding_settings` words them
    neurons: Neurons | None = None  # the neuron view's numbers, for the explorer (`explorer.explorer_record`)

    def weights(self, kind: str) -> torch.Tensor:
        if kind not in KINDS:
            raise BadInput(f"`kind` must be one of {', '.join(KINDS)}; got {kind!r}")
        return getattr(self, f"{kind}_attention")

    @property
    def encoder_tokens(self) -> list[str]:
        """Raw tokens of the encoder's axis."""
        return self.source_tokens

    @property
    def decoder_tokens(self) -> list[str]:
        """Raw tokens of the decoder's axis: what it read, the last output token excluded."""
        return self.target_tokens[:-1]

    @property
    def source_labels(self) -> list[str]:
        """Readable tick labels of the source axis."""
        return [_label(piece) for piece in self.source_pieces]

    @property
    def target_labels(self) -> list[str]:
        """Readable tick labels of what the decoder read; its start token (<pad>) is called <start>."""
        return ["<start>"] + [_label(piece) for piece in self.target_pieces[1:-1]]

    def axes(self, kind: str) -> tuple[list[str], list[str]]:
        """Tick labels (queries, keys) of a kind of attention."""
        if kind == "encoder":
            return self.source_labels, self.source_labels
        if kind == "decoder":
            return self.target_labels, self.target_labels
        return self.target_labels, self.source_labels

    @property
    def num_decoder_layers(self) -> int:
        return self.decoder_attention.size(0)


def _label(piece: str) -> str:
    """A piece as a tick label: spaces trimmed, a bare space shown as ␣, a character's first bytes as ·."""
    return piece.strip() or ("␣" if piece else "·")


def decoding_settings(model, num_beams=None, length_penalty=None, max_new_tokens=None) -> dict:
    """The settings a translation was decoded with, in words: the call's, else the model's (§6.1 for saved folders)."""
    config = model.generation_config
    beams = num_beams or config.num_beams or 1
    settings = {"beam size": str(beams) if beams > 1 else "1 (greedy)"}
    if beams > 1:
        alpha = next(value for value in (length_penalty, config.length_penalty, 1.0) if value is not None)  # 1.0: transformers'
        style = "GNMT" if getattr(config, "length_penalty_style", None) == "gnmt" else "transformers' |Y|^α"
        settings["length penalty"] = f"{alpha:g} ({style})"
    offset = getattr(config, "max_length_offset", None) or DEFAULT_MAX_LENGTH_OFFSET
    if max_new_tokens:
        settings["longest output"] = f"{max_new_tokens} tokens"
    elif config.max_new_tokens:
        settings["longest output"] = f"source length + {offset}, at most {config.max_new_tokens} tokens"
    else:
        settings["longest output"] = f"source length + {offset} tokens"
    return settings


def check_attention_support(model) -> None:
    """Refuse, with `teacher_forced_attentions`' message, a model that computes no attention weights
    (a Marian folder loads with transformers' fused "sdpa" attention), by a one-token pass: milliseconds."""
    ids = torch.full((1, 2), model.config.decoder_start_token_id, device=next(model.parameters()).device)
    with as_bad_input():
        teacher_forced_attentions(model, ids[:, :1], ids)


@torch.no_grad()
def collect_attentions(
    model, tokenizer, text: str, num_beams: int | None = None, max_new_tokens: int | None = None,
    length_penalty: float | None = None,
) -> AttentionRecord:
    """Translate `text` and return the attention weights of every layer and head behind the translation.

    A model that computes no weights is refused, and so is a text longer than the model reads (a heat map of a
    truncated text would mislead), before it translates.
    """
    if not isinstance(text, str):
        raise TypeError(f"`text` must be a string; got {type(text).__name__}")
    if not text.strip():
        raise BadInput("`text` is empty: give a sentence to translate.")
    model.eval()
    settings = decoding_settings(model, num_beams, length_penalty, max_new_tokens)  # what the map says it decoded with
    check_attention_support(model)
    device = next(model.parameters()).device
    input_ids = tokenizer(text, return_tensors="pt")["input_ids"].to(device)
    limit = longest_source(model, tokenizer)
    if input_ids.size(1) > limit:
        raise BadInput(f"`text` is {input_ids.size(1)} tokens long; the model reads at most {limit}. Give one sentence.")
    options = {"num_beams": num_beams, "max_new_tokens": max_new_tokens, "length_penalty": length_penalty}
    generate_kwargs = {key: value for key, value in options.items() if value is not None}  # None: the model's
    output_ids = model.generate(input_ids=input_ids, **generate_kwargs)
    weights = teacher_forced_attentions(model, input_ids, output_ids)
    target_ids = output_ids[0].tolist()
    return AttentionRecord(
        source=text,
        translation=tokenizer.decode(output_ids[0], skip_special_tokens=True),
        source_ids=weights["input_ids"],
        target_ids=target_ids,
        source_tokens=tokenizer.convert_ids_to_tokens(weights["input_ids"]),
        target_tokens=tokenizer.convert_ids_to_tokens(target_ids),
        source_pieces=readable_pieces(tokenizer, weights["input_ids"]),
        target_pieces=readable_pieces(tokenizer, target_ids),
        encoder_attention=weights["encoder_attention"],
        decoder_attention=weights["decoder_attention"],
        cross_attention=weights["cross_attention"],
        special_ids=sorted(tokenizer.all_special_ids),
        model=str(getattr(model, "name_or_path", "") or ""),
        settings=settings,
    )


# ----------------------------------------------------------------------------------------------
# Drawing (matplotlib, Agg backend: files only, no display needed)
# ----------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(count: int) -> tuple[int, int]:
    """Rows and columns for `count` panels: at most 4 across, as in the classic 8-head figures (2 × 4)."""
    columns = min(count, 4)
    return math.ceil(count / columns), columns


def _draw(ax, matrix, row_labels, column_labels, vmax, fontsize):
    image = ax.imshow(matrix, cmap="viridis", vmin=0.0, vmax=vmax, aspect="equal", interpolation="nearest")
    box = ax.get_position()
    columns = _every(len(column_labels), box.width * ax.figure.get_figwidth(), fontsize)
    ax.set_xticks(columns)
    ax.set_xticklabels([column_labels[i] for i in columns], rotation=90, fontsize=fontsize)
    rows = _every(len(row_labels), box.height * ax.figure.get_figheight(), fontsize)
    ax.set_yticks(rows)
    ax.set_yticklabels([row_labels[i] for i in rows], fontsize=fontsize)
    ax.tick_params(length=0)
    return image


def _every(count: int, inches: float, fontsize: float) -> range:
    """The tokens to label on an axis of `count` tokens: all where they fit, else every k-th, so that no
    two labels (a line of `fontsize` points each) overlap."""
    return range(0, count, max(1, math.ceil(count * fontsize * 1.3 / 72 / max(inches, 1e-6))))


MAX_PANEL_INCHES = 6.0  # the edge of one heat map: a long sentence gets smaller cells, not a larger picture
MAX_FIGURE_INCHES = 60.0  # the edge of a whole figure (6,600 pixels at its 110 dpi), however many layers or heads


def _figure(plt, grid_rows: int, grid_columns: int, queries: int, keys: int):
    """A figure whose panels give every token cell the same size, with room for the labels; its size has
    a ceiling (`MAX_PANEL_INCHES`, `MAX_FIGURE_INCHES`): a long sentence has smaller cells, fewer labels."""
    longest = max(queries, keys)
    cell = min(0.24 if longest <= 30 else 0.16, MAX_PANEL_INCHES / longest)  # inches per token
    panel_width, panel_height = cell * keys + 1.1, cell * queries + 1.1
    width, height = panel_width * grid_columns + 1.0, panel_height * grid_rows + 1.0
    shrink = min(1.0, MAX_FIGURE_INCHES / width, MAX_FIGURE_INCHES / height)
    fig, axes = plt.subplots(grid_rows, grid_columns, squeeze=False, figsize=(width * shrink, height * shrink))
    return fig, axes, 8.0 if cell > 0.2 else 6.0


def _finish(fig, image, title: str, label: str):
    # Each line of the title wrapped to the figure's width (11-point characters are about 0.55 em wide): none is cut.
    width = max(30, int(fig.get_figwidth() * 0.92 * 72 / (11 * 0.55)))
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.92, 0.97))
    colour_bar_axes = fig.add_axes((0.935, 0.15, 0.015, 0.7))
    fig.colorbar(image, cax=colour_bar_axes, label=label)


def _label_axes(axes, kind: str) -> None:
    """Name what the rows and columns are on the grid's left and bottom edges."""
    rows, columns = AXIS_LABELS[kind]
    for ax in axes[:, 0]:
        ax.set_ylabel(rows, fontsize=9)
    for ax in axes[-1, :]:
        ax.set_xlabel(columns, fontsize=9)


def _rows_line(kinds) -> str:
    """The title's line on what rows and columns are; it names the decoder's convention where decoder rows are drawn."""
    return "rows: queries, columns: keys" + (f"; {DECODER_ROWS}" if set(kinds) & {"decoder", "cross"} else "")


def plot_layer(
    record: AttentionRecord, kind: str, layer: int, path: str | os.PathLike, vmax: float | None = 1.0,
) -> Path:
    """One PNG of one layer: every head's heat map in a grid, tokens on the axes, one shared colour bar.

    Rows are queries, columns keys. Colours run from 0 to `vmax`: 1 by default, the same in every layer's
    file; None scales them to the layer's largest weight, which shows weak patterns but differs from file to file.
    """
    weights = record.weights(kind)
    if not 0 <= layer < weights.size(0):
        raise BadInput(f"`layer` must be in 0..{weights.size(0) - 1} for {KINDS[kind]}; got {layer}")
    plt = _pyplot()
    rows, keys = record.axes(kind)
    heads = weights.size(1)
    grid_rows, grid_columns = _grid(heads)
    fig, axes, fontsize = _figure(plt, grid_rows, grid_columns, len(rows), len(keys))
    top = float(weights[layer].max()) if vmax is None else vmax
    for head, ax in enumerate(axes.flat):
        if head >= heads:
            ax.axis("off")
            continue
        image = _draw(ax, weights[layer, head].numpy(), rows, keys, top, fontsize)
        ax.set_title(f"head {head + 1}", fontsize=10)
    _label_axes(axes, kind)
    scale = "0 to 1, one scale for every layer" if vmax is not None else f"0 to {top:.2g}, this layer's largest weight"
    title = f"{KINDS[kind]}, layer {layer + 1} of {weights.size(0)}\n{_rows_line([kind])}; colours: {scale}\n"
    title += _caption(record)
    _finish(fig, image, title, "attention weight")
    return _save(fig, path)


def plot_overview(record: AttentionRecord, path: str | os.PathLike) -> Path:
    """One PNG with a row per kind of attention and a column per layer, each panel the heads' mean (colours 0 to 1)."""
    plt = _pyplot()
    layers = max(record.encoder_attention.size(0), record.decoder_attention.size(0))
    longest = max(len(record.source_labels), len(record.target_labels))
    fig, axes, fontsize = _figure(plt, len(KINDS), layers, longest, longest)
    for row, kind in enumerate(KINDS):
        weights = record.weights(kind)
        rows, keys = record.axes(kind)
        for layer in range(layers):
            ax = axes[row, layer]
            if layer >= weights.size(0):
                ax.axis("off")
                continue
            image = _draw(ax, weights[layer].mean(0).numpy(), rows, keys, 1.0, fontsize)
            ax.set_title(f"{KINDS[kind]}, layer {layer + 1}", fontsize=10)
        axes[row, 0].set_ylabel(AXIS_LABELS[kind][0], fontsize=9)
    scale = "colours: 0 to 1, one scale for every layer"
    title = f"Every layer, mean of the heads\n{_rows_line(KINDS)}; {scale}\n{_caption(record)}"
    _finish(fig, image, title, "attention weight (mean of heads)")
    return _save(fig, path)


def plot_models(records: dict[str, AttentionRecord], path: str | os.PathLike, kind: str = "cross", layer: int = -1) -> Path:
    """One PNG comparing models on the same sentence: a panel per model (the dict's keys are the panel
    titles), each the mean of the heads of one layer (default: the last) of one kind of attention.

    Every panel has the same colour scale, 0 to the largest weight of any panel, so that a sharper
    pattern looks sharper. Each model's own translation gives its panel's rows.
    """
    if not records:
        raise BadInput("`records` is empty: give at least one model's AttentionRecord.")
    sources = {record.source for record in records.values()}
    if len(sources) > 1:
        raise BadInput(f"the records translate different sentences ({len(sources)}); compare models on one sentence.")
    means = {}
    for name, record in records.items():
        weights = record.weights(kind)
        if not -weights.size(0) <= layer < weights.size(0):
            raise BadInput(f"`layer` must be in {-weights.size(0)}..{weights.size(0) - 1} for {name}; got {layer}")
        means[name] = weights[layer].mean(0)
    plt = _pyplot()
    grid_rows, grid_columns = math.ceil(len(records) / min(len(records), 3)), min(len(records), 3)
    queries, keys = (max(len(record.axes(kind)[axis]) for record in records.values()) for axis in (0, 1))
    fig, axes, fontsize = _figure(plt, grid_rows, grid_columns, queries, keys)
    vmax = max(float(mean.max()) for mean in means.values())
    for ax, name in zip(axes.flat, records):
        image = _draw(ax, means[name].numpy(), *records[name].axes(kind), vmax, fontsize)
        ax.set_title(f"{name}\n{_cut(records[name].translation, 40)}", fontsize=9)
    for ax in list(axes.flat)[len(records):]:
        ax.axis("off")
    _label_axes(axes, kind)
    layers = next(iter(records.values())).weights(kind).size(0)
    title = (f"{KINDS[kind]}, layer {layer % layers + 1} of {layers}, mean of the heads\n{_rows_line([kind])}\n"
             f"{_cut(sources.pop(), 90)}")
    _finish(fig, image, title, "attention weight (mean of heads; one scale for all panels)")
    return _save(fig, path)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _caption(record: AttentionRecord, width: int = 70) -> str:
    return f"{_cut(record.source, width)}  →  {_cut(record.translation, width)}"


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.15)  # every label whole, however short the sentence
    _pyplot().close(fig)
    return path


def bertviz_data(record: AttentionRecord) -> dict:
    """The keyword arguments of bertviz's `model_view`/`head_view` for an encoder-decoder model:
    per-layer tuples of (batch=1, heads, queries, keys) tensors, and the two token lists as readable
    labels (bertviz turns only "Ġ" into a space: raw byte-level tokens would show "JesÃºs")."""
    queries, keys = record.axes("cross")
    return {
        "encoder_attention": tuple(layer[None] for layer in record.encoder_attention),
        "decoder_attention": tuple(layer[None] for layer in record.decoder_attention),
        "cross_attention": tuple(layer[None] for layer in record.cross_attention),
        "encoder_tokens": keys,
        "decoder_tokens": queries,
    }


def save_attention_maps(record: AttentionRecord, output_dir: str | os.PathLike) -> list[Path]:
    """Write `<kind>_layer<N>.png` for every layer of each kind, `overview.png` and `bertviz.pt`.

    Files are drawn in a staging folder inside `output_dir` and then moved in (`staging.staged_files`),
    so a failure leaves no partial set, and no `output_dir` where it made one.
    """
    output_dir = Path(output_dir)
    sweep_staging(output_dir)  # what an interrupted save left
    with staged_files(output_dir, "attention") as staging:
        for kind in KINDS:
            for layer in range(record.weights(kind).size(0)):
                plot_layer(record, kind, layer, staging / f"{kind}_layer{layer + 1}.png")
        plot_overview(record, staging / "overview.png")
        torch.save(bertviz_data(record), staging / "bertviz.pt")
        paths = [output_dir / file.name for file in sorted(staging.iterdir())]
    return paths
