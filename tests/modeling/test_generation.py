"""Decoding as the paper does it (§6.1): GNMT length penalty, per-sentence length cap, batching.

As fairseq tests its generator, a scripted decoder with fixed next-token probabilities (no
training) makes the best hypothesis under each penalty a matter of hand arithmetic.
"""

import copy
import itertools
import math

import pytest
import torch
from torch import nn
from transformers import GenerationConfig
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.modeling.generation import (
    CACHE_NAME,
    resolve_cache_argument,
    paper_generation_config,
)
from vanilla_transformer.modeling.search import gnmt_beam_search

PAD, BOS, EOS, A, B, C = range(6)  # PAD is also the decoder start token
VOCAB = 6

# Next-token probabilities by (first source token, generated prefix). Tokens a row leaves out
# share what is left of the mass equally; a prefix that is not listed gets a uniform row.
TABLE = {
    # Sentence X: "A </s>" (short) against "B C A </s>" (long).
    (A, ()): {A: 0.5, B: 0.4},
    (A, (A,)): {EOS: 0.6, C: 0.38},
    (A, (A, C)): {EOS: 0.5, B: 0.3},
    (A, (B,)): {C: 0.9},
    (A, (B, C)): {A: 0.9},
    (A, (B, C, A)): {EOS: 0.7},
    # Sentence Y: "C C </s>".
    (B, ()): {C: 0.7, A: 0.2},
    (B, (C,)): {C: 0.7},
    (B, (C, C)): {EOS: 0.8},
    # Sentence Z never wants to stop: </s> has 0.1% wherever it is not listed (see `row`).
}
SHORT, LONG = [A, EOS], [B, C, A, EOS]
LOG_P_SHORT = math.log(0.5) + math.log(0.6)  # -1.20397
LOG_P_LONG = math.log(0.4) + math.log(0.9) + math.log(0.9) + math.log(0.7)  # -1.48369


def row(sentence: int, prefix: tuple) -> torch.Tensor:
    listed = TABLE.get((sentence, prefix), {})
    if sentence == C:
        listed = {EOS: 0.001, A: 0.5}
    rest = [t for t in range(VOCAB) if t not in listed]
    share = (1.0 - sum(listed.values())) / len(rest) if rest else 0.0
    return torch.tensor([listed.get(t, share) for t in range(VOCAB)], dtype=torch.float64)


class SourceIds(nn.Module):
    """The scripted encoder: its output is the source ids, so the decoder knows the sentence."""

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return BaseModelOutput(last_hidden_state=input_ids.float().unsqueeze(-1))


class ScriptedDecoder(nn.Module):
    """The scripted network: its "hidden states" are TABLE's log-probabilities, which the model's output
    projection (the identity here) turns into logits. The generated prefix is read back from the
    self-attention cache (the ids are stored there as keys), so beam reordering of the cache is exercised
    as with the real network. Called as our decoder is: ids, the encoder output (here the sentences'
    numbers), its mask, the decoder's mask, the cache."""

    def forward(self, input_ids, encoder_hidden_states, encoder_attention_mask=None, attention_mask=None, cache=None,
                *args, **kwargs):
        sentences = encoder_hidden_states[:, 0, 0].long().tolist()
        prefixes = input_ids
        if cache is not None:
            ids = input_ids.float()[:, None, :, None]
            prefixes = cache.self_attention_cache.update(ids, ids, 0)[0][:, 0, :, 0].long()
        rows = [row(s, tuple(p[1:].tolist())) for s, p in zip(sentences, prefixes)]
        log_probs = torch.stack(rows).log().float()[:, None, :]  # softmax leaves log-probabilities as they are
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=log_probs, **{CACHE_NAME: cache})


class ScriptedBase(nn.Module):
    """The base model around the scripted decoder, as transformers' loops call it."""

    def __init__(self):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # transformers reads the model's device from a parameter
        self.decoder = ScriptedDecoder()

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, encoder_outputs=None,
                cache=None, use_cache=None, past_key_values=None, **kwargs):
        cache = resolve_cache_argument(cache, past_key_values) if use_cache is not False else None
        outputs = self.decoder(decoder_input_ids, encoder_outputs[0], attention_mask, None, cache)
        return Seq2SeqModelOutput(last_hidden_state=outputs.last_hidden_state, **{CACHE_NAME: cache})


