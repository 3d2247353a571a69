"""The exponential moving average of the weights (`WeightAverage`): it follows the weights, and checkpoints keep it."""

import pytest
import torch

from vanilla_transformer.training.averaging import WeightAverage


def test_the_moving_average_follows_the_weights_and_round_trips_through_its_state():
    model = torch.nn.Linear(3, 3)
    average = WeightAverage(model, decay=0.9)
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    average.update_parameters(model)  # first update: decay min(0.9, 2/11), so mostly the new weights
    expected = [s + 1.0 - 2 / 11 for s in start]
    copy = torch.nn.Linear(3, 3)
    average.copy_to(copy)
    for p, e in zip(copy.parameters(), expected):
        torch.testing.assert_close(p, e)
    restored = WeightAverage(torch.nn.Linear(3, 3), decay=0.9)
    restored.load_state_dict(average.state_dict())
    assert restored.updates == 1 and all(torch.equal(a, b) for a, b in zip(restored.average, average.average))
    with pytest.raises(ValueError, match="does not fit"):
        WeightAverage(torch.nn.Linear(3, 3, bias=False), 0.9).load_state_dict(average.state_dict())
    narrow = average.state_dict()
    narrow["average"] = {**narrow["average"], "bias": torch.zeros(1)}  # would broadcast into the bias of 3
    with pytest.raises(ValueError, match="does not fit"):
        WeightAverage(torch.nn.Linear(3, 3), 0.9).load_state_dict(narrow)
    with pytest.raises(ValueError, match="`decay` must be in"):
        WeightAverage(model, decay=1.0)
