"""The model's own decoding loops: greedy search and the paper's beam search (§6.1), inside transformers' `generate`.

Words: a hypothesis (in greedy search, a row) is *finished* once it emits </s>, meets a stopping criterion or
reaches its sentence's cap; a sentence (in greedy search, a row) is *done* once its search is over, and done ones
leave the batch.

The beam search ranks as the paper does, with the length penalty of Wu et al. 2016 (GNMT), which the paper
cites: a finished hypothesis Y is ranked by

    score(Y) = log P(Y | X) / lp(Y),    lp(Y) = ((5 + |Y|) / 6) ** α

where |Y| counts the generated tokens including </s>. transformers' beam search divides by |Y| ** α
instead, a different function of length; both are available (transformers' in its own loop).

§6.1's length cap is a logits processor (`SourceLengthCap`): generation.py builds one for each call from the
source; these loops apply it, ask it which sentences are at their last step and keep the caps of the sentences
that stay in the batch. A hypothesis that cannot emit </s> in time (</s> suppressed, or `min_new_tokens` past its
cap) is finished at its cap without it, as transformers' loop finishes one at max_length.

The search runs inside transformers' `generate` as a `custom_generate` callable (a documented
argument of `generate`: "perform the usual input preparation steps, then call the provided callable
to run the decoding loop"), so input preparation (encoder run once, beam expansion, cache, logits
processors such as no_repeat_ngram_size, stopping criteria) stays transformers' own and only the
loop below is ours. The model's `generate` passes the search (`greedy_search` or `gnmt_beam_search`, as
generation.py's `choose_search` picks it); anyone can pass one explicitly:
`model.generate(..., num_beams=4, custom_generate=gnmt_beam_search)`. The other form of `custom_generate`,
a `custom_generate/generate.py` folder in a Hub repository, is not used: it replaces `generate` wholesale
(greedy and sampling would have to be re-implemented), needs `trust_remote_code` at every call and is not
written by `save_pretrained`.

This file ships with saved models and is loaded with `trust_remote_code=True`: it imports only the
standard library, torch, the public API of transformers and the files beside it.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers.generation import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    GenerateBeamEncoderDecoderOutput,
    InfNanRemoveLogitsProcessor,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.masking_utils import create_bidirectional_mask

from .input_checks import CACHE_NAME


def gnmt_length_penalty(length: torch.Tensor | float, alpha: float) -> torch.Tensor | float:
    """lp(Y) = ((5 + |Y|) / 6) ** α (Wu et al. 2016, eq. 14)."""
    return ((5 + length) / 6) ** alpha


def _force_eos(scores: torch.Tensor, last_step: torch.Tensor, eos: int) -> torch.Tensor:
    """Rows at their last allowed step may only emit </s>: every other token gets -inf (§6.1's cap). Where
    </s> is ruled out (min_new_tokens past the cap, a suppressed </s>) the row is left as it is: the
    search finishes it at the cap without </s>, as transformers' loop does at max_length."""
    last_step = last_step & (scores[:, eos] > float("-inf"))
    others = torch.ones(scores.size(-1), dtype=torch.bool, device=scores.device)
    others[eos] = False
    return scores.masked_fill(last_step[:, None] & others, float("-inf"))


class SourceLengthCap(LogitsProcessor):
    """Sentence i may generate at most `max_new_tokens[i]` tokens: at the last one only </s> is allowed.

    Works on logits (greedy, sampling) and on log-probabilities (beam search): every other token is
    set to -inf and </s> keeps its own score, as in fairseq. Rows are sentences repeated
    `rows // len(max_new_tokens)` times (beams or return sequences), as `generate` lays them out.
    transformers' loops apply it as any logits processor; ours too, and ask it which sentences are at
    their last step and, as done sentences leave the batch, for the cap of those that stay.
    `shortest` (default: the smallest cap, read from the device once) may be any lower bound of the caps:
    before it no sentence is at its last step, which the host then knows without asking the device.
    """

    def __init__(self, max_new_tokens: torch.Tensor, eos_token_id: int, prompt_length: int = 1,
                 shortest: int | None = None):
        self.max_new_tokens = max_new_tokens
        self.eos_token_id = eos_token_id
        self.prompt_length = prompt_length  # the decoder start token
        self.shortest = int(max_new_tokens.min()) if shortest is None else shortest

    def last_step(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Per sentence: is the next token its last? `input_ids` are the tokens so far (any rows per sentence)."""
        return input_ids.size(1) - self.prompt_length + 1 >= self.max_new_tokens.to(input_ids.device)

    def select(self, sentences: torch.Tensor) -> SourceLengthCap:
        """The cap of `sentences` alone (their places in the batch): for a batch that done sentences leave."""
        return SourceLengthCap(self.max_new_tokens[sentences.to(self.max_new_tokens.device)], self.eos_token_id,
                               self.prompt_length, self.shortest)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.size(1) - self.prompt_length + 1 < self.shortest:
            return scores  # no sentence is at its last step yet
        rows_per_sentence = scores.size(0) // self.max_new_tokens.numel()
        return _force_eos(scores, self.last_step(input_ids).repeat_interleave(rows_per_sentence), self.eos_token_id)


# Logits processors that treat every row on its own, from its tokens, and our length cap, which selects
# the rows that stay: with only these, done sentences can leave the batch without changing a score.
ROW_WISE_PROCESSORS = (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    SourceLengthCap,
)


def _with_one_length_cap(logits_processor, sentences: int, eos: int, prompt_length: int, device) -> LogitsProcessorList:
    """The processors with one SourceLengthCap, last (where transformers' loop has the one `generate`
    adds): the tightest of those given, or, without one, a cap that never finishes a hypothesis."""
    never = torch.iinfo(torch.int64).max
    limit, shortest = torch.full((sentences,), never, device=device), never
    for processor in logits_processor:
        if isinstance(processor, SourceLengthCap):
            limit = torch.minimum(limit, processor.max_new_tokens.to(device))
            shortest = min(shortest, processor.shortest)
    others = (p for p in logits_processor if not isinstance(p, SourceLengthCap))
    return LogitsProcessorList([*others, SourceLengthCap(limit, eos, prompt_length, shortest)])


def first_token_id(token_id) -> int:
    """One id from a setting that may hold several (`eos_token_id` can be a list): the first. The </s> these searches
    and the cap force, and the pipeline's."""
    return token_id[0] if isinstance(token_id, (list, tuple)) else token_id


def _padding(generation_config) -> int:
    """What the searches put after a finished hypothesis: the padding token, or </s> where the model has none."""
    pad = generation_config.pad_token_id
    return pad if pad is not None else first_token_id(generation_config.eos_token_id)


class _LiveRows:
    """The decoder's side of these searches: the rows still in the batch (`rows_per_sentence` a sentence),
    their cache, encoder output and logits processors, run one step at a time; done sentences leave.
    `output_attentions` and `output_hidden_states` go to the decoder. The encoder has run: each step calls
    the decoder (`get_decoder()`) alone."""

    def __init__(self, model, input_ids, logits_processor, generation_config, model_kwargs, rows_per_sentence=1,
                 output_attentions=False, output_hidden_states=False):
        rows, prompt_length = input_ids.shape
        self.model, self.decoder, self.rows_per_sentence = model, model.get_decoder(), rows_per_sentence
        self.cache = model_kwargs.get(CACHE_NAME) if model_kwargs.get("use_cache", True) else None
        self.encoder_hidden_states = model_kwargs["encoder_outputs"].last_hidden_state  # (B, S, d_model)
        self.attention_mask = _source_mask(model, self.encoder_hidden_states, model_kwargs.get("attention_mask"))
        self.output_attentions, self.output_hidden_states = output_attentions, output_hidden_states
        eos = first_token_id(generation_config.eos_token_id)
        self.processors = _with_one_length_cap(logits_processor, rows // rows_per_sentence, eos, prompt_length,
                                               input_ids.device)
        self.project = model.get_output_embeddings()  # §3.4's lm_head, looked up once (oneDNN decoding may pack it)

    @property
    def cap(self) -> SourceLengthCap:
        """The sentences' length cap, last of the processors."""
        return self.processors[-1]

    def can_prune(self, returns_dict: bool) -> bool:
        """Rows may leave the batch unless something needs every row (the returned cache and per-step outputs
        of `return_dict_in_generate`, a static cache, a processor that reads across rows) or the fast paths are off."""
        static_cache = self.cache is not None and self.cache.is_compileable
        return (self.model.config.fast_paths and not returns_dict and not static_cache
                and all(isinstance(p, ROW_WISE_PROCESSORS) for p in self.processors))

    def step(self, tokens: torch.Tensor):
        """Run the decoder on the rows' tokens so far (the last alone where the cache holds the others): its
        outputs and the logits of the next token."""
        new = tokens[:, -1:] if self.cache is not None and self.cache.get_seq_length() else tokens
        outputs = self.decoder(input_ids=new, encoder_hidden_states=self.encoder_hidden_states,
                               encoder_attention_mask=self.attention_mask, cache=self.cache,
                               output_attentions=self.output_attentions, output_hidden_states=self.output_hidden_states)
        return outputs, self.project(outputs.last_hidden_state[:, -1]).float()  # §3.4, last position only

    def process(self, tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The logits processors in turn, the length cap last, as LogitsProcessorList calls them (which also reads
        each one's signature at every step, for arguments these loops do not have)."""
        for processor in self.processors:
            scores = processor(tokens, scores)
        return scores

    def reorder(self, rows: torch.Tensor) -> None:
        """Beams move within a sentence, whose cross-attention rows are all equal: only the self-attention
        cache is reordered."""
        if self.cache is not None:
            self.cache.self_attention_cache.reorder_cache(rows)

    def keep(self, staying: torch.Tensor, self_attention_rows=None) -> None:
        """Only the sentences `staying` (their places in the batch) stay: their rows of the cache, the
        encoder output and the length cap (the self-attention cache takes `self_attention_rows` instead,
        where beams are reordered in the same gather)."""
        rows = _rows_of(staying, self.rows_per_sentence)
        if self.cache is not None:
            self.cache.self_attention_cache.batch_select_indices(rows if self_attention_rows is None else self_attention_rows)
            self.cache.cross_attention_cache.batch_select_indices(rows)
        self.encoder_hidden_states = self.encoder_hidden_states[rows]
        self.attention_mask = self.attention_mask[rows] if self.attention_mask is not None else None
        self.processors = LogitsProcessorList(p.select(staying) if isinstance(p, SourceLengthCap) else p
                                              for p in self.processors)


def _source_mask(model, encoder_hidden_states: torch.Tensor, attention_mask):
    """The decoder's cross-attention mask, built once per call rather than at every step: it depends only on
    the source's padding, (B, 1, 1, S) for any query positions, in the form the attention function takes
    (transformers' mask functions pass a prepared 4-D mask through). Local attention's windows move with the
    query, and flex attention's block mask has a query length: there the padding mask (B, S) stays. Built
    even where nothing is padded: asking would make the host wait for the device."""
    if attention_mask is None or model.config.local_attention != "none":
        return attention_mask
    mask = create_bidirectional_mask(model.config, encoder_hidden_states[:, :1], attention_mask, encoder_hidden_states,
                                     allow_is_bidirectional_skip=False)
    return mask if isinstance(mask, torch.Tensor) and mask.dim() == 4 else attention_mask


def _rows_of(sentences: torch.Tensor, rows_per_sentence: int) -> torch.Tensor:
    """The rows of `sentences` (places in the batch), each `rows_per_sentence` consecutive rows."""
    within = torch.arange(rows_per_sentence, device=sentences.device)
    return (sentences[:, None] * rows_per_sentence + within).view(-1)


def _not_done_count(done: torch.Tensor) -> int:
    """How many rows (or sentences) are not `done`: the step's one wait for the device."""
    return done.numel() - int(done.sum())


def _staying_and_leaving(done: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The places of the `count` not done and of those `done`, each in order, found on the device
    (a mask's `nonzero` or boolean indexing would wait for it again); only when some leave."""
    places = torch.sort(done.byte(), stable=True).indices
    return places[:count], places[count:]


def should_prune(not_done: int, batch: int) -> bool:
    """The one rule by which done rows (in beam search, done sentences) leave the batch of our loops: at once, when
    fewer than the `batch` rows (or sentences) are `not_done`. Gathering the rows that stay costs no more than
    computing done rows for a step or two, and beam search gathers its self-attention cache at every step anyway (to
    reorder its beams)."""
    return not_done < batch


def call_context(model, rows: int):
    """The context one call of our loops over `rows` rows runs in: the model's `decoding_context` (set where the
    package loads the model: its oneDNN decoding), or none."""
    hook = getattr(model, "decoding_context", None)
    return contextlib.nullcontext() if hook is None else hook(model, rows)


def greedy_search(model, input_ids, logits_processor, stopping_criteria, generation_config, prune=True, **model_kwargs):
    """Greedy decoding in which done rows leave the batch (`should_prune`); a `custom_generate`
    callable. A row is done once its hypothesis is finished.

    Returns what transformers' greedy search returns, token for token: each row its argmax tokens,
    padded after it finishes, up to the step the last row finished. Rows stay in place (as in transformers,
    fed padding once done) under the conditions of `gnmt_beam_search`. As there, the host waits for the
    device once a step (how many rows are not done); each call runs in the model's `decoding_context`
    (`call_context`). Our `generate` uses it for
    plain greedy decoding without per-step outputs or a static cache (with one, transformers' loop
    compiles the step).
    """
    rows = input_ids.size(0)
    live = _LiveRows(model, input_ids, logits_processor, generation_config, model_kwargs)
    prune = prune and live.can_prune(returns_dict=False)  # with it, transformers' loop runs
    pad = _padding(generation_config)

    sequences = input_ids.new_full((rows, generation_config.max_length), pad)
    active = torch.arange(rows, device=input_ids.device)  # the rows in the batch, by their index in the input
    tokens = input_ids  # theirs so far
    done = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    with call_context(model, rows):
        while True:
            _, logits = live.step(tokens)
            scores = live.process(tokens, logits)
            last_step = live.cap.last_step(tokens)  # finishes with this token, </s> or not (where </s> is ruled out)
            next_tokens = torch.where(done, pad, scores.argmax(dim=-1))  # done rows are fed padding
            tokens = torch.cat((tokens, next_tokens[:, None]), dim=1)
            done |= stopping_criteria(tokens, scores) | last_step
            count = _not_done_count(done)
            if count == 0:
                sequences[active, : tokens.size(1)] = tokens
                return sequences[:, : tokens.size(1)]
            if prune and should_prune(count, done.numel()):
                staying, leaving = _staying_and_leaving(done, count)
                sequences[active[leaving], : tokens.size(1)] = tokens[leaving]
                live.keep(staying)
                tokens, active, done = tokens[staying], active[staying], done[staying]


class GNMTRanking:
    """The paper's ranking (§6.1): log P / lp(|Y|), lp = ((5 + |Y|) / 6)^α, `num_return_sequences`
    finished hypotheses kept per sentence.

    When a sentence is done, exactly for α >= 0 and α < 0 alike: a live hypothesis can only lose
    log-probability, so its best possible score is max(log P / lp(L + 1), log P / lp(L_max)), lp being monotone
    in length (L its length, L_max the sentence's cap). A sentence is done when the worst kept hypothesis
    is at least that bound for its best live hypothesis; `early_stopping` is not used. A kept place
    left empty scores -inf, which only the bound of a sentence with no live hypothesis (-inf too)
    reaches: it is done.
    """

    def __init__(self, generation_config):
        self.alpha = generation_config.length_penalty
        self.num_kept = generation_config.num_return_sequences or 1

    def penalty(self, length):
        return gnmt_length_penalty(length, self.alpha)

    def is_done(self, best_live, length: int, max_new, worst_kept):
        """Per sentence: can no live hypothesis (best log P `best_live`, `length` tokens, at most
        `max_new`) beat the worst of those kept (`worst_kept`, -inf until `num_kept` are)?"""
        bound = torch.maximum(best_live / self.penalty(length + 1), best_live / self.penalty(max_new.float()))
        return worst_kept >= bound


class _Candidates(NamedTuple):
    """The 2K best extensions of each sentence's live hypotheses, best first."""

    scores: torch.Tensor  # (sentences, 2K): log P
    tokens: torch.Tensor  # (sentences * 2K, length)
    origins: torch.Tensor  # (sentences * 2K, length - prompt): the rows the tokens were generated from
    rows: torch.Tensor  # (sentences * 2K,): the rows they extend, in the batch now
    finishes: torch.Tensor  # (sentences, 2K): finished (</s>, a stopping criterion, the sentence's cap)


class _Finished(NamedTuple):
    """A finished hypothesis: its score by the ranking, its tokens and the row each token came from."""

    score: float
    tokens: torch.Tensor  # (length,): the prompt, then the generated tokens
    beam_indices: torch.Tensor  # (length - prompt,): transformers' beam_indices


class _Hypotheses:
    """Beam search's hypotheses: per row of the batch a live one (tokens, origins, log P), per sentence
    its `ranking.num_kept` best finished ones (`GNMTRanking`) and whether it is done; `active`: the sentences
    in the batch. Finished hypotheses are kept on the device, in tables of the longest output (`max_length`
    tokens), padded with `fill`, so that a step never waits for the device to tell which finished. A beam that may
    not be extended scores -inf."""

    def __init__(self, input_ids, generation_config):
        rows, self.prompt_length = input_ids.shape
        beams, max_length = generation_config.num_beams, generation_config.max_length
        batch, device = rows // beams, input_ids.device
        self.beams, self.ranking, self.fill = beams, GNMTRanking(generation_config), _padding(generation_config)
        kept = self.ranking.num_kept
        self.tokens = input_ids  # (rows, t)
        self.prompts = input_ids[::beams]  # (batch, t): each sentence's, its beams' alike
        self.origins = input_ids.new_zeros(rows, 0)  # the row each token was generated from (transformers' beam_indices)
        self.scores = torch.full((batch, beams), float("-inf"), device=device)
        self.scores[:, 0] = 0.0  # all beams start identical: expand only the first
        self.active = torch.arange(batch, device=device)  # by their index in the input
        # Per sentence, its kept finished hypotheses, best first; an empty place scores -inf.
        self.kept_scores = torch.full((batch, kept), float("-inf"), device=device)
        self.kept_tokens = input_ids.new_full((batch, kept, max_length), self.fill)
        self.kept_origins = input_ids.new_full((batch, kept, max_length - self.prompt_length), -1)
        self.kept_lengths = input_ids.new_zeros(batch, kept)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)  # per sentence: its search is over

    def candidates(self, log_probs: torch.Tensor, stopping_criteria, last_step: torch.Tensor) -> _Candidates:
        """Extend every live hypothesis by every token; keep the 2K best per sentence by log P (all have the
        same length, so the penalty does not change their order). `last_step`: per sentence, at its cap."""
        beams, sentences, vocab = self.beams, self.active.numel(), log_probs.size(-1)
        extended = (self.scores.view(-1, 1) + log_probs).view(sentences, beams * vocab)
        scores, index = extended.topk(2 * beams, dim=1)
        parent = index // vocab  # the beam within its sentence
        position = torch.arange(sentences, device=scores.device)[:, None]  # (sentences, 1): their places in the batch now
        rows = (parent + position * beams).view(-1)
        tokens = torch.cat((self.tokens[rows], (index % vocab).view(-1, 1)), dim=1)
        # in the input's batch (rows leave as sentences are done), as transformers numbers beam_indices
        origins = torch.cat((self.origins[rows], (parent + self.active[:, None] * beams).view(-1, 1)), dim=1)
        # A candidate at its sentence's cap finishes, as one at max_length does.
        finishes = stopping_criteria(tokens, None).view(sentences, 2 * beams) | last_step[:, None]
        return _Candidates(scores, tokens, origins, rows, finishes)

    def finish(self, candidates: _Candidates) -> None:
        """Candidates that finish among the K best of a sentence not done are finished hypotheses,
        scored by the ranking; a sentence keeps its `ranking.num_kept` best (the earlier first among equals)."""
        beams, active = self.beams, self.active
        length = candidates.tokens.size(1)
        ranked = candidates.scores[:, :beams] / self.ranking.penalty(length - self.prompt_length)
        finished = candidates.finishes[:, :beams] & (candidates.scores[:, :beams] > float("-inf"))  # -inf never does
        finished &= ~self.done[active][:, None]
        scores = torch.cat((self.kept_scores[active], ranked.masked_fill(~finished, float("-inf"))), dim=1)
        scores, order = scores.sort(dim=1, descending=True, stable=True)
        order = order[:, : self.ranking.num_kept]
        self.kept_scores[active] = scores[:, : self.ranking.num_kept]

        self.kept_tokens[active] = self._merged(self.kept_tokens, candidates.tokens, order, self.fill)
        self.kept_origins[active] = self._merged(self.kept_origins, candidates.origins, order, -1)
        new_lengths = self.kept_lengths.new_full((active.numel(), beams), length)
        self.kept_lengths[active] = torch.cat((self.kept_lengths[active], new_lengths), dim=1).gather(1, order)

    def _merged(self, kept: torch.Tensor, new: torch.Tensor, order: torch.Tensor, fill: int) -> torch.Tensor:
        """The active sentences' `kept` entries and their first K candidates' `new` ones (padded with
        `fill` to the tables' length), in `order`."""
        new = new.view(self.active.numel(), 2 * self.beams, -1)[:, : self.beams]
        new = torch.nn.functional.pad(new, (0, kept.size(-1) - new.size(-1)), value=fill)
        both = torch.cat((kept[self.active], new), dim=1)
        return both.gather(1, order[:, :, None].expand(-1, -1, both.size(-1)))

    def live_on(self, candidates: _Candidates) -> torch.Tensor:
        """The K best candidates that did not finish are the live hypotheses (those that finished score -inf,
        and live on only if fewer than K did not); returns the rows they extend."""
        ranked = candidates.scores.masked_fill(candidates.finishes, float("-inf"))
        self.scores, live = ranked.topk(self.beams, dim=1)
        position = torch.arange(live.size(0), device=live.device)[:, None]
        selected = (live + position * 2 * self.beams).view(-1)
        self.tokens, self.origins = candidates.tokens[selected], candidates.origins[selected]
        return candidates.rows[selected]

    def sentences_done(self, max_new: torch.Tensor) -> torch.Tensor:
        """Mark done the sentences at their longest output (`max_new`, per sentence in the batch) or whose
        finished hypotheses no live one can beat, by the ranking; returns which in the batch are done."""
        length = self.tokens.size(1) - self.prompt_length
        active = self.active
        worst_kept = self.kept_scores[active, -1]  # -inf until `ranking.num_kept` are kept
        beaten = self.ranking.is_done(self.scores[:, 0], length, max_new, worst_kept)
        self.done[active] |= (length >= max_new) | beaten
        return self.done[active]

    def keep(self, staying: torch.Tensor) -> None:
        """Only the sentences `staying` (their places in the batch) stay in the batch."""
        rows = _rows_of(staying, self.beams)
        self.tokens, self.origins, self.scores = self.tokens[rows], self.origins[rows], self.scores[staying]
        self.active = self.active[staying]

    def best(self, n: int) -> list[_Finished]:
        """Each sentence's `n` best finished hypotheses, sentence by sentence. A place no hypothesis reached (every
        token was ruled out) holds the prompt alone, scored -inf as a dead beam: each sentence keeps its `n` rows in
        the output, as in transformers' loop."""
        scores, lengths = self.kept_scores[:, :n].tolist(), self.kept_lengths[:, :n].tolist()
        return [
            _Finished(score, self.kept_tokens[sentence, rank, :length],
                     self.kept_origins[sentence, rank, : length - self.prompt_length]) if score > float("-inf")
            else _Finished(float("-inf"), self.prompts[sentence], self.kept_origins.new_empty(0))
            for sentence, (sentence_scores, sentence_lengths) in enumerate(zip(scores, lengths))
            for rank, (score, length) in enumerate(zip(sentence_scores, sentence_lengths))
        ]


class _StepOutputs:
    """What `return_dict_in_generate` asks a search for at each step (scores, attentions, hidden states)."""

    def __init__(self, generation_config):
        self.config = generation_config
        self.wanted = bool(generation_config.return_dict_in_generate and (
            generation_config.output_scores or generation_config.output_attentions
            or generation_config.output_hidden_states))
        self.scores, self.decoder_attentions, self.cross_attentions, self.decoder_hidden_states = [], [], [], []

    def record(self, scores: torch.Tensor, outputs) -> None:
        """`outputs`: the decoder's."""
        if self.wanted:
            self.scores.append(scores)
            self.decoder_attentions.append(outputs.attentions)
            self.cross_attentions.append(outputs.cross_attentions)
            self.decoder_hidden_states.append(outputs.hidden_states)

    def beam_output(self, hypotheses: list[_Finished], fill: int, encoder_outputs, cache, device):
        """The sequences (padded with `fill`), or with `return_dict_in_generate` transformers' output of a
        beam search: scores, beam indices and what each step gave."""
        config = self.config
        sequences = pad_sequence([h.tokens for h in hypotheses], batch_first=True, padding_value=fill)
        if not config.return_dict_in_generate:
            return sequences
        attentions, hidden_states = config.output_attentions, config.output_hidden_states
        return GenerateBeamEncoderDecoderOutput(
            sequences=sequences,
            sequences_scores=torch.tensor([h.score for h in hypotheses], device=device) if config.output_scores else None,
            scores=tuple(self.scores) if config.output_scores else None,
            beam_indices=pad_sequence([h.beam_indices for h in hypotheses], batch_first=True, padding_value=-1),
            encoder_attentions=encoder_outputs.attentions if attentions else None,
            encoder_hidden_states=encoder_outputs.hidden_states if hidden_states else None,
            decoder_attentions=tuple(self.decoder_attentions) if attentions else None,
            cross_attentions=tuple(self.cross_attentions) if attentions else None,
            decoder_hidden_states=tuple(self.decoder_hidden_states) if hidden_states else None,
            **{CACHE_NAME: cache},
        )


def gnmt_beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config, prune=True,
                     **model_kwargs):
    """Beam search ranked as the paper does (`GNMTRanking`); a `custom_generate` callable for `generate`.

    `generate` has already run the encoder once and repeated each sentence `num_beams` times, so
    `input_ids` is (batch * beams, 1), the decoder start token.

    Each step (as fairseq and transformers): run the decoder on the live rows; extend every live
    hypothesis by every token and keep the 2K best candidates per sentence by log P; candidates that finish
    (</s>, a stopping criterion such as max_length, the sentence's cap) among the best K are kept as finished
    hypotheses, scored by the ranking; the best K that did not finish live on; sentences whose finished hypotheses
    no live one can beat are done. The host waits for the device once a step, for the number of sentences
    not done (`_not_done_count`); everything else stays on the device. The call runs in the model's
    `decoding_context` (`call_context`).

    Done sentences leave the batch (as in fairseq's generator, by the rule of `should_prune`): their
    rows are no longer computed, and the search returns when the last sentence is done. Outputs and scores
    are those of the full batch. Rows stay in place (done sentences are then ignored) with
    `return_dict_in_generate` (the returned cache, as transformers returns it, and any per-step outputs
    hold every row), with a static cache, with a logits processor that is not known to treat rows on their
    own, or with `prune=False`.
    """
    beams, prompt_length = generation_config.num_beams, input_ids.size(1)
    hypotheses = _Hypotheses(input_ids, generation_config)
    live = _LiveRows(model, input_ids, logits_processor, generation_config, model_kwargs, rows_per_sentence=beams,
                     output_attentions=bool(generation_config.output_attentions),
                     output_hidden_states=bool(generation_config.output_hidden_states))
    steps = _StepOutputs(generation_config)
    prune = prune and live.can_prune(bool(generation_config.return_dict_in_generate))
    longest = generation_config.max_length - prompt_length  # transformers' max_length, under the sentences' caps

    count = -1
    with call_context(model, input_ids.size(0)):
        while count != 0:
            parents, done = _beam_step(live, hypotheses, steps, stopping_criteria, longest)
            count = _not_done_count(done)
            if prune and 0 < count and should_prune(count, done.numel()):  # in the gather that reorders the beams
                staying, _ = _staying_and_leaving(done, count)
                live.keep(staying, self_attention_rows=parents[_rows_of(staying, beams)])
                hypotheses.keep(staying)
            else:
                live.reorder(parents)

    n_return = generation_config.num_return_sequences or 1
    return steps.beam_output(hypotheses.best(n_return), hypotheses.fill, model_kwargs["encoder_outputs"],
                             live.cache, input_ids.device)


def _beam_step(live: _LiveRows, hypotheses: _Hypotheses, steps: _StepOutputs, stopping_criteria, longest: int):
    """One step of the search: the live hypotheses extended by every token, those of the best candidates that
    finish kept as finished hypotheses, the best that do not live on. Returns the row each live hypothesis comes
    from, and the sentences done."""
    outputs, logits = live.step(hypotheses.tokens)
    log_probs = live.process(hypotheses.tokens, logits.log_softmax(dim=-1))
    steps.record(log_probs, outputs)
    candidates = hypotheses.candidates(log_probs, stopping_criteria, live.cap.last_step(hypotheses.tokens))
    hypotheses.finish(candidates)
    parents = hypotheses.live_on(candidates)
    return parents, hypotheses.sentences_done(live.cap.max_new_tokens.clamp(max=longest))


__all__ = [
    "GNMTRanking",
    "SourceLengthCap",
    "first_token_id",
    "gnmt_beam_search",
    "gnmt_length_penalty",
    "greedy_search",
]
