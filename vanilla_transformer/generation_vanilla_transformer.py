"""Decoding as the paper does it (§6.1): beam size 4, length penalty α = 0.6, output capped at input length + 50.

The length penalty is that of Wu et al. 2016 (GNMT), which the paper cites: a finished hypothesis Y
is ranked by

    score(Y) = log P(Y | X) / lp(Y),    lp(Y) = ((5 + |Y|) / 6) ** α

where |Y| counts the generated tokens including </s>. transformers' beam search divides by |Y| ** α
instead, a different function of length; both are available.

Two generation-config attributes select the paper's behaviour (GenerationConfig keeps unknown
attributes and saves them in generation_config.json; they can also be passed to `generate`):

    length_penalty_style: "gnmt" runs `gnmt_beam_search` below for plain beam search (num_beams > 1,
        no sampling, groups or constraints); "transformers" (the default when unset) leaves every
        mode to transformers. Greedy search and sampling are unaffected by a length penalty.
    max_length_offset: when the call sets neither `max_new_tokens` nor `max_length` (as arguments or
        in a `generation_config` argument), sentence i may generate at most
        (number of non-padding source tokens of i) + max_length_offset new tokens, </s> included;
        </s> is forced at the last allowed step. Default 50, the paper's; it holds for every mode
        (greedy, sampling, either beam search), per sentence in a batch.

Lengths stored in the model's generation config (generation_config.json), the rule: a stored
`max_new_tokens` is a ceiling on the per-sentence cap (nothing in transformers sets it unasked); a
stored `max_length` is ignored by the cap. transformers fills `max_length` with its default of 20
tokens wherever it is unset (`Seq2SeqTrainer` writes it into the model's generation config at every
evaluation, and `save_model` then saves it), so honouring it would cut every later translation at 19
tokens. To cap outputs, pass `max_new_tokens` or `max_length` to `generate` (or the pipeline), which
replaces the cap, store `max_new_tokens`, or lower `max_length_offset`.

The search runs inside transformers' `generate` as a `custom_generate` callable (a documented
argument of `generate`: "perform the usual input preparation steps, then call the provided callable
to run the decoding loop"), so input preparation (encoder run once, beam expansion, cache, logits
processors such as no_repeat_ngram_size, stopping criteria) stays transformers' own and only the
loop below is ours. The model's `generate` passes it when the style is "gnmt"; anyone can pass it
explicitly: `model.generate(..., num_beams=4, custom_generate=gnmt_beam_search)`. The other form of
`custom_generate`, a `custom_generate/generate.py` folder in a Hub repository, is not used: it
replaces `generate` wholesale (greedy and sampling would have to be re-implemented), needs
`trust_remote_code` at every call and is not written by `save_pretrained`.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only the
standard library, torch and the public API of transformers.
"""

from __future__ import annotations

import copy
import math
import numbers

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import GenerationConfig
from transformers.generation import GenerateBeamEncoderDecoderOutput, LogitsProcessor, LogitsProcessorList
from transformers.modeling_outputs import BaseModelOutput

LENGTH_PENALTY_STYLES = ("gnmt", "transformers")
DEFAULT_MAX_LENGTH_OFFSET = 50  # §6.1: "maximum output length to input length + 50"


def paper_generation_config(model_config, **overrides) -> GenerationConfig:
    """The paper's decoding settings (§6.1) for a model: `model.generation_config = paper_generation_config(model.config)`.

    A new GenerationConfig rather than edits to `model.generation_config`: that one is derived from
    the model config, and transformers drops unknown attributes such as ours when it loads a
    generation config marked as derived (`_from_model_config`).
    """
    settings = dict(num_beams=4, length_penalty=0.6, length_penalty_style="gnmt",
                    max_length_offset=DEFAULT_MAX_LENGTH_OFFSET)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        settings[name] = getattr(model_config, name)
    return GenerationConfig(**{**settings, **overrides})


