"""A joint byte-level BPE vocabulary for both languages, as a stock transformers fast tokenizer.

The tokenizer is a `tokenizers.Tokenizer` wrapped in transformers' own
`TokenizersBackend` (alias `PreTrainedTokenizerFast`), so a folder written by
`save_pretrained` (tokenizer.json + tokenizer_config.json) loads with
`AutoTokenizer.from_pretrained(folder)` and no custom code.

Special tokens come first, so their ids are fixed: `<pad>`=0, `<s>`=1, `</s>`=2,
`<unk>`=3. Encoding appends `</s>` to every sequence (labels too); `<s>` is left
for the model to use as it sees fit. Read the ids from the tokenizer, never
hard-code them.

Scheme: byte-level BPE (GPT-2 pre-tokenizer, no prefix space, no normaliser), or SentencePiece's unigram
model over the same bytes (`model_type="unigram"`).
Every string maps to bytes and back, so `decode(encode(x), skip_special_tokens=True)
== x` holds for all text: typographic quotes, accents (NFC and NFD alike),
emoji, CJK, runs of spaces, tabs, newlines, leading and trailing spaces. No
character is ever `<unk>`. The one exception, shared by every transformers
tokenizer: the literal strings "<pad>", "<s>", "</s>", "<unk>" typed in a text
are read as the special tokens (so `skip_special_tokens` drops them); pass
`split_special_tokens=True` to read them as plain text. The price of byte-level
input is that a word at the start of a text tokenises differently from the same
word after a space ("In" vs " In"), as in GPT-2.

Why this scheme and a vocabulary of 8,000 (the paper's 37k shared vocabulary was for 4.5M pairs; on
~29k pairs most entries past 8,000 are too rare to train): the comparison of schemes and sizes is in
docs/tokenizer.md, and `python -m benchmarks.tokenizer` times training and encoding.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from .choices import DEFAULT_VOCAB_SIZE, TOKENIZER_MODELS
from .corpora import iter_texts
from .errors import BadInput
from .checks.files import utf8_lines
from .staging import staged_files, sweep_staging

__all__ = [
    "DEFAULT_MIN_FREQUENCY",
    "DEFAULT_VOCAB_SIZE",
    "MODEL_MAX_LENGTH",
    "MODEL_TYPES",
    "SPECIAL_TOKENS",
    "check_appends_eos",
    "read_text_files",
    "save_tokenizer",
    "save_tokenizer_files",
    "train_tokenizer",
    "training_texts",
    "wrap_tokenizer",
]

# Order fixes the ids: <pad>=0, <s>=1, </s>=2, <unk>=3.
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
DEFAULT_MIN_FREQUENCY = 2
# Longest sequence the tokenizer reports as safe; verses are < 200 tokens, and
# the model's sinusoidal positions have no hard limit.
MODEL_MAX_LENGTH = 1024

# Tokenizer training reads at most this many characters of a line: the trainers' work grows with the length of a
# word, so one long line without spaces (a pasted file, a table) would hold training for many minutes.
MAX_TRAINING_LINE = 10_000

logger = logging.getLogger(__name__)

MODEL_TYPES = TOKENIZER_MODELS  # bpe or unigram: choices.py says what each is

_BYTE_ALPHABET = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte symbols every vocabulary starts with
MIN_VOCAB_SIZE = len(_BYTE_ALPHABET) + len(SPECIAL_TOKENS)  # the smallest vocabulary a new tokenizer can have


def _count_texts(texts: Iterable[str], seen: list[int], cut: list[int]) -> Iterator[str]:
    """Pass texts through to the trainer while counting the non-blank ones, each cut to MAX_TRAINING_LINE
    characters (counted in `cut`)."""
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"texts must be strings, got {type(text).__name__}: {text!r:.80}")
        if text.strip():
            seen[0] += 1
        cut[0] += len(text) > MAX_TRAINING_LINE
        yield text[:MAX_TRAINING_LINE]


def training_texts(texts: Iterable[str]) -> list[str]:
    """`texts` as tokenizer training reads them: each cut to MAX_TRAINING_LINE characters."""
    return [text[:MAX_TRAINING_LINE] for text in texts]


def read_text_files(paths: Sequence[str | os.PathLike]) -> Iterator[str]:
    """Yield the lines (without line ends) of UTF-8 plain text files, failing early on an unreadable one."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise BadInput("text_files is empty: give at least one file")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"text file not found: {path}")
        if not os.access(path, os.R_OK):
            raise PermissionError(f"text file is not readable: {path}")
    for path in paths:
        with path.open("rb") as f:
            yield from utf8_lines(f, str(path))


