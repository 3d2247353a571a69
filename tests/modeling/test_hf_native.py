"""The paths transformers users take every day, written as they would write them:
Seq2SeqTrainer, every way of saving, PEFT LoRA, pipelines over data sets, the tokenizer, export,
`attn_implementation`, the static cache and `inputs_embeds`.

The saved-folder tests run in processes that cannot import vanilla_transformer: the folder's own code
(loaded with trust_remote_code) must do everything.
"""

import json

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, GenerationConfig

from vanilla_transformer.corpora import load_translation_dataset, text_pairs

LONG = [
    "And it came to pass, when men began to multiply on the face of the earth, and daughters were born unto them,",
    "And the LORD said, I will destroy man whom I have created from the face of the earth; both man, and beast.",
]


@pytest.fixture(scope="module")
def verses():
    """32 real en-es training pairs."""
    source, target = text_pairs(load_translation_dataset("bible-en-es")["train"].select(range(32)), "en", "es")
    return source, target


def _generated_lengths(sequences) -> list[int]:
    """New tokens per row (after the start token, up to and including </s>)."""
    lengths = []
    for row in sequences:
        row = row[1:]
        ends = [i for i, token in enumerate(row) if token in (0, 2)]  # <pad> fills, </s> ends
        lengths.append(ends[0] + 1 if ends else len(row))
    return lengths


@pytest.fixture(scope="module")
def untrained_folder(hub_tiny_model, tmp_path_factory):
    """A tiny model with random weights, as a Hub folder: its translations never end before the source +
    50 cap, so any cut shows."""
    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
    from vanilla_transformer.hub import save_for_hub

    _, tokenizer = hub_tiny_model
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer)))
    return save_for_hub(model, tokenizer, tmp_path_factory.mktemp("untrained") / "untrained")


@pytest.mark.slow
def test_seq2seq_trainer_round_trip_keeps_full_length_translations(untrained_folder, verses, tmp_path, run_without_package):
    """Seq2SeqTrainer(predict_with_generate=True) writes transformers' default max_length=20 into the model's
    generation config at its first evaluation, and save_model saves it. Translations must not be cut by it:
    not in evaluation, not after saving, not after reloading."""
    source, target = verses
    out = run_without_package(
        f"""
        import json
        from datasets import Dataset
        from transformers import (AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, GenerationConfig,
                                  Seq2SeqTrainer, Seq2SeqTrainingArguments)
        folder, output = {str(untrained_folder)!r}, {str(tmp_path / "tuned")!r}
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)

        def encode(batch):
            features = tokenizer(batch["en"], truncation=True, max_length=128)
            features["labels"] = tokenizer(batch["es"], truncation=True, max_length=128)["input_ids"]
            return features

        pairs = Dataset.from_dict({{"en": {source!r}, "es": {target!r}}})
        train = pairs.map(encode, batched=True, remove_columns=["en", "es"])
        long = Dataset.from_dict({{"en": {LONG!r}, "es": ["", ""]}}).map(encode, batched=True, remove_columns=["en", "es"])
        args = Seq2SeqTrainingArguments(
            output_dir={str(tmp_path / "trainer")!r}, per_device_train_batch_size=8, per_device_eval_batch_size=8,
            max_steps=4, learning_rate=1e-4, eval_strategy="steps", eval_steps=2, predict_with_generate=True,
            save_strategy="no", report_to=[], use_cpu=True, seed=0,
        )
        trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=train, eval_dataset=train.select(range(8)),
                                 data_collator=DataCollatorForSeq2Seq(tokenizer, model=model), processing_class=tokenizer)
        trainer.train()
        predicted = trainer.predict(long).predictions.tolist()
        trainer.save_model(output)
        # What the fine-tuned weights give with the folder's decoding settings (beam 4, GNMT, source + 50):
        batch = tokenizer({LONG!r}, return_tensors="pt", padding=True)
        expected = model.generate(**batch, generation_config=GenerationConfig.from_pretrained(folder)).tolist()
        print(json.dumps(dict(stored=model.generation_config.max_length, predicted=predicted, expected=expected)))
        """
    )
    first = json.loads(out.strip().splitlines()[-1])
    reloaded = run_without_package(
        f"""
        import json
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained({str(tmp_path / "tuned")!r}, trust_remote_code=True)
        model = AutoModelForSeq2SeqLM.from_pretrained({str(tmp_path / "tuned")!r}, trust_remote_code=True)
        print(json.dumps(model.generate(**tokenizer({LONG!r}, return_tensors="pt", padding=True)).tolist()))
        """
    )
    reloaded = json.loads(reloaded.strip().splitlines()[-1])
    assert first["stored"] == 20  # what Seq2SeqTrainer wrote into the model's generation config
    expected = first["expected"]
    assert max(_generated_lengths(expected)) > 25, "translations are cut: a stored max_length must not cap them"
    assert reloaded == expected
    # In evaluation too: generate's own output, before the Trainer pads it with -100.
    assert _generated_lengths(first["predicted"]) == _generated_lengths(expected)


