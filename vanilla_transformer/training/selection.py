"""Model selection by validation: the best checkpoints kept, and early stopping (fairseq's checkpoint_best, --patience).

Not in the paper, which averages the last checkpoints (§6.1). With `best_metric`, each validation's score
is compared with the best so far: `RunState.best` lists the best evaluations, best first (one, or
`average_last` with `average_best`), whose checkpoints pruning never deletes, and
`evaluations_without_improvement` counts towards `patience`. Both live in the checkpoints, so a resumed
run keeps knowing its best and its count. BLEU and chrF compare only on as many validation sentences
(`eval_samples`): a resume that changes their number starts a new comparison.
"""

from __future__ import annotations

from accelerate.logging import get_logger

from .arguments import BEST_METRICS
from .run_state import RunState

logger = get_logger(__name__)

__all__ = ["best_steps", "out_of_patience", "record_validation"]


def record_validation(state: RunState, metrics: dict, best_metric: str | None, eval_samples: int | None,
                      kept: int) -> bool:
    """Compare the validation `metrics` of `state.step` (on `eval_samples` sentences) with the best so far by
    `best_metric`, keeping the `kept` best; whether they are a new best."""
    if best_metric is None:
        return False
    value, better = metrics[best_metric], BEST_METRICS[best_metric]
    _start_anew_on_other_samples(state, best_metric, eval_samples)
    improved = not state.best or (value != state.best[0]["value"] and better(value, state.best[0]["value"]) == value)
    # Sorted best first; an earlier step wins a tie (it was there first).
    candidates = state.best + [{"step": state.step, "metric": best_metric, "value": value,
                                "eval_samples": eval_samples}]
    state.record_selection(sorted(candidates, key=lambda r: r["value"], reverse=better is max)[:kept],
                           0 if improved else state.evaluations_without_improvement + 1)
    return improved


def _start_anew_on_other_samples(state: RunState, best_metric: str, eval_samples: int | None) -> None:
    """BLEU or chrF on another number of validation sentences is another measure: the best so far are forgotten
    (the loss is on the whole split, whatever `eval_samples` is). Records from before the count was kept compare."""
    if best_metric == "loss" or not state.best:
        return
    before = state.best[0].get("eval_samples", eval_samples)
    if before != eval_samples:
        logger.info(f"`eval_samples` is {eval_samples}, the best validation {best_metric} so far (step "
                    f"{state.best[0]['step']}) was on {before}: model selection starts a new comparison at step {state.step}")
        state.record_selection([], 0)


def best_steps(state: RunState) -> list[int]:
    """The steps whose checkpoints model selection keeps."""
    return [record["step"] for record in state.best]


def out_of_patience(state: RunState, patience: int | None) -> bool:
    return patience is not None and state.evaluations_without_improvement >= patience
