"""Generation throughput on the en-es test split: ours, MarianMTModel with the same weights, CTranslate2.

The weights: our model, randomly initialised or (on a GPU, where it takes seconds) trained briefly
on the en-es train split; random weights repeat one token up to the length cap, so every contender
decodes the same fixed-length workload and beam search never finishes early. `--generation-model
DIR` adds a trained model (its own size and tokenizer): sentences then end at their own lengths.
The weights are copied into a MarianMTModel (`vanilla_transformer.export.marian.to_marian`) and exported to CTranslate2
(fp32 and int8) by our exporter (`vanilla_transformer.export.ctranslate2`). Before any timing, ours
and Marian must produce identical tokens in fp32; CTranslate2's agreement with ours is reported (its
search is transformers' with `early_stopping=True`, which is what ours and Marian run here).
CTranslate2 runs in a process of its own, as it is deployed (see `_Ctranslate2Process`).

Throughput counts generated tokens (</s> included, the start token not) and sentences. Greedy and
beam 4 use transformers' beam scoring with explicit options for both PyTorch models: ours hands such a
beam search to transformers' own loop, so its beam 4 row times transformers' loop on our model; our own
beam search, with the GNMT penalty (`length_penalty_style="gnmt"`), is timed as well, when the model has it. A trained model's
outputs are also scored against the references (BLEU, sacrebleu's defaults).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import tempfile

import torch
from transformers import CompileConfig, GenerationConfig, GenerationMixin

from vanilla_transformer import VanillaTransformerForConditionalGeneration
from vanilla_transformer.onednn_decoding import choose_onednn_decoding
from vanilla_transformer.export.marian import to_marian
from vanilla_transformer.modeling.search import gnmt_beam_search, greedy_search
from vanilla_transformer.inference import score_translations

from .common import Timer, attention_kernels, encode, model_config, pairs, peak_memory_mb, summary, token_batch

BATCH_SIZE = 32
LENGTH_PENALTY = 0.6
MODES = {
    "greedy": dict(num_beams=1),
    "beam4": dict(num_beams=4, length_penalty=LENGTH_PENALTY, early_stopping=True),
}
GNMT = dict(length_penalty_style="gnmt")
# What each of our decoding changes buys: ours with them undone one at a time, timed beside
# the rest. "rows stay": our loop keeps finished sentences in the batch (`prune=False`) instead of letting them
# leave (`should_prune`). PLAIN: the decoder's products and the output projection on torch's default kernel (MKL
# on a CPU) instead of oneDNN's on the weights packed for the call, where that is faster. "transformers' loop":
# transformers' own search loop instead of ours (it keeps rows and packs nothing). Each row undoes one more.
# Beam search: our loop is the GNMT one (transformers' ranking runs in transformers' loop, the "ours" row).
PLAIN = {"onednn_decoding": False}  # not a `generate` option: `_hf_runner` turns oneDNN off around the call
ROWS_STAY = {"greedy": functools.partial(greedy_search, prune=False),
             "beam4": functools.partial(gnmt_beam_search, prune=False)}
ABLATIONS = {
    "greedy": {
        "ours, rows stay": dict(custom_generate=ROWS_STAY["greedy"]),
        "ours, rows stay, plain products": dict(PLAIN, custom_generate=ROWS_STAY["greedy"]),
        "ours, plain products, transformers' loop": dict(PLAIN, return_dict_in_generate=True),
    },
    "beam4": {
        "ours-gnmt, rows stay": dict(GNMT, custom_generate=ROWS_STAY["beam4"]),
        "ours-gnmt, rows stay, plain products": dict(GNMT, **PLAIN, custom_generate=ROWS_STAY["beam4"]),
    },
}
# Greedy search with transformers' static cache runs in transformers' loop, which compiles the decoder step
# (with CUDA graphs on a GPU; on a CPU because `_compile_all_devices` asks it to, with inductor's C++ kernels).
COMPILED_CONFIG = CompileConfig()
COMPILED_CONFIG._compile_all_devices = True
COMPILED = {"greedy": {"ours, static cache, compiled": dict(cache_implementation="static", compile_config=COMPILED_CONFIG)}}


def train_briefly(model, tokenizer, steps: int, target_tokens: int = 2048, lr: float = 1e-3) -> float:
    """A few hundred Adam steps with warm-up (§5.3), enough for sentence-like outputs that end in </s>.
    Returns the last loss."""
    source, target = pairs("train")
    device = next(model.parameters()).device
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)
    warmup = max(1, steps // 5)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    start, loss = 0, float("nan")
    for _ in range(steps):
        batch = token_batch(tokenizer, source, target, target_tokens, start)
        start += batch["input_ids"].size(0)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(**{name: tensor.to(device) for name, tensor in batch.items()}).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.item()
    return loss


def generated_lengths(sequences: torch.Tensor, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Tokens each row generated: up to and including the first </s>, the start token not counted."""
    generated = sequences[:, 1:]
    is_eos = generated == eos_token_id
    first_eos = is_eos.int().argmax(dim=1)
    return torch.where(is_eos.any(dim=1), first_eos + 1, (generated != pad_token_id).sum(dim=1))


