"""The batches of a run: how many tokens each holds and how many make an optimiser step (`size_batches`), and the
sampler that cuts the training split into them (`training_sampler`, `TokenBatchSampler`), padded and sent to the
device ahead of the step (`PadCollator`, `PrefetchedBatches`).

§5.1: "Sentence pairs were batched together by approximate sequence length. Each
training batch contained a set of sentence pairs containing approximately 25000
source tokens and 25000 target tokens." `TokenBatchSampler` does this as fairseq's
`--max-tokens` does: pairs of similar length go together and a batch holds at most
`max_tokens` tokens per side, padding included (batch size × longest sequence).

With `bucket_shapes`, every training batch is padded to one of a few shapes (rows × length) chosen from
the data's lengths, so that a step compiled for a shape (`torch.compile`, CUDA graphs) is compiled a few
times per run rather than once per batch; the padding rows and columns change no loss.

Given `max_tokens`, a run takes it; on a GPU without it, the paper's step sized to the device's memory (`gpu_batch`);
elsewhere CPU_MAX_TOKENS, one batch a step. The plan is returned, and the run's options take it (`set_up`): nothing
here changes the options given.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType

from ..errors import BadInput
from .arguments import CPU_MAX_TOKENS, TrainArguments
from .task import TokenizedSplit

__all__ = ["GPU_BUCKETS", "IGNORE_INDEX", "PAPER_STEP_TOKENS", "BatchPlan", "PadCollator", "PrefetchedBatches",
           "TokenBatchSampler", "bucket_shapes", "gpu_batch", "size_batches", "training_sampler"]

logger = get_logger(__name__)

IGNORE_INDEX = -100  # the label of padding positions, which the loss skips (transformers' convention)
PAPER_STEP_TOKENS = 25_000  # §5.1: "approximately 25000 source tokens and 25000 target tokens" per batch
GPU_BUCKETS = 16  # batch shapes on a GPU by default: each is one compilation of a compiled step


def gpu_batch(memory: int, config, parameters: int, processes: int, max_length: int,
              accumulation: int | None = None) -> tuple[int, int]:
    """(max_tokens, gradient_accumulation_steps) of about the paper's 25000 tokens per optimiser step over
    `processes`, each batch fitting a device of `memory` bytes beside the model's `parameters`: with
    `accumulation` given, the batch it needs (within what fits); else the fewest batches whose largest fits.

    The estimate is coarse and errs towards less: 20 bytes a parameter (fp32 weights, gradients, Adam's two
    moments, autocast's bf16 copies), and per token of a batch what a layer keeps for backward in bf16
    autocast (about 30 d_model + 5 d_ff bytes, more in the decoder, which also attends to the source) and the
    output layer's logits with their fp32 log-softmax and gradients (12 bytes a vocabulary entry), doubled for
    the allocator's fragments and temporaries, within 80% of the memory."""
    d, d_ff = config.d_model, config.d_ff
    per_token = (config.encoder_layers * (30 * d + 5 * d_ff) + config.decoder_layers * (44 * d + 5 * d_ff)
                 + 12 * config.vocab_size)
    fits = int((0.8 * memory - 20 * parameters) / (2 * per_token))
    if fits < max_length:
        raise BadInput(f"a batch of `max_length` ({max_length}) tokens does not fit the device's "
                       f"{memory / 2**30:.1f} GiB beside the model's {parameters:,} parameters; lower `max_length` "
                       "or give `max_tokens`")
    if accumulation is None:
        accumulation = -(-PAPER_STEP_TOKENS // (processes * fits))  # rounded up
    wanted = -(-PAPER_STEP_TOKENS // (processes * accumulation))
    return max(min(wanted, fits), max_length), accumulation


class BatchPlan(NamedTuple):
    """The batches of every optimiser step: `max_tokens` tokens each, `gradient_accumulation_steps` of them a process."""

    max_tokens: int
    gradient_accumulation_steps: int


def size_batches(args: TrainArguments, accelerator, model) -> BatchPlan:
    """`max_tokens` and `gradient_accumulation_steps`, those given or, where left unset, on a GPU the paper's batch
    sized to its memory (`gpu_batch`), elsewhere CPU_MAX_TOKENS and one batch per step; one line says what was chosen."""
    accumulation = args.gradient_accumulation_steps
    if args.max_tokens is not None or accelerator.distributed_type == DistributedType.DEEPSPEED:
        accumulation = accumulation or 1  # DeepSpeed: one batch a step
    if args.max_tokens is not None:
        return BatchPlan(args.max_tokens, accumulation)
    processes = accelerator.num_processes
    if accelerator.device.type == "cuda":
        memory = torch.cuda.get_device_properties(accelerator.device).total_memory
        parameters = sum(p.numel() for p in model.parameters())
        plan = BatchPlan(*gpu_batch(memory, model.config, parameters, processes, args.max_length, accumulation))
        why = (f"the paper's ~{PAPER_STEP_TOKENS} per step, sized to the GPU's {memory / 2**30:.1f} GiB and "
               f"{parameters:,} parameters")
    else:
        plan, why = BatchPlan(CPU_MAX_TOKENS, accumulation or 1), "the default off a GPU"
    step_tokens = plan.max_tokens * plan.gradient_accumulation_steps * processes
    logger.info(f"batch: {plan.max_tokens} tokens x {plan.gradient_accumulation_steps} batch(es) x {processes} "
                f"process(es) = {step_tokens} tokens per optimiser step ({why}; --max-tokens and "
                "--gradient-accumulation-steps choose them)")
    return plan


def training_sampler(accelerator, split: TokenizedSplit, epoch: int, max_tokens: int, seed: int, *,
                     shape_count: int | None, compiled: bool) -> TokenBatchSampler:
    """The training batches of at most `max_tokens` tokens, shuffled by `seed`, padded to `shape_count` shapes (by
    default GPU_BUCKETS on a GPU or for a `compiled` step, none elsewhere); one line says the shapes and the padding
    they waste beside that of batches as long as their longest pair."""
    count = shape_count
    if count is None:
        count = GPU_BUCKETS if accelerator.device.type == "cuda" or compiled else 0
    shapes = bucket_shapes(split.lengths, max_tokens, count) if count else None
    shard = dict(seed=seed, num_replicas=accelerator.num_processes, rank=accelerator.process_index)
    sampler = TokenBatchSampler(split.lengths, max_tokens, shapes=shapes, **shard)
    if shapes is None:
        logger.info(f"batches: each as long as its longest pair; {sampler.padding(epoch):.1%} of their slots pad")
    else:
        plain = TokenBatchSampler(split.lengths, max_tokens, **shard).padding(epoch)
        logger.info(f"batches: {len(shapes)} shapes (rows x length: {', '.join(f'{r}x{n}' for r, n in shapes)}); "
                    f"{sampler.padding(epoch):.1%} of their slots pad (as long as their longest pair: {plain:.1%})")
    return sampler


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