# ----------------------------------------------------------------------------------------------
# Every way of saving writes a folder that `pipeline("translation", ...)` loads
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_way_of_saving_gives_a_folder_the_translation_pipeline_loads(hub_tiny_folder, tmp_path, run_without_package):
    saved = {name: str(tmp_path / name) for name in ("save_pretrained", "trainer", "peft_merged", "push_to_hub")}
    run_without_package(
        f"""
        import shutil
        from pathlib import Path
        from unittest import mock
        from huggingface_hub import HfApi, ModelCard
        from huggingface_hub.errors import EntryNotFoundError
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, Trainer, TrainingArguments
        folder, saved = {str(hub_tiny_folder)!r}, {saved!r}
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)

        model.save_pretrained(saved["save_pretrained"])
        tokenizer.save_pretrained(saved["save_pretrained"])

        args = TrainingArguments(output_dir={str(tmp_path / "trainer-run")!r}, report_to=[], use_cpu=True)
        Trainer(model=model, args=args, processing_class=tokenizer).save_model(saved["trainer"])

        lora = LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=["q_proj", "v_proj"], r=4)
        peft_model = get_peft_model(AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True), lora)
        peft_model.merge_and_unload().save_pretrained(saved["peft_merged"])
        tokenizer.save_pretrained(saved["peft_merged"])

        # push_to_hub up to the upload: keep what would be committed.
        def commit(self, repo_id, operations, **kwargs):
            for operation in operations:
                target = Path(saved["push_to_hub"]) / operation.path_in_repo
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(operation.path_or_fileobj, target)

        repo = mock.Mock(repo_id="someone/tiny-en-es")
        with mock.patch.object(HfApi, "create_repo", return_value=repo), mock.patch.object(HfApi, "create_commit", commit), \\
                mock.patch.object(ModelCard, "load", side_effect=EntryNotFoundError("no card yet")):
            model.push_to_hub("someone/tiny-en-es")
            tokenizer.push_to_hub("someone/tiny-en-es")
        """
    )
    sentences = ["In the beginning God created the heavens and the earth.", "Jesus wept."]
    out = run_without_package(
        f"""
        import json
        from transformers import pipeline
        results = {{}}
        for name, folder in {{"original": {str(hub_tiny_folder)!r}, **{saved!r}}}.items():
            translate = pipeline("translation", model=folder, trust_remote_code=True)
            results[name] = [r["translation_text"] for r in translate({sentences!r}, num_beams=2, max_new_tokens=12)]
        print(json.dumps(results))
        """
    )
    results = json.loads(out.strip().splitlines()[-1])
    assert all(text.strip() for text in results["original"])
    for name in saved:  # the same weights (a fresh LoRA adds zero), so the same translations
        assert results[name] == results["original"], name


# ----------------------------------------------------------------------------------------------
# PEFT
# ----------------------------------------------------------------------------------------------