class ScriptedModel(VanillaTransformerForConditionalGeneration):
    """Our model with its network replaced by TABLE (`ScriptedBase`) and an identity output projection."""

    def __init__(self):
        super().__init__(VanillaTransformerConfig(vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1,
                                                  num_heads=2, d_ff=8))
        self.source_ids = SourceIds()
        self.model = ScriptedBase()
        self.lm_head = nn.Identity()

    def get_encoder(self, modality=None):
        return self.source_ids

    def get_decoder(self):
        return self.model.decoder

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, encoder_outputs=None, cache=None,
                past_key_values=None, **kwargs):
        """transformers' loops call the whole model: the scripted network, then the identity projection.
        Both names of the cache, as our model's `forward` takes them (transformers checks for them)."""
        outputs = self.model(input_ids, attention_mask, decoder_input_ids, encoder_outputs, cache=cache,
                             past_key_values=past_key_values, **kwargs)
        return Seq2SeqLMOutput(logits=outputs.last_hidden_state, **{CACHE_NAME: outputs[CACHE_NAME]})


def gnmt(length, alpha):
    return ((5 + length) / 6) ** alpha


def transformers_penalty(length, alpha):
    return length**alpha


def exhaustive_best(sentence: int, penalty, alpha: float, max_new_tokens: int):
    """The best complete hypothesis over all outputs of at most `max_new_tokens` tokens."""
    best = (-math.inf, None)
    for length in range(1, max_new_tokens + 1):
        for body in itertools.product([t for t in range(VOCAB) if t != EOS], repeat=length - 1):
            hypothesis = (*body, EOS)
            log_p = sum(math.log(row(sentence, hypothesis[:i])[t]) for i, t in enumerate(hypothesis))
            best = max(best, (log_p / penalty(length, alpha), list(hypothesis)))
    return best


def scripted_generate(model, sources, style, alpha, num_beams=2, **kwargs):
    input_ids = torch.tensor(sources)
    out = model.generate(input_ids, attention_mask=(input_ids != PAD).long(), num_beams=num_beams,
                         length_penalty=alpha, length_penalty_style=style, max_length_offset=3,
                         return_dict_in_generate=True, output_scores=True, **kwargs)
    return out


# Sentence X has 2 source tokens, so with max_length_offset=3 it may generate up to 5.
# Long beats short iff LOG_P_LONG / lp(4) > LOG_P_SHORT / lp(2), i.e. iff lp(4) / lp(2) > 1.2324 (= LOG_P_LONG / LOG_P_SHORT):
#   alpha = 0:   both penalties are 1                              -> short, score -1.20397
#   alpha = 0.6: GNMT (9/7)^0.6 = 1.1627 -> short, -1.20397 / (7/6)^0.6 = -1.09763
#                transformers 2^0.6 = 1.5157 -> long,  -1.48369 / 4^0.6 = -0.64582
#   alpha = 1:   GNMT 9/7 = 1.2857       -> long,  -1.48369 / (9/6) = -0.98912
#                transformers 2          -> long,  -1.48369 / 4 = -0.37092
# Beam size 2 finds them: after "A" / "B", step 2 finishes "A </s>" (-1.204, rank 2 of the
# candidates) and keeps "B C" (-1.022) and "A C" (-1.661); step 3 keeps "B C A" (-1.127); step 4
# finishes "B C A </s>" (-1.484).
EXPECTED = {
    ("gnmt", 0.0): (SHORT, LOG_P_SHORT),
    ("transformers", 0.0): (SHORT, LOG_P_SHORT),
    ("gnmt", 0.6): (SHORT, LOG_P_SHORT / (7 / 6) ** 0.6),
    ("transformers", 0.6): (LONG, LOG_P_LONG / 4**0.6),
    ("gnmt", 1.0): (LONG, LOG_P_LONG / 1.5),
    ("transformers", 1.0): (LONG, LOG_P_LONG / 4),
}


