"""A `translation` pipeline for the Transformer of "Attention Is All You Need".

transformers 5 dropped its built-in `translation` and `text2text-generation` pipelines. This file
is saved next to the model's code and recorded under `custom_pipelines` in config.json, so that

    from transformers import pipeline
    translate = pipeline("translation", model="user/model-or-folder", trust_remote_code=True)
    translate("In the beginning God created the heaven and the earth.")
    # [{'translation_text': 'En el principio creó Dios los cielos y la tierra.'}]

works on any machine with transformers, without this package. It imports only the standard
library, torch, the public API of transformers and the files beside it.

Inputs: a string, a list of strings, a data set column, `KeyDataset` or generator (`batch_size=`
batches them). A model already in memory (say, just fine-tuned) makes a pipeline directly:
`TranslationPipeline(model=model, tokenizer=tokenizer)`; transformers 5's `pipeline()` refuses the
task name "translation" unless it reads `custom_pipelines` from a config it loads itself, so it
needs a folder or Hub id. Generation options such as
`num_beams`, `max_new_tokens` and `length_penalty` go to `model.generate`, whose defaults (the saved
generation config and the model's own `generate`) decode as in §6.1 of the paper: beam size 4, length
penalty 0.6, each output at most its source length + 50 tokens. `return_attentions=True` adds the
attention weights behind each translation (`attentions`: the weights, and for each side the token
ids, the raw tokens and `readable_pieces`, the text each token stands for). `src_lang`/`tgt_lang`
(the names transformers' translation pipelines used) are checked against the pair the model was
trained on, with a warning if they differ.

The call takes every argument of transformers 4's `TranslationPipeline`, with its meaning there
(`return_tensors`, `return_text`, `return_type`, `clean_up_tokenization_spaces`, `truncation`,
`stop_sequence`, `num_return_sequences`, ...: see `TranslationPipeline.__call__`). Two things no
longer fail a whole batch for one line: a text longer than the model's limit (the tokenizer's
`model_max_length`, the position table for learned positions, `location_max_length` for location-based
scores) is truncated to it with a
warning, and an empty or blank text translates to "" with a warning, the rest of its batch
translated as if it were not there. `num_beams`, `max_new_tokens` and `length_penalty` have bounds
(value_checks.py), and a `max_new_tokens` past what a model with a bounded length writes (learned
positions, location-based scores) is lowered to it with a warning.
"""

from __future__ import annotations

import numbers
import warnings
from types import GeneratorType

import torch
from torch.utils.data import Dataset
from transformers import Pipeline

from .value_checks import check_decoding_options
from .generation import longest_target
from .search import first_token_id

# What config.json names under `custom_pipelines` (the model's `save_pretrained` writes it), read by
# transformers' `pipeline()`: "impl" is "<module file>.<class>" inside the model folder, "pt" the Auto
# class the model is loaded with.
CUSTOM_PIPELINES = {
    "translation": {
        "impl": "pipeline_vanilla_transformer.TranslationPipeline",
        "pt": ["AutoModelForSeq2SeqLM"],
        "tf": [],
        "type": "text",
    }
}


def language_pair_mismatch(config, source_lang: str | None, target_lang: str | None) -> str | None:
    """What is wrong when asked for a pair other than the one the model was trained on (training stores
    it in the config); None when the pair fits or either is unknown."""
    trained = (getattr(config, "source_lang", None), getattr(config, "target_lang", None))
    asked = (source_lang or trained[0], target_lang or trained[1])
    if None in trained or asked == trained:
        return None
    data = getattr(config, "dataset_name", None)
    return (f"the model translates {trained[0]}->{trained[1]}{f' (trained on {data})' if data else ''}, "
            f"not {asked[0]}->{asked[1]}: its output will not be in the language asked for")


def longest_source(model, tokenizer) -> int:
    """The longest source, in tokens, that the model reads: the tokenizer's `model_max_length`, and the
    config's `longest_sequence` (learned positions, location-based scores). Its twin for the decoder's side is
    generation.py's `longest_target`."""
    longest = _longest_sequence(model.config)
    return tokenizer.model_max_length if longest is None else min(tokenizer.model_max_length, longest)


