"""Fine-tune a saved model with transformers' own Seq2SeqTrainer, optionally with PEFT LoRA.

    python examples/finetune.py --model runs/quickstart --output-dir runs/tuned
    python examples/finetune.py --model runs/quickstart --output-dir runs/tuned-lora --lora

Everything here is plain transformers, datasets, evaluate and peft; the model's code comes from its
folder (`trust_remote_code=True`). From vanilla_transformer only the embedded corpus and the shipped
BLEU/chrF metric are used. The output folder loads anywhere, `pipeline("translation", ...)` included.
"""

import argparse

import evaluate
import numpy as np
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)

from vanilla_transformer.corpora import load_translation_dataset
from vanilla_transformer.metrics import BLEU_CHRF


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a saved model folder or Hub id")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--dataset", default="bible-en-es", help="an embedded corpus, a local file or a Hub data set")
    parser.add_argument("--source-lang", default="en")
    parser.add_argument("--target-lang", default="es")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters on q_proj and v_proj only")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-samples", type=int, default=200, help="validation pairs translated at each evaluation")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, trust_remote_code=True)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=["q_proj", "v_proj"], r=16, lora_alpha=32)
        model = get_peft_model(model, lora)
        model.print_trainable_parameters()

    # A DatasetDict (train / validation / test) of rows {"translation": {"en": ..., "es": ...}}.
    data = load_translation_dataset(args.dataset, source_lang=args.source_lang, target_lang=args.target_lang)

    def encode(batch):
        pairs = batch["translation"]
        features = tokenizer([p[args.source_lang] for p in pairs], truncation=True, max_length=128)
        features["labels"] = tokenizer([p[args.target_lang] for p in pairs], truncation=True, max_length=128)["input_ids"]
        return features

    tokenized = data.map(encode, batched=True, remove_columns=data["train"].column_names)
    bleu_chrf = evaluate.load(BLEU_CHRF)  # sacrebleu's BLEU and chrF, shipped in the package: no Hub needed

    def compute_metrics(eval_pred):
        # The Trainer pads labels, and generations gathered from batches of different lengths, with -100.
        predictions = np.where(eval_pred.predictions != -100, eval_pred.predictions, tokenizer.pad_token_id)
        labels = np.where(eval_pred.label_ids != -100, eval_pred.label_ids, tokenizer.pad_token_id)
        scores = bleu_chrf.compute(
            predictions=tokenizer.batch_decode(predictions, skip_special_tokens=True),
            references=tokenizer.batch_decode(labels, skip_special_tokens=True),
        )
        return {"bleu": scores["bleu"], "chrf": scores["chrf"]}

    training_args = Seq2SeqTrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=32,
        learning_rate=1e-3 if args.lora else 1e-4,
        warmup_steps=min(100, args.max_steps // 10),
        label_smoothing_factor=0.1,  # §5.4
        eval_strategy="steps",
        eval_steps=max(1, args.max_steps // 2),
        predict_with_generate=True,  # beam 4, GNMT length penalty, source + 50: the folder's own defaults
        save_strategy="no",
        report_to=[],
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"].select(range(min(args.eval_samples, len(tokenized["validation"])))),
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    print(trainer.evaluate())
    if args.lora:
        model.save_pretrained(f"{args.output_dir}/adapter")  # the adapter alone (a few hundred KB)
        model = model.merge_and_unload()  # the base model with the adapter folded into its weights
        model.save_pretrained(args.output_dir)
        tokenizer.save_pretrained(args.output_dir)
    else:
        trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