def _trim(sequences: torch.Tensor, eos_token_id: int, pad_token_id: int) -> list[list[int]]:
    lengths = generated_lengths(sequences, eos_token_id, pad_token_id)
    return [row[1 : 1 + n].tolist() for row, n in zip(sequences, lengths.tolist())]


def _ctranslate2_models(model, tokenizer, folder: str, quantizations) -> dict:
    """Exported by `vanilla-transformer export --format ctranslate2`'s code, once per quantization."""
    if not quantizations:
        return {}
    from vanilla_transformer.export.ctranslate2 import export_ctranslate2

    return {q: str(export_ctranslate2(model, tokenizer, os.path.join(folder, f"ct2-{q}"), q)) for q in quantizations}


def run(tokenizer, sizes, device: str, threads: int, sentences: int, max_new_tokens: int, repeats: int,
        train_steps: dict, ctranslate2_quantizations=("float32", "int8"), model_dir: str | None = None) -> dict:
    """Per size, random (or briefly trained) weights of that preset; with `model_dir`, the one size
    given is a label for the trained model in that folder, which `tokenizer` must belong to."""
    source, target = pairs("test")
    source, target = source[:sentences], target[:sentences]
    batches = [encode(tokenizer, source[i : i + BATCH_SIZE]) for i in range(0, len(source), BATCH_SIZE)]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    results = {}
    for size in sizes:
        torch.manual_seed(0)
        steps = 0 if model_dir else train_steps.get(size, 0)
        if model_dir:
            ours = VanillaTransformerForConditionalGeneration.from_pretrained(model_dir)
            # Saved folders decode as the paper does (GNMT search, source-length cap); here ours runs
            # transformers' search as Marian does, and the GNMT search only in its own row.
            ours.generation_config = GenerationConfig.from_model_config(ours.config)
            weights = f"trained, from {model_dir}"
        else:
            ours = VanillaTransformerForConditionalGeneration(model_config(size, tokenizer))
            weights = "random, repeating tokens up to the cap"
        loss = None
        if steps:
            loss = train_briefly(ours.to(device), tokenizer, steps, target_tokens=8192)
            weights = f"{steps} training steps, loss {loss:.2f}"
        ours.cpu().eval()
        choose_onednn_decoding(ours)  # the kernel the package's load_model chooses for it on this CPU
        marian = to_marian(ours).eval()
        entry = {"weights": weights, "train_steps": steps, "train_loss": loss, "modes": {}}

        # Agreement first, in fp32 on the CPU: identical tokens or the timing compares different work.
        references = {}
        with torch.no_grad():
            for mode, options in MODES.items():
                args = dict(do_sample=False, max_new_tokens=max_new_tokens, **options)
                ours_out = [_trim(ours.generate(**b, **args), eos, pad) for b in batches]
                marian_out = [_trim(marian.generate(**b, **args), eos, pad) for b in batches]
                ours_flat = [row for batch in ours_out for row in batch]
                marian_flat = [row for batch in marian_out for row in batch]
                references[mode] = ours_flat
                entry["modes"][mode] = {
                    "ours_equals_marian": sum(a == b for a, b in zip(ours_flat, marian_flat)) / len(ours_flat),
                    "distinct_outputs": len({tuple(row) for row in ours_flat}),
                    "mean_output_tokens": sum(map(len, ours_flat)) / len(ours_flat),
                    "ended_with_eos": sum(bool(row) and row[-1] == eos for row in ours_flat) / len(ours_flat),
                    "mean_distinct_tokens_per_output": sum(len(set(row)) for row in ours_flat) / len(ours_flat),
                }

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        contenders = {
            "ours": _hf_runner(ours.to(device, dtype), batches, device, max_new_tokens, eos, pad),
            "marian": _hf_runner(marian.to(device, dtype), batches, device, max_new_tokens, eos, pad),
        }
        gnmt = type(ours).generate is not GenerationMixin.generate
        if importlib.util.find_spec("ctranslate2") is None:  # an extra: pip install -e ".[bench]"
            ctranslate2_quantizations = ()
        with tempfile.TemporaryDirectory() as folder:
            converted = _ctranslate2_models(ours.float().cpu(), tokenizer, folder, ctranslate2_quantizations)
            ours.to(device, dtype)
            for quantization, path in converted.items():
                contenders[f"ctranslate2-{quantization}"] = _ctranslate2_runner(
                    path, tokenizer, batches, device, threads, max_new_tokens
                )
            for mode, options in MODES.items():
                mode_runners = {name: functools.partial(runner, options) for name, runner in contenders.items()}
                if gnmt and mode == "beam4":
                    mode_runners["ours-gnmt"] = lambda: contenders["ours"](dict(options, **GNMT))
                if gnmt:
                    for name, undone in {**ABLATIONS[mode], **COMPILED.get(mode, {})}.items():
                        mode_runners[name] = lambda u=undone: contenders["ours"](dict(options, **u))
                timed = _time(mode_runners, repeats, references[mode], device)
                for name, contender in timed["contenders"].items():
                    outputs = contender.pop("outputs", None)
                    if outputs is not None and model_dir:  # translations, not repeated tokens: quality means something
                        hypotheses = tokenizer.batch_decode(outputs, skip_special_tokens=True)
                        contender["bleu"] = score_translations(hypotheses, target)["bleu"]
                entry["modes"][mode].update(timed)
            for quantization in converted:  # their processes end before their folders go
                contenders.pop(f"ctranslate2-{quantization}").close()
        entry["attention_kernels"] = {
            "ours": attention_kernels(lambda: contenders["ours"](MODES["greedy"], batches[:1])),
            "marian": attention_kernels(lambda: contenders["marian"](MODES["greedy"], batches[:1])),
        }
        entry["ctranslate2_conversion"] = "not installed" if not converted else (
            "vanilla_transformer.export.ctranslate2 (CTranslate2's converter API and TransformerSpec, "
            "quantized by its converter)"
        )
        results[size] = entry
        contenders.clear()  # the runners hold the models: freed before the next size
        del ours, marian
    return results