def _longest_sequence(config) -> int | None:
    """The config's `longest_sequence`; None for another model's config, which does not say."""
    return config.longest_sequence() if hasattr(config, "longest_sequence") else None


@torch.no_grad()
def teacher_forced_attentions(model, input_ids, output_ids) -> dict:
    """The attention weights behind one translation, as full matrices.

    `input_ids` (1, S) is the source, `output_ids` (1, T+1) what `generate` returned: the start
    token, the translation and usually `</s>`. The decoder is run once, teacher-forced, over the
    T tokens it read while generating (everything but the last output token). With the causal
    mask (§3.2.3) and no dropout this gives exactly the weights of step-by-step decoding, but as
    square (T, T) decoder maps in one pass, and without the per-beam bookkeeping that
    `generate(output_attentions=True)` needs under beam search.

    Returns per-layer stacks, layer first, without batch: encoder (L, H, S, S), decoder (L, H, T, T),
    cross (L, H, T, S), and the ids of both axes (`input_ids`, `decoder_input_ids`). A model that
    computes no weights (transformers' fused "sdpa" attention, as a Marian folder loads) is refused.
    """
    decoder_input_ids = output_ids[:, :-1]
    outputs = model(
        input_ids=input_ids,
        decoder_input_ids=decoder_input_ids,
        output_attentions=True,
        use_cache=False,
    )
    kinds = ("encoder_attentions", "decoder_attentions", "cross_attentions")
    if not all(getattr(outputs, kind, None) and all(w is not None for w in getattr(outputs, kind)) for kind in kinds):
        implementation = getattr(model.config, "_attn_implementation", None)
        raise ValueError(
            f"the model ({type(model).__name__}, model_type {getattr(model.config, 'model_type', '?')!r}) returned no "
            f"attention weights with its {implementation!r} attention, so there is nothing to show. Models of "
            "vanilla-transformer always return them; load another transformers model with "
            "attn_implementation='eager', or convert a Marian model with vanilla_transformer.export.marian.from_marian."
        )
    return {
        "encoder_attention": torch.cat(outputs.encoder_attentions).float().cpu(),
        "decoder_attention": torch.cat(outputs.decoder_attentions).float().cpu(),
        "cross_attention": torch.cat(outputs.cross_attentions).float().cpu(),
        "input_ids": input_ids[0].tolist(),
        "decoder_input_ids": decoder_input_ids[0].tolist(),
    }


