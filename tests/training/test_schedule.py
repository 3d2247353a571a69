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


@pytest.mark.parametrize("kwargs", [dict(warmup_steps=0), dict(scale=0.0)])
def test_bad_schedule_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match="warmup_steps|scale"):
        make_scheduler(make_optimizer(torch.nn.Linear(2, 2)), 64, **kwargs)
