"""Mixture-of-experts models train with their router's load-balancing loss (transformers computes it only when
asked, ``output_router_logits=True``, which is off by default): with the model's own coefficient, or the
recipe's (``model.router_aux_loss_coef``; 0 turns it off). One process, tiny Mixtral- and Qwen3-MoE-shaped models;
transformers' own loss with ``output_router_logits=True`` is the truth."""

import lightning.pytorch as pl
import pytest
import torch
from architectures import tiny_config
from conftest import DEFAULT_RECIPE
from transformers import AutoConfig, AutoModelForCausalLM

from shardlight.build import build_hf_config, build_module
from shardlight.errors import ShardlightError
from shardlight.lm_loss import loss_sum, loss_terms, model_router_aux_coef, router_aux_coef
from shardlight.preflight import check_router_aux
from shardlight.recipe import load_recipe

FAMILIES = ["mixtral", "qwen3_moe"]
COEF = 0.05  # larger than the families' defaults (0.001), so the router term is far above rounding


def tiny_moe(family: str, coef: float = COEF):
    spec = dict(tiny_config(family), router_aux_loss_coef=coef)
    model_type = spec.pop("model_type")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **spec), dtype=torch.float32)


def batch(vocab: int = 512):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 24), generator=generator)
    mask = torch.ones_like(ids)
    mask[2, 18:] = 0  # a padded row: its padding is routed by no one's count
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :6] = -100  # a prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def router_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if "gate" in n and "proj" not in n}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_router_loss_is_transformers_own_and_reaches_the_router(family):
    model, data = tiny_moe(family), batch()
    coef = router_aux_coef(None, model.config)
    assert coef == COEF  # the model's own coefficient when the recipe sets none

    expected = model(**data, output_router_logits=True, use_cache=False)
    expected.loss.backward()
    truth = router_grads(model)
    assert truth, "the model's routers"
    model.zero_grad(set_to_none=True)

    total, count = loss_sum(model, data, router_aux_coef=coef)
    (total / count).backward()
    assert float((total / count).detach()) == pytest.approx(float(expected.loss.detach()), rel=1e-6)
    for name, grad in router_grads(model).items():
        torch.testing.assert_close(grad, truth[name], rtol=1e-5, atol=1e-8, msg=name)

    # Without the router term the routers get other gradients: the term is what balances them.
    model.zero_grad(set_to_none=True)
    plain, plain_count = loss_sum(model, data, router_aux_coef=0.0)
    (plain / plain_count).backward()
    assert float((plain / plain_count).detach()) < float((total / count).detach())
    assert any(not torch.allclose(grad, truth[name]) for name, grad in router_grads(model).items())


@pytest.mark.parametrize("family", FAMILIES)
def test_coefficient_zero_is_the_plain_token_loss(family):
    model, data = tiny_moe(family), batch()
    assert router_aux_coef(0.0, model.config) == 0.0
    with torch.no_grad():
        total, count = loss_sum(model, data, router_aux_coef=0.0)
        expected = model(**data, use_cache=False)  # transformers' default: no router loss
    assert float(total / count) == pytest.approx(float(expected.loss), rel=1e-6)


def test_expert_load_counts_each_real_token_top_k_times():
    model, data = tiny_moe("qwen3_moe"), batch()
    terms = loss_terms(model, data, router_aux=True)
    layers, experts = model.config.num_hidden_layers, model.config.num_experts
    assert terms.expert_load.shape == (layers, experts)
    real_tokens = int(data["attention_mask"].sum())
    assert terms.expert_load.sum(1).tolist() == [real_tokens * model.config.num_experts_per_tok] * layers


def test_dense_models_have_no_router_loss_and_a_coefficient_for_one_is_refused():
    from transformers import LlamaConfig

    assert model_router_aux_coef(LlamaConfig()) is None
    assert router_aux_coef(None, LlamaConfig()) == 0.0
    cfg = load_recipe(str(DEFAULT_RECIPE), ["model.router_aux_loss_coef=0.01"])
    with pytest.raises(ShardlightError, match=r"^model.router_aux_loss_coef 0.01: llama has no router "
                                              r"load-balancing loss .*; use null$"):
        check_router_aux(cfg, build_hf_config(cfg.model))
    check_router_aux(load_recipe(str(DEFAULT_RECIPE), ["model.router_aux_loss_coef=0"]), LlamaConfig())


class Logged(pl.Callback):
    def __init__(self) -> None:
        self.metrics = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


@pytest.mark.parametrize("coef", [None, 0.0])
def test_training_logs_the_router_loss_and_the_expert_load(tmp_path, coef):
    """The module on a tiny Qwen3-MoE: the recipe's coefficient (null: the model's own) is what it trains with,
    and each logging step carries the router loss and the fullest expert's load over the mean."""
    config = {**tiny_config("qwen3_moe"), "router_aux_loss_coef": COEF}
    overrides = ["trainer.max_steps=2", "trainer.log_every_n_steps=1", "data.seq_len=32", "trainer.micro_batch_size=2"]
    if coef is not None:
        overrides.append(f"model.router_aux_loss_coef={coef}")
    cfg = load_recipe(str(DEFAULT_RECIPE), overrides)
    cfg.model.config = config
    module = build_module(cfg, sharded_load=False)
    logged = Logged()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[logged], logger=False,
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=tmp_path)
    data = batch(512)
    rows = [{k: v[i % 3] for k, v in data.items()} for i in range(4)]
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=2))
    last = logged.metrics[-1]
    if coef == 0.0:
        assert module.router_aux_coef == 0.0 and "train/aux_loss" not in last
        return
    assert module.router_aux_coef == COEF
    assert last["train/aux_loss"] > 0
    assert last["train/expert_load_max_over_mean"] >= 1.0 >= last["train/expert_load_min_over_mean"] >= 0.0