def readable_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds to the decoded sentence: tokens a person can read.

    Byte-level BPE tokens are byte symbols (`ĠJesÃºs` stands for " Jesús") and one may hold only some
    of a character's UTF-8 bytes. Decoding ever longer prefixes and keeping what each token adds gives
    pieces that join to exactly `tokenizer.decode(ids, skip_special_tokens=True)`, their leading spaces
    kept (a piece that starts with a space starts a word). A token that only begins a character gets ""
    and the one that completes it the character. Special tokens are given as themselves ("</s>").
    """
    specials = set(tokenizer.all_special_ids)
    pieces, text_ids, done, last = [], [], "", None
    for token_id in ids:
        if token_id in specials:
            pieces.append(tokenizer.convert_ids_to_tokens(token_id))
            continue
        text_ids.append(token_id)
        # An unfinished character decodes as U+FFFD until its last byte comes.
        text = tokenizer.decode(text_ids, clean_up_tokenization_spaces=False).rstrip("\ufffd")
        pieces.append(text[len(done):])
        done, last = text, len(pieces) - 1
    if last is not None:  # bytes that never became a character stay U+FFFD, on the last token
        pieces[last] += tokenizer.decode(text_ids, clean_up_tokenization_spaces=False)[len(done):]
    return pieces


def _trim(ids: torch.Tensor, stop_ids: set[int], keep_first: bool) -> torch.Tensor:
    """Cut a generated sequence (T,) after its first stop token (kept), dropping batch padding."""
    for position in range(1 if keep_first else 0, ids.size(0)):
        if int(ids[position]) in stop_ids:
            return ids[: position + 1]
    return ids


def _strip_padding(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """A generated sequence (T,) without the batch padding after its end; the decoder start token stays."""
    real = (ids[1:] != pad).nonzero()
    return ids[: int(real[-1]) + 2] if real.numel() else ids[:1]


def _positive_int(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
    return int(value)


def _what_to_return(return_tensors, return_text, return_type) -> dict:
    """The postprocess parameters `return_tensors` and `return_text` (or the older `return_type`) ask for;
    none when none is given."""
    # transformers 4's ReturnType: TENSORS (0) gives the token ids alone, TEXT (1) the text alone.
    if return_type is not None and return_tensors is None and return_text is None:
        kind = getattr(return_type, "value", return_type)
        if kind not in (0, 1):
            raise ValueError(f"`return_type` must be 0 (token ids) or 1 (text), as transformers 4's ReturnType; got {return_type!r}.")
        return_tensors, return_text = kind == 0, kind == 1
    if return_tensors is None and return_text is None:
        return {}
    # Either alone says what to return: `return_tensors=True` gives the ids instead of the text, as before.
    return_tensors = not return_text if return_tensors is None else bool(return_tensors)
    return_text = not return_tensors if return_text is None else bool(return_text)
    if not (return_tensors or return_text):
        raise ValueError("`return_text` and `return_tensors` are both False: there would be nothing to return.")
    return {"return_tensors": return_tensors, "return_text": return_text}


def _stop_token(tokenizer, stop_sequence: str) -> int:
    """As transformers 4 did: generation ends at the stop sequence's first token, which is kept."""
    stop_ids = tokenizer.encode(stop_sequence, add_special_tokens=False)
    if not stop_ids:
        raise ValueError(f"`stop_sequence` must be text that has tokens; got {stop_sequence!r}.")
    if len(stop_ids) > 1:  # stacklevel: one more than _sanitize_parameters' own warnings, a call deeper
        warnings.warn(f"`stop_sequence` {stop_sequence!r} is {len(stop_ids)} tokens; generation stops at its first.", stacklevel=4)
    return stop_ids[0]


