"""Configuration of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

The defaults are the paper's base model (Table 3, row "base"); `big` (Table 3), `small` (the
quickstart's CPU model) and `tiny` (tests) are named presets, as fairseq names its architectures:

    config = VanillaTransformerConfig.from_preset("base", vocab_size=37000)
    config = VanillaTransformerConfig.from_preset("big", vocab_size=37000)

This file ships with saved models and is loaded with `trust_remote_code=True`: as MarianConfig, it imports
only the standard library and transformers' `PretrainedConfig`, not torch's side of the model (the names a field
takes are plain tuples here; attention_variants.py holds one class for each score name).
"""

import math
import numbers

from transformers import PretrainedConfig

# The score functions (attention_variants.py's SCORE_CLASSES, one class each; docs/attention.md compares them).
ATTENTION_SCORES = ("scaled_dot", "dot", "general", "additive", "cosine", "location")
ATTENTION_NORMALIZATIONS = ("softmax", "relu", "sparsemax")
LOCAL_ATTENTIONS = ("none", "local-m", "local-p")
ATTENTION_HARDNESSES = ("soft", "hard")
POSITION_ENCODINGS = ("sinusoidal", "learned")
NORM_POSITIONS = ("post", "pre")
ACTIVATIONS = ("relu", "gelu")

# Table 3 of the paper. N = layers, d_model, d_ff, h = heads, P_drop = dropout.
# "big" uses P_drop 0.3 as for EN-DE (§6.1; the EN-FR big model used 0.1).
# The one place a preset is named: the command line (`train --preset`, `quickstart --preset`) reads its names and
# shapes from this file's source (choices.py), so each entry is a literal.
PRESETS = {
    "base": {"d_model": 512, "encoder_layers": 6, "decoder_layers": 6, "num_heads": 8, "d_ff": 2048, "dropout": 0.1},
    "big": {"d_model": 1024, "encoder_layers": 6, "decoder_layers": 6, "num_heads": 16, "d_ff": 4096, "dropout": 0.3},
    # Not in the paper: small enough for unit tests.
    "tiny": {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "num_heads": 4, "d_ff": 128, "dropout": 0.1},
    # Not in the paper: the quickstart's, which learns in minutes on a CPU. No dropout (a short run does not
    # overfit); a deeper decoder than encoder; narrow layers, whose cheaper steps beat wider ones in a short run.
    "small": {"d_model": 192, "encoder_layers": 2, "decoder_layers": 4, "num_heads": 4, "d_ff": 256, "dropout": 0.0},
}


# What each field takes; VanillaTransformerConfig._validate refuses anything else, naming the field.
CHOICES = {
    "attention_score": ATTENTION_SCORES,
    "attention_normalization": ATTENTION_NORMALIZATIONS,
    "local_attention": LOCAL_ATTENTIONS,
    "attention_hardness": ATTENTION_HARDNESSES,
    "position_encoding": POSITION_ENCODINGS,
    "norm_position": NORM_POSITIONS,
    "activation": ACTIVATIONS,
}
SIZE_FIELDS = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "num_heads", "d_ff",
               "max_position_embeddings", "location_max_length", "attention_window")
MAX_SIZE = 2**31 - 1  # past any real model; larger numbers overflow torch's index arithmetic
PROBABILITIES = ("dropout", "attention_dropout", "label_smoothing")
FLAGS = ("scale_embedding", "tie_word_embeddings", "use_cache", "fast_paths")
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
OPTIONAL_STRINGS = ("source_lang", "target_lang", "dataset_name", "dataset_config", "dataset_columns")


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, allowed))}; got {value!r}.")


def _is_int(value) -> bool:  # True and False are ints to Python, not sizes or token ids
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """An int or float that is neither NaN nor infinite (True and False are no numbers here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_probability(name: str, value) -> None:
    """The range of `dropout`, `attention_dropout` and `label_smoothing`, which training's options share."""
    if not is_finite_number(value) or not 0 <= value < 1:
        raise ValueError(f"`{name}` must be a number in [0, 1); got {value!r}.")