def wrap_tokenizer(tokenizer: Tokenizer, model_max_length: int = MODEL_MAX_LENGTH) -> PreTrainedTokenizerFast:
    """Wrap a trained `tokenizers.Tokenizer` as transformers' stock fast tokenizer."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        **SPECIAL_TOKENS,
        # No add_eos_token flag: transformers 5 does not save it, and the
        # post-processor in tokenizer.json (which appends </s>) is the one truth.
        model_max_length=model_max_length,
        padding_side="right",
        # The default clean-up would glue " ," into "," and break the exact round trip.
        clean_up_tokenization_spaces=False,
    )


def _new_tokenizer(model_type: str) -> Tokenizer:
    # Byte-level: every byte is in the vocabulary, so no text ever needs <unk>.
    tokenizer = Tokenizer(models.BPE() if model_type == "bpe" else models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _trainer(model_type: str, vocab_size: int, min_frequency: int, special_tokens: list[str]) -> trainers.Trainer:
    if model_type == "bpe":
        return trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special_tokens,
                                   initial_alphabet=_BYTE_ALPHABET, show_progress=False)
    # The unigram model scores pieces by likelihood, not by count: min_frequency has no part in it.
    return trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=_BYTE_ALPHABET,
                                   unk_token=SPECIAL_TOKENS["unk_token"], show_progress=False)


def train_tokenizer(
    texts: Iterable[str] | datasets.Dataset | datasets.DatasetDict,
    *,
    languages: Sequence[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    min_frequency: int = DEFAULT_MIN_FREQUENCY,
    special_tokens: Sequence[str] = (),
    output_dir: str | os.PathLike | None = None,
    model_max_length: int = MODEL_MAX_LENGTH,
    model_type: str = "bpe",
) -> PreTrainedTokenizerFast:
    """Learn a joint byte-level vocabulary (BPE, or with `model_type="unigram"` SentencePiece's unigram
    model, for which `min_frequency` does not apply) and return it as a transformers tokenizer.

    `texts` is any iterable of strings, or a translation `Dataset`/`DatasetDict`
    (see `vanilla_transformer.corpora`), of which the `languages` sides (all by
    default) of the train split are read. `special_tokens` are extra special
    tokens (e.g. language tags) placed after `<pad> <s> </s> <unk>`. With
    `output_dir`, the tokenizer is also saved there (see `save_tokenizer`).
    Each text is read to its first MAX_TRAINING_LINE characters; a warning says how many were cut.
    """
    extra = [t for t in special_tokens if t not in SPECIAL_TOKENS.values()]
    all_special = [*SPECIAL_TOKENS.values(), *extra]
    _check_training_arguments(texts, vocab_size, min_frequency, model_type, len(all_special))
    if isinstance(texts, (datasets.Dataset, datasets.DatasetDict)):
        texts = iter_texts(texts, languages)

    tokenizer = _new_tokenizer(model_type)
    trainer = _trainer(model_type, vocab_size, min_frequency, all_special)
    seen, cut = [0], [0]
    tokenizer.train_from_iterator(_count_texts(texts, seen, cut), trainer)
    if seen[0] == 0:
        raise BadInput("no text to learn from: the data set or text files are empty")
    if cut[0]:
        logger.warning(f"{cut[0]:,} of {seen[0]:,} texts are longer than {MAX_TRAINING_LINE:,} characters: the tokenizer "
                       f"learnt from the first {MAX_TRAINING_LINE:,} of each")
    tokenizer.post_processor = _eos_appender(tokenizer)
    wrapped = wrap_tokenizer(tokenizer, model_max_length)
    if extra:
        wrapped.add_special_tokens({"extra_special_tokens": extra})
    if output_dir is not None:
        save_tokenizer(wrapped, output_dir)
    return wrapped


def _check_training_arguments(texts, vocab_size: int, min_frequency: int, model_type: str, special_count: int) -> None:
    """train_tokenizer's arguments, refused before any text is read."""
    smallest = len(_BYTE_ALPHABET) + special_count
    if vocab_size < smallest:
        raise BadInput(
            f"vocab_size={vocab_size} is smaller than the byte alphabet ({len(_BYTE_ALPHABET)}) "
            f"plus the special tokens ({special_count}); use at least {smallest}"
        )
    if model_type not in MODEL_TYPES:
        raise BadInput(f"model_type must be one of {', '.join(MODEL_TYPES)}; got {model_type!r}")
    if min_frequency < 1:
        raise BadInput(f"min_frequency must be at least 1, got {min_frequency}")
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be an iterable of strings or a data set, not a single string")


def _eos_appender(tokenizer: Tokenizer) -> processors.TemplateProcessing:
    """The post-processor that appends `</s>` to every sequence (and to each of a pair)."""
    eos = SPECIAL_TOKENS["eos_token"]
    return processors.TemplateProcessing(
        single=f"$A:0 {eos}:0",
        pair=f"$A:0 {eos}:0 $B:1 {eos}:1",
        special_tokens=[(eos, tokenizer.token_to_id(eos))],
    )


def check_appends_eos(tokenizer, name: str) -> None:
    """Raise ValueError unless encoding a sentence ends it with the tokenizer's `</s>`: a model trained on
    labels without it never learns to stop. `name` says where the tokenizer came from (a folder, an option)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise BadInput(f"{name}: the tokenizer has no end-of-sequence token; give one that appends </s> to every "
                       "sentence (train-tokenizer writes one)")
    ids = tokenizer("A sentence.")["input_ids"]
    if not ids or ids[-1] != eos:
        raise BadInput(f"{name}: the tokenizer does not append {tokenizer.eos_token} to an encoded sentence, so a "
                       "model could never learn to stop; give one whose post-processor appends it "
                       "(train-tokenizer writes one)")


def save_tokenizer_files(tokenizer: PreTrainedTokenizerFast, folder: str | os.PathLike) -> None:
    """`save_pretrained` without the truncation and padding of the last call: transformers leaves them set
    on the `tokenizers` object, and tokenizer.json would keep them for whoever reads it with `tokenizers`."""
    tokenizer.backend_tokenizer.no_truncation()
    tokenizer.backend_tokenizer.no_padding()
    tokenizer.save_pretrained(folder)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, output_dir: str | os.PathLike) -> Path:
    """`save_pretrained` into `output_dir` without ever leaving it half written.

    Files are written to a staging folder inside `output_dir` (so that a read-only parent does not
    matter), then each is renamed into place; what an interrupted save left there is removed first.
    A full disk is raised as DiskFull naming the file, and a folder made for the tokenizer is removed.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"output_dir exists and is not a folder: {output_dir}")
    sweep_staging(output_dir)
    with staged_files(output_dir, "tokenizer") as staging:
        save_tokenizer_files(tokenizer, staging)
    return output_dir