class TranslationPipeline(Pipeline):
    """Translate text with a sequence-to-sequence model; returns `[{"translation_text": ...}]`."""

    def _sanitize_parameters(
        self,
        return_attentions=None,
        truncation=None,
        src_lang=None,
        tgt_lang=None,
        return_tensors=None,
        return_text=None,
        return_type=None,
        clean_up_tokenization_spaces=None,
        stop_sequence=None,
        **generate_kwargs,
    ):
        preprocess_params, forward_params, postprocess_params = {}, {}, {}
        mismatch = language_pair_mismatch(self.model.config, src_lang, tgt_lang)
        if mismatch:
            warnings.warn(mismatch, stacklevel=3)
        if truncation is not None:
            preprocess_params["truncation"] = _truncates(truncation)
        if return_attentions is not None:
            forward_params["return_attentions"] = return_attentions
            postprocess_params["return_attentions"] = return_attentions
        postprocess_params.update(_what_to_return(return_tensors, return_text, return_type))
        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        if stop_sequence is not None:
            generate_kwargs["eos_token_id"] = _stop_token(self.tokenizer, stop_sequence)
        if "num_return_sequences" in generate_kwargs:
            _positive_int("num_return_sequences", generate_kwargs["num_return_sequences"])
        check_decoding_options(**{name: generate_kwargs.get(name) for name in ("num_beams", "length_penalty", "max_new_tokens")})
        # the most tokens a model with a bounded target length writes after the decoder start token
        bounded = _longest_sequence(self.model.config) is not None
        longest = longest_target(self.model.config) - 1 if bounded else None
        if longest is not None and isinstance(generate_kwargs.get("max_new_tokens"), numbers.Integral) \
                and generate_kwargs["max_new_tokens"] > longest:
            warnings.warn(f"`max_new_tokens`={generate_kwargs['max_new_tokens']} is more than this model writes; "
                          f"translations stop at {longest} tokens.", stacklevel=3)
            generate_kwargs["max_new_tokens"] = longest
        forward_params["generate_kwargs"] = generate_kwargs
        return preprocess_params, forward_params, postprocess_params

    def __call__(self, inputs, **kwargs):
        """Translate `inputs`: a string; a list, tuple or `datasets` column of strings; or a stream that
        `Pipeline.__call__` iterates over: `KeyDataset(dataset, "text")` (any torch Dataset), a
        generator or an iterator. An empty or blank string translates to "" (with a warning), without
        touching the other texts of its batch.

        Returns a list with one `{"translation_text": ...}` per string (a list of one for a single
        string), and an iterator of those dicts for a stream, so that `list(translate(KeyDataset(ds,
        "text")))` equals `translate(ds["text"])`. With `num_return_sequences=n` > 1 each text gets a
        list of n dicts instead (a single string: that list). Keyword arguments, those of transformers 4's
        `TranslationPipeline` with their meaning there:

        - `batch_size`, `num_workers`: as for every pipeline.
        - `return_text` (default True) and `return_tensors` (default False): whether each dict holds
          `translation_text` and `translation_token_ids` (the generated ids, decoder start and `</s>`
          included, as a tensor); `return_tensors=True` alone gives the ids instead of the text.
          `return_type` (0: ids, 1: text) is the older spelling.
        - `clean_up_tokenization_spaces` (default False): as in `tokenizer.decode` ("a ." -> "a.").
        - `truncation` (default True here): texts longer than the model's limit are cut to it with a
          warning; False (or "do_not_truncate") refuses them instead.
        - `src_lang`/`tgt_lang`: checked against the model's pair (a warning if they differ).
        - `stop_sequence`: generation ends at its first token.
        - `return_attentions`: adds the attention weights behind each translation.
        - anything else goes to `model.generate` (`num_beams`, `max_new_tokens`, `num_return_sequences`,
          `do_sample`, `generation_config`, ...).
        """
        if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__iter__") and not isinstance(inputs, Dataset):
            _check_text(inputs, "inputs")
            result = super().__call__(inputs, **kwargs)
            return result if isinstance(result, list) else [result]
        if isinstance(inputs, Dataset) or iter(inputs) is inputs:  # KeyDataset, generators, iterators: streamed
            return super().__call__(inputs if isinstance(inputs, (Dataset, GeneratorType)) else (t for t in inputs), **kwargs)
        inputs = list(inputs)  # a list, tuple or data set column
        if not inputs:
            raise ValueError("`inputs` is empty: give at least one text to translate.")
        for index, text in enumerate(inputs):
            _check_text(text, f"inputs[{index}]")
        return super().__call__(inputs, **kwargs)

    def preprocess(self, text, truncation=True):
        _check_text(text, "each input")
        blank = not text.strip()
        if blank:
            # One blank line in a file should not cost the rest of its batch: it is not translated at all.
            warnings.warn("An empty or blank text translates to the empty string.", stacklevel=2)
            text = ""
        limit = longest_source(self.model, self.tokenizer)
        encoded = self.tokenizer(text, return_tensors="pt", truncation=False)
        length = encoded["input_ids"].size(1)
        if length > limit:
            if not truncation:
                raise ValueError(
                    f"The text is {length} tokens long; the model reads at most {limit}. Split it, or pass "
                    "truncation=True to translate its first tokens only."
                )
            warnings.warn(
                f"A text of {length} tokens was truncated to the model's limit of {limit} tokens; only its "
                "beginning is translated. Split long texts into sentences.",
                stacklevel=2,
            )
            encoded = self.tokenizer(text, return_tensors="pt", truncation=True, max_length=limit)
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "blank": torch.tensor([blank])}

    def _forward(self, model_inputs, generate_kwargs=None, return_attentions=False):
        generate_kwargs = generate_kwargs or {}
        stored = generate_kwargs.get("generation_config") or self.model.generation_config
        sequences = _positive_int("num_return_sequences", generate_kwargs.get("num_return_sequences") or stored.num_return_sequences or 1)
        start = first_token_id(stored.decoder_start_token_id if stored.decoder_start_token_id is not None
                               else self.model.config.decoder_start_token_id)
        eos = first_token_id(generate_kwargs.get("eos_token_id", stored.eos_token_id))
        pad = self.model.config.pad_token_id
        # Blank texts leave the batch: the others are generated exactly as they would be without them.
        blank = model_inputs["blank"]
        inputs = {name: model_inputs[name][~blank] for name in ("input_ids", "attention_mask")}
        inputs = {name: tensor[:, inputs["attention_mask"].any(0)] for name, tensor in inputs.items()}
        generated = self.model.generate(**inputs, **generate_kwargs) if bool((~blank).any()) else None
        # (texts, sequences, length): transformers 4's layout, which the pipeline's unbatching splits by text.
        length = 2 if generated is None else max(2, generated.size(1))
        output_ids = torch.full((blank.size(0), sequences, length), pad, dtype=torch.long, device=blank.device)
        output_ids[blank, :, 0], output_ids[blank, :, 1] = start, eos  # the empty translation
        if generated is not None:
            output_ids[~blank, :, : generated.size(1)] = generated.view(-1, sequences, generated.size(1))
        outputs = {"output_ids": output_ids}
        if return_attentions:
            stops = {eos, pad}
            per_text = []
            for row in range(output_ids.size(0)):
                source = model_inputs["input_ids"][row][model_inputs["attention_mask"][row].bool()]
                weights = []
                for sequence in output_ids[row]:
                    target = _trim(sequence, stops, keep_first=True)
                    if target.size(0) < 2:  # nothing was generated: nothing was attended
                        target = torch.cat([target, target.new_tensor([eos])])
                    weights.append(teacher_forced_attentions(self.model, source[None], target[None]))
                per_text.append(weights)
            # A list: when batching, the pipeline's unbatching hands each text its own entry.
            outputs["attention_weights"] = per_text
        return outputs

    def postprocess(self, model_outputs, return_attentions=False, return_text=True, return_tensors=False,
                    clean_up_tokenization_spaces=False):
        weights = model_outputs.get("attention_weights")
        if weights and isinstance(weights[0], list):  # not unbatched: the batch of this one text
            weights = weights[0]
        records = []
        for index, output_ids in enumerate(model_outputs["output_ids"][0]):
            record = {}
            if return_text:
                record["translation_text"] = self.tokenizer.decode(
                    output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=clean_up_tokenization_spaces
                )
            if return_tensors:
                record["translation_token_ids"] = _strip_padding(output_ids, self.model.config.pad_token_id)
            if return_attentions:
                record["attentions"] = self._readable_attentions(weights[index])
            records.append(record)
        return records[0] if len(records) == 1 else records

    def _readable_attentions(self, weights: dict) -> dict:
        weights = dict(weights)
        for side, key in (("encoder", "input_ids"), ("decoder", "decoder_input_ids")):
            ids = weights.pop(key)
            weights[f"{side}_ids"] = ids
            weights[f"{side}_tokens"] = self.tokenizer.convert_ids_to_tokens(ids)  # raw, as bertviz takes them
            weights[f"{side}_pieces"] = readable_pieces(self.tokenizer, ids)  # the text each token stands for
        return weights


def _truncates(truncation) -> bool:
    """transformers 4's truncation settings for one text: True, False or a TruncationStrategy (or its name)."""
    value = getattr(truncation, "value", truncation)
    if value in (True, "longest_first", "only_first"):
        return True
    if value in (False, "do_not_truncate"):
        return False
    raise ValueError(f"`truncation` must be True, False, 'longest_first', 'only_first' or 'do_not_truncate'; got {truncation!r}.")


def _check_text(text, name: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"`{name}` must be a string to translate; got {type(text).__name__}: {text!r:.80}")