def _hf_runner(model, batches, device, max_new_tokens, eos, pad):
    def generate(options, subset=None):
        outputs = []
        options = dict(options)
        packed = options.pop("onednn_decoding", True)  # see PLAIN
        with torch.no_grad(), contextlib.nullcontext() if packed else _without_onednn():
            for batch in subset or batches:
                batch = {k: v.to(device) for k, v in batch.items()}
                sequences = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens, **options)
                sequences = getattr(sequences, "sequences", sequences)  # return_dict_in_generate
                outputs.extend(_trim(sequences.cpu(), eos, pad))
        return outputs

    return generate


@contextlib.contextmanager
def _without_onednn():
    """torch's oneDNN off within the block (`torch.backends.mkldnn.flags` would also reset its other
    flags, and warn doing so)."""
    was, torch.backends.mkldnn.enabled = torch.backends.mkldnn.enabled, False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = was


def _ctranslate2_runner(path, tokenizer, batches, device, threads, max_new_tokens):
    token_batches = [
        [tokenizer.convert_ids_to_tokens(ids[mask.bool()].tolist()) for ids, mask in
         zip(batch["input_ids"], batch["attention_mask"])]
        for batch in batches
    ]
    return _Ctranslate2Process(path, token_batches, device, threads, max_new_tokens, tokenizer.eos_token_id)


