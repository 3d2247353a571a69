"""Scoring a model during and after training: loss, perplexity, and BLEU and chrF of its translations.

`evaluate` scores a tokenised split on every process, each its share of the batches: the label-smoothed
loss and the NLL per target token (criterion.py's `batch_loss`, the training objective of §5.4), perplexity, and
(unless asked not to) BLEU and chrF of beam-search translations (§6.1's decoding) with sacrebleu's
signatures. `full_model` is the model as one process can score, decode and save it.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from accelerate.logging import get_logger

from ..metrics import load_bleu_chrf, repeated_phrase
from ..modeling.generation import paper_generation_config
from ..modeling.modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration
from . import criterion
from .arguments import TrainArguments
from .batches import PadCollator, PrefetchedBatches, TokenBatchSampler
from .task import TokenizedSplit

__all__ = ["evaluate", "full_model", "load_weights", "report", "translate_split"]

logger = get_logger(__name__)


@torch.no_grad()
def evaluate(accelerator, model, tokenizer, split: TokenizedSplit, args: TrainArguments, translate_samples=None,
             full_precision: bool = False) -> dict:
    """Loss, perplexity and (unless `translate_samples` is 0) BLEU and chrF of beam-search translations.

    Each process scores its share of the batches; `gather_for_metrics` brings the sums and the
    translations together. `loss` is the label-smoothed training objective per target token,
    `perplexity` exp(NLL per target token) without smoothing. BLEU and chrF are the package's
    `evaluate` metric (`metrics.BLEU_CHRF`: sacrebleu's command-line defaults), with signatures.
    `full_precision` leaves mixed precision off, as `vanilla-transformer evaluate` computes: the final scores.
    """
    precision = nullcontext if full_precision else accelerator.autocast
    model = full_model(accelerator, model)
    was_training = model.training
    model.eval()
    collate = PadCollator(tokenizer.pad_token_id)
    shard = dict(shuffle=False, num_replicas=accelerator.num_processes, rank=accelerator.process_index)
    sums, tokens = torch.zeros(2, dtype=torch.float64, device=accelerator.device), 0  # loss, nll; target tokens
    sampler = TokenBatchSampler(split.lengths, args.max_tokens, **shard)
    with PrefetchedBatches(split, sampler, collate, accelerator.device) as batches, precision():
        for batch, batch_tokens in batches:
            loss, nll = criterion.batch_loss(model, batch)
            sums += torch.stack([loss.double(), nll.double()])
            tokens += batch_tokens
    sums = torch.cat([sums, sums.new_tensor([tokens])])
    loss, nll, tokens = accelerator.gather_for_metrics(sums.unsqueeze(0)).sum(0).tolist()
    metrics = {"loss": loss / tokens, "nll": nll / tokens, "perplexity": math.exp(min(nll / tokens, 100.0))}

    count = len(split.dataset) if translate_samples is None else min(translate_samples, len(split.dataset))
    if count:
        metrics.update(_translation_scores(accelerator, model, tokenizer, split, args, count, precision),
                       pairs=len(split.dataset))  # beside `translated`: a bounded count says it is a part
    model.train(was_training)
    return metrics


def _translation_scores(accelerator, model, tokenizer, split: TokenizedSplit, args: TrainArguments, count: int,
                        precision) -> dict:
    """BLEU and chrF of beam-search translations of the first `count` pairs of `split`, each process its share."""
    shard = dict(shuffle=False, num_replicas=accelerator.num_processes, rank=accelerator.process_index)
    subset = TokenizedSplit(split.dataset.select(range(count)), count, 0, 0)
    # Beam search holds num_beams hypotheses per sentence: fewer sentences per batch.
    lengths = subset.lengths
    budget = max(args.max_tokens // args.num_beams, int(lengths.max()))
    indices = list(TokenBatchSampler(lengths, budget, **shard))
    collate = PadCollator(tokenizer.pad_token_id)
    with PrefetchedBatches(subset, indices, collate, accelerator.device) as batches, precision():
        translations = translate_split(model, tokenizer, batches, indices, args)
    translations = sorted(accelerator.gather_for_metrics(translations, use_gather_object=True))
    hypotheses = [text for _, text in translations]
    references = [subset.dataset[i]["reference"] for i, _ in translations]
    scores = load_bleu_chrf().compute(predictions=hypotheses, references=references)
    return dict(
        {key: scores[key] for key in ("bleu", "chrf", "bleu_signature", "chrf_signature")},
        translated=len(hypotheses),
        # Translations that loop ("y de su mujer, y de su mujer"), and beside them the references that
        # repeat a phrase too: a coordination ("á todos los ganados ... á todos los animales") is no loop
        # but counts: read the first count against the second.
        repeating=sum(repeated_phrase(h) is not None for h in hypotheses),
        references_repeating=sum(repeated_phrase(r) is not None for r in references),
        examples=[{"reference": r, "translation": h} for r, h in zip(references[:3], hypotheses[:3])],
    )


def full_model(accelerator, model):
    """The model unwrapped, to evaluate, decode and save. Under FSDP2, whose layers hold shards of their
    weights and gather them in every forward (all processes together), a plain copy with the whole weights
    on each process, gathered by all of them here: each can then score and decode its own batches, of
    different numbers and lengths, without waiting for the others."""
    from torch.distributed.fsdp import FSDPModule

    unwrapped = accelerator.unwrap_model(model)
    if not isinstance(unwrapped, FSDPModule):
        return unwrapped
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    weights = get_model_state_dict(unwrapped, options=StateDictOptions(full_state_dict=True))
    full = VanillaTransformerForConditionalGeneration(unwrapped.config).to(accelerator.device)
    load_weights(full, weights)
    full.generation_config = unwrapped.generation_config
    return full.train(unwrapped.training)


def load_weights(model, weights: dict) -> None:
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = tuple(model.all_tied_weights_keys)  # a LoRA run's names (PEFT's) end with them
    if unexpected or any(not name.endswith(tied) for name in missing):
        raise RuntimeError(f"the weights do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()


def translate_split(model, tokenizer, batches, indices: list[list[int]], args: TrainArguments) -> list[tuple[int, str]]:
    """(pair index, translation) for every pair of `batches`, whose pairs `indices` lists batch by batch."""
    translations = []
    for (batch, _), batch_indices in zip(batches, indices):
        generated = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            # §6.1: beam search, GNMT length penalty, at most source length + 50 tokens per sentence.
            generation_config=paper_generation_config(
                model.config, num_beams=args.num_beams, length_penalty=args.length_penalty
            ),
        )
        translations += zip(batch_indices, tokenizer.batch_decode(generated, skip_special_tokens=True))
    return translations


def _describe(metrics: dict) -> str:
    text = f"loss {metrics['loss']:.4f}, perplexity {metrics['perplexity']:.2f}"
    if "bleu" in metrics:
        text += (f", BLEU {metrics['bleu']:.2f}, chrF {metrics['chrf']:.2f} ({metrics['translated']} sentences, "
                 f"{metrics['repeating']} repeating a 3-word phrase; references: {metrics['references_repeating']})")
    return text


def report(accelerator, history: list, step: int, name: str, metrics: dict, log=None, weights: str | None = None) -> None:
    """Log `metrics` of split `name` at `step`, and add them to `history` (what checkpoints keep) and to `log`
    (the run's TrainingLog). `weights` names the final weights scored (whose newest checkpoint is `step`'s)."""
    logger.info(f"step {step} {name}{f' (final weights: {weights})' if weights else ''}: {_describe(metrics)}")
    if "bleu_signature" in metrics:
        logger.info(f"sacrebleu {metrics['bleu_signature']} | {metrics['chrf_signature']}")
    final = {"final_weights": weights} if weights else {}
    history.append({"step": step, "split": name, **final, **{k: v for k, v in metrics.items() if k != "examples"}})
    if log is not None:
        log.append(history[-1])
    accelerator.log({f"{name}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
