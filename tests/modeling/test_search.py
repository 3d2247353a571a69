"""Our decoding loops (search.py): transformers' own cache in every mode (a returned one continues a generation);
done sentences leaving the batch and the self-attention-only beam reordering change no output against transformers'
own loops. The decoder's products on oneDNN, the package's, are tested in tests/test_onednn_decoding.py."""

import functools
import inspect
import json
import logging

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CompileConfig, GenerationMixin
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from vanilla_transformer.modeling import search as loops
from vanilla_transformer.modeling.generation import CACHE_NAME
from vanilla_transformer.modeling.search import gnmt_beam_search, greedy_search

aten = torch.ops.aten

# Very different source lengths: sentences end (and leave the batch) at very different steps.
SENTENCES = [
    "Jesus wept.",
    "In the beginning God created the heavens and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of God "
    "moved upon the face of the waters.",
    "Amen.",
    "And God said, Let there be light: and there was light.",
]


@pytest.fixture(scope="module")
def model_and_batch(hub_tiny_model):
    model, tokenizer = hub_tiny_model
    return model, tokenizer(SENTENCES, return_tensors="pt", padding=True)


# α = 0: both rankings are log P alone, so our (GNMT) beam search and transformers' loop keep the same beams.
LOG_P_RANKING = dict(length_penalty_style="gnmt", length_penalty=0.0)


def _ended(sequences: torch.Tensor, eos: int) -> torch.Tensor:
    """`sequences` with everything after a row's first </s> set to -1: the two loops pad differently."""
    after = (sequences == eos).long().cumsum(1) - (sequences == eos).long() > 0
    return sequences.masked_fill(after, -1)


def _generate(model, batch, seed=0, **options):
    torch.manual_seed(seed)
    return model.generate(**batch, **options)


MODES = {
    "greedy": dict(num_beams=1),
    "sampling": dict(do_sample=True, top_k=50, num_return_sequences=2),
    "beam, transformers' scoring": dict(num_beams=4, length_penalty_style="transformers", length_penalty=0.6),
    "beam, GNMT": dict(num_beams=4, length_penalty_style="gnmt", length_penalty=0.6),
    "beam, GNMT, 2 returned": dict(num_beams=4, num_return_sequences=2, length_penalty_style="gnmt"),
}


def _is_transformers_cache(cache) -> bool:
    """An EncoderDecoderCache of transformers' DynamicCaches, as transformers' `generate` makes for Marian."""
    parts = (cache.self_attention_cache, cache.cross_attention_cache) if type(cache) is EncoderDecoderCache else ()
    return bool(parts) and all(type(part) is DynamicCache and {type(layer) for layer in part.layers} <= {DynamicLayer}
                               for part in parts)


@pytest.mark.parametrize("mode", MODES)
def test_generate_s_default_cache_is_transformers_own(model_and_batch, mode, monkeypatch):
    """Every mode, in our loops and transformers', decodes with transformers' own cache, and returns it."""
    model, batch = model_and_batch
    caches = []
    forward = model.model.decoder.forward  # our loops and transformers' both run the decoder with the cache
    signature = inspect.signature(forward)

    def spy(*args, **kwargs):
        caches.append(signature.bind(*args, **kwargs).arguments["cache"])
        return forward(*args, **kwargs)

    monkeypatch.setattr(model.model.decoder, "forward", spy)
    _generate(model, batch, **MODES[mode])  # plain: our loops, except sampling and transformers' ranking
    assert caches and all(_is_transformers_cache(cache) for cache in caches), {type(c).__name__ for c in caches}
    returned = _generate(model, batch, return_dict_in_generate=True, **MODES[mode])[CACHE_NAME]
    assert _is_transformers_cache(returned)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("beams", [1, 4])
