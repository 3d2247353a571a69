"""Differential test against transformers' MarianMTModel: every argument of `generate`, greedy and beam.

A tiny model of ours, trained for a few steps to copy its input (so that outputs end, vary and repeat
as real ones do), is converted to a MarianMTModel holding the same weights (`to_marian`, the same logits
to 1e-5). For every generation argument transformers has (GenerationConfig's fields and `generate`'s
own parameters, read from the installed transformers, not listed by hand) both models run `generate`
on the same sentences, greedy and with num_beams=3, the argument set to the valid, non-default value of
`VALUES`. The result is one of:

- "same output": the same tokens, and every other output field the same (scores to 1e-4);
- "same error": both raise the same exception type;
- "differs by design": named in `BY_DESIGN` with the reason (our own arguments among them).

Our paper generation config is neutralised: transformers' length penalty style and an explicit
`max_new_tokens` (the source + 50 cap applies only when the call names no length). The returned cache is
not compared here (tests/modeling/test_search.py compares it with transformers' loop's).

`python tests/modeling/test_generation_differential.py` prints the table of every argument with its result.
"""

import collections
import copy
import inspect
import sys

import pytest
import torch
import transformers
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import (
    BaseStreamer,
    CompileConfig,
    MaxLengthCriteria,
    SuppressTokensLogitsProcessor,
    WatermarkingConfig,
)

from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
from vanilla_transformer.export.marian import paper_from_marian_permutation, to_marian
from vanilla_transformer.modeling.generation import paper_generation_config
from vanilla_transformer.tokenizer import train_tokenizer

SENTENCES = ["the cat sat on the mat.", "a dog ran in the park.", "the sun is hot today.", "we read a good book.",
             "she sings a song.", "the bird flies over the sea.", "he eats an apple.", "they play in the garden."]
MAX_NEW_TOKENS = 12
MODES = {"greedy": 1, "beam": 3}  # num_beams
DOT, SPACE, EOS = 17, 224, 2  # "." and " " in the tokenizer below


class Own:
    """A value made for each model: `Own(lambda model, tokenizer: ...)`."""

    def __init__(self, make):
        self.make = make


class Collect(BaseStreamer):
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value.tolist())

    def end(self):
        pass


