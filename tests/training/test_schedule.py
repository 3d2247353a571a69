import math

import pytest
import torch

from vanilla_transformer.training.schedule import make_optimizer, make_scheduler, noam_rate


def test_noam_rate_is_the_papers_formula():
    d, warmup = 512, 4000
    for step in (1, 100, 3999, 4000, 4001, 100_000):
        assert noam_rate(step, d, warmup) == pytest.approx(d**-0.5 * min(step**-0.5, step * warmup**-1.5))
    peak = noam_rate(warmup, d, warmup)
    assert peak == pytest.approx(d**-0.5 * warmup**-0.5)  # 7e-4 for the base model
    assert noam_rate(warmup - 1, d, warmup) < peak and noam_rate(warmup + 1, d, warmup) < peak
    assert noam_rate(10, d, warmup, scale=2.0) == pytest.approx(2 * noam_rate(10, d, warmup))


def test_scheduler_sets_the_rate_of_each_optimizer_step_and_adam_has_the_papers_betas():
    model = torch.nn.Linear(4, 4)
    optimizer = make_optimizer(model)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9 and group["weight_decay"] == 0
    scheduler = make_scheduler(optimizer, d_model=64, warmup_steps=10, scale=0.5)
    seen = []
    for _ in range(30):
        seen.append(optimizer.param_groups[0]["lr"])  # the rate the next optimizer.step() uses
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([noam_rate(step, 64, 10, 0.5) for step in range(1, 31)])
    assert max(seen) == seen[9]


@pytest.mark.parametrize("kwargs", [dict(warmup_steps=0), dict(scale=0.0)])
def test_bad_schedule_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match="warmup_steps|scale"):
        make_scheduler(make_optimizer(torch.nn.Linear(2, 2)), 64, **kwargs)