def test_our_loops_build_the_source_mask_once_and_no_look_ahead_mask(model_and_batch, beams, attn_implementation,
                                                                       monkeypatch):
    """The cross-attention mask depends only on the source's padding: our loops build it once per call (the
    encoder's is the only other one), not at every step as transformers' loop does; one new query sees every
    cached key, so a step builds no look-ahead mask. The tokens are those of transformers' loop."""
    model, batch = model_and_batch
    assert not batch["attention_mask"].all()  # padded sources: the mask hides something
    built = []
    mask_function = ALL_MASK_ATTENTION_FUNCTIONS[attn_implementation]
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS, attn_implementation,
                        lambda *args, **kwargs: built.append(kwargs["q_length"]) or mask_function(*args, **kwargs))
    loop = GenerationMixin._sample if beams == 1 else GenerationMixin._beam_search
    options = dict(num_beams=beams, max_new_tokens=8, **LOG_P_RANKING)
    model.set_attn_implementation(attn_implementation)
    try:
        theirs = model.generate(**batch, custom_generate=loop, **options)
        assert len(built) > 2
        built.clear()
        ours = model.generate(**batch, **options)
    finally:
        model.set_attn_implementation("sdpa")
    assert built == [batch["input_ids"].size(1), 1]  # the encoder's, then the source's for every decoding step
    assert torch.equal(_ended(ours, model.config.eos_token_id), _ended(theirs, model.config.eos_token_id))


@pytest.mark.parametrize("start", ["given", "prepended by transformers"])
def test_a_returned_cache_continues_the_generation(model_and_batch, start):
    """As transformers documents: the cache `generate` returns, passed back with the tokens so far (and
    their `decoder_attention_mask`, by whose length transformers 5.24 tells an encoder-decoder's cached
    tokens from new ones; MarianMTModel needs it too), continues them: 3 then 2 new tokens are the 5 of
    one call, with the same cache. Without the decoder start token, transformers prepends it (to the
    mask too), and the cache still fits."""
    model, batch = model_and_batch
    # No sentence ends early: a continuation cannot know which did (transformers' own test sets eos to -1).
    options = dict(num_beams=1, return_dict_in_generate=True,
                   suppress_tokens=[model.config.eos_token_id, model.config.pad_token_id])
    whole = model.generate(**batch, max_new_tokens=5, **options)
    first = model.generate(**batch, max_new_tokens=3, **options)
    so_far = first.sequences if start == "given" else first.sequences[:, 1:]
    assert so_far[0, 0] != model.config.decoder_start_token_id or start == "given"
    rest = model.generate(**batch, decoder_input_ids=so_far, decoder_attention_mask=torch.ones_like(so_far),
                          max_new_tokens=2, **{CACHE_NAME: first[CACHE_NAME]}, **options)
    assert torch.equal(rest.sequences, whole.sequences)
    for ours, one_call in zip(rest[CACHE_NAME].self_attention_cache.layers, whole[CACHE_NAME].self_attention_cache.layers):
        torch.testing.assert_close(ours.keys, one_call.keys)
        torch.testing.assert_close(ours.values, one_call.values)


def test_beam_search_returns_the_cache_transformers_beam_search_returns(model_and_batch):
    """Our beam search hands back what transformers' `_beam_search` does: its cache class holding every
    row (batch x beams) as the beams stood at the last step, so that it continues as theirs would. (A beam
    cache holds the live beams, not the returned hypotheses: token-exact continuation is greedy's.) No sentence
    ends early, so both loops run every step."""
    model, batch = model_and_batch
    options = dict(num_beams=4, return_dict_in_generate=True, max_new_tokens=9,
                   suppress_tokens=[model.config.eos_token_id], **LOG_P_RANKING)
    ours = model.generate(**batch, **options)[CACHE_NAME]
    theirs = model.generate(**batch, custom_generate=GenerationMixin._beam_search, **options)[CACHE_NAME]
    assert _is_transformers_cache(ours)
    for part in ("self_attention_cache", "cross_attention_cache"):
        for a, b in zip(getattr(ours, part).layers, getattr(theirs, part).layers, strict=True):
            assert a.keys.shape == b.keys.shape == (4 * len(SENTENCES), *b.keys.shape[1:]), part
            torch.testing.assert_close(a.keys, b.keys)
            torch.testing.assert_close(a.values, b.values)


@pytest.mark.parametrize("extra", [{}, dict(no_repeat_ngram_size=2), dict(max_new_tokens=9)], ids=["cap", "ngram", "max_new"])
def test_finished_sentences_leaving_the_batch_changes_nothing(model_and_batch, extra):
    model, batch = model_and_batch
    pruned = model.generate(**batch, num_beams=1, custom_generate=greedy_search, **extra)
    whole = model.generate(**batch, num_beams=1, custom_generate=functools.partial(greedy_search, prune=False), **extra)
    assert torch.equal(pruned, whole)
    if not extra:
        lengths = pruned[:, 1:].ne(model.config.pad_token_id).sum(1)
        assert lengths.min() < lengths.max()  # sentences did end at different steps

    pruned = model.generate(**batch, num_beams=4, custom_generate=gnmt_beam_search, **extra)
    whole = model.generate(**batch, num_beams=4, custom_generate=functools.partial(gnmt_beam_search, prune=False),
                           **extra)
    assert torch.equal(pruned, whole)