def plain_greedy(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """A `custom_generate` callable: greedy decoding without a cache, any model."""
    for _ in range(MAX_NEW_TOKENS):
        logits = model(encoder_outputs=model_kwargs["encoder_outputs"], attention_mask=model_kwargs["attention_mask"],
                       decoder_input_ids=input_ids).logits[:, -1]
        input_ids = torch.cat((input_ids, logits.argmax(-1, keepdim=True)), dim=1)
    return input_ids


SELF = Own(lambda model, tokenizer: model)
TOKENIZER = Own(lambda model, tokenizer: tokenizer)
ONE = dict(sentences=1)  # transformers assists one sentence at a time
ASSISTED = dict(ONE, assistant_model=SELF)
SAMPLING = dict(do_sample=True)
PER_STEP = dict(return_dict_in_generate=True)

# Every generation argument: a valid value other than the default, and the settings without which it
# does nothing (an assistant for the assistant's options, sampling for the sampling filters).
VALUES = {
    # GenerationConfig's fields
    "assistant_confidence_threshold": (0.2, ASSISTED),
    "assistant_early_exit": (1, ONE),
    "assistant_ensemble_weight": (0.5, ASSISTED),
    "assistant_lookbehind": (5, dict(ASSISTED, tokenizer=TOKENIZER, assistant_tokenizer=TOKENIZER)),
    "bad_words_ids": ([[DOT]], {}),
    "begin_suppress_tokens": ([SPACE], {}),
    "bos_token_id": (5, {}),
    "cache_config": ({"max_batch_size": 8}, dict(cache_implementation="static")),
    "cache_implementation": ("static", {}),
    "compile_config": (CompileConfig(fullgraph=False), {}),
    "constraints": ([[DOT]], {}),  # transformers 5 runs constrained beam search from the Hub only
    "continuous_batching_config": ({}, {}),
    "decoder_start_token_id": (1, {}),
    "disable_compile": (True, {}),
    "diversity_penalty": (0.5, dict(num_beam_groups=3)),
    "do_sample": (True, {}),
    "dola_layers": ("low", {}),
    "early_stopping": (True, {}),
    "encoder_no_repeat_ngram_size": (2, {}),
    "encoder_repetition_penalty": (1.5, {}),
    "eos_token_id": ([EOS, DOT], {}),
    "epsilon_cutoff": (3e-2, SAMPLING),
    "eta_cutoff": (3e-2, SAMPLING),
    "exponential_decay_length_penalty": ((3, 1.5), {}),
    "force_words_ids": ([[DOT]], {}),
    "forced_bos_token_id": (5, {}),
    "forced_eos_token_id": (EOS, {}),
    "guidance_scale": (1.5, {}),
    "is_assistant": (True, ONE),
    "length_penalty": (2.0, {}),
    "low_memory": (True, {}),
    "max_cache_len": (64, dict(cache_implementation="static")),
    "max_length": (8, dict(max_new_tokens=None)),
    "max_matching_ngram_size": (1, dict(ONE, prompt_lookup_num_tokens=3)),
    "max_new_tokens": (5, {}),
    "max_time": (60.0, {}),
    "min_length": (14, {}),
    "min_new_tokens": (14, dict(max_new_tokens=16)),
    "min_p": (0.2, SAMPLING),
    "no_repeat_ngram_size": (2, {}),
    "num_assistant_tokens": (3, ASSISTED),
    "num_assistant_tokens_schedule": ("constant", ASSISTED),
    "num_beam_groups": (3, {}),
    "num_beams": (2, {}),
    "num_return_sequences": (2, {}),
    "output_attentions": (True, PER_STEP),
    "output_hidden_states": (True, PER_STEP),
    "output_logits": (True, PER_STEP),
    "output_scores": (True, PER_STEP),
    "pad_token_id": (3, {}),
    "penalty_alpha": (0.6, dict(top_k=4)),
    "prefill_chunk_size": (4, {}),
    "prompt_lookup_num_tokens": (3, ONE),
    "remove_invalid_values": (True, {}),
    "renormalize_logits": (True, {}),
    "repetition_penalty": (1.5, {}),
    "return_dict_in_generate": (True, {}),
    "sequence_bias": ({(DOT,): -5.0}, {}),
    "speculation_type": ("dflash", ASSISTED),
    "stop_strings": (["at"], dict(tokenizer=TOKENIZER)),
    "suppress_tokens": ([DOT], {}),
    "target_lookbehind": (5, dict(ASSISTED, tokenizer=TOKENIZER, assistant_tokenizer=TOKENIZER)),
    "temperature": (0.7, SAMPLING),
    "token_healing": (True, dict(tokenizer=TOKENIZER)),
    "top_h": (0.5, SAMPLING),
    "top_k": (5, SAMPLING),
    "top_p": (0.8, SAMPLING),
    "typical_p": (0.8, SAMPLING),
    "use_cache": (False, {}),
    "use_mtp": (True, ONE),
    "watermarking_config": (WatermarkingConfig(greenlist_ratio=0.5), {}),
    # generate's own parameters, and the keyword arguments it reads by name
    "assistant_model": (SELF, ONE),
    "assistant_tokenizer": (TOKENIZER, dict(ASSISTED, tokenizer=TOKENIZER)),
    "custom_generate": (plain_greedy, {}),
    "generation_config": (GenerationConfig(no_repeat_ngram_size=1, max_new_tokens=MAX_NEW_TOKENS), {}),
    "logits_processor": (LogitsProcessorList([SuppressTokensLogitsProcessor([SPACE])]), {}),
    "negative_prompt_ids": (Own(lambda model, tokenizer: tokenizer(["the"], return_tensors="pt").input_ids), {}),
    "negative_prompt_attention_mask": (Own(lambda model, tokenizer: torch.ones(1, 2, dtype=torch.long)),
                                       dict(negative_prompt_ids=Own(lambda m, t: t(["the"], return_tensors="pt").input_ids))),
    "prefix_allowed_tokens_fn": (lambda batch_id, input_ids: [t for t in range(300) if t != SPACE], {}),
    "stopping_criteria": (StoppingCriteriaList([MaxLengthCriteria(max_length=6)]), {}),
    "streamer": (Own(lambda model, tokenizer: Collect()), {}),
    "synced_gpus": (True, {}),
    "tokenizer": (TOKENIZER, {}),
}
# Ours (see generation.py), which Marian does not take: its call leaves them out.
OUR_ARGUMENTS = {
    "length_penalty_style": ("gnmt", dict(length_penalty=0.6)),
    "max_length_offset": (1, dict(max_new_tokens=None)),
}
# Generation arguments that are not GenerationConfig fields: `generate`'s keyword arguments read by name.
GENERATE_KWARGS = ("tokenizer", "assistant_tokenizer")
NOT_ARGUMENTS = ("_from_model_config", "transformers_version")  # GenerationConfig's bookkeeping
# Fields that transformers 5.10.1, the oldest supported, does not have yet.
NEWER_THAN_OLDEST = ("assistant_ensemble_weight", "max_cache_len", "speculation_type", "use_mtp")

# Where ours may differ from Marian, and why.
BY_DESIGN = {
    ("length_penalty_style", "beam"): "the paper's GNMT length penalty ((5 + |Y|) / 6)^α ranks the beams; "
                                      "transformers' is |Y|^α",
    **{("max_length_offset", mode): "with no length in the call, ours stops each sentence at its source length "
                                    "+ max_length_offset (§6.1); Marian at max_length (20)" for mode in MODES},
    **{("prefill_chunk_size", mode): "transformers' chunked prefill changes a padded sentence's tokens "
                                     "(ours gives those of the sentence alone)" for mode in MODES},
}


def generation_arguments():
    """Every argument `generate` takes, from the installed transformers."""
    fields = set(GenerationConfig().to_dict()) - set(NOT_ARGUMENTS)
    own = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "inputs", "kwargs"}
    return sorted(fields | own | set(GENERATE_KWARGS))