def check_decoding_options(num_beams=None, length_penalty=None, max_new_tokens=None) -> None:
    """Refuse settings that transformers would fail on many frames deep (num_beams=0 divides by zero)
    or decode with silently (a NaN length penalty ranks every beam alike). None: not given."""
    for name, value in (("num_beams", num_beams), ("max_new_tokens", max_new_tokens)):
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
            raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
    if length_penalty is not None and (
        not isinstance(length_penalty, numbers.Real) or isinstance(length_penalty, bool) or not math.isfinite(length_penalty)
    ):
        raise ValueError(f"`length_penalty` must be a finite number (the paper's: 0.6); got {length_penalty!r}.")


def gnmt_length_penalty(length: torch.Tensor | float, alpha: float) -> torch.Tensor | float:
    """lp(Y) = ((5 + |Y|) / 6) ** α (Wu et al. 2016, eq. 14)."""
    return ((5 + length) / 6) ** alpha


class SourceLengthCap(LogitsProcessor):
    """Sentence i may generate at most `max_new_tokens[i]` tokens: at the last one only </s> is allowed.

    Works on logits (greedy, sampling) and on log-probabilities (beam search): every other token is
    set to -inf and </s> keeps its own score, as in fairseq. Rows are sentences repeated
    `rows // len(max_new_tokens)` times (beams or return sequences), as `generate` lays them out.
    """

    def __init__(self, max_new_tokens: torch.Tensor, eos_token_id: int, prompt_length: int = 1):
        self.max_new_tokens = max_new_tokens
        self.eos_token_id = eos_token_id
        self.prompt_length = prompt_length  # the decoder start token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids.size(1) - self.prompt_length
        limit = self.max_new_tokens.to(scores.device).repeat_interleave(scores.size(0) // self.max_new_tokens.numel())
        last_step = generated + 1 >= limit  # (rows,)
        if not bool(last_step.any()):
            return scores
        only_eos = torch.full_like(scores, float("-inf"))
        only_eos[:, self.eos_token_id] = scores[:, self.eos_token_id]
        return torch.where(last_step[:, None], only_eos, scores)


def _setting(name, kwargs, generation_config, model_config, default=None):
    """A generation option as `generate` resolves it: the call, then the passed config, then the model's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    for config in (generation_config, model_config):
        if config is not None and getattr(config, name, None) is not None:
            return getattr(config, name)
    return default


def generate(model, base_generate, inputs=None, generation_config=None, logits_processor=None, **kwargs):
    """`generate` with the two attributes described at the top of this file; everything else is transformers'.

    `base_generate` is transformers' `GenerationMixin.generate` bound to `model`.
    """
    style = _setting("length_penalty_style", kwargs, generation_config, model.generation_config, "transformers")
    offset = _setting("max_length_offset", kwargs, generation_config, model.generation_config, DEFAULT_MAX_LENGTH_OFFSET)
    for name in ("length_penalty_style", "max_length_offset"):  # ours, not model inputs
        kwargs.pop(name, None)
    if style not in LENGTH_PENALTY_STYLES:
        raise ValueError(f"`length_penalty_style` must be one of {LENGTH_PENALTY_STYLES}; got {style!r}.")
    if not isinstance(offset, int) or offset < 1:
        raise ValueError(f"`max_length_offset` must be a positive integer; got {offset!r}.")
    check_decoding_options(
        num_beams=_setting("num_beams", kwargs, generation_config, model.generation_config),
        length_penalty=_setting("length_penalty", kwargs, generation_config, model.generation_config),
        max_new_tokens=_setting("max_new_tokens", kwargs, generation_config, None),
    )

    lengths_in_call = (kwargs, vars(generation_config) if generation_config is not None else {})
    source = next((x for x in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if x is not None), None)
    if source is not None and all(c.get(n) is None for c in lengths_in_call for n in ("max_new_tokens", "max_length")):
        mask = kwargs.get("attention_mask")
        if mask is not None:
            lengths = mask.sum(1)
        elif source.dim() == 3:  # inputs_embeds (B, S, d_model)
            lengths = torch.full((source.size(0),), source.size(1), device=source.device)
        else:
            lengths = (source != model.config.pad_token_id).sum(1)
        prompt = kwargs["decoder_input_ids"].size(1) if kwargs.get("decoder_input_ids") is not None else 1
        # A stored max_new_tokens is a ceiling (see the top of this file); learned position tables end
        # at max_position_embeddings (sinusoids take it as a hint).
        stored = model.generation_config
        ceiling = min(stored.max_new_tokens or math.inf, model.config.max_position_embeddings - prompt)
        limits = (lengths + offset).clamp(max=ceiling)
        eos = _setting("eos_token_id", kwargs, generation_config, stored)
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        logits_processor = LogitsProcessorList([*(logits_processor or []), SourceLengthCap(limits, eos, prompt)])
        # Name the longest output as the stored config does, or transformers warns that both are set.
        name, value = ("max_new_tokens", int(limits.max())) if stored.max_new_tokens else ("max_length", prompt + int(limits.max()))
        if generation_config is None:
            kwargs[name] = value
        else:  # on the config: transformers warns about a config and generation kwargs together
            generation_config = copy.deepcopy(generation_config)
            setattr(generation_config, name, value)

    plain_beam_search = (
        _setting("num_beams", kwargs, generation_config, model.generation_config, 1) > 1
        and not _setting("do_sample", kwargs, generation_config, model.generation_config, False)
        and _setting("num_beam_groups", kwargs, generation_config, model.generation_config, 1) == 1
        and _setting("constraints", kwargs, generation_config, model.generation_config) is None
        and _setting("force_words_ids", kwargs, generation_config, model.generation_config) is None
        and kwargs.get("assistant_model") is None
    )
    if style == "gnmt" and plain_beam_search and kwargs.get("custom_generate") is None:
        kwargs["custom_generate"] = gnmt_beam_search
    return base_generate(inputs, generation_config=generation_config, logits_processor=logits_processor, **kwargs)


def gnmt_beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """Beam search ranked by log P / lp with the GNMT penalty; a `custom_generate` callable for `generate`.

    `generate` has already run the encoder once and repeated each sentence `num_beams` times, so
    `input_ids` is (batch * beams, 1), the decoder start token.

    Each step (as fairseq and transformers): extend every live hypothesis by every token, keep the 2K
    best candidates per sentence by log P (all have the same length, so the penalty does not change
    their order); candidates that end (</s>, or a stopping criterion such as max_length) among the
    best K are finished and scored log P / lp(|Y|); the best K that did not end live on.

    Stopping rule, exact for α >= 0 and α < 0 alike: a live hypothesis can only lose log-probability,
    so its best possible final score is max(log P / lp(L + 1), log P / lp(L_max)), lp being monotone in
    length (L its length, L_max the sentence's cap). A sentence is done when it has
    `num_return_sequences` finished hypotheses and the worst of those is at least that bound for its
    best live hypothesis; `early_stopping` is not used.
    """
    beams, alpha = generation_config.num_beams, generation_config.length_penalty
    n_return = generation_config.num_return_sequences or 1
    rows, prompt_length = input_ids.shape
    batch = rows // beams
    device = input_ids.device
    use_cache = model_kwargs.get("use_cache", True)
    cache = model_kwargs.get("past_key_values") if use_cache else None
    encoder_outputs = model_kwargs["encoder_outputs"]
    memory = BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state)
    output_attentions = bool(generation_config.output_attentions)
    output_hidden_states = bool(generation_config.output_hidden_states)
    want_dict = generation_config.return_dict_in_generate

    # Longest output per sentence: transformers' max_length, or the source-length cap if it is set.
    max_new = torch.full((batch,), generation_config.max_length - prompt_length, device=device)
    for processor in logits_processor:
        if isinstance(processor, SourceLengthCap):
            max_new = torch.minimum(max_new, processor.max_new_tokens.to(device))

    tokens = input_ids  # (rows, t)
    origins = input_ids.new_zeros(rows, 0)  # the row each token was generated from (transformers' beam_indices)
    scores = torch.full((batch, beams), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    finished = [[] for _ in range(batch)]  # per sentence: (score, log P, tokens, origins), best first
    worst_kept = torch.full((batch,), float("-inf"), device=device)  # n_return-th best finished score
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    step_scores, decoder_attentions, cross_attentions, decoder_hidden_states = [], [], [], []
    sentence_offset = torch.arange(batch, device=device)[:, None] * beams

    while not bool(done.all()):
        outputs = model(
            decoder_input_ids=tokens[:, -1:] if cache is not None else tokens,
            encoder_outputs=memory,
            attention_mask=model_kwargs.get("attention_mask"),
            past_key_values=cache,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        log_probs = logits_processor(tokens, outputs.logits[:, -1].float().log_softmax(dim=-1))
        if want_dict:
            step_scores.append(log_probs)
            decoder_attentions.append(outputs.decoder_attentions)
            cross_attentions.append(outputs.cross_attentions)
            decoder_hidden_states.append(outputs.decoder_hidden_states)
        vocab = log_probs.size(-1)
        candidates = (scores.view(-1, 1) + log_probs).view(batch, beams * vocab)
        top_scores, top_index = candidates.topk(2 * beams, dim=1)  # (batch, 2K), best first
        source_row = (top_index // vocab + sentence_offset).view(-1)
        candidate_tokens = torch.cat((tokens[source_row], (top_index % vocab).view(-1, 1)), dim=1)
        candidate_origins = torch.cat((origins[source_row], source_row[:, None]), dim=1)
        ended = stopping_criteria(candidate_tokens, None).view(batch, 2 * beams) & (top_scores > float("-inf"))

        # Finished hypotheses: ended among the K best, in sentences still searching.
        length = candidate_tokens.size(1) - prompt_length
        lp = gnmt_length_penalty(float(length), alpha)
        final = ended & ~done[:, None]
        final[:, beams:] = False
        for sentence, rank in final.nonzero().tolist():
            log_p = top_scores[sentence, rank].item()
            i = sentence * 2 * beams + rank
            kept = finished[sentence]
            kept.append((log_p / lp, log_p, candidate_tokens[i], candidate_origins[i]))
            kept.sort(key=lambda hypothesis: -hypothesis[0])
            del kept[n_return:]
            if len(kept) == n_return:
                worst_kept[sentence] = kept[-1][0]

        # Live hypotheses: the K best that did not end (stable sort keeps them in score order).
        live = torch.sort(ended.int(), dim=1, stable=True).indices[:, :beams]
        scores = top_scores.gather(1, live).masked_fill(ended.gather(1, live), float("-inf"))
        selected = (live + sentence_offset * 2).view(-1)
        tokens, origins = candidate_tokens[selected], candidate_origins[selected]
        if cache is not None:  # beams only move within a sentence, whose cross-attention rows are all equal
            cache.self_attention_cache.reorder_cache(source_row[selected])

        best_possible = torch.maximum(
            scores[:, 0] / gnmt_length_penalty(float(length + 1), alpha),
            scores[:, 0] / gnmt_length_penalty(max_new.float(), alpha),
        )
        done |= (length >= max_new) | (worst_kept >= best_possible)

    hypotheses = [h for kept in finished for h in kept]
    pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
    sequences = pad_sequence([h[2] for h in hypotheses], batch_first=True, padding_value=pad)
    if not want_dict:
        return sequences
    beam_indices = pad_sequence([h[3] for h in hypotheses], batch_first=True, padding_value=-1)
    return GenerateBeamEncoderDecoderOutput(
        sequences=sequences,
        sequences_scores=torch.tensor([h[0] for h in hypotheses], device=device),
        scores=tuple(step_scores) if generation_config.output_scores else None,
        beam_indices=beam_indices,
        encoder_attentions=encoder_outputs.attentions if output_attentions else None,
        encoder_hidden_states=encoder_outputs.hidden_states if output_hidden_states else None,
        decoder_attentions=tuple(decoder_attentions) if output_attentions else None,
        cross_attentions=tuple(cross_attentions) if output_attentions else None,
        decoder_hidden_states=tuple(decoder_hidden_states) if output_hidden_states else None,
        past_key_values=cache,
    )


__all__ = ["SourceLengthCap", "check_decoding_options", "generate", "gnmt_beam_search", "gnmt_length_penalty", "paper_generation_config"]