class _HostWaits(TorchDispatchMode):
    """Counts what makes the host wait for the device's values (on a GPU, a synchronisation): a scalar read
    (`.item()`, `bool()`, `int()`), `nonzero`, boolean indexing, a repeat by a tensor of counts, `tolist`,
    outside the decoder's forward (which our loops call) and the source mask our loops build once per call
    with transformers' mask function (before transformers 5.24 it asks whether anything is padded)."""

    READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
             aten.repeat_interleave.Tensor, aten.equal.default}
    INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}

    def __init__(self, model, monkeypatch):
        super().__init__()
        self.count, self.in_forward = 0, False
        self.rows, self.before = [], []  # at each step: the rows in the batch, the count before it
        forward, tolist = self.uncounted(model.model.decoder.forward), torch.Tensor.tolist

        def counted_forward(*args, **kwargs):
            self.rows.append(kwargs["input_ids"].size(0))  # the decoder's input ids, as our loops pass them
            self.before.append(self.count)
            return forward(*args, **kwargs)

        def counted_tolist(tensor):
            self.count += not self.in_forward
            return tolist(tensor)

        monkeypatch.setattr(model.model.decoder, "forward", counted_forward)
        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
        monkeypatch.setattr(loops, "_source_mask", self.uncounted(loops._source_mask))

    def uncounted(self, function):
        """`function`, what it waits for not counted."""

        def run(*args, **kwargs):
            self.in_forward = True
            try:
                return function(*args, **kwargs)
            finally:
                self.in_forward = False

        return run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        waits = func in self.READS or (func in self.INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]))
        self.count += waits and not self.in_forward
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("search", [greedy_search, gnmt_beam_search], ids=["greedy", "GNMT beam"])
def test_our_loops_wait_for_the_device_at_most_once_a_step(model_and_batch, search, monkeypatch):
    """At most one host-device synchronisation per decoding step in our loops (where rows leave: the count of
    those going on), against the length cap's check, `nonzero().tolist()`, `.item()` per finished hypothesis
    and boolean indexing. (Counted on the CPU by the aten operations that would wait on a GPU.)"""
    model, batch = model_and_batch
    waits = _HostWaits(model, monkeypatch)

    @functools.wraps(search)
    def counted(*args, **kwargs):
        with waits:
            return search(*args, **kwargs)

    model.generate(**batch, num_beams=1 if search is greedy_search else 4, custom_generate=counted)
    assert len(waits.rows) > 3 and min(waits.rows) < max(waits.rows)  # rows left the batch
    per_step = [b - a for a, b in zip(waits.before, waits.before[1:] + [waits.count])]
    # None before the first step; the last step's followed by reading the results once (two tables in beam search).
    assert waits.before[0] == 0 and max(per_step[:-1]) <= 1 and per_step[-1] <= 3, per_step


# transformers' beam search, rule for rule: each way `early_stopping` ends a sentence, both signs of
# the length penalty, more than one sequence returned, our source-length cap and a fixed max_new_tokens.
TRANSFORMERS_RULES = {
    "early_stopping=False": dict(early_stopping=False, length_penalty=0.6),
    "early_stopping=True": dict(early_stopping=True, length_penalty=0.6),
    "early_stopping=never": dict(early_stopping="never", length_penalty=1.0),
    "negative penalty": dict(early_stopping=False, length_penalty=-0.5),
    "3 returned": dict(early_stopping=False, length_penalty=0.6, num_return_sequences=3),
    "max_new_tokens": dict(early_stopping=False, length_penalty=0.6, max_new_tokens=30),  # some end, some are cut
}