@pytest.mark.parametrize("style,alpha", list(EXPECTED))
@pytest.mark.parametrize("num_beams", [2, 4])
def test_best_hypothesis_and_score_are_the_hand_worked_ones(style, alpha, num_beams):
    tokens, score = EXPECTED[style, alpha]
    out = scripted_generate(ScriptedModel().eval(), [[A, EOS]], style, alpha, num_beams)
    assert out.sequences[0].tolist() == [PAD, *tokens]
    assert out.sequences_scores[0].item() == pytest.approx(score, abs=1e-6)
    # ... and it is the best of all outputs, not only of those the beam kept.
    penalty = gnmt if style == "gnmt" else transformers_penalty
    assert exhaustive_best(A, penalty, alpha, 5) == (pytest.approx(score, abs=1e-6), tokens)


def test_the_two_penalties_differ_exactly_where_the_arithmetic_says():
    model = ScriptedModel().eval()
    for alpha, same in ((0.0, True), (0.6, False), (1.0, True)):
        ours = scripted_generate(model, [[A, EOS]], "gnmt", alpha).sequences
        theirs = scripted_generate(model, [[A, EOS]], "transformers", alpha).sequences
        assert torch.equal(ours, theirs) == same, alpha


# The stopping rule's two terms, each the one that decides at one sign of alpha. Sentence BOS, up to 5 tokens:
# "</s>" ends at step 1 and "B" lives on. A search that stops there keeps "</s>"; the better, longer one it
# would miss is the exhaustive best.
#   alpha = 1 (lp grows with length): "</s>" scores log 0.5 / lp(1) = -0.69315; "B" (log P -0.91629) can reach
#     -0.91629 / lp(5) = -0.54977 at the cap, but only -0.91629 / lp(2) = -0.78539 at the next step: a bound
#     without the L_max term stops. "B C A </s>" scores (log 0.4 + 3 log 0.99) / lp(4) = -0.63096.
#   alpha = -1 (lp shrinks with length): "</s>" scores log 0.4 / lp(1) = -0.91629; "B" (log P -0.59784) can reach
#     -0.59784 / lp(2) = -0.69748 at the next step, only -0.99640 at the cap: a bound without the L + 1 term
#     stops. "B </s>" scores (log 0.55 + log 0.95) / lp(2) = -0.75733.
STOPPING = {
    1.0: ({(): {EOS: 0.5, B: 0.4}, (B,): {C: 0.99}, (B, C): {A: 0.99}, (B, C, A): {EOS: 0.99}},
          [B, C, A, EOS], (math.log(0.4) + 3 * math.log(0.99)) / 1.5),
    -1.0: ({(): {EOS: 0.4, B: 0.55}, (B,): {EOS: 0.95}}, [B, EOS], (math.log(0.55) + math.log(0.95)) * 7 / 6),
}


@pytest.mark.parametrize("alpha", list(STOPPING))
def test_beam_search_stops_only_when_no_live_hypothesis_can_win_at_any_length(alpha, monkeypatch):
    """`GNMTRanking.is_done` bounds a live hypothesis by its best score at the next step and at the cap: at
    each sign of alpha one of the two is the bound, and a search that stops on the other misses the best."""
    table, tokens, score = STOPPING[alpha]
    for prefix, probabilities in table.items():
        monkeypatch.setitem(TABLE, (BOS, prefix), probabilities)
    out = scripted_generate(ScriptedModel().eval(), [[BOS, EOS]], "gnmt", alpha)
    assert out.sequences[0].tolist() == [PAD, *tokens]
    assert out.sequences_scores[0].item() == pytest.approx(score, abs=1e-6)
    assert exhaustive_best(BOS, gnmt, alpha, 5) == (pytest.approx(score, abs=1e-6), tokens)


