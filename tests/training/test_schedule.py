import pytest
import torch

from vanilla_transformer.training.arguments import TrainArguments
from vanilla_transformer.training.schedule import (SCHEDULES, BudgetSchedule, make_optimizer, make_scheduler, noam_rate,
                                                   schedule_summary)


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


def test_the_fused_update_is_adams_update():
    torch.manual_seed(0)
    fused_model, plain_model = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    plain_model.load_state_dict(fused_model.state_dict())
    fused = make_optimizer(fused_model)
    plain = torch.optim.Adam(plain_model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    assert fused.param_groups[0]["fused"]
    assert not make_optimizer(fused_model, device="mps").param_groups[0]["fused"]  # no fused kernel there
    for optimizer in (fused, plain):
        for group in optimizer.param_groups:
            group["lr"] = 1e-2
    for _ in range(5):
        x = torch.randn(4, 8)
        for model, optimizer in ((fused_model, fused), (plain_model, plain)):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kwargs", [dict(warmup_steps=0), dict(scale=0.0), dict(scale=float("nan")), dict(schedule="step")])
def test_bad_schedule_arguments_are_refused(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=f"^`{name}` must be"):
        make_scheduler(make_optimizer(torch.nn.Linear(2, 2)), 64, **kwargs)


def _rates(scheduler, optimizer, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])  # the rate the next optimizer.step() uses
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_a_budget_schedule_warms_up_like_noam_then_falls_monotonely_to_zero_at_the_last_step(shape):
    budget, warmup = 40, 10
    optimizer = make_optimizer(torch.nn.Linear(2, 2))
    scheduler = make_scheduler(optimizer, 64, warmup, 0.5, shape, remaining_steps=lambda step: budget - step)
    assert isinstance(scheduler, BudgetSchedule)
    seen = _rates(scheduler, optimizer, budget)
    assert seen[:warmup] == pytest.approx([noam_rate(step, 64, warmup, 0.5) for step in range(1, warmup + 1)])
    after = seen[warmup - 1 :]
    assert all(a > b for a, b in zip(after, after[1:]))  # strictly falling after the peak
    assert seen[-1] == 0.0 and seen[-2] > 0  # the budget's last step has rate 0, none before it
    if shape == "linear":  # the closed form: peak * (budget - step) / (budget - warmup)
        peak = noam_rate(warmup, 64, warmup, 0.5)
        expected = [peak * (budget - step) / (budget - warmup) for step in range(warmup, budget + 1)]
        assert after == pytest.approx(expected, abs=1e-12)
    else:  # half way through the decay, half the peak
        assert seen[warmup - 1 + (budget - warmup) // 2] == pytest.approx(seen[warmup - 1] / 2)


def test_a_budget_schedule_resumed_from_its_state_gives_the_same_rates():
    budget = 50

    def fresh():
        optimizer = make_optimizer(torch.nn.Linear(2, 2))
        return optimizer, make_scheduler(optimizer, 64, 10, 1.0, "cosine", remaining_steps=lambda step: budget - step)

    optimizer, scheduler = fresh()
    whole = _rates(scheduler, optimizer, budget)
    optimizer, scheduler = fresh()
    before = _rates(scheduler, optimizer, 23)
    saved = scheduler.state_dict()
    optimizer, scheduler = fresh()
    scheduler.load_state_dict(saved)
    assert before + _rates(scheduler, optimizer, budget - 23) == whole  # exactly, not approximately


def test_a_time_budget_with_a_wandering_estimate_still_falls_monotonely_and_ends_near_zero():
    # A time budget of 100 s, steps taking 0.8-1.2 s: the estimate of the steps left changes each step.
    import random

    rng = random.Random(0)
    optimizer = make_optimizer(torch.nn.Linear(2, 2))
    clock = {"elapsed": 0.0}

    def remaining(step):  # as the loop estimates it: time left over the mean time of a step
        return (100 - clock["elapsed"]) / (clock["elapsed"] / step)

    scheduler = make_scheduler(optimizer, 64, 10, 1.0, "linear", remaining_steps=remaining)
    seen = []
    while clock["elapsed"] < 100:
        seen.append(optimizer.param_groups[0]["lr"])
        clock["elapsed"] += rng.uniform(0.8, 1.2)
        optimizer.step()
        scheduler.step()
    peak = max(seen)
    after = seen[seen.index(peak):]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert seen[-1] < 0.03 * peak  # the last step of the budget is close to zero
    assert seen[len(seen) // 2] > 0.3 * peak  # and the decay did not end early


@pytest.mark.parametrize("kwargs, expected", [
    (dict(schedule="step"), "`schedule` must be one of 'noam', 'linear', 'cosine'"),
    (dict(schedule="linear"), "give `remaining_steps`"),
])
def test_bad_schedules_are_refused(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        make_scheduler(make_optimizer(torch.nn.Linear(2, 2)), 64, 10, **kwargs)


def test_each_schedule_describes_itself_where_the_options_and_the_log_name_it():
    """A schedule is one function and one SCHEDULES entry: its docstring's first line is what `--help` says of
    it, so that a new schedule needs no edit anywhere else."""
    help_text = TrainArguments.__dataclass_fields__["lr_schedule"].metadata["help"]
    for name in SCHEDULES:
        summary = schedule_summary(name)
        assert summary and summary[0].islower() and f"{name}: {summary}" in help_text
    assert schedule_summary("linear") == "the paper's warm-up to its peak, then a linear decay to zero where the budget ends"