@pytest.mark.parametrize("rules", TRANSFORMERS_RULES)
def test_a_beam_search_with_transformers_ranking_runs_in_transformers_loop(model_and_batch, rules, monkeypatch,
                                                                            caplog):
    """transformers' ranking and stopping rules are transformers' own: such a beam request goes to its loop, the
    reason logged, none of our loops run, and gives the tokens, scores and beam indices of transformers' own
    `_beam_search` (with our source-length cap) or, where the call sets a length, of `GenerationMixin.generate`."""
    model, batch = model_and_batch
    # The style named: the session's shared model may carry a generation config set to "gnmt" by now.
    options = dict(num_beams=4, return_dict_in_generate=True, output_scores=True, length_penalty_style="transformers",
                   **TRANSFORMERS_RULES[rules])
    theirs = model.generate(**batch, custom_generate=GenerationMixin._beam_search, **options)
    if "max_new_tokens" in options:
        plain = {name: value for name, value in options.items() if name != "length_penalty_style"}  # ours
        assert torch.equal(GenerationMixin.generate(model, **batch, **plain).sequences, theirs.sequences)
    monkeypatch.setattr(loops, "_LiveRows", None)  # every loop of ours starts with it
    with caplog.at_level(logging.DEBUG, logger="vanilla_transformer.modeling.generation"):
        ours = model.generate(**batch, **options)
    assert "transformers' own generation loop serves this call: transformers' length penalty" in caplog.text
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.equal(ours.beam_indices, theirs.beam_indices)
    assert torch.equal(ours.sequences_scores, theirs.sequences_scores)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores, strict=True))


def test_the_pruning_searches_are_what_generate_runs(model_and_batch, monkeypatch):
    """Plain greedy and GNMT beam calls go through the pruning searches, and rows do leave."""
    model, batch = model_and_batch
    batch_sizes = []
    forward = model.model.decoder.forward  # our loops run the decoder and project the last position themselves
    monkeypatch.setattr(model.model.decoder, "forward", lambda **k: batch_sizes.append(k["input_ids"].size(0)) or forward(**k))
    model.generate(**batch, num_beams=1)
    assert batch_sizes[0] == len(SENTENCES) and batch_sizes[-1] < len(SENTENCES)
    batch_sizes.clear()
    model.generate(**batch, num_beams=4, length_penalty_style="gnmt")
    assert batch_sizes[0] == 4 * len(SENTENCES) and batch_sizes[-1] < 4 * len(SENTENCES)


def test_one_rule_lets_done_rows_leave_greedy_and_beam_search(monkeypatch):
    """`loops.should_prune`, the rule of both searches: done rows (in beam search, the rows of done
    sentences) leave at once; rows that stay change no output."""
    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    assert [loops.should_prune(16 - finished, 16) for finished in (0, 1, 16)] == [False, True, True]
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=40, dropout=0.0)).eval()
    # Random weights run every sentence to its cap (source length 1 to 16, + 2): one sentence ends per
    # step from the third on.
    input_ids = torch.randint(4, 40, (16, 16), generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=input_ids, attention_mask=(torch.arange(16)[None] <= torch.arange(16)[:, None]).long(),
                 max_length_offset=2)
    batch_sizes = []
    forward = model.model.decoder.forward  # our loops run the decoder and project the last position themselves
    monkeypatch.setattr(model.model.decoder, "forward", lambda **k: batch_sizes.append(k["input_ids"].size(0)) or forward(**k))
    for search, beams in ((greedy_search, 1), (gnmt_beam_search, 2)):
        batch_sizes.clear()
        pruned = model.generate(**batch, num_beams=beams, custom_generate=search)
        assert batch_sizes == [16 * beams] * 3 + [sentences * beams for sentences in range(15, 0, -1)], search
        whole = model.generate(**batch, num_beams=beams, custom_generate=functools.partial(search, prune=False))
        assert torch.equal(pruned, whole)
        with monkeypatch.context() as patch:
            patch.setattr(loops, "should_prune", lambda not_done, batch: False)  # the rule decides, in each search
            batch_sizes.clear()
            assert torch.equal(model.generate(**batch, num_beams=beams, custom_generate=search), whole)
            assert set(batch_sizes) == {16 * beams}