def test_sequence_scores_are_sums_of_the_transition_scores_over_lp():
    model = ScriptedModel().eval()
    out = scripted_generate(model, [[A, EOS, PAD], [B, A, EOS]], "gnmt", 0.6, num_beams=3, num_return_sequences=2)
    transitions = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    lengths = (out.beam_indices >= 0).sum(1)
    torch.testing.assert_close(transitions.sum(1) / gnmt(lengths, 0.6), out.sequences_scores)
    assert out.sequences_scores[0] >= out.sequences_scores[1] and out.sequences_scores[2] >= out.sequences_scores[3]


def test_same_output_alone_and_in_a_padded_batch_of_mixed_lengths():
    model = ScriptedModel().eval()
    batch = [[A, EOS, PAD, PAD, PAD], [B, A, A, A, EOS], [C, EOS, PAD, PAD, PAD]]
    together = scripted_generate(model, batch, "gnmt", 0.6, num_beams=4)
    for i, source in enumerate(batch):
        alone = scripted_generate(model, [[t for t in source if t != PAD]], "gnmt", 0.6, num_beams=4)
        n = alone.sequences.size(1)
        assert together.sequences[i, :n].tolist() == alone.sequences[0].tolist()
        assert (together.sequences[i, n:] == PAD).all()
        assert together.sequences_scores[i].item() == pytest.approx(alone.sequences_scores[0].item(), abs=1e-6)
    assert together.sequences[1, :4].tolist() == [PAD, C, C, EOS]


def padded_sources(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 40, (len(lengths), max(lengths)), generator=g)
    attention_mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths):
        input_ids[i, n - 1], input_ids[i, n:], attention_mask[i, :n] = EOS, PAD, 1
    return input_ids, attention_mask


@pytest.fixture(scope="module")
def toy_model():
    """A tiny network trained for 80 steps to reverse its input: half-learnt, so it emits
    varied tokens and </s>, and beam search and greedy search disagree on some sentences."""
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=40, dropout=0.0))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    lengths = torch.randint(2, 10, (80, 32), generator=torch.Generator().manual_seed(0)).tolist()
    for step, batch_lengths in enumerate(lengths):
        input_ids, attention_mask = padded_sources(batch_lengths, seed=step + 100)
        labels = torch.full_like(input_ids, -100)
        for i, n in enumerate(batch_lengths):
            labels[i, : n - 1], labels[i, n - 1] = input_ids[i, : n - 1].flip(0), EOS
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_real_network_same_output_alone_and_in_a_batch(toy_model):
    model = toy_model
    input_ids, attention_mask = padded_sources([9, 3, 6, 1])
    args = dict(num_beams=4, length_penalty=0.6, length_penalty_style="gnmt", max_length_offset=4,
                return_dict_in_generate=True, output_scores=True)
    together = model.generate(input_ids, attention_mask=attention_mask, **args)
    for i, n in enumerate(attention_mask.sum(1).tolist()):
        alone = model.generate(input_ids[i : i + 1, :n], **args)
        width = alone.sequences.size(1)
        assert together.sequences[i, :width].tolist() == alone.sequences[0].tolist()
        assert (together.sequences[i, width:] == PAD).all()
        assert together.sequences_scores[i].item() == pytest.approx(alone.sequences_scores[0].item(), abs=1e-4)


def test_beam_size_one_is_greedy_search(toy_model):
    model = toy_model
    input_ids, attention_mask = padded_sources([7, 2, 5])
    greedy = model.generate(input_ids, attention_mask=attention_mask, num_beams=1, max_length_offset=3)
    ours = model.generate(input_ids, attention_mask=attention_mask, num_beams=1, max_length_offset=3,
                          custom_generate=gnmt_beam_search)
    assert torch.equal(ours, greedy)
    assert len(set(greedy[0].tolist())) > 3  # not a trivial output


@pytest.mark.parametrize("mode", [dict(num_beams=1), dict(num_beams=3, length_penalty_style="transformers"),
                                  dict(num_beams=3, length_penalty_style="gnmt"), dict(do_sample=True, top_k=3)])