def test_lora_with_the_usual_targets_trains_saves_and_reloads(hub_tiny_folder, verses, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hub_tiny_folder, trust_remote_code=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(hub_tiny_folder, trust_remote_code=True)
    config = model.config
    lora = LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=["q_proj", "v_proj"], r=8, lora_alpha=16)
    peft_model = get_peft_model(model, lora)
    adapted = [name for name, module in peft_model.named_modules() if hasattr(module, "lora_A")]
    attention_blocks = config.encoder_layers + 2 * config.decoder_layers  # self, and cross in the decoder
    assert len(adapted) == 2 * attention_blocks  # Q and V of every block
    assert {name.rsplit(".", 1)[-1] for name in adapted} == {"q_proj", "v_proj"}

    source, target = verses
    inputs = tokenizer(source[:8], return_tensors="pt", padding=True)
    labels = tokenizer(target[:8], return_tensors="pt", padding=True)["input_ids"]
    labels[labels == tokenizer.pad_token_id] = -100
    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(0)
    peft_model.train()
    losses = []
    for _ in range(30):
        loss = peft_model(**inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses  # only the adapters learn

    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    base = AutoModelForSeq2SeqLM.from_pretrained(hub_tiny_folder, trust_remote_code=True)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        expected = peft_model(**inputs, labels=labels).logits
        assert torch.allclose(reloaded(**inputs, labels=labels).logits, expected, atol=1e-5)
        generated = reloaded.generate(**tokenizer(source[:2], return_tensors="pt", padding=True), max_new_tokens=5)
    assert generated.shape[0] == 2


# ----------------------------------------------------------------------------------------------
# The pipeline over data sets
# ----------------------------------------------------------------------------------------------


def test_pipeline_over_a_dataset_equals_the_list_call(hub_tiny_model, verses):
    from datasets import Dataset
    from transformers.pipelines.pt_utils import KeyDataset

    from vanilla_transformer import TranslationPipeline

    model, tokenizer = hub_tiny_model
    translate = TranslationPipeline(model=model, tokenizer=tokenizer)  # a model in memory, as the README shows
    texts = verses[0][:5]
    options = dict(num_beams=2, max_new_tokens=8, batch_size=2)
    expected = translate(texts, **options)
    assert len(expected) == 5 and all(set(r) == {"translation_text"} for r in expected)
    data = Dataset.from_dict({"text": texts})
    assert list(translate(KeyDataset(data, "text"), **options)) == expected
    assert list(translate((text for text in texts), **options)) == expected
    assert translate(data["text"], **options) == expected
    assert translate(texts[0], num_beams=2, max_new_tokens=8) == expected[:1]
    with pytest.raises(TypeError, match="must be a string"):
        list(translate(KeyDataset(Dataset.from_dict({"text": [texts[0], None]}), "text")))


# ----------------------------------------------------------------------------------------------
# The tokenizer is a stock transformers class
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tokenizer_loads_without_a_question(hub_tiny_folder, run_without_package):
    """AutoTokenizer reads config.json before tokenizer_config.json, and config.json names our code
    (`auto_map`): transformers asks before running it unless told. `trust_remote_code=True`, or the
    stock class itself, load with no question; without either, a process with no standard input (a
    service, a batch job) loads the same tokenizer at once instead of waiting for an answer."""
    folder = str(hub_tiny_folder)
    outputs = [
        run_without_package(
            f"""
            from transformers import AutoTokenizer, PreTrainedTokenizerFast
            tokenizer = {how}
            print(type(tokenizer).__name__, tokenizer("Jesus wept.")["input_ids"])
            """
        )
        for how in (f"AutoTokenizer.from_pretrained({folder!r}, trust_remote_code=True)",
                    f"PreTrainedTokenizerFast.from_pretrained({folder!r})",
                    f"AutoTokenizer.from_pretrained({folder!r})")
    ]
    assert "custom code" not in outputs[0] + outputs[1]
    assert outputs[2].startswith("The repository")  # the question, printed; nobody there to answer it
    loaded = [out[out.rindex("TokenizersBackend ["):].strip() for out in outputs]
    assert loaded[0] == loaded[1] == loaded[2]


# ----------------------------------------------------------------------------------------------
# Export, attention implementations, the static cache, inputs_embeds
# ----------------------------------------------------------------------------------------------


def _tiny(**overrides):
    from vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    torch.manual_seed(0)
    return VanillaTransformerForConditionalGeneration(VanillaTransformerConfig.from_preset("tiny", vocab_size=50, **overrides)).eval()


def _inputs(batch, source_length, target_length, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 50, (batch, source_length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    input_ids[-1, source_length // 2 :], attention_mask[-1, source_length // 2 :] = 0, 0  # one padded source
    decoder_input_ids = torch.randint(3, 50, (batch, target_length), generator=g)
    decoder_input_ids[:, 0] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)


def _dynamic_shapes():
    batch, source, target = torch.export.Dim("batch"), torch.export.Dim("source"), torch.export.Dim("target")
    return {"input_ids": {0: batch, 1: source}, "attention_mask": {0: batch, 1: source},
            "decoder_input_ids": {0: batch, 1: target}, "use_cache": None}


def test_torch_export_with_static_and_dynamic_lengths():
    model = _tiny()
    example = _inputs(2, 7, 5)
    static = torch.export.export(model, (), {**example, "use_cache": False})
    with torch.no_grad():
        assert torch.allclose(static.module()(**example, use_cache=False).logits, model(**example).logits, atol=1e-5)
    dynamic = torch.export.export(model, (), {**example, "use_cache": False}, dynamic_shapes=_dynamic_shapes())
    for shape in ((2, 7, 5), (3, 12, 9)):
        inputs = _inputs(*shape, seed=1)
        with torch.no_grad():
            assert torch.allclose(dynamic.module()(**inputs, use_cache=False).logits, model(**inputs).logits, atol=1e-5)


@pytest.mark.slow
def test_onnx_export_runs_in_onnx_runtime_with_our_logits(tmp_path):
    import onnxruntime

    model = _tiny()
    program = torch.onnx.export(
        model, (), kwargs={**_inputs(2, 7, 5), "use_cache": False}, dynamic_shapes=_dynamic_shapes(), dynamo=True
    )
    program.save(tmp_path / "model.onnx")
    session = onnxruntime.InferenceSession(tmp_path / "model.onnx", providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names == ["input_ids", "attention_mask", "decoder_input_ids"]
    for shape in ((2, 7, 5), (3, 12, 9)):  # the exported length and another
        inputs = _inputs(*shape, seed=2)
        logits = session.run(None, {name: inputs[name].numpy() for name in names})[0]
        with torch.no_grad():
            expected = model(**inputs).logits
        assert logits.shape == tuple(expected.shape)
        assert torch.allclose(torch.from_numpy(logits), expected, atol=1e-4)


def test_attn_implementation_from_a_folder_runs_transformers_attention_functions(hub_tiny_folder, monkeypatch):
    calls = []
    fused = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))
    inputs = _inputs(2, 7, 5)
    inputs["input_ids"] = inputs["input_ids"] % 50
    logits = {}
    for implementation in ("sdpa", "eager", "flex_attention"):
        model = AutoModelForSeq2SeqLM.from_pretrained(hub_tiny_folder, trust_remote_code=True, attn_implementation=implementation)
        assert model.config._attn_implementation == implementation
        calls.clear()
        with torch.no_grad():  # flex attention has no backward on a CPU
            logits[implementation] = model(**inputs).logits
        assert bool(calls) == (implementation == "sdpa")
    torch.testing.assert_close(logits["sdpa"], logits["eager"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits["flex_attention"], logits["eager"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="banana"):  # refused at load, naming what was asked (the wording is transformers')
        AutoModelForSeq2SeqLM.from_pretrained(hub_tiny_folder, trust_remote_code=True, attn_implementation="banana")


@pytest.mark.parametrize(
    "options",
    [
        dict(num_beams=1),  # greedy
        dict(num_beams=3),  # our GNMT beam search (the folder's default style)
        dict(num_beams=3, length_penalty_style="transformers"),
        dict(num_beams=2, num_return_sequences=2, output_scores=True, return_dict_in_generate=True),
    ],
)
def test_static_cache_generates_what_the_dynamic_cache_does(hub_tiny_model, options):
    model, tokenizer = hub_tiny_model
    batch = tokenizer(LONG + ["Jesus wept."], return_tensors="pt", padding=True)
    dynamic = model.generate(**batch, **options)
    static = model.generate(**batch, cache_implementation="static", **options)
    if isinstance(dynamic, torch.Tensor):
        assert torch.equal(static, dynamic)
    else:
        assert torch.equal(static.sequences, dynamic.sequences)
        assert torch.allclose(static.sequences_scores, dynamic.sequences_scores, atol=1e-5)


def test_inputs_embeds_replace_ids(hub_tiny_model):
    model, tokenizer = hub_tiny_model
    batch = tokenizer(["Jesus wept.", "In the beginning God created the heavens."], return_tensors="pt", padding=True)
    embed = model.get_input_embeddings()
    decoder_input_ids = torch.tensor([[0, 40, 41], [0, 42, 43]])
    with torch.no_grad():
        by_ids = model(**batch, decoder_input_ids=decoder_input_ids).logits
        by_embeds = model(inputs_embeds=embed(batch["input_ids"]), attention_mask=batch["attention_mask"],
                          decoder_inputs_embeds=embed(decoder_input_ids)).logits
    assert torch.allclose(by_ids, by_embeds, atol=1e-6)
    generated = model.generate(inputs_embeds=embed(batch["input_ids"]), attention_mask=batch["attention_mask"], num_beams=2)
    assert torch.equal(generated, model.generate(**batch, num_beams=2))
    with pytest.raises(ValueError, match="`input_ids` or `inputs_embeds`, not both"):
        model(**batch, inputs_embeds=embed(batch["input_ids"]), decoder_input_ids=decoder_input_ids)


def test_stored_max_length_does_not_cut_but_stored_max_new_tokens_caps(hub_tiny_model):
    """The rule in generation.py: the per-sentence cap (source + 50) is the default; a
    stored max_length (transformers' default 20, written by its tools) is ignored; a stored
    max_new_tokens is a ceiling; a length passed to generate replaces the cap."""
    model, tokenizer = hub_tiny_model
    batch = tokenizer(LONG, return_tensors="pt", padding=True)
    saved = model.generation_config
    try:
        reference = model.generate(**batch, num_beams=1)
        assert max(_generated_lengths(reference.tolist())) > 25
        model.generation_config = GenerationConfig(**{**saved.to_diff_dict(), "max_length": 20})
        assert torch.equal(model.generate(**batch, num_beams=1), reference)
        model.generation_config = GenerationConfig(**{**saved.to_diff_dict(), "max_new_tokens": 10})
        assert max(_generated_lengths(model.generate(**batch, num_beams=1).tolist())) <= 10
    finally:
        model.generation_config = saved
    assert max(_generated_lengths(model.generate(**batch, num_beams=1, max_new_tokens=7).tolist())) <= 7



# ----------------------------------------------------------------------------------------------
# The README's fine-tuning example, run as a user runs it
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finetuned(hub_tiny_folder, tmp_path_factory, run_without_package):
    """examples/finetune.py run as a user runs it, all weights and with LoRA; then each output folder translating
    through the pipeline in one process without the package: {"full" | "lora": (run, folder, translation)}."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "finetune.py"
    root, runs = tmp_path_factory.mktemp("finetuned"), {}
    for name, extra in (("full", []), ("lora", ["--lora"])):
        command = [sys.executable, str(script), "--model", str(hub_tiny_folder), "--output-dir", str(root / name),
                   "--max-steps", "2", "--eval-samples", "4", *extra]
        runs[name] = subprocess.run(command, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    folders = {name: str(root / name) for name, run in runs.items() if run.returncode == 0}
    out = run_without_package(
        f"""
        import json
        from transformers import pipeline
        translations = {{}}
        for name, folder in {folders!r}.items():
            translate = pipeline("translation", model=folder, trust_remote_code=True)
            translations[name] = translate("Jesus wept.", num_beams=1, max_new_tokens=5)[0]["translation_text"]
        print(json.dumps(translations))
        """
    )
    translations = json.loads(out.strip().splitlines()[-1])
    return {name: (run, root / name, translations.get(name)) for name, run in runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["full", "lora"])
def test_the_finetuning_example_runs_and_its_folder_translates(finetuned, name):
    done, folder, translation = finetuned[name]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'eval_bleu'" in done.stdout
    if name == "lora":
        assert (folder / "adapter" / "adapter_model.safetensors").is_file()
    assert translation.strip()


def test_weights_that_do_not_fit_are_refused_not_left_random(hub_tiny_model, tmp_path):
    """Weights whose key and value projections are fused into one `kv_proj` per attention block: our loaders refuse
    them, naming the tensors they lack, instead of transformers' warning and randomly initialised k_proj / v_proj."""
    from safetensors.torch import load_file, save_file

    from vanilla_transformer.checks.model_folder import check_model_folder

    model, _ = hub_tiny_model
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for name in [n for n in weights if n.endswith(("k_proj.weight", "k_proj.bias"))]:
        fused = torch.cat([weights.pop(name), weights.pop(name.replace("k_proj", "v_proj"))])
        weights[name.replace("k_proj", "kv_proj")] = fused
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"are not those config.json describes: they lack model\.\S+\.k_proj\.weight"):
        check_model_folder(tmp_path, needs_tokenizer=False).load()
