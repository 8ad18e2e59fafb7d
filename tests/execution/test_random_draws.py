"""The fidelity check's random layers: switched off in every model a workload builds within the
context, and the workload as it was after."""

from __future__ import annotations

import torch
from torch import nn

from search.execution.random_draws import random_layers_off, switch_off_random_layers


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_dropout = 0.1  # passed to the kernel as dropout_p
        self.scale = 0.5  # no "drop" in its name: left alone
        self.drop_nothing = 0.0  # already off: not counted


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.drop2d = nn.Dropout2d(0.0)
        self.attn = Attention()


def test_every_random_layer_is_switched_off_and_counted():
    net = Net()
    assert switch_off_random_layers(net) == 2
    assert net.drop.p == 0.0 and net.attn.attention_dropout == 0.0 and net.attn.scale == 0.5
    x = torch.ones(1000)
    assert torch.equal(net.train().drop(x), x)


def test_the_models_built_within_have_them_off_and_the_workload_is_untouched():
    from search.execution.knobs import build_model

    class Builds:
        def build_model(self):
            return Net()

    workload, cpu = Builds(), torch.device("cpu")
    with random_layers_off() as counts:
        first, second = build_model(workload, cpu, 0), build_model(workload, cpu, 0)
    assert counts == [2, 2] and first.drop.p == 0.0 and second.attn.attention_dropout == 0.0
    assert build_model(workload, cpu, 0).drop.p == 0.2  # outside: as built