def test_each_sentence_is_capped_at_its_source_length_plus_the_offset(mode):
    model = ScriptedModel().eval()  # sentence Z never wants to stop
    input_ids = torch.tensor([[C, EOS, PAD, PAD], [C, A, A, EOS], [C, A, EOS, PAD]])
    out = model.generate(input_ids, attention_mask=(input_ids != PAD).long(), max_length_offset=2, **mode)
    generated = out[:, 1:]  # transformers' beam search pads with </s> when pad_token_id is 0
    lengths = [row.tolist().index(EOS) + 1 for row in generated]
    assert lengths == [2 + 2, 4 + 2, 3 + 2]
    # The paper's default offset is 50, and an explicit length wins over the cap.
    assert model.generate(input_ids[:1, :2], **mode).size(1) == 1 + 2 + 50
    assert model.generate(input_ids, max_new_tokens=3, **mode).size(1) == 1 + 3


def test_the_length_cap_answers_for_the_sentences_still_in_the_batch():
    """Our searches apply the cap as a logits processor and ask it which sentences are at their last step;
    as done sentences leave, `select` gives the cap of those that stay."""
    from vanilla_transformer.modeling.search import SourceLengthCap

    cap = SourceLengthCap(torch.tensor([3, 1, 2]), eos_token_id=EOS)
    tokens = torch.zeros(6, 2, dtype=torch.long)  # the start token and one generated: the next is the second
    assert cap.last_step(tokens).tolist() == [False, True, True]
    scores = torch.zeros(6, VOCAB)  # two rows (beams) a sentence
    scores[5, EOS] = float("-inf")  # </s> ruled out: that row stays as it is, to stop unfinished at its cap
    forced = cap(tokens, scores)
    assert forced[:2].eq(0).all() and forced[5].eq(0).sum() == VOCAB - 1
    assert all(forced[row].isfinite().tolist() == [t == EOS for t in range(VOCAB)] for row in (2, 3, 4))
    kept = cap.select(torch.tensor([0, 2]))  # the second sentence has left
    assert kept.max_new_tokens.tolist() == [3, 2] and kept.last_step(tokens).tolist() == [False, True]
    assert torch.equal(kept(tokens[[0, 1, 4, 5]], scores[[0, 1, 4, 5]]), forced[[0, 1, 4, 5]])


def test_style_comes_from_the_generation_config_and_transformers_is_the_default():
    model = ScriptedModel().eval()
    input_ids = torch.tensor([[A, EOS]])
    args = dict(num_beams=2, length_penalty=0.6, max_length_offset=3)
    assert model.generate(input_ids, **args)[0].tolist() == [PAD, *LONG]  # transformers' |Y|^alpha
    model.generation_config.length_penalty_style = "gnmt"
    assert model.generate(input_ids, **args)[0].tolist() == [PAD, *SHORT]
    assert model.generate(input_ids, length_penalty_style="transformers", **args)[0].tolist() == [PAD, *LONG]
    with pytest.raises(ValueError, match="length_penalty_style"):
        model.generate(input_ids, length_penalty_style="wu", **args)
    with pytest.raises(ValueError, match="max_length_offset"):
        model.generate(input_ids, num_beams=2, max_length_offset=-1)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_beams=0), "`num_beams` must be a positive integer; got 0"),
        (dict(num_beams=-2), "`num_beams` must be a positive integer; got -2"),
        (dict(generation_config=GenerationConfig(num_beams=0)), "`num_beams` must be a positive integer; got 0"),
        (dict(num_beams=2, length_penalty=float("nan")), "`length_penalty` must be a finite number"),
        # transformers' own check, where it has one, words it its way
        (dict(max_new_tokens=0), "`max_new_tokens` must be (a positive integer; got|greater than) 0"),
    ],
)
def test_bad_decoding_options_are_refused_naming_the_option(options, message):
    # Refused naming the option, never an error inside transformers' beam search or a NaN penalty used.
    model = ScriptedModel().eval()
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[A, EOS]]), **options)


