"""Setting a run up: the batch plan, which `set_up` returns beside the options as the user typed them."""

import pytest
from accelerate import Accelerator

from vanilla_transformer.training.arguments import CPU_MAX_TOKENS, TrainArguments
from vanilla_transformer.training.batch_plan import BatchPlan, size_batches


@pytest.mark.parametrize(("typed", "planned"), [
    ({}, (CPU_MAX_TOKENS, 1)),
    ({"max_tokens": 512}, (512, 1)),
    ({"gradient_accumulation_steps": 3}, (CPU_MAX_TOKENS, 3)),
], ids=["nothing typed", "max_tokens", "gradient_accumulation_steps"])
def test_the_batch_plan_is_returned_and_the_options_stay_as_typed(tmp_path, typed, planned):
    args = TrainArguments(output_dir=str(tmp_path), **typed)
    assert size_batches(args, Accelerator(cpu=True), model=None) == BatchPlan(*planned)
    assert (args.max_tokens, args.gradient_accumulation_steps) == (typed.get("max_tokens"),
                                                                   typed.get("gradient_accumulation_steps"))
