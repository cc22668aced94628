"""The LightningModule around a Hugging Face causal LM: loss on supervised tokens, metrics, grad clipping,
and the guard against non-finite steps (``trainer.on_nonfinite``).

One optimizer step's loss is the summed token cross-entropy over every supervised token of every micro-batch on
every data-parallel rank, divided by their global count, however the batch is split. Each micro-batch
back-propagates its sum (over a constant, ``_loss_unit``); after the window's last backward the accumulated
gradients are scaled by one all-reduced count (``_scale_to_token_mean``), as torchtune does. See
docs/strategy.md, "One step's loss".

It builds nothing itself: ``shardlight.build.training_model.build_module`` hands it the functions that make the model
(in ``configure_model``, so FSDP wraps it) and the optimizer.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from transformers import PreTrainedModel
from typing_extensions import override

from shardlight.lm_loss import LossTerms, loss_terms, router_aux_coef
from shardlight.recipe import RecipeConfig
from shardlight.strategy.sharded_load import checkpoint_keys, unloaded_keys


class NonFiniteStop(Exception):
    """Raised on every rank at the same optimizer step (``trainer.on_nonfinite: stop``), before that step's
    update, so the weights in memory and on disk stay those of the step before.

    Arguments:
        step: the optimizer step that was not taken (1-based, as checkpoints ``step-N`` count).
        what: ``"loss"`` or ``"gradient norm"``.
        where: the ranks that saw a non-finite loss, or ``"all ranks (global gradient norm)"``.
        value: the offending value (the first such rank's loss, or the global gradient norm).
    """

    def __init__(self, step: int, what: str, where: str, value: float) -> None:
        self.step, self.what, self.where, self.value = step, what, where, value
        super().__init__(describe_nonfinite(step, what, where, value))


def describe_nonfinite(step: int, what: str, where: str, value: float) -> str:
    return f"non-finite {what} ({value:g}) at step {step} on {where}"


def clean_param_name(name: str) -> str:
    """A parameter's name as in the unwrapped model (FSDP and checkpoint wrappers add prefixes)."""
    return _WRAPPER_PREFIX.sub("", name)


_WRAPPER_PREFIX = re.compile(r"(_fsdp_wrapped_module\.|_checkpoint_wrapped_module\.|_orig_mod\.)")
_WINDOW = 4  # the logging window's scalar sums (``CausalLMModule._add_to_window``)


class CausalLMModule(pl.LightningModule):
    """Fine-tunes ``AutoModelForCausalLM``; the model is built in ``configure_model`` so FSDP wraps it.

    Arguments:
        cfg: the recipe.
        make_model: ``(weights: bool) -> PreTrainedModel``; ``weights=False`` builds the skeleton for a sharded
            load (parameters on the meta device).
        make_optimization: parameter groups → what ``configure_optimizers`` returns.
        sharded_weights: a safetensors checkpoint to read into the shards: the model is built as a skeleton and
            the strategy, once it has sharded it, reads each rank's slices (``sharded_weights`` stays set for
            it). None: the model is built with its weights.
    """

    def __init__(self, cfg: RecipeConfig, make_model: Callable[[bool], PreTrainedModel],
                 make_optimization: Callable[[List[Dict[str, Any]]], Dict[str, Any]],
                 sharded_weights: Optional[Path] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self._make_model = make_model
        self._make_optimization = make_optimization
        self.sharded_weights = sharded_weights
        self.model: Optional[PreTrainedModel] = None
        self.first_val_loss: Optional[float] = None
        self.last_val_loss: Optional[float] = None
        self.tokens_seen = 0
        self._val_sums = torch.zeros(1, 2, dtype=torch.float64)
        # Since the last logging step, this rank's: token loss, supervised tokens, attention tokens, router
        # loss x tokens, then each MoE layer's tokens per expert (flattened).
        self._train_window = torch.zeros(_WINDOW, dtype=torch.float64)
        # This rank's supervised tokens since the last optimizer step (the step's share of the count).
        self._step_tokens = torch.zeros((), dtype=torch.float64)
        # Each micro-batch back-propagates its summed loss over this constant (the most tokens a micro-batch
        # holds), not its own count: gradients keep a token mean's magnitude (fp16 and bf16 reductions, the
        # GradScaler) without weighing the micro-batch by its length. _scale_to_token_mean undoes it exactly.
        self._loss_unit = float(cfg.trainer.micro_batch_size * cfg.data.seq_len)
        self.router_aux_coef = 0.0
        self._expert_layers = 0
        self._grad_norm: Optional[torch.Tensor] = None
        self._decay_names: set = set()
        # This rank's last non-finite micro-batch loss since the last optimizer step (0: none), on the device.
        self._nonfinite_loss = torch.zeros((), dtype=torch.float64)
        self.nonfinite_skips = 0

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self._build_model()
            # FSDP flattens parameters to 1-D shards, so decide what gets weight decay before wrapping.
            self._decay_names = {f"model.{n}" for n, p in self.model.named_parameters() if p.dim() >= 2}
            self.router_aux_coef = router_aux_coef(self.cfg.model.router_aux_loss_coef, self.model.config)

    def _build_model(self) -> PreTrainedModel:
        if self.sharded_weights is None:
            return self._make_model(True)
        skeleton = self._make_model(False)
        missing = unloaded_keys(skeleton, checkpoint_keys(self.sharded_weights) or set())
        if not missing:
            return skeleton
        # transformers renames or fuses some architectures' tensors while loading (e.g. MoE experts): only its
        # own from_pretrained can read such a checkpoint, and every rank holds the whole model while it does.
        rank_zero_warn(f"model.name_or_path: the checkpoint's tensors are not the model's (no {missing[0]}, and "
                       f"{len(missing) - 1} more): every rank loads the whole model with from_pretrained")
        self.sharded_weights = None
        return self._make_model(True)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _loss_sum(self, batch: Dict[str, torch.Tensor]):
        """The batch's summed token loss and count, without the router loss (validation's loss)."""
        terms = loss_terms(self.model, batch, self.cfg.trainer.loss_chunks)
        return terms.total, terms.count

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        terms = loss_terms(self.model, batch, self.cfg.trainer.loss_chunks, router_aux=self.router_aux_coef > 0)
        self._step_tokens += terms.count
        self._add_to_window(terms, batch)
        return self._poison_if_nonfinite(terms.objective(self.router_aux_coef) / self._loss_unit)

    def _add_to_window(self, terms: LossTerms, batch: Dict[str, torch.Tensor]) -> None:
        """Summed locally; reduced across ranks once per logging step, not once per micro-batch."""
        count = terms.count.double()
        aux = terms.aux.detach().double() * count if terms.aux is not None else count.new_zeros(())
        parts = [terms.total.detach().double(), count, batch["attention_mask"].sum().double(), aux]
        if terms.expert_load is not None:
            self._expert_layers = terms.expert_load.shape[0]
            parts.append(terms.expert_load.double().flatten())
        sums = torch.cat([part.reshape(-1) for part in parts])
        if sums.numel() > self._train_window.numel():  # the first MoE batch: room for its layers' experts
            self._train_window = torch.cat([self._train_window, sums.new_zeros(sums.numel() - _WINDOW)])
        self._train_window[: sums.numel()] += sums

    def _scale_to_token_mean(self) -> None:
        """Make the accumulated gradients those of the step's token mean: sum over every supervised token of the
        step's micro-batches on every data-parallel rank, divided by their global count.

        Each micro-batch back-propagated ``sum / _loss_unit``; Lightning divided it by
        ``accumulate_grad_batches`` and FSDP averaged it over the data-parallel ranks. One scalar all-reduce
        of the step's token count (tensor-parallel ranks of one data-parallel group saw the same tokens: counted
        once) undoes both. It works on gradients already accumulated, so it needs no look-ahead at the window's
        batches (Lightning hands them over one at a time), and a last, partial window is scaled by its own count.
        """
        trainer = self.trainer
        tp = self.cfg.parallelism.tp_size
        tokens = float(trainer.strategy.reduce(self._step_tokens.clone(), reduce_op="sum")) / tp
        self._step_tokens.zero_()
        dp = trainer.world_size // tp
        scale = dp * trainer.accumulate_grad_batches * self._loss_unit / max(tokens, 1.0)
        by_kind: Dict[Any, List[torch.Tensor]] = {}
        for param in self.parameters():
            if param.grad is not None:
                by_kind.setdefault((param.grad.device, param.grad.dtype, type(param.grad)), []).append(param.grad)
        for grads in by_kind.values():
            torch._foreach_mul_(grads, scale)

    def _poison_if_nonfinite(self, loss: torch.Tensor) -> torch.Tensor:
        """Remember a non-finite loss and make every gradient NaN with it, on the device (no host sync).

        An inf loss can have finite gradients (a -inf logit on the target); multiplied by NaN it cannot, so a
        non-finite loss on any rank always reaches the global gradient norm that every rank checks. A finite
        loss is multiplied by exactly 1.0: its value and gradients are unchanged."""
        finite = torch.isfinite(loss.detach())
        self._nonfinite_loss = torch.where(finite, self._nonfinite_loss, loss.detach().double())
        return loss * torch.where(finite, 1.0, math.nan).to(loss.dtype)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        step = trainer.global_step
        if step % trainer.log_every_n_steps and step < trainer.max_steps:
            return
        totals = trainer.strategy.reduce(self._train_window.clone(), reduce_op="sum")
        self._train_window = torch.zeros_like(self._train_window)
        if totals[1] > 0:
            # The tensor-parallel ranks of one data-parallel group all see the same batch: count it once.
            self.tokens_seen += int(totals[2].item()) // self.cfg.parallelism.tp_size
            # Token-weighted over every rank and micro-batch of the window, as each step's loss is (ranks that
            # share their tokens count them as often in the sum as in the count).
            self.log("train/loss", float(totals[0] / totals[1]), prog_bar=True, rank_zero_only=True)
            self.log("train/tokens_seen", float(self.tokens_seen), rank_zero_only=True)
            if self.router_aux_coef > 0:
                # The step's objective is train/loss + router_aux_coef x train/aux_loss.
                self.log("train/aux_loss", float(totals[3] / totals[1]), rank_zero_only=True)
                self._log_expert_load(totals[_WINDOW:])
        # Only on logging steps: Lightning's per-call logging cost is visible on small, fast steps.
        self.log("lr", trainer.optimizers[0].param_groups[0]["lr"], rank_zero_only=True)
        if self._grad_norm is not None:
            self.log("train/grad_norm", self._grad_norm.float(), rank_zero_only=True)
        if self.cfg.trainer.on_nonfinite == "skip":
            self.log("train/nonfinite_skips", float(self.nonfinite_skips), rank_zero_only=True)

    def _log_expert_load(self, load: torch.Tensor) -> None:
        """The most-loaded expert's tokens over the mean expert's, in the worst layer (1.0: perfectly even), and
        the least-loaded's in that layer: how unevenly the routers spread the window's tokens."""
        if not load.numel() or not self._expert_layers:
            return
        per_layer = load.reshape(self._expert_layers, -1)
        mean = per_layer.mean(dim=1).clamp(min=1e-12)
        ratios = per_layer.max(dim=1).values / mean
        worst = int(ratios.argmax())
        self.log("train/expert_load_max_over_mean", float(ratios[worst]), rank_zero_only=True)
        self.log("train/expert_load_min_over_mean", float(per_layer[worst].min() / mean[worst]), rank_zero_only=True)

    def on_train_start(self) -> None:
        self._train_window = torch.zeros(_WINDOW, dtype=torch.float64, device=self.device)
        self._step_tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self._nonfinite_loss = torch.zeros((), dtype=torch.float64, device=self.device)

    def on_validation_epoch_start(self) -> None:
        loaders = self.trainer.val_dataloaders
        sources = len(loaders) if isinstance(loaders, (list, tuple)) else 1  # a mixture: one per dataset
        self._val_sums = torch.zeros(sources, 2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        loss_sum, count = self._loss_sum(batch)
        self._val_sums[dataloader_idx] += torch.stack([loss_sum.detach().double(), count.double()])

    def on_validation_epoch_end(self) -> None:
        # Token-weighted over the whole validation set on all ranks, not a mean of per-batch means; a
        # mixture's sources each too, and overall.
        totals = self.trainer.strategy.reduce(self._val_sums.float(), reduce_op="sum")
        overall = totals.sum(0)
        val_loss = float(overall[0] / overall[1].clamp(min=1))
        self.last_val_loss = val_loss
        metrics = {"val/loss": val_loss, "val/perplexity": math.exp(min(val_loss, 50.0))}
        if len(totals) > 1:
            names = self.trainer.datamodule.val_names
            metrics.update({f"val/loss/{name}": float(t[0] / t[1].clamp(min=1)) for name, t in zip(names, totals)})
        if self.trainer.sanity_checking:
            # Lightning mutes self.log during the sanity pass; this is the pre-training loss we want.
            self.first_val_loss = val_loss
            if self.trainer.is_global_zero:
                for logger in self.trainer.loggers:
                    logger.log_metrics(metrics, step=0)
            return
        for key, value in metrics.items():
            self.log(key, value, prog_bar=key == "val/loss", rank_zero_only=True)

    def on_after_backward(self) -> None:
        # The window's last backward (Lightning's own test for it, the one that decides the optimizer step): the
        # gradients are complete and reduced; scaled here, before any callback's on_before_optimizer_step reads
        # them, and before the GradScaler's unscale (a linear factor: the order does not matter to it).
        if not self.trainer.fit_loop.epoch_loop._should_accumulate():  # noqa: SLF001
            self._scale_to_token_mean()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Clipping off: the same global norm with max_norm=inf (gradients scaled by exactly 1.0), because
        # the non-finite check needs a signal every rank shares.
        max_norm = self.cfg.trainer.gradient_clip_val
        max_norm = math.inf if max_norm is None else max_norm
        clip = getattr(self.trainer.strategy, "clip_gradients", None)
        if clip is not None:
            norm = clip(max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        self._grad_norm = norm.detach() if torch.is_tensor(norm) else torch.tensor(float(norm))
        self._guard_nonfinite(optimizer, self._grad_norm)
        self._nonfinite_loss.zero_()

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        # Free the gradients as soon as the step has used them. Lightning's own zero_grad runs inside the next
        # step's closure, between its forward and its backward, so every forward held the last step's gradients
        # (a gradient shard per parameter) beside its activations. The planner assumes they are gone by then.
        # Lightning's later zero_grad then finds nothing to free.
        optimizer.zero_grad(set_to_none=True)

    def _guard_nonfinite(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> None:
        """Stop or skip this step when the global gradient norm is non-finite.

        The norm is global (reduced across shards), so every rank takes the same decision at the same step
        without another collective; a non-finite loss anywhere shows up in it (``_poison_if_nonfinite``).
        The cost is one scalar read on the host per optimizer step, as torch's GradScaler does."""
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            return  # 16-mixed: the GradScaler skips steps with non-finite gradients itself, routinely
        if bool(torch.isfinite(norm)):
            return
        # Only on a bad step, and then on every rank: which ranks saw the non-finite loss (one slot per rank).
        slots = torch.zeros(self.trainer.world_size, dtype=torch.float64, device=self._nonfinite_loss.device)
        slots[self.global_rank] = self._nonfinite_loss
        losses = self.trainer.strategy.reduce(slots, reduce_op="sum").tolist()
        bad_ranks = [rank for rank, value in enumerate(losses) if not math.isfinite(value)]
        step = self.trainer.global_step + 1
        if bad_ranks:
            where = ("rank " if len(bad_ranks) == 1 else "ranks ") + ", ".join(map(str, bad_ranks))
            what, value = "loss", losses[bad_ranks[0]]
        else:
            what, where, value = "gradient norm", "all ranks (global gradient norm)", float(norm)
        # No gradients: the optimizer updates nothing and leaves its state (moments, step counts) as it was.
        optimizer.zero_grad(set_to_none=True)
        if self.cfg.trainer.on_nonfinite == "stop":
            raise NonFiniteStop(step, what, where, value)
        self.nonfinite_skips += 1
        if self.trainer.is_global_zero:
            print(f"shardlight: {describe_nonfinite(step, what, where, value)}; optimizer step skipped "
                  f"({self.nonfinite_skips} so far)", file=sys.stderr, flush=True)

    def configure_optimizers(self) -> Dict[str, Any]:
        optim = self.cfg.optim
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if param.requires_grad:
                (decay if clean_param_name(name) in self._decay_names else no_decay).append(param)
        groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return self._make_optimization(groups)
