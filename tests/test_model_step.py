"""The training step's order under Lightning's loop, in-process on one CPU rank with the default recipe's model:
gradients are freed right after each optimizer step, so the next forward does not hold them beside its
activations (the order the planner assumes), and gradient accumulation still sums every micro-batch of a window
into the update."""

import copy

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from shardlight.build.training_model import build_module
from shardlight.lm_loss import loss_sum
from shardlight.recipe import load_recipe

ACCUMULATE, STEPS, SEQ = 2, 3, 16


class StepOrder(pl.Callback):
    """What the gradients are at each micro-batch's start, and the first update's gradients."""

    def __init__(self) -> None:
        self.grads_at_start = []  # per micro-batch: how many parameters hold a gradient
        self.first_update = None  # {name: gradient} just before the first optimizer step
        self.initial = None

    def on_train_start(self, trainer, pl_module):
        self.initial = copy.deepcopy(pl_module.model)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.grads_at_start.append(sum(p.grad is not None for p in pl_module.parameters()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.first_update is None:
            self.first_update = {n: p.grad.clone() for n, p in pl_module.model.named_parameters()}


def batches(vocab: int):
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(2 * ACCUMULATE * STEPS):  # micro-batches of 2 rows
        ids = torch.randint(3, vocab, (SEQ,), generator=generator)
        labels = ids.clone()
        labels[: SEQ // 4] = -100  # a prompt: not supervised
        rows.append({"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels})
    return rows


def test_gradients_are_freed_after_each_step_and_accumulate_within_a_window(tmp_path):
    torch.manual_seed(0)
    cfg = load_recipe(None, [f"trainer.accumulate_grad_batches={ACCUMULATE}", f"trainer.max_steps={STEPS}",
                             "optim.warmup_steps=0", "trainer.gradient_clip_val=null"])
    module = build_module(cfg)
    order = StepOrder()
    rows = batches(cfg.model.config["vocab_size"])
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE,
                         callbacks=[order], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(rows, batch_size=2))

    # A window's first micro-batch starts with no gradients (the last step freed them); its second one
    # starts with the first one's.
    params = sum(1 for _ in module.parameters())
    assert order.grads_at_start == [0, params] * STEPS
    assert all(p.grad is None for p in module.parameters())

    # The first update's gradients are those of both micro-batches of its window: their summed token loss over
    # the window's token count (what every callback's on_before_optimizer_step sees).
    loader = iter(DataLoader(rows, batch_size=2))
    initial = order.initial
    sums = [loss_sum(initial, next(loader)) for _ in range(ACCUMULATE)]
    (sum(total for total, _ in sums) / sum(count for _, count in sums)).backward()
    expected = {n: p.grad for n, p in initial.named_parameters()}
    assert expected.keys() == order.first_update.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(order.first_update[name], grad, rtol=1e-4, atol=1e-6, msg=name)
