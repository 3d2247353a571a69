"""Export a model to CTranslate2 (the runtime OPUS-MT and faster-whisper deploy with), and translate with it.

    folder = export_ctranslate2(model, tokenizer, "runs/en-es-ct2", quantization="int8")
    CTranslate2Translator(folder).translate(["Jesus wept."])     # or plain ctranslate2: see the folder's README

The converter fills CTranslate2's own `TransformerSpec` through its public converter API (a
`ctranslate2.converters.Converter` whose `_load` returns the spec; `convert` validates, quantizes and
saves it). Our config maps onto the spec exactly:

- `norm_position` "post" / "pre" -> `pre_norm` False / True (pre-norm's final LayerNorm of each stack
  -> the stack's `layer_norm`); every LayerNorm's epsilon -> `layer_norm_epsilon`.
- `attention_score` "scaled_dot" -> CTranslate2's default query scale 1/sqrt(d_k); "dot" (Luong, no
  scaling) -> `queries_scale` 1. "general", "additive" and "cosine" have learned score parameters
  that CTranslate2 has no place for: refused, naming the option.
- `attention_normalization`, `local_attention` and `attention_hardness` other than the defaults (softmax
  over every key) are refused the same way: CTranslate2's attention has no such option.
- Q, K, V, W^O with their biases -> self-attention's fused QKV and output projections; cross-attention's
  Q, fused KV and output. `fc1`, `fc2` (biases included) -> the FFN; `activation` relu -> RELU, gelu
  (erf, torch's default) -> GELU (erf, not the tanh or sigmoid approximations).
- `scale_embedding` -> `scale_embeddings` (x sqrt(d_model), §3.4); `tie_word_embeddings` -> one array
  for the source and target embeddings and the output projection (CTranslate2 stores it once), or three.
- Positions: CTranslate2's built-in sinusoids are tensor2tensor's (all sines then all cosines, timescales
  10000^(i/(d/2-1)), positions from 1), not §3.5's (interleaved, 10000^(2i/d), from 0): no permutation
  of our weights makes them equal. So the table itself is stored, `max_position_embeddings` rows of
  our own `sinusoidal_encoding` (or the learned table), and the weights keep our dimension order.
- The decoder starts from the embedding of `decoder_start_token_id` (`start_from_zero_embedding` off;
  CTranslate2's Marian loader starts from a zero vector, which is why a Marian round trip differs);
  the vocabulary is the tokenizer's, in id order; the source is given with our `</s>` already
  appended by the tokenizer, so CTranslate2 adds nothing (`add_source_bos`/`add_source_eos` off).

Decoding: CTranslate2 ranks finished beams by log P / |Y|^α (transformers' formula, |Y| counting
`</s>`) and stops a sentence once `beam_size` hypotheses have finished, as transformers does with
`early_stopping=True`; with those settings its outputs are token-identical to `generate` (tested).
The paper's GNMT penalty ((5 + |Y|)/6)^α and our exact stopping rule cannot be expressed. The length
cap is one number per call (`max_decoding_length`) at which it stops without forcing `</s>`; ours is
per sentence and forces `</s>` at the cap.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import torch

from ..errors import BadInput, MissingPackage
from ..modeling.generation import DEFAULT_MAX_LENGTH_OFFSET
from ..modeling.value_checks import MAX_NEW_TOKENS
from ..modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration, sinusoidal_encoding
from ..choices import QUANTIZATIONS, TRANSLATION_BATCH_SIZE
from ..checks.folder_fields import OPTIONS_FILE
from ..inference import cut_texts
from ..checks.model_folder import check_export_folder
from ..modeling.pipeline_vanilla_transformer import longest_source
from ..staging import staged_files, sweep_staging

__all__ = ["CTranslate2Translator", "QUANTIZATIONS", "export_ctranslate2", "import_ctranslate2"]

# Query scale per score function CTranslate2 can compute; None keeps its default, 1/sqrt(d_k).
QUERIES_SCALES = {"scaled_dot": None, "dot": 1.0}
INSTALL_HINT = "pip install 'vanilla-transformer[ctranslate2]' (or pip install 'ctranslate2>=4.5')"


def import_ctranslate2():
    """The ctranslate2 module, or a MissingPackage saying how to install it (it is an optional extra)."""
    try:
        import ctranslate2
    except ImportError as err:
        raise MissingPackage(f"CTranslate2 is not installed: {INSTALL_HINT}") from err
    return ctranslate2


def _check_exportable(model, tokenizer, quantization: str) -> list[str]:
    """Refuse what CTranslate2 cannot compute; return the vocabulary in id order."""
    if not isinstance(model, VanillaTransformerForConditionalGeneration):
        raise BadInput(f"`model` must be a VanillaTransformerForConditionalGeneration; got {type(model).__name__}.")
    if quantization not in QUANTIZATIONS:
        raise BadInput(f"`quantization` must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}.")
    config = model.config
    if config.attention_score not in QUERIES_SCALES:
        raise BadInput(
            f"CTranslate2 cannot express `attention_score`={config.attention_score!r} (it has learned score "
            f"parameters); only {' and '.join(map(repr, QUERIES_SCALES))} export."
        )
    # Softmax over every key is all CTranslate2's attention computes.
    for name, default in (("attention_normalization", "softmax"), ("local_attention", "none"),
                          ("attention_hardness", "soft")):
        if getattr(config, name, default) != default:
            raise BadInput(f"CTranslate2 cannot express `{name}`={getattr(config, name)!r}; only {default!r} exports.")
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    if [vocab[token] for token in tokens] != list(range(len(tokens))) or len(tokens) != config.vocab_size:
        raise BadInput(
            f"the tokenizer's vocabulary ({len(tokens)} tokens, ids {min(vocab.values())}..{max(vocab.values())}) "
            f"must number the model's {config.vocab_size} embedding rows 0..{config.vocab_size - 1}: CTranslate2 "
            "names every row by its token. Export the model with the tokenizer it was trained with."
        )
    if tokenizer.unk_token not in vocab:
        raise BadInput("the tokenizer needs an unknown token in its vocabulary (CTranslate2 would append one).")
    return tokens


def _spec(model, tokens: list[str], unk_token: str):
    """Our model as a CTranslate2 `TransformerSpec` (weights in fp32; `convert` quantizes them)."""
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    spec = transformer_spec.TransformerSpec.from_config(
        (config.encoder_layers, config.decoder_layers),
        config.num_heads,
        pre_norm=config.norm_position == "pre",
        activation={"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[config.activation],
    )
    # Copies: CTranslate2's quantization rewrites the arrays it is given in place, and a float32 CPU
    # tensor's .float().cpu() is the model's own memory (an int8 export once quantized the caller's model).
    weight = {name: tensor.detach().float().cpu().clone() for name, tensor in model.state_dict().items()}
    _fill_stack(spec.encoder, "encoder", weight, config)
    _fill_stack(spec.decoder, "decoder", weight, config)
    spec.decoder.projection.weight = weight["lm_head.weight"]
    spec.decoder.start_from_zero_embedding = False

    spec.config.layer_norm_epsilon = config.layer_norm_eps
    spec.config.unk_token = unk_token
    spec.config.bos_token = tokens[config.bos_token_id]
    spec.config.eos_token = tokens[config.eos_token_id]
    spec.config.decoder_start_token = tokens[config.decoder_start_token_id]
    spec.config.add_source_bos = spec.config.add_source_eos = False
    spec.register_source_vocabulary(tokens)
    spec.register_target_vocabulary(tokens)
    return spec


def _fill_stack(stack, side: str, weight: dict, config) -> None:
    """One stack of the spec (`side` "encoder" or "decoder"): embeddings, positions, layers."""
    prefix = f"model.{side}"
    embeddings = stack.embeddings[0] if side == "encoder" else stack.embeddings
    embeddings.weight = weight[f"{prefix}.embeddings.embed_tokens.weight"]
    stack.scale_embeddings = config.scale_embedding
    stack.position_encodings.encodings = (
        weight[f"{prefix}.embeddings.learned_positions.weight"] if config.position_encoding == "learned"
        else sinusoidal_encoding(torch.arange(config.max_position_embeddings), config.d_model)
    )
    if config.norm_position == "pre":
        _fill_norm(stack.layer_norm, weight, f"{prefix}.final_norm")
    queries_scale = QUERIES_SCALES[config.attention_score]
    for i, layer in enumerate(stack.layer):
        name = f"{prefix}.layers.{i}"
        _fill_attention(layer.self_attention, weight, f"{name}.self_attn", f"{name}.self_attn_residual", queries_scale)
        if side == "decoder":
            _fill_attention(layer.attention, weight, f"{name}.cross_attn", f"{name}.cross_attn_residual", queries_scale,
                            cross=True)
        _fill_linear(layer.ffn.linear_0, weight, f"{name}.feed_forward.fc1")
        _fill_linear(layer.ffn.linear_1, weight, f"{name}.feed_forward.fc2")
        _fill_norm(layer.ffn.layer_norm, weight, f"{name}.feed_forward_residual.norm")


def _fill_attention(target, weight: dict, name: str, residual: str, queries_scale, cross: bool = False) -> None:
    """An attention block: self-attention's fused QKV, or cross-attention's Q and fused KV; W^O; its LayerNorm."""
    projections = [f"{name}.{p}_proj" for p in ("q", "k", "v")]
    groups = [projections[:1], projections[1:]] if cross else [projections]
    for linear_spec, names in zip(target.linear, [*groups, [f"{name}.out_proj"]]):
        _fill_linear(linear_spec, weight, *names)
    _fill_norm(target.layer_norm, weight, f"{residual}.norm")
    if queries_scale is not None:
        target.queries_scale = queries_scale


def _fill_linear(target, weight: dict, *names: str) -> None:
    """A linear map; several names are fused along the output rows (Q, K, V -> QKV)."""
    target.weight = torch.cat([weight[f"{name}.weight"] for name in names])
    target.bias = torch.cat([weight[f"{name}.bias"] for name in names])


def _fill_norm(target, weight: dict, name: str) -> None:
    target.gamma, target.beta = weight[f"{name}.weight"], weight[f"{name}.bias"]


def _plain_tokenizer(backend):
    """A copy of a `tokenizers.Tokenizer` without the padding or truncation that transformers leaves
    set on it after a padded call (saved, it would pad every text of `encode_batch` to the longest)."""
    from tokenizers import Tokenizer

    plain = Tokenizer.from_str(backend.to_str())
    plain.no_padding()
    plain.no_truncation()
    return plain


def translation_options(model, tokenizer) -> dict:
    """The model's decoding defaults (§6.1: beam 4, α 0.6, source + 50) as `translate_batch` arguments.

    `max_decoding_length` is the ceiling ours has (the stored `max_new_tokens`, and the position table
    less the start token); per call it is min(ceiling, longest source + `max_length_offset`)."""
    config, generation = model.config, model.generation_config
    return {
        "beam_size": generation.num_beams or 1,
        "length_penalty": generation.length_penalty if generation.length_penalty is not None else 1.0,
        "min_decoding_length": 0,  # as generate: </s> may come first
        "max_input_length": min(longest_source(model, tokenizer), config.max_position_embeddings),
        "max_decoding_length": min(generation.max_new_tokens or math.inf, config.max_position_embeddings - 1,
                                   MAX_NEW_TOKENS),
        "max_length_offset": getattr(generation, "max_length_offset", None) or DEFAULT_MAX_LENGTH_OFFSET,
    }


def export_ctranslate2(model, tokenizer, output_dir: str | os.PathLike, quantization: str = "float32") -> Path:
    """Write a self-contained CTranslate2 folder: model.bin, config.json and shared_vocabulary.json
    (CTranslate2's), our tokenizer.json, translation_options.json (the decoding defaults) and a README.

    The files are staged inside `output_dir` (its parent may be read-only) and renamed into place, so a
    failed export leaves nothing; an existing non-empty `output_dir` is refused rather than overwritten.
    """
    ctranslate2 = import_ctranslate2()
    output_dir = Path(output_dir)
    sweep_staging(output_dir)  # what an interrupted export left
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise BadInput(f"`output_dir` {output_dir} already exists and is not an empty folder; choose a new one.")
    tokens = _check_exportable(model, tokenizer, quantization)
    spec = _spec(model, tokens, tokenizer.unk_token)

    class VanillaTransformerConverter(ctranslate2.converters.Converter):
        def _load(self):
            return spec

    options = translation_options(model, tokenizer)
    with staged_files(output_dir, "export", last=["model.bin"]) as staging:  # an export once model.bin lands
        VanillaTransformerConverter().convert(str(staging), quantization=quantization, force=True)
        _plain_tokenizer(tokenizer.backend_tokenizer).save(str(staging / "tokenizer.json"))
        (staging / OPTIONS_FILE).write_text(json.dumps(options, indent=2) + "\n")
        (staging / "README.md").write_text(_readme(model.config, quantization, options, ctranslate2.__version__))
    return output_dir


def _readme(config, quantization: str, options: dict, version: str) -> str:
    offset, alpha = options["max_length_offset"], options["length_penalty"]
    return f"""# CTranslate2 export of a vanilla-transformer model

Weights in {quantization}, converted with CTranslate2 {version}: d_model {config.d_model}, \
{config.encoder_layers} + {config.decoder_layers} layers, {config.num_heads} heads, {config.norm_position}-norm, \
{config.position_encoding} positions. This folder needs only `pip install ctranslate2 tokenizers`:

```python
import json
import ctranslate2
import tokenizers

folder = "."  # this folder
translator = ctranslate2.Translator(folder, device="cpu")  # or "cuda"; compute_type="int8" etc. to change precision
tokenizer = tokenizers.Tokenizer.from_file(f"{{folder}}/tokenizer.json")
options = json.load(open(f"{{folder}}/{OPTIONS_FILE}"))
offset = options.pop("max_length_offset")
tokenizer.enable_truncation(options["max_input_length"])  # keeps the final </s>

sources = [encoding.tokens for encoding in tokenizer.encode_batch(["Jesus wept.", "Love is patient."])]
options["max_decoding_length"] = min(options["max_decoding_length"], max(map(len, sources)) + offset)
results = translator.translate_batch(sources, **options)
print([tokenizer.decode([tokenizer.token_to_id(t) for t in r.hypotheses[0]]) for r in results])
```

Or with the package: `vanilla-transformer translate --engine ctranslate2 --model FOLDER "Jesus wept."`
(`evaluate --engine ctranslate2` scores it).

Source tokens are the tokenizer's, `</s>` included; the decoder starts from the embedding of token \
{config.decoder_start_token_id}, as the model's does. `{OPTIONS_FILE}` holds the model's decoding defaults \
as `translate_batch` arguments: beam {options["beam_size"]}, length penalty {alpha}, sources cut at \
{options["max_input_length"]} tokens, outputs of at most the longest source + {offset} tokens (and never \
more than {options["max_decoding_length"]}).

How this decoding differs from the model's own `generate` (the paper's, §6.1):

