"""Training data: tokenise pairs, drop what cannot be trained on, batch by token count.

§5.1: "Sentence pairs were batched together by approximate sequence length. Each
training batch contained a set of sentence pairs containing approximately 25000
source tokens and 25000 target tokens." `TokenBatchSampler` does this as fairseq's
`--max-tokens` does: pairs of similar length go together and a batch holds at most
`max_tokens` tokens per side, padding included (batch size × longest sequence).

With `bucket_shapes`, every training batch is padded to one of a few shapes (rows × length) chosen from
the data's lengths, so that a step compiled for a shape (`torch.compile`, CUDA graphs) is compiled a few
times per run rather than once per batch; the padding rows and columns change no loss.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import datasets
import numpy as np
import torch

from ..errors import BadInput

__all__ = ["PadCollator", "PrefetchedBatches", "TokenBatchSampler", "TokenizedSplit", "bucket_shapes",
           "tokenization_workers", "tokenize_pairs"]

IGNORE_INDEX = -100  # the label of padding positions, which the loss skips (transformers' convention)
PAIRS_PER_WORKER = 200_000  # below this a worker process costs more (start, pickling the tokenizer) than it saves
NUM_PROC_ENV = "VANILLA_TRANSFORMER_NUM_PROC"  # set to override how many processes tokenise a large split


def tokenization_workers(pairs: int) -> int | None:
    """How many processes `Dataset.map` tokenises `pairs` pairs with: None (this process) for small splits, else
    one per PAIRS_PER_WORKER pairs up to the CPUs this process may use; `VANILLA_TRANSFORMER_NUM_PROC` overrides.
    Every process of a run computes the same number, which the map cache's file names depend on."""
    if os.environ.get(NUM_PROC_ENV):
        text = os.environ[NUM_PROC_ENV].strip()
        if not text.isdigit():
            raise BadInput(f"{NUM_PROC_ENV} must be a whole number of processes (1: this process only); got {text!r}.")
        workers = int(text)
    else:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = min(cpus, pairs // PAIRS_PER_WORKER)
    return workers if workers > 1 else None


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """`tokenizer(texts)["input_ids"]`, from the Rust tokenizer directly where that gives the same ids (a backend
    that neither truncates nor pads on its own), without transformers' wrapping, which costs time on large corpora."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer(texts)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch(texts)]


def map_fingerprint(dataset: datasets.Dataset, tokenizer, **options) -> str | None:
    """The map cache's key for tokenising `dataset` with `tokenizer` and `options`: what the result depends on
    (the data, the tokenizer's vocabulary and rules, the options, this module's code), not how the tokenizer
    object came to be. `Dataset.map` hashes the pickled tokenizer otherwise, and a tokenizer just trained
    pickles differently from the same one loaded from its file: the run after the one that trained it tokenised
    2M pairs again (benchmarks/big_corpus.py). None (let `datasets` hash) for a tokenizer without a backend, or
    where this module's source cannot be read."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        code = inspect.getsource(tokenize_pairs) + inspect.getsource(encode_texts) + inspect.getsource(blank_to_empty)
    except OSError:  # installed without sources
        return None
    described = {
        "data": dataset._fingerprint,
        "tokenizer": [type(tokenizer).__name__, backend.to_str(), tokenizer.all_special_tokens],
        "options": options,
        "code": code,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def column(dataset: datasets.Dataset, name: str) -> np.ndarray:
    """A whole numeric column as a NumPy array, read through Arrow: `np.asarray(dataset[name])` converts it
    row by row, most of the wait before the first step on a large corpus (benchmarks/big_corpus.py)."""
    return dataset.with_format("arrow")[name].to_numpy()


@dataclass
class TokenizedSplit:
    """A split ready for training, with what was left out of it and why."""

    dataset: datasets.Dataset  # columns: input_ids, labels, length
    total: int  # pairs before filtering
    empty: int  # pairs with a side that is empty or only white space (it tokenises to </s> alone)
    too_long: int  # pairs with a side over max_length (dropped, or truncated when truncate=True)

    @property
    def lengths(self) -> np.ndarray:
        """Each pair's longer side, in tokens: what batches are built from."""
        return column(self.dataset, "length")

    def describe(self, name: str, max_length: int, truncate: bool) -> str:
        kept = len(self.dataset)
        action = "truncated" if truncate else "dropped"
        return (
            f"{name}: {kept:,} of {self.total:,} pairs kept; {self.empty:,} dropped with an empty or blank side, "
            f"{self.too_long:,} {action} for a side over {max_length} tokens"
        )


def blank_to_empty(text: str | None) -> str:
    """"" for a missing text or one of white space only, which then tokenises to </s> alone: an empty side."""
    return text if text and text.strip() else ""


def pair_encoder(tokenizer, source_lang: str, target_lang: str, max_length: int, truncate: bool,
                 keep_references: bool):
    """The batched `Dataset.map` function of `tokenize_pairs`: both sides encoded, with their lengths."""

    def encode(batch):
        pairs = batch["translation"]
        # A blank side would otherwise be a pair teaching that a space translates to a sentence, or to nothing.
        sources = [blank_to_empty((p or {}).get(source_lang)) for p in pairs]
        targets = [blank_to_empty((p or {}).get(target_lang)) for p in pairs]
        raw_src, raw_tgt = encode_texts(tokenizer, sources), encode_texts(tokenizer, targets)
        options = dict(truncation=True, max_length=max_length)
        src = tokenizer(sources, **options)["input_ids"] if truncate else raw_src
        tgt = tokenizer(targets, **options)["input_ids"] if truncate else raw_tgt
        references = {"reference": targets} if keep_references else {}
        return {
            **references,
            "input_ids": src,
            "labels": tgt,
            "length": [max(len(s), len(t)) for s, t in zip(src, tgt)],
            "min_length": [min(len(s), len(t)) for s, t in zip(src, tgt)],
            "raw_length": [max(len(s), len(t)) for s, t in zip(raw_src, raw_tgt)],
        }

    return encode


def tokenize_pairs(
    dataset: datasets.Dataset,
    tokenizer,
    source_lang: str,
    target_lang: str,
    max_length: int,
    truncate: bool = False,
    name: str = "split",
    keep_references: bool = False,
    num_proc: int | None | str = "auto",
) -> TokenizedSplit:
    """Tokenise the `translation` column with `Dataset.map` (batched; cached on disk for file-backed data).

    Both sides are encoded with the one joint tokenizer, which appends </s>. A pair whose
    source or target is empty or only white space is dropped (and counted); a pair with a side longer than `max_length` tokens
    is dropped, or cut to `max_length` (keeping </s>) when `truncate`. `keep_references` keeps
    the target text in a `reference` column, to score translations against. `num_proc` processes
    tokenise ("auto": `tokenization_workers`); for file-backed data the result is cached next to the
    data set's files and a later run with the same tokenizer and options reads it back instead.
    """
    if max_length < 2:
        raise BadInput(f"`max_length` must be at least 2 (a token and </s>); got {max_length!r}.")

    encode = pair_encoder(tokenizer, source_lang, target_lang, max_length, truncate, keep_references)
    if num_proc == "auto":
        num_proc = tokenization_workers(len(dataset))
    options = dict(source_lang=source_lang, target_lang=target_lang, max_length=max_length, truncate=truncate,
                   keep_references=keep_references)
    encoded = dataset.map(
        encode, batched=True, remove_columns=dataset.column_names, num_proc=num_proc, desc=f"tokenising {name}",
        new_fingerprint=map_fingerprint(dataset, tokenizer, **options),
    )
    min_length, raw_length = column(encoded, "min_length"), column(encoded, "raw_length")
    empty = min_length <= 1  # nothing but </s>
    too_long = ~empty & (raw_length > max_length)
    keep = ~empty if truncate else ~empty & ~too_long
    kept = encoded.select(np.flatnonzero(keep)).remove_columns(["min_length", "raw_length"])
    split = TokenizedSplit(kept, len(encoded), int(empty.sum()), int(too_long.sum()))
    if len(kept) == 0:
        raise BadInput(
            f"no pairs left in the {name} split: {split.describe(name, max_length, truncate)}. Check the "
            f"language keys ({source_lang!r}, {target_lang!r}), `max_length`, or pass `truncate`."
        )
    return split


def bucket_shapes(lengths, max_tokens: int, count: int) -> list[tuple[int, int]]:
    """At most `count` batch shapes (rows, length), shortest first: the lengths that waste the least padding when
    every pair is padded to the shortest of them it fits (exactly, by dynamic programming over the distinct
    lengths), each with the rows that cut its pairs into the fewest batches `max_tokens` allows, all but the
    last full (an epoch's pairs of a length are the same every epoch). The longest length is the data's longest."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    if values.size == 0 or count < 1:
        raise BadInput("bucket shapes need at least one length and one bucket")
    if max_tokens < values[-1]:
        raise BadInput(f"`max_tokens` ({max_tokens}) must be at least the longest sequence ({values[-1]} tokens).")
    pairs, tokens = np.concatenate([[0], np.cumsum(counts)]), np.concatenate([[0], np.cumsum(counts * values)])

    def padding(first, last):  # of the pairs with lengths values[first..last] (first an array) padded to values[last]
        return values[last] * (pairs[last + 1] - pairs[first]) - (tokens[last + 1] - tokens[first])

    n = values.size
    best = [padding(np.zeros(n, dtype=np.int64), np.arange(n)).astype(float)]  # best[k][j]: k + 1 buckets, the last ends at j
    starts = [np.zeros(n, dtype=np.int64)]  # where that last bucket starts
    for _ in range(1, min(count, n)):
        cost, start = np.full(n, np.inf), np.zeros(n, dtype=np.int64)  # inf: fewer lengths than buckets
        for last in range(1, n):
            first = np.arange(1, last + 1)
            options = best[-1][first - 1] + padding(first, last)
            cost[last], start[last] = options.min(), first[options.argmin()]
        best.append(cost)
        starts.append(start)
    shapes, last = [], n - 1
    for start in reversed(starts):
        length, members = int(values[last]), int(pairs[last + 1] - pairs[start[last]])
        batches = -(-members // (max_tokens // length))  # rounded up
        shapes.append((-(-members // batches), length))  # rows alike in every batch: the last is nearly full
        if start[last] == 0:
            break
        last = start[last] - 1
    return shapes[::-1]


class PadCollator:
    """Pad a batch of examples into tensors: sources with <pad> and a mask, labels with IGNORE_INDEX.

    With `shapes` ((rows, length), shortest first), a batch is padded to the first shape that holds it: its
    extra rows are a source of one <pad> token that the mask lets attention see (kernels differ on a row that
    sees no key at all, some give NaN, and NaN times a zero gradient is NaN) and targets all IGNORE_INDEX."""

    def __init__(self, pad_token_id: int, shapes: list[tuple[int, int]] | None = None):
        self.pad_token_id, self.shapes = pad_token_id, shapes

    def shape(self, rows: int, longest: int) -> tuple[int, int]:
        if not self.shapes:
            return rows, longest
        for shape in self.shapes:
            if shape[0] >= rows and shape[1] >= longest:
                return shape
        raise BadInput(f"a batch of {rows} rows of up to {longest} tokens fits none of the shapes {self.shapes}")

    def __call__(self, columns: dict[str, list]) -> dict[str, torch.Tensor]:
        """`columns` is what `dataset[indices]` returns: {"input_ids": [[...], ...], "labels": [[...], ...]}."""
        sources, targets = columns["input_ids"], columns["labels"]
        rows, length = self.shape(len(sources), max(map(len, sources + targets)))

        def pad(sequences, value, length):
            out = torch.full((rows, length), value, dtype=torch.long)
            for i, sequence in enumerate(sequences):
                out[i, : len(sequence)] = torch.as_tensor(sequence)
            return out

        input_ids = pad(sources, self.pad_token_id, length if self.shapes else max(map(len, sources)))
        attention_mask = (input_ids != self.pad_token_id).long()
        attention_mask[len(sources):, 0] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": pad(targets, IGNORE_INDEX, length if self.shapes else max(map(len, targets))),
        }


class TokenBatchSampler:
    """Batches of pair indices holding at most `max_tokens` tokens (batch size × longest side).

    Training (`shuffle=True`): in each epoch the pairs are shuffled, stably sorted by length
    (so equal lengths mix differently every epoch), cut into batches greedily, and the batches
    are shuffled; everything is drawn from a generator seeded with (seed, epoch), so the
    order is the same on every run and every process. With several processes the batch list
    is cut to a multiple of `num_replicas` and process r takes batches r, r + n, r + 2n, ...:
    an optimiser step over n processes sees the same batches as one process accumulating n.

    Evaluation (`shuffle=False`): batches in length order, every pair exactly once over all
    processes (nothing cut).

    `set_epoch(epoch, start)` picks the epoch and skips its first `start` local batches,
    which is how a resumed run continues exactly where it stopped.

    With `shapes` (`bucket_shapes`; training only), each sorted pair goes to the shortest length it fits, and
    each length's pairs are cut into batches of that shape's rows: an epoch has at most len(shapes) shapes.
    """

    def __init__(
        self,
        lengths,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        shapes: list[tuple[int, int]] | None = None,
    ):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.size == 0:
            raise BadInput("cannot batch an empty data set")
        longest = int(self.lengths.max())
        if max_tokens < longest:
            raise BadInput(f"`max_tokens` ({max_tokens}) must be at least the longest sequence ({longest} tokens).")
        if not 0 <= rank < num_replicas:
            raise BadInput(f"rank {rank} is not in [0, {num_replicas}).")
        if shapes and (not shuffle or shapes[-1][1] < longest):
            raise BadInput(f"bucket shapes are for training batches up to the longest sequence ({longest} tokens); "
                           f"got {shapes} for {'training' if shuffle else 'evaluation'}")
        self.max_tokens, self.shuffle, self.seed, self.shapes = max_tokens, shuffle, seed, shapes
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch, self.start = 0, 0
        self._cached: tuple[int | None, list] = (None, [])

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """Every batch of `epoch`, over all processes, in the order they are consumed."""
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            permutation = rng.permutation(len(self.lengths))
            order = permutation[np.argsort(self.lengths[permutation], kind="stable")]
        else:
            order = np.argsort(self.lengths, kind="stable")
        batches = self._cut(order) if self.shapes is None else self._cut_by_shape(order)
        if self.shuffle:
            rng.shuffle(batches)
            if len(batches) < self.num_replicas:
                raise BadInput(
                    f"{len(batches)} batch(es) of at most {self.max_tokens} tokens cannot feed {self.num_replicas} "
                    "processes; lower `max_tokens` or use fewer processes."
                )
            batches = batches[: len(batches) - len(batches) % self.num_replicas]
        return batches

    def _cut(self, order: np.ndarray) -> list[np.ndarray]:
        """Greedily: a batch grows while its rows × longest length stays within `max_tokens`."""
        batches, begin, longest = [], 0, 0
        for end, index in enumerate(order):
            longest_with = max(longest, self.lengths[index])
            if (end - begin + 1) * longest_with > self.max_tokens:
                batches.append(order[begin:end])
                begin, longest_with = end, self.lengths[index]
            longest = longest_with
        batches.append(order[begin:])
        return batches

    def _cut_by_shape(self, order: np.ndarray) -> list[np.ndarray]:
        bucket = np.searchsorted([length for _, length in self.shapes], self.lengths[order])  # the shortest that fits
        batches = []
        for b, (rows, _) in enumerate(self.shapes):
            members = order[bucket == b]
            batches += [members[begin : begin + rows] for begin in range(0, len(members), rows)]
        return batches

    def padding(self, epoch: int = 0) -> float:
        """The share of the epoch's batch slots (rows × length, over all processes) that pad the longer side."""
        slots = tokens = 0
        for batch in self.global_batches(epoch):
            lengths = self.lengths[batch]
            rows, length = len(batch), int(lengths.max())
            if self.shapes:
                rows, length = next(shape for shape in self.shapes if shape[1] >= length)
            slots, tokens = slots + rows * length, tokens + int(lengths.sum())
        return 1 - tokens / slots

    def local_batches(self, epoch: int) -> list[np.ndarray]:
        if self._cached[0] != epoch:
            self._cached = (epoch, self.global_batches(epoch)[self.rank :: self.num_replicas])
        return self._cached[1]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.local_batches(self.epoch)[self.start :]:
            yield batch.tolist()

    def __len__(self) -> int:
        return max(len(self.local_batches(self.epoch)) - self.start, 0)


class PrefetchedBatches:
    """Padded batches in the sampler's order, each with its number of target tokens: `(batch on device, tokens)`.

    A background thread reads and pads the next `ahead` batches while the device works, counts their
    target tokens on the host (so that counting waits for no device), and on CUDA puts them in pinned
    memory, from which the copy to the device (`non_blocking=True`) runs without stopping the host.
    The batches and their order are the sampler's; no RNG is drawn (a DataLoader's iterators draw from
    torch's global RNG, which would make a resumed run's dropout differ from an uninterrupted one).
    Use as a context manager, or `close()` it: a consumer that stops early stops the thread.
    """

    _END = object()

    def __init__(self, split: TokenizedSplit, sampler, collate: PadCollator, device, ahead: int = 2):
        self.device = torch.device(device)
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._finished = False
        pin = self.device.type == "cuda"
        self._thread = threading.Thread(
            target=self._fill, args=(split, iter(sampler), collate, pin), name="prefetched-batches", daemon=True
        )
        self._thread.start()

    def _fill(self, split, indices, collate, pin) -> None:
        try:
            for batch_indices in indices:
                batch = collate(split.dataset[batch_indices])
                tokens = int((batch["labels"] != IGNORE_INDEX).sum())
                if pin:
                    batch = {name: tensor.pin_memory() for name, tensor in batch.items()}
                if not self._put((batch, tokens)):
                    return
            self._put(self._END)
        except BaseException as err:  # raised again in the consumer's thread, where it can be handled
            self._put(err)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def __next__(self) -> tuple[dict[str, torch.Tensor], int]:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is self._END or isinstance(item, BaseException):
            self._finished = True
            if item is self._END:
                raise StopIteration
            raise item
        batch, tokens = item
        return {name: tensor.to(self.device, non_blocking=True) for name, tensor in batch.items()}, tokens

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