class _Ctranslate2Process:
    """CTranslate2 in a process of its own, as it is deployed. In the process where torch has run its
    OpenMP threads, CTranslate2's run several times slower, and stay so.
    Called as the PyTorch runners are, `(options, subset=None)`; `last_peak_mb` is the memory the last
    call needed in that process (peak resident memory above its start)."""

    def __init__(self, path, token_batches, device, threads, max_new_tokens, eos):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch threads in it
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=_serve_ctranslate2, daemon=True,
            args=(child, path, token_batches, "cuda" if device.startswith("cuda") else "cpu", threads,
                  max_new_tokens, eos),
        )
        self.process.start()
        child.close()
        self.last_peak_mb = None

    def __call__(self, options, subset=None):
        self.connection.send((options, len(subset) if subset else None))
        reply = self.connection.recv()
        if isinstance(reply, BaseException):
            raise reply
        outputs, self.last_peak_mb = reply
        return outputs

    def close(self):
        self.connection.send(None)
        self.process.join(timeout=60)


def _serve_ctranslate2(connection, path, token_batches, device, threads, max_new_tokens, eos):
    from vanilla_transformer.export.ctranslate2 import CTranslate2Translator

    from .common import peak_rss_mb, reset_peak_rss

    translator = CTranslate2Translator(path, device=device, threads=threads)
    while (request := connection.recv()) is not None:
        options, count = request
        try:
            before = reset_peak_rss()
            outputs = []
            for tokens in token_batches[:count]:
                ids = translator.translate_tokens(tokens, num_beams=options["num_beams"], max_new_tokens=max_new_tokens,
                                                  length_penalty=options.get("length_penalty", 1.0))
                # </s> counted as for the PyTorch models, where a sentence ended before the cap
                outputs.extend(row + [eos] if len(row) < max_new_tokens else row for row in ids)
            connection.send((outputs, peak_rss_mb() - before))
        except Exception as error:  # noqa: BLE001 (handed to the parent, which raises it)
            connection.send(error)


def _peak_memory_mb(runner, device) -> float:
    """`peak_memory_mb` of a runner; a CTranslate2 runner measures it in its own process."""
    if isinstance(getattr(runner, "func", None), _Ctranslate2Process):
        runner()
        return runner.func.last_peak_mb
    return peak_memory_mb(runner, device)


def _time(runners: dict, repeats: int, reference, device) -> dict:
    """Each contender once as warm-up, then `repeats` rounds in rotating order; then each contender's
    peak memory in one more run (CTranslate2's on a GPU is outside torch's allocator: not measured)."""
    outputs = {name: runner() for name, runner in runners.items()}
    seconds = {name: [] for name in runners}
    names = list(runners)
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            with Timer(device) as timer:
                runners[name]()
            seconds[name].append(timer.seconds)
    cuda = torch.device(device).type == "cuda"
    memory = {name: None if cuda and name.startswith("ctranslate2") else _peak_memory_mb(runner, device)
              for name, runner in runners.items()}
    timed = {}
    for name, output in outputs.items():
        tokens = sum(map(len, output))
        s = summary(seconds[name])
        timed[name] = {
            "generated_tokens": tokens,
            "seconds": s,
            "tokens_per_s": {"median": tokens / s["median"], "min": tokens / s["max"], "max": tokens / s["min"]},
            "sentences_per_s": {k: len(output) / s[k2] for k, k2 in (("median", "median"), ("min", "max"), ("max", "min"))},
            "agrees_with_ours": sum(a == b for a, b in zip(output, reference)) / len(reference),
            "peak_memory_mb": memory[name],
            "outputs": output,
        }
    ours_seconds = seconds["ours"]
    timed["speedup_vs_marian"] = summary([m / o for o, m in zip(ours_seconds, seconds["marian"])])
    return {"contenders": timed}