def test_attentions_and_hidden_states_come_back(toy_model):
    model = toy_model
    input_ids, attention_mask = padded_sources([5, 3])
    out = model.generate(input_ids, attention_mask=attention_mask, num_beams=3, length_penalty_style="gnmt",
                         max_new_tokens=4, output_attentions=True, output_hidden_states=True,
                         return_dict_in_generate=True)
    # one per decoding step; beam indices, as transformers', as long as the longest sentence returned
    assert out.beam_indices.size(1) == out.sequences.size(1) - 1 <= len(out.cross_attentions) <= 4
    assert out.cross_attentions[0][0].shape == (2 * 3, 4, 1, 5)  # (batch * beams, heads, 1, source)
    assert len(out.encoder_attentions) == 2 and len(out.decoder_hidden_states[0]) == 3


@pytest.mark.slow
def test_saved_folder_decodes_the_papers_way_without_the_package(toy_model, tmp_path, run_without_package):
    model = copy.deepcopy(toy_model)
    model.generation_config = paper_generation_config(model.config, max_length_offset=5)
    model.save_pretrained(tmp_path / "model")
    assert (tmp_path / "model" / "generation.py").exists() and (tmp_path / "model" / "search.py").exists()
    saved = GenerationConfig.from_pretrained(tmp_path / "model")
    assert (saved.num_beams, saved.length_penalty, saved.length_penalty_style, saved.max_length_offset) == (4, 0.6, "gnmt", 5)
    input_ids, attention_mask = padded_sources([8, 3])
    expected = model.generate(input_ids, attention_mask=attention_mask)
    torch.save({"inputs": (input_ids, attention_mask), "tokens": expected}, tmp_path / "expected.pt")
    out = run_without_package(
        """
        import torch
        from transformers import AutoModelForSeq2SeqLM
        expected = torch.load("expected.pt")
        input_ids, attention_mask = expected["inputs"]
        model = AutoModelForSeq2SeqLM.from_pretrained("model", trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        tokens = model.generate(input_ids, attention_mask=attention_mask)
        assert torch.equal(tokens, expected["tokens"]), (tokens, expected["tokens"])
        print("ok")
        """,
        cwd=tmp_path,
    )
    assert out.split() == ["ok"]


def test_a_stored_max_new_tokens_is_a_ceiling_on_the_cap_and_a_stored_max_length_is_ignored():
    model = ScriptedModel().eval()  # sentence Z never wants to stop
    input_ids = torch.tensor([[C, EOS, PAD, PAD, PAD, PAD], [C, A, A, A, A, EOS]])
    mask = (input_ids != PAD).long()
    model.generation_config.max_new_tokens = 7
    out = model.generate(input_ids, attention_mask=mask, max_length_offset=2)
    assert [row.tolist().index(EOS) for row in out[:, 1:]] == [4 - 1, 7 - 1]  # 2 + 2, min(6 + 2, 7)
    # transformers' default max_length (what Seq2SeqTrainer stores) does not cut: the cap alone holds.
    model.generation_config.max_new_tokens, model.generation_config.max_length = None, 1 + 3
    out = model.generate(input_ids, attention_mask=mask, max_length_offset=2)
    assert [row.tolist().index(EOS) for row in out[:, 1:]] == [4 - 1, 8 - 1]  # 2 + 2, 6 + 2


@pytest.mark.parametrize("num_beams", [1, 4])
def test_a_source_given_as_the_encoders_output_is_capped_as_its_tokens_are(num_beams):
    # §6.1's cap counts the source's tokens in whatever form the call brings it (the encoder run beforehand too).
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(
        VanillaTransformerConfig.from_preset("tiny", vocab_size=40, dropout=0.0)).eval()
    input_ids = torch.randint(4, 40, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(input_ids)
    mask[1, 25:] = 0
    by_ids = model.generate(input_ids=input_ids, attention_mask=mask, num_beams=num_beams)
    by_output = model.generate(encoder_outputs=model.get_encoder()(input_ids, mask), attention_mask=mask,
                               num_beams=num_beams)
    assert by_ids.size(1) > 21 and torch.equal(by_output, by_ids)  # a random model runs to its cap, 30 + 50