def test_output_attentions_and_the_pipeline_still_work(model_and_batch, hub_tiny_model):
    from vanilla_transformer import TranslationPipeline

    model, batch = model_and_batch
    # No sentence ends early: both loops run the same steps.
    options = dict(num_beams=3, output_attentions=True, return_dict_in_generate=True, max_new_tokens=6,
                   suppress_tokens=[model.config.eos_token_id], **LOG_P_RANKING)
    out = model.generate(**batch, **options)
    reference = model.generate(**batch, custom_generate=GenerationMixin._beam_search, **options)
    assert len(out.cross_attentions) == len(reference.cross_attentions)
    for a, b in zip(out.decoder_attentions[-1], reference.decoder_attentions[-1]):
        assert torch.allclose(a, b, atol=1e-5)
    translate = TranslationPipeline(model=hub_tiny_model[0], tokenizer=hub_tiny_model[1])
    texts = [r["translation_text"] for r in translate(SENTENCES, batch_size=2)]
    assert texts == [tokenizer_text for tokenizer_text in hub_tiny_model[1].batch_decode(
        model.generate(**batch), skip_special_tokens=True)]


@pytest.mark.slow
def test_a_saved_folder_uses_transformers_cache_without_the_package(hub_tiny_folder, model_and_batch, run_without_package):
    model, batch = model_and_batch
    expected = model.generate(**batch).tolist()
    out = run_without_package(
        f"""
        import json
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({str(hub_tiny_folder)!r}, trust_remote_code=True)
        model = AutoModelForSeq2SeqLM.from_pretrained({str(hub_tiny_folder)!r}, trust_remote_code=True)
        batch = tokenizer({SENTENCES!r}, return_tensors="pt", padding=True)
        out = model.generate(**batch, return_dict_in_generate=True)
        cache = out["cache" if "cache" in out else "past_key_values"]  # its name from transformers 5.24, and before
        layer = cache.self_attention_cache.layers[0]
        print(json.dumps([type(layer).__name__, type(layer).__module__, out.sequences.tolist()]))
        """
    )
    name, module, sequences = json.loads(out.strip().splitlines()[-1])
    assert (name, module) == ("DynamicLayer", "transformers.cache_utils")
    assert sequences == expected


def test_a_cache_of_the_wrong_kind_is_refused_clearly_and_two_names_resolve_as_peft_needs(model_and_batch):
    model, batch = model_and_batch
    start = batch["input_ids"][:, :1] * 0
    with pytest.raises(ValueError, match=r"`cache` \(`past_key_values`\) must be an EncoderDecoderCache"):
        model(**batch, decoder_input_ids=start, past_key_values=DynamicCache())
    # Both names at once (PEFT's prefix tuning in transformers' loop): an empty `cache` gives way to
    # `past_key_values`, the prefix; a `cache` that holds tokens goes on, as transformers' own models take it.
    prefix, empty = (EncoderDecoderCache(DynamicCache(), DynamicCache()) for _ in range(2))
    out = model(**batch, decoder_input_ids=start, cache=empty, past_key_values=prefix, use_cache=True)
    assert getattr(out, CACHE_NAME) is prefix and prefix.get_seq_length() == 1 and empty.get_seq_length() == 0
    fresh = EncoderDecoderCache(DynamicCache(), DynamicCache())
    out = model(**batch, decoder_input_ids=start, cache=prefix, past_key_values=fresh, use_cache=True)
    assert getattr(out, CACHE_NAME) is prefix and prefix.get_seq_length() == 2 and fresh.get_seq_length() == 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_greedy_search_with_a_static_cache_compiles_the_decoder_step_into_one_graph(hub_tiny_model, device):
    """`cache_implementation="static"`: transformers' loop compiles the decoder step (on a GPU by itself,
    with CUDA graphs; on a CPU when `compile_config` asks, here with dynamo's eager backend, which
    captures the graph without generating code). One graph, no break, no recompilation per step, and the
    dynamic cache's tokens. (Our own greedy loop would run the step uncompiled; a graph break would
    leave part of each step outside the graph.)"""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (transformers compiles the static-cache step by itself there)")
    model, tokenizer = hub_tiny_model
    compile_config = None
    if device == "cpu":
        compile_config = CompileConfig(backend="eager", mode="default")
        compile_config._compile_all_devices = True  # transformers' switch for compiling on any device
    model = model.to(device)
    torch._dynamo.reset()
    counters.clear()
    try:
        batch = tokenizer(SENTENCES, return_tensors="pt", padding=True).to(device)
        dynamic = model.generate(**batch, num_beams=1, cache_implementation="dynamic")
        static = model.generate(**batch, num_beams=1, cache_implementation="static", compile_config=compile_config)
        assert torch.equal(static, dynamic)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert static.size(1) > 3  # several decoder steps ran through that one graph
    finally:
        model.to("cpu")
        torch._dynamo.reset()