- Length penalty: CTranslate2 ranks finished hypotheses by log P / |Y|^α (|Y| counts `</s>`), the
  formula of transformers' beam search; the model ranks by the paper's GNMT penalty,
  log P / ((5 + |Y|) / 6)^α, which CTranslate2 cannot express.
- Stopping: CTranslate2 finishes a sentence once `beam_size` hypotheses have ended (transformers'
  `early_stopping=True`); the model searches until no live hypothesis can beat the best finished one.
- Length cap: one `max_decoding_length` per call, at which CTranslate2 stops without adding `</s>`;
  the model caps each sentence at its own source length + {offset} and forces `</s>` there.

With `generate(num_beams=4, length_penalty={alpha}, early_stopping=True, length_penalty_style="transformers", \
max_new_tokens=N)` and `max_decoding_length=N` here, float32 outputs are token-identical to the model's.
"""


class CTranslate2Translator:
    """A folder written by `export_ctranslate2`, translating text as `inference.translate_texts` does.

    `device`: "cpu", "cuda" or "cuda:N" (default: the GPU when CTranslate2 sees one); `threads`: CPU
    threads (0: CTranslate2's default, min(4, cores), or OMP_NUM_THREADS).
    """

    def __init__(self, folder: str | os.PathLike, device: str | None = None, threads: int = 0):
        ctranslate2 = import_ctranslate2()
        from tokenizers import Tokenizer

        folder = Path(folder)
        self.options = check_export_folder(folder)  # before CTranslate2 reads anything of it
        self.folder = folder
        device = device or ("cuda" if ctranslate2.get_cuda_device_count() else "cpu")
        kind, _, index = device.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise BadInput(f"`device` must be cpu, cuda or cuda:N for CTranslate2; got {device!r}")
        try:
            self.translator = ctranslate2.Translator(str(folder), device=kind, device_index=int(index or 0),
                                                     intra_threads=threads)
        except RuntimeError as err:  # a damaged model.bin or config.json; a CUDA error names itself
            raise BadInput(f"`model` {folder}: CTranslate2 cannot load it: {err}") from None
        try:
            self.tokenizer = _plain_tokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")))
        except Exception as err:  # tokenizers raises plain Exception ("Model missing. at line 1 column 2")
            raise BadInput(f"{folder / 'tokenizer.json'} is not a tokenizer file this version can read: {err}") from None
        # The most characters one token stands for: a longer text is cut before tokenising, as our pipeline cuts.
        self.token_characters = max(map(len, self.tokenizer.decode_batch(
            [[i] for i in range(self.tokenizer.get_vocab_size())], skip_special_tokens=False)))

    def encode(self, texts: list[str]) -> list[list[str]]:
        """Source tokens, </s> included, cut (keeping </s>) to `max_input_length` as our pipeline cuts."""
        limit = self.options["max_input_length"]
        self.tokenizer.enable_truncation(limit)
        try:
            encodings = self.tokenizer.encode_batch(texts)
        finally:
            self.tokenizer.no_truncation()
        cut = sum(bool(encoding.overflowing) for encoding in encodings)
        if cut:
            warnings.warn(f"{cut} text(s) were truncated to the model's limit of {limit} tokens.", stacklevel=3)
        return [encoding.tokens for encoding in encodings]

    def translate_tokens(self, sources: list[list[str]], *, num_beams: int | None = None,
                         length_penalty: float | None = None, max_new_tokens: int | None = None) -> list[list[int]]:
        """One batch: the output ids of each source, without </s>."""
        ceiling = self.options["max_decoding_length"]  # the position table's, or the model's stored max_new_tokens
        if max_new_tokens is not None and max_new_tokens > ceiling:
            raise BadInput(f"`max_new_tokens` must be at most {ceiling} for this export (the longest output its "
                           f"model decodes); got {max_new_tokens}")
        options = dict(self.options)
        offset = options.pop("max_length_offset")
        longest = max(map(len, sources))
        options["max_decoding_length"] = max_new_tokens or min(options["max_decoding_length"], longest + offset)
        options["beam_size"] = num_beams or options["beam_size"]
        if length_penalty is not None:
            options["length_penalty"] = length_penalty
        try:
            results = self.translator.translate_batch(sources, **options)
        except RuntimeError as err:  # a length past the position table the export stores ("No position encodings")
            raise BadInput(f"{self.folder / OPTIONS_FILE}: CTranslate2 cannot decode with these options: "
                           f"{str(err).splitlines()[0]}. Export the model again") from None
        return [[self.tokenizer.token_to_id(token) for token in result.hypotheses[0]] for result in results]

    def translate(self, texts: list[str], *, batch_size: int = TRANSLATION_BATCH_SIZE, first_line: int = 1, **options) -> list[str]:
        """Translate each text; blank texts give "". A text longer than the model reads is cut before tokenising,
        with a warning naming its line (`first_line` is the first text's). Batches hold texts of similar length
        (longest first), so that each batch's length cap is close to each of its texts' own."""
        texts = cut_texts(texts, self.options["max_input_length"], self.token_characters, first_line)
        translations = [""] * len(texts)
        order = [i for i, text in enumerate(texts) if text.strip()]
        sources = dict(zip(order, self.encode([texts[i] for i in order]))) if order else {}
        order.sort(key=lambda i: -len(sources[i]))
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            for i, ids in zip(batch, self.translate_tokens([sources[i] for i in batch], **options)):
                translations[i] = " ".join(self.tokenizer.decode(ids, skip_special_tokens=True).splitlines())
        return translations