def score_parameter_count(config) -> int:
    """How many parameters an attention block of `config`'s score function adds to MultiHeadAttention's (W_a, v_a,
    a strength per head; location's W_a replaces W^K)."""
    d, head_dim = config.d_model, config.head_dim
    return {"general": d * head_dim, "additive": 2 * d * head_dim + d, "cosine": config.num_heads,
            "location": d * config.location_max_length - (d * d + d)}.get(config.attention_score, 0)


class VanillaTransformerConfig(PretrainedConfig):
    r"""
    Args:
        vocab_size: size of the shared source/target BPE vocabulary (§5.1).
        d_model: width of every sub-layer output and embedding (§3.1).
        encoder_layers / decoder_layers: N, the number of stacked layers (§3.1).
        num_heads: h, the number of attention heads; d_k = d_v = d_model / h (§3.2.2).
        d_ff: inner width of the position-wise feed-forward network (§3.3).
        dropout: P_drop, applied to each sub-layer output and to the sums of embeddings and positions (§5.4).
        attention_dropout: dropout on attention weights. The paper does not use it (0.0).
        activation: "relu" as in the paper (§3.3), or "gelu".
        max_position_embeddings: longest sequence a "learned" position table holds. The "sinusoidal"
            encoding has no limit; the number is then only a hint for tokenizers and generation.
        position_encoding: "sinusoidal" (§3.5) or "learned" (the paper's Table 3, row E).
        norm_position: "post", LayerNorm(x + Sublayer(x)) as in §3.1, or "pre", x + Sublayer(LayerNorm(x)),
            which adds a final LayerNorm to each stack and trains more stably without warm-up.
        scale_embedding: multiply embeddings by sqrt(d_model) (§3.4).
        tie_word_embeddings: one matrix for source embeddings, target embeddings and the pre-softmax
            projection (§3.4). If False, the three are separate.
        attention_score: how a query is compared with the keys: "scaled_dot" (the paper, §3.2.1) or one
            of the score functions of attention_variants.py (`ATTENTION_SCORES`; compared
            in docs/attention.md), such as "location" (Luong: scores from the query alone, W_a q over key
            positions; the keys' content is not read). It applies in every attention block: encoder
            self-attention, decoder self-attention (with "location", a learned pattern over earlier target
            positions; the look-ahead mask still applies) and cross-attention.
        location_max_length: with attention_score="location", the number of key positions W_a scores:
            the longest source (encoder self- and cross-attention) and the longest target so far
            (decoder self-attention) the model reads. Longer inputs are refused, naming this field.
            Default 256, the training script's default `max_length`.
        attention_normalization: how scores become weights: "softmax" (the paper, §3.2.1), "relu"
            (ReLU(scores) divided by their sum; a row with no positive score gets all-zero weights) or
            "sparsemax" (Martins & Astudillo 2016: a projection onto the simplex, exact zeros for low scores).
        local_attention: "none" (every query sees every key) or Luong et al. 2015's local attention, each
            query seeing only keys within ±`attention_window` of an aligned position (§3.2 there). In self-
            attention that position is the query's own; in cross-attention "local-m" aligns target position
            t with source position t (clipped to the source's last token), and "local-p" predicts it,
            p_t = S·sigmoid(v_p^T tanh(W_p q_t)), and weights the window by a Gaussian of sigma = D/2.
        attention_window: D, the half-width of the local window (used when `local_attention` is not "none").
        attention_hardness: "soft" (weights spread over keys) or "hard" (each query takes one key: the
            argmax at inference, a straight-through Gumbel-softmax sample in training, Jang et al. 2017).
            Straight-through trains; REINFORCE, measured beside it, does not (docs/attention.md): use "hard".
            Hard attention needs "softmax" normalisation.
        layer_norm_eps: epsilon of every LayerNorm.
        label_smoothing: epsilon_ls used when `labels` are given to the model. The paper trains with 0.1
            (§5.4); the model's default is 0 so that its loss is the plain negative log-likelihood. The
            training command sets it to its `--label-smoothing` (0.1), and the saved model keeps it.
        source_lang / target_lang / dataset_name: the language pair the model was trained to translate
            and the data set it was trained on (written by training; None when unknown), so that scoring
            or translating another pair can be warned about.
        dataset_config / dataset_columns: what else reads that data set again (a Hub configuration, the
            column names of a headerless .tsv/.csv, comma-separated), written by training; None when not needed.
        fast_paths: True (the default) builds the model with its speed-ups, which give the plain path's
            numbers with less work: the smoothed cross-entropy with its gradient in closed form and
            attention's projections of one input as one product in training (fast_modeling.py), done
            sentences leaving the batch in decoding (search.py), and the package's oneDNN decoding where it
            loads the model. False builds and decodes on the plain paper path.
            Read when the model is built (and by `generate`).
    """

    model_type = "vanilla_transformer"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the cache, named as in transformers >= 5.24 and before
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "num_heads",
        # Caches are built for the decoder, whose layers hold them.
        "num_hidden_layers": "decoder_layers",
    }

    def __init__(
        self,
        vocab_size: int = 37000,
        d_model: int = 512,
        encoder_layers: int = 6,
        decoder_layers: int = 6,
        num_heads: int = 8,
        d_ff: int = 2048,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: str = "relu",
        max_position_embeddings: int = 1024,
        position_encoding: str = "sinusoidal",
        norm_position: str = "post",
        scale_embedding: bool = True,
        tie_word_embeddings: bool = True,
        attention_score: str = "scaled_dot",
        location_max_length: int = 256,
        attention_normalization: str = "softmax",
        local_attention: str | None = "none",
        attention_window: int = 8,
        attention_hardness: str = "soft",
        layer_norm_eps: float = 1e-5,
        label_smoothing: float = 0.0,
        pad_token_id: int = 0,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        decoder_start_token_id: int | None = None,
        use_cache: bool = True,
        is_encoder_decoder: bool = True,
        source_lang: str | None = None,
        target_lang: str | None = None,
        dataset_name: str | None = None,
        dataset_config: str | None = None,
        dataset_columns: str | None = None,
        fast_paths: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.encoder_layers = encoder_layers
        self.decoder_layers = decoder_layers
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation = activation
        self.max_position_embeddings = max_position_embeddings
        self.position_encoding = position_encoding
        self.norm_position = norm_position
        self.scale_embedding = scale_embedding
        self.attention_score = attention_score
        self.location_max_length = location_max_length
        self.attention_normalization = attention_normalization
        self.local_attention = "none" if local_attention is None else local_attention
        self.attention_window = attention_window
        self.attention_hardness = attention_hardness
        self.layer_norm_eps = layer_norm_eps
        self.label_smoothing = label_smoothing
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        # Like Marian and fairseq, the decoder starts from a token that never appears as output.
        self.decoder_start_token_id = pad_token_id if decoder_start_token_id is None else decoder_start_token_id
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.source_lang = source_lang
        self.target_lang = target_lang
        self.dataset_name = dataset_name
        self.dataset_config = dataset_config
        self.dataset_columns = dataset_columns
        self.fast_paths = fast_paths
        self._validate()
        super().__init__(is_encoder_decoder=is_encoder_decoder, **kwargs)

    def _validate(self) -> None:
        """A value the model cannot be built with is a ValueError naming the field and what it takes, here
        rather than deep inside the first forward pass."""
        for name, allowed in CHOICES.items():
            _check_choice(name, getattr(self, name), allowed)
        if self.attention_hardness == "hard" and self.attention_normalization != "softmax":
            raise ValueError(
                f'`attention_hardness`="hard" picks one key by a (Gumbel-)softmax sample; it cannot be combined with '
                f'`attention_normalization`={self.attention_normalization!r} (use "softmax").'
            )
        for name in SIZE_FIELDS:
            if not _is_int(value := getattr(self, name)) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
            if value > MAX_SIZE:
                raise ValueError(f"`{name}` must be at most {MAX_SIZE}; got {value!r}.")
        if self.d_model % self.num_heads:
            raise ValueError(f"`d_model` ({self.d_model}) must be divisible by `num_heads` ({self.num_heads}).")
        if self.position_encoding == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"`d_model` must be even for sinusoidal positions (§3.5 pairs a sine and a cosine of "
                             f"each frequency); got {self.d_model}.")
        for name in PROBABILITIES:
            check_probability(name, getattr(self, name))
        if not is_finite_number(self.layer_norm_eps) or self.layer_norm_eps <= 0:
            raise ValueError(f"`layer_norm_eps` must be a positive number; got {self.layer_norm_eps!r}.")
        for name in FLAGS:
            if not isinstance(value := getattr(self, name), bool):
                raise ValueError(f"`{name}` must be true or false; got {value!r}.")
        if self.pad_token_id is None:
            raise ValueError("`pad_token_id` must be a token id; got None (padding and the decoder start need one).")
        for name in TOKEN_IDS:  # rows of the embedding table, or None: not used
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value < self.vocab_size):
                raise ValueError(f"`{name}` must be a token id in [0, vocab_size={self.vocab_size}); got {value!r}.")
        for name in OPTIONAL_STRINGS:
            if (value := getattr(self, name)) is not None and not isinstance(value, str):
                raise ValueError(f"`{name}` must be a string or None; got {value!r}.")

    def parameter_count(self) -> int:
        """The number of the model's parameters, from the fields alone (nothing is built): the embeddings and the
        output projection (§3.4), each layer's attention blocks (§3.2.2) with their score parameters
        (`score_parameter_count`), its feed-forward network (§3.3) and LayerNorms (§3.1). Exact:
        tests/modeling/test_modeling_vanilla_transformer.py holds it to a build on the meta device."""
        d, d_ff, head_dim = self.d_model, self.d_ff, self.head_dim
        score = score_parameter_count(self)
        local_p = d * head_dim + d if self.local_attention == "local-p" else 0  # cross-attention only
        attention = 4 * (d * d + d) + score
        feed_forward, norm = 2 * d * d_ff + d + d_ff, 2 * d
        encoder = self.encoder_layers * (attention + feed_forward + 2 * norm)
        decoder = self.decoder_layers * (2 * attention + local_p + feed_forward + 3 * norm)
        tables = 1 if self.tie_word_embeddings else 3  # source and target embeddings, pre-softmax projection
        positions = 2 * self.max_position_embeddings * d if self.position_encoding == "learned" else 0
        final_norms = 2 * norm if self.norm_position == "pre" else 0
        return tables * self.vocab_size * d + positions + encoder + decoder + final_norms

    def sequence_bounds(self) -> dict[str, int]:
        """The longest sequence the model reads, by the field that sets it: location-based scores end at
        `location_max_length`, a learned position table at `max_position_embeddings`; sinusoids with another
        score function set none (they take `max_position_embeddings` as a hint)."""
        bounds = {"location_max_length": self.location_max_length} if self.attention_score == "location" else {}
        if self.position_encoding == "learned":
            bounds["max_position_embeddings"] = self.max_position_embeddings
        return bounds

    def longest_sequence(self) -> int | None:
        """The longest sequence, source or target, the model reads; None where nothing bounds it."""
        return min(self.sequence_bounds().values(), default=None)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "VanillaTransformerConfig":
        """A named architecture (a key of PRESETS) with any field overridden."""
        _check_choice("preset", name, tuple(PRESETS))
        return cls(**{**PRESETS[name], **overrides})


__all__ = ["VanillaTransformerConfig"]
