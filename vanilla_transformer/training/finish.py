"""Finishing a run: the final weights first, then its scores, model card and upload, none of which can lose them.

Once training is done, §6.1's average of the last `average_last` checkpoints (or, with `ema_decay`, the
moving average of the weights when it scores better on validation) is saved with the config and tokenizer,
and `output_dir` becomes a complete Hub repository: then the validation and test splits are scored
(results.json), the model card is written and, with `push_to_hub`, the folder is uploaded. The scoring is
timed beside the training (the time limit counts the steps alone), and SIGINT or SIGTERM stops it at once:
results.json then lists what was `not_scored`, and `resume` scores it.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from itertools import islice

from accelerate.logging import get_logger

from ..hub import RESULTS_FILE, save_model_files, write_model_card, write_results
from ..modeling.generation import paper_generation_config
from .arguments import TrainArguments
from .checkpoints import average_checkpoints, checkpoint_step, checkpoint_path, list_checkpoints
from .distributed import end_training
from .evaluation import evaluate, full_model, load_weights, report
from .budget import Budget, ScoringInterrupted, StopScoring
from .run_state import RunState
from .finetuning import save_adapter
from .setup import Components

__all__ = ["finish"]

logger = get_logger(__name__)


def finish(components: Components, state: RunState, budget: Budget) -> dict:
    """The model first: once training is done, §6.1's averaged weights, the config and the tokenizer are
    saved before anything else. Then the final scores (results.json), the model card and the upload,
    none of which can take the saved model with it. `resume` on a finished run comes here at once."""
    accelerator, args = components.accelerator, components.args
    state.record_part(budget.training_seconds(), budget.scoring_seconds)  # this part's training time, not its final scores
    elapsed = budget.training_seconds()
    # A stop asked for after the last step, or while saving, skips the scores; the model is saved whole first.
    with StopScoring(budget.requested_signal()) as stops:
        unwrapped, weights = _final_weights(components, state, args)
        unwrapped.generation_config = paper_generation_config(unwrapped.config)
        if accelerator.is_main_process:
            save_model_files(unwrapped, components.task.tokenizer, args.output_dir)
            logger.info(f"saved the model and tokenizer to {args.output_dir}")
        results = _final_results(components, state, args, unwrapped, weights, elapsed, budget.part_tokens, stops)
        if accelerator.is_main_process:
            write_results(args.output_dir, results)
            write_model_card(
                unwrapped, components.task.tokenizer, args.output_dir, results, dataset=args.dataset,
                source_lang=components.task.source_lang, target_lang=components.task.target_lang,
                hyperparameters=_card_hyperparameters(state, args, weights),
                example=_card_example(components, args.max_length),
            )
            logger.info(f"saved {RESULTS_FILE} and the model card to {args.output_dir}")
    components.unwrap_model()  # the DDP wrapper goes before the process group (a gloo hang at exit otherwise)
    end_training(accelerator)
    if results.get("not_scored"):  # stopped: no upload of a folder its owner did not let finish
        raise ScoringInterrupted(stops.signum, args.output_dir, results["not_scored"])
    if accelerator.is_main_process and args.push_to_hub:  # after the barrier: no process waits on the upload
        _upload(args.output_dir, args.push_to_hub)
    return results


def _card_hyperparameters(state: RunState, args: TrainArguments, weights: dict) -> dict:
    """The run's options as it trained with them (those its checkpoints record, each resume's typed ones
    included), as the card states them; `average_last` as many checkpoints as were averaged."""
    options = state.recorded_options if state.recorded_options is not None else asdict(args)
    shown = {k: v for k, v in options.items() if v is not None and k not in ("output_dir", "resume")}
    return {**shown, "average_last": len(weights["averaged_checkpoints"])}


def _card_example(components: Components, max_length: int) -> str | None:
    """The sentence whose attention the model card shows: the first validation source that the model
    reads whole (at most `max_length` tokens; a held-out split may start with a very long one)."""
    for row in islice(components.task.data["validation"], 200):
        text = (row["translation"] or {}).get(components.task.source_lang)
        if text and text.strip() and len(components.task.tokenizer(text)["input_ids"]) <= max_length:
            return text
    return None


def _upload(output_dir: str, repo_id: str) -> None:
    """`push_to_hub`: the saved folder goes up; if it cannot, the folder stays and the warning says how to retry."""
    from ..hub import push_folder

    try:
        logger.info(f"uploaded to {push_folder(output_dir, repo_id)}")
    except Exception as err:  # the network, the token, the Hub: the model is saved either way
        logger.warning(
            f"uploading to {repo_id} failed: {type(err).__name__}: {err}. The model is saved in {output_dir}; "
            f"upload it with `vanilla-transformer push --folder {output_dir} --repo-id {repo_id}`"
        )


def _final_weights(components: Components, state: RunState, args: TrainArguments):
    """§6.1: the final model averages the last `average_last` checkpoints; with `best_metric`, the best
    checkpoint by validation instead (or, with `average_best`, the average of the best `average_last`);
    with `ema_decay`, the moving average replaces them when its validation perplexity is lower. Returns
    the unwrapped model and what its weights are: {"averaged_checkpoints": names, "best_checkpoint": the
    best validation, or None, "weight_average": the comparison, or None}."""
    chosen = _chosen_checkpoints(components, state, args)
    # Every process: under FSDP they gather the weights together.
    unwrapped = full_model(components.accelerator, components.model)
    if [p.name for p in chosen] != [checkpoint_path(components.checkpoint_root, state.step).name]:  # not the model as it is
        load_weights(unwrapped, average_checkpoints(chosen))
        logger.info(f"final weights: {'the average of ' * (len(chosen) > 1)}{', '.join(p.name for p in chosen)}")
    best = None
    if state.best:
        best = {**state.best[0], "checkpoint": checkpoint_path(components.checkpoint_root, state.best[0]["step"]).name}
    compared = _compare_weight_average(components, args, unwrapped) if components.average is not None else None
    if args.lora_rank is not None:  # the adapters merged into the weights: a plain model folder, no PEFT to load it
        if components.accelerator.is_main_process:  # ... and kept beside it, for PEFT
            logger.info(f"saved the LoRA adapter to {save_adapter(unwrapped, args.output_dir, args.model_name_or_path)}")
        unwrapped = unwrapped.merge_and_unload()
        logger.info("LoRA adapters merged into the weights")
    return unwrapped, {"averaged_checkpoints": [p.name for p in chosen], "best_checkpoint": best, "weight_average": compared,
                       "final_weights": _final_weights_named(state, chosen, compared)}


def _final_weights_named(state: RunState, chosen: list, compared: dict | None) -> dict:
    """The step the final weights are of (the newest averaged) and their name, for the lines and records of their
    scores: "checkpoint-00000450", "the average of ...", or the moving average."""
    if compared is not None and compared["used"]:
        return {"step": state.step, "name": f"the moving average of the weights at step {state.step}"}
    names = [p.name for p in chosen]
    return {"step": max(int(name.rpartition("-")[2]) for name in names),
            "name": names[0] if len(names) == 1 else f"the average of {', '.join(names)}"}


def _chosen_checkpoints(components: Components, state: RunState, args: TrainArguments) -> list:
    """The checkpoints the final weights are (the average of): the best by validation, or the last `average_last`."""
    if state.best and (args.average_best or args.average_last == 1):
        return sorted(checkpoint_path(components.checkpoint_root, step) for step in state.best_steps())
    if args.best_metric is not None and not state.best:
        logger.warning(f"`best_metric` is {args.best_metric}, but no validation ran (`eval_steps` {args.eval_steps}): "
                       "the final weights are the last checkpoints'")
    checkpoints = list_checkpoints(components.checkpoint_root)
    # a fine-tuning's baseline (step 0) trained nothing: it is final only as the best, or where nothing else was saved
    trained = [p for p in checkpoints if checkpoint_step(p.name) != 0] or checkpoints
    chosen = trained[-args.average_last :]
    if len(chosen) < args.average_last:
        logger.warning(f"`average_last` is {args.average_last}, but the run has {len(chosen)} checkpoint(s): the "
                       f"final weights average those {len(chosen)} (save more often with `save_steps`)")
    return chosen


def _compare_weight_average(components: Components, args: TrainArguments, model) -> dict:
    """Validation perplexity of the weights as they are and of the moving average; the better one stays in `model`."""
    def perplexity() -> float:  # in fp32, as the final scores
        return evaluate(components.accelerator, model, components.task.tokenizer, components.task.eval_splits["validation"], args, 0,
                        full_precision=True)["perplexity"]

    kept = {name: p.detach().clone() for name, p in model.state_dict().items()}
    scores = {"checkpoint": perplexity()}
    components.average.copy_to(model)
    scores["moving_average"] = perplexity()
    use_average = scores["moving_average"] < scores["checkpoint"]
    if not use_average:
        model.load_state_dict(kept)
    logger.info(f"final weights: {'the moving average' if use_average else 'the last checkpoint'} (validation "
                f"perplexity {scores['moving_average']:.2f} averaged, {scores['checkpoint']:.2f} not; "
                f"decay {components.average.decay})")
    return {"decay": components.average.decay, "used": use_average, "validation_perplexity": scores}


def _final_results(components: Components, state: RunState, args: TrainArguments, unwrapped, weights: dict,
                   elapsed: float, part_tokens: int, stops: StopScoring) -> dict:
    """Validation and test scores of the final weights, with the run's numbers, flat as results.json holds them."""
    epoch_batches = max(len(components.sampler.local_batches(state.epoch)), 1)
    results = {
        "steps": state.step,
        "epochs": state.epoch + state.batches_done / epoch_batches,
        "train_tokens": state.train_tokens,
        # The run's training time, every part of it (the first and each resume), and each part's share.
        "train_minutes": round(sum(part["seconds"] for part in state.parts) / 60, 2),
        "parts": state.parts,
        "tokens_per_second": round(part_tokens / elapsed, 1) if elapsed else None,  # this part's
        "mixed_precision": components.accelerator.mixed_precision,
        "scored_precision": "fp32",  # the final scores, as `vanilla-transformer evaluate` computes them
        "attn_implementation": state.attn_implementation,
        "compiled_step": components.compiled.record() if components.compiled is not None else None,  # this part's compiling
        **weights,
        "source_lang": components.task.source_lang,
        "target_lang": components.task.target_lang,
        "dataset": args.dataset,
        "columns": args.columns,
        "decoding": {"num_beams": args.num_beams, "length_penalty": args.length_penalty, "max_new_tokens": "input length + 50"},
    }
    splits, started = _final_splits(components, args), time.perf_counter()
    try:
        for name, samples in splits.items():
            stops.check()
            results[name] = _final_scores(components, state, args, unwrapped, weights, name, samples)
    except ScoringInterrupted:
        results["not_scored"] = [name for name in splits if name not in results]
        logger.warning(f"the final scoring was stopped: {', '.join(results['not_scored'])} not scored; the model is "
                       f"saved in {args.output_dir}, and `resume` scores it")
    stops.disarm()  # the results and the card are written whole
    final_seconds = time.perf_counter() - started
    # Validation and scoring, timed beside the training time that the time limit counts.
    results["scoring_minutes"] = round((sum(p.get("scoring_seconds", 0) for p in state.parts) + final_seconds) / 60, 2)
    results["final_scoring_seconds"] = round(final_seconds, 2)
    logger.info(f"final scores in {final_seconds / 60:.2f} min; the run trained {results['train_minutes']:.2f} min "
                f"and validated and scored {results['scoring_minutes']:.2f} min besides")
    results["history"] = state.history
    return {**_headline(results), **results, "replica_checksums": _replica_checksums(components.accelerator, unwrapped)}