class Pair:
    """Our tiny copying model, the MarianMTModel with its weights, their tokenizer and the test's input."""

    def __init__(self):
        self.tokenizer = train_tokenizer(SENTENCES * 4, vocab_size=300)
        torch.manual_seed(0)
        config = VanillaTransformerConfig.from_preset("tiny", vocab_size=len(self.tokenizer), d_model=32, d_ff=64, dropout=0.0)
        ours = VanillaTransformerForConditionalGeneration(config)
        optimizer = torch.optim.Adam(ours.parameters(), lr=3e-3)
        batch = self.tokenizer(SENTENCES, padding=True, return_tensors="pt")
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        for _ in range(30):
            optimizer.zero_grad()
            ours(**batch, labels=labels).loss.backward()
            optimizer.step()
        self.ours = ours.eval()
        self.marian = to_marian(ours)
        # The paper's config with transformers' length penalty style, and the same ids on Marian
        self.ours.generation_config = paper_generation_config(config, num_beams=1, length_penalty=1.0,
                                                              length_penalty_style="transformers")
        self.marian.generation_config = paper_generation_config(config, num_beams=1, length_penalty=1.0)
        for name in ("length_penalty_style", "max_length_offset"):
            delattr(self.marian.generation_config, name)
        self.marian.set_attn_implementation("eager")  # sdpa returns no attention weights
        self.inputs = self.tokenizer(SENTENCES[:3], padding=True, return_tensors="pt")

    def generate(self, model, argument, mode, sentences=None):
        """`argument` set on `model`'s call, with its companions (None: the first `sentences`, nothing set)."""
        value, companions = {**VALUES, **OUR_ARGUMENTS}.get(argument, (None, {"sentences": sentences}))
        options = {"max_new_tokens": MAX_NEW_TOKENS, "num_beams": MODES[mode], **companions, argument: value}
        if argument in OUR_ARGUMENTS and model is self.marian:
            del options[argument]
        if argument == "generation_config":
            del options["max_new_tokens"]
        sentences = options.pop("sentences", None)
        options = {k: v.make(model, self.tokenizer) if isinstance(v, Own) else copy.deepcopy(v)
                   if isinstance(v, GenerationConfig) else v for k, v in options.items() if v is not None}
        torch.manual_seed(0)
        try:
            return model.generate(**{k: v[:sentences] for k, v in self.inputs.items()}, **options)
        except Exception as error:  # the comparison is of the errors
            return error


def same(ours, theirs, path="output"):
    """None if equal (tokens exactly, floats to 1e-4), else where they first differ."""
    if isinstance(ours, dict) or isinstance(theirs, dict):  # ModelOutputs among them
        if type(ours) is not type(theirs):
            return f"{path}: {type(ours).__name__} vs {type(theirs).__name__}"
        cache_names = ("past_key_values", "cache")
        ours_keys = [k for k in ours.keys() if k not in cache_names]
        theirs_keys = [k for k in theirs.keys() if k not in cache_names]
        if ours_keys != theirs_keys:
            return f"{path}: fields {ours_keys} vs {theirs_keys}"
        return next((d for k in ours_keys if (d := same(ours[k], theirs[k], f"{path}.{k}"))), None)
    if isinstance(ours, (tuple, list)) or isinstance(theirs, (tuple, list)):
        if type(ours) is not type(theirs) or len(ours) != len(theirs):
            return f"{path}: {type(ours).__name__} of {len(ours)} vs {type(theirs).__name__} of {len(theirs)}"
        return next((d for i, (a, b) in enumerate(zip(ours, theirs)) if (d := same(a, b, f"{path}[{i}]"))), None)
    if isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor):
        if "hidden_state" in path:  # Marian orders the model's dimensions sines first (see to_marian)
            ours = ours[..., paper_from_marian_permutation(ours.size(-1)).argsort()]
        if ours.shape != theirs.shape:
            return f"{path}: shape {tuple(ours.shape)} vs {tuple(theirs.shape)}"
        if ours.is_floating_point():
            close = torch.allclose(ours, theirs, rtol=0, atol=1e-4, equal_nan=True)
        else:
            close = torch.equal(ours, theirs)
        return None if close else f"{path}: values differ"
    return None if ours == theirs else f"{path}: {ours!r} vs {theirs!r}"


