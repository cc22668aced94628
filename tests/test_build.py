"""Builders: the optimizer a recipe names is the one training gets (the planner's names), and what this machine
cannot run is refused before any rank starts."""

import pytest
import torch

from shardlight.build.optimizer import build_optimization, check_optimizer
from shardlight.errors import ShardlightError
from shardlight.recipe import load_recipe


@pytest.mark.parametrize("name, cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam),
                                       ("sgd", torch.optim.SGD)])
def test_optim_name_builds_that_optimizer_with_the_recipe_settings(name, cls):
    cfg = load_recipe(None, [f"optim.name={name}", "optim.lr=0.5", "optim.weight_decay=0.1", "optim.betas=[0.8,0.9]",
                             "optim.warmup_steps=0", "optim.schedule=constant"])
    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    built = build_optimization([{"params": [weight], "weight_decay": 0.1}, {"params": [bias], "weight_decay": 0.0},
                                {"params": [], "weight_decay": 0.0}], cfg.optim, cfg.trainer.max_steps)
    optimizer = built["optimizer"]
    assert type(optimizer) is cls and len(optimizer.param_groups) == 2  # the empty group is dropped
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.param_groups[0]["lr"] == 0.5
    if name == "sgd":
        assert optimizer.param_groups[0]["momentum"] == 0.8
    else:
        assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)


def test_unknown_or_unrunnable_optimizer_is_one_clear_line():
    with pytest.raises(ShardlightError, match=r"optim.name: 'lion' is not allowed; allowed values: adamw, adam, sgd"):
        load_recipe(None, ["optim.name=lion"])
    cfg = load_recipe(None, ["optim.name=adamw8bit"])
    with pytest.raises(ShardlightError, match="adamw8bit"):
        check_optimizer(cfg.optim, uses_gpu=False)


def test_preflight_refuses_adamw8bit_on_cpu_before_spawn(cli, monkeypatch):
    from conftest import forbid_training

    from shardlight.cli.main import main

    forbid_training(monkeypatch)
    assert main(["train", "optim.name=adamw8bit"]) == 2