def _final_splits(components: Components, args: TrainArguments) -> dict:
    """The splits the final weights are scored on, each with the pairs translated (None: all). The test split,
    unless `test_samples` is 0, on `test_samples`; the validation split on its own `eval_samples`, or, as the
    headline where there is no test split, on `test_samples`."""
    test = "test" in components.task.eval_splits and args.test_samples != 0
    splits = {"validation": args.eval_samples if test or args.test_samples == 0 else args.test_samples}
    return {**splits, "test": args.test_samples} if test else splits


def _final_scores(components: Components, state: RunState, args: TrainArguments, unwrapped, weights: dict,
                  name: str, samples: int | None) -> dict:
    """The scores of split `name` on the final weights; a validation of the same weights on as many pairs during
    training stands for them, never computed twice."""
    step, split = weights["final_weights"]["step"], components.task.eval_splits[name]
    count = len(split.dataset) if samples is None else min(samples, len(split.dataset))
    as_trained = (weights["averaged_checkpoints"] == [checkpoint_path(components.checkpoint_root, step).name]
                  and not (weights["weight_average"] or {}).get("used"))
    earlier = [record for record in state.history if record["step"] == step and record["split"] == name
               and "final_weights" not in record and record.get("translated", 0) == count]
    if name == "validation" and as_trained and earlier:
        logger.info(f"step {step} validation (final weights: {weights['final_weights']['name']}): as validated during "
                    "training, the same weights on the same pairs")
        return {k: v for k, v in earlier[-1].items() if k not in ("step", "split")}
    start = time.perf_counter()
    metrics = evaluate(components.accelerator, unwrapped, components.task.tokenizer, split, args,
                       translate_samples=samples, full_precision=True)
    metrics["seconds"] = round(time.perf_counter() - start, 2)
    report(components.accelerator, state.history, step, name, metrics, components.training_log, weights=weights["final_weights"]["name"])
    return metrics


def _headline(results: dict) -> dict:
    """The headline numbers, flat, as the model card reads them: the test split's, else the validation split's;
    None where the final scoring was stopped before them."""
    split = "test" if "test" in results else "validation"
    final, validation = results.get(split) or {}, results.get("validation") or {}
    return {
        "split": split,
        "bleu": final.get("bleu"),
        "chrf": final.get("chrf"),
        "sacrebleu_signature": final.get("bleu_signature"),
        "chrf_signature": final.get("chrf_signature"),
        "scored_pairs": final.get("translated"),  # the card's headline says how many of the split's pairs it covers
        "split_pairs": final.get("pairs"),
        "validation_loss": validation.get("loss"),
        "validation_perplexity": validation.get("perplexity"),
    }


def _replica_checksums(accelerator, model) -> list[float]:
    """One number per process that changes with any weight: DDP must leave every replica identical."""
    checksum = sum(p.detach().double().abs().sum() + p.detach().double().sum() * 1e-3 for p in model.parameters())
    checksums = accelerator.gather(checksum.reshape(1).to(accelerator.device)).tolist()
    if len(set(checksums)) > 1:
        raise RuntimeError(f"the processes ended with different weights (checksums {checksums}); DDP is broken")
    return checksums