def one_line(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def compare(pair, argument, mode):
    """(result, detail) for one argument and mode: see the top of this file."""
    ours, theirs = pair.generate(pair.ours, argument, mode), pair.generate(pair.marian, argument, mode)
    if (argument, mode) in BY_DESIGN and not isinstance(ours, Exception) and same(ours, theirs) is not None:
        return "differs by design", BY_DESIGN[argument, mode]
    if isinstance(ours, Exception) or isinstance(theirs, Exception):
        if type(ours) is type(theirs):
            return "same error", one_line(ours)
        describe = lambda r: one_line(r) if isinstance(r, Exception) else type(r).__name__
        return "wrong", f"ours {describe(ours)}; Marian {describe(theirs)}"
    difference = same(ours, theirs)
    if difference is not None:
        return "wrong", difference
    sequences = lambda output: output if isinstance(output, torch.Tensor) else output.sequences
    sentences = {**VALUES, **OUR_ARGUMENTS}[argument][1].get("sentences")
    plain = pair.generate(pair.ours, None, mode, sentences)  # the same call without the argument
    changed = sequences(ours).shape != plain.shape or not torch.equal(sequences(ours), plain)
    return "same output", "the argument changes it" if changed else ""


@pytest.fixture(scope="module")
def pair():
    return Pair()


def test_the_table_has_a_value_for_every_generation_argument():
    """Fails when a transformers release adds an argument: give it a value in VALUES."""
    missing = set(generation_arguments()) - set(VALUES)
    assert not missing, f"no test value for {sorted(missing)}: add them to VALUES"
    stale = set(VALUES) - set(generation_arguments()) - set(NEWER_THAN_OLDEST)
    assert not stale, f"VALUES names {sorted(stale)}, which this transformers does not have"


def test_the_pair_holds_the_same_model(pair):
    ours, theirs = (model.generate(**pair.inputs, max_new_tokens=MAX_NEW_TOKENS) for model in (pair.ours, pair.marian))
    assert torch.equal(ours, theirs)
    assert (ours == EOS).any() and len(set(ours[0].tolist())) > 4  # real outputs: varied, and some end


@pytest.mark.slow  # 2 x 170 calls of generate
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("argument", generation_arguments() + list(OUR_ARGUMENTS))
def test_each_argument_gives_what_marian_gives(pair, argument, mode):
    result, detail = compare(pair, argument, mode)
    assert result != "wrong", detail


@pytest.mark.parametrize("flags", [dict(), dict(output_attentions=True), dict(output_hidden_states=True),
                                   dict(output_attentions=True, output_hidden_states=True, return_dict=False)])
def test_forward_outputs_have_marians_structure_and_values(pair, flags):
    decoder_input_ids = pair.marian.generate(**pair.inputs, max_new_tokens=MAX_NEW_TOKENS)
    args = dict(**pair.inputs, decoder_input_ids=decoder_input_ids, use_cache=False, **flags)
    with torch.no_grad():
        ours, theirs = pair.ours(**args), pair.marian(**args)
        if flags.get("return_dict") is False:  # tuples: their fields by Marian's names, for the comparison
            assert type(ours) is type(theirs) is tuple and len(ours) == len(theirs)
            names = pair.marian(**dict(args, return_dict=True)).keys()
            ours, theirs = dict(zip(names, ours)), dict(zip(names, theirs))
        assert same(ours, theirs) is None


def table():
    """Markdown: every argument, its result greedy and beam, and the counts."""
    pair = Pair()
    rows, counts = [], collections.Counter()
    for argument in generation_arguments() + list(OUR_ARGUMENTS):
        cells = []
        for mode in MODES:
            result, detail = compare(pair, argument, mode)
            counts[result] += 1
            detail = detail if len(detail) < 120 else detail[:120] + "…"
            cells.append((f"{result}: {detail}" if detail else result).replace("|", "\\|"))
        rows.append(f"| `{argument}` | {' | '.join(cells)} |")
    header = [f"transformers {transformers.__version__}: {len(rows) - len(OUR_ARGUMENTS)} arguments of transformers' "
              f"and {len(OUR_ARGUMENTS)} of ours, {sum(counts.values())} rows: "
              + ", ".join(f"{n} {result}" for result, n in counts.most_common()), "",
              "| argument | greedy | beam (num_beams=3) |", "|---|---|---|"]
    return "\n".join(header + rows)


if __name__ == "__main__":
    torch.set_num_threads(1)  # as the tests run (tests/conftest.py)
    sys.exit(print(table()))
