"""shardlight's training loss, the one definition training, validation, preflight and the planner's fake step
all call: summed token cross-entropy over the supervised positions, whole or in pieces of the sequence
(``trainer.loss_chunks``), and for a mixture-of-experts model its router's load-balancing loss. Without
Lightning, so the planner and preflight load without it.

A sum, not a mean: one optimizer step's loss is the sum over every supervised token of every micro-batch on every
data-parallel rank divided by their global count, which no single micro-batch knows (``causal_lm`` scales the
accumulated gradients by it). See docs/strategy.md, "One step's loss"."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


class LossTerms(NamedTuple):
    """One batch's loss before any mean.

    Arguments:
        total: summed token cross-entropy over the supervised positions (fp32).
        count: the number of supervised positions.
        aux: the router's load-balancing loss of this batch, as the model defines it (a mean over its tokens
            and layers); None when not asked for or the model has none.
        expert_load: tokens routed to each expert, ``[layers, experts]`` (each token counted once per expert of
            its top-k, padding left out); None with ``aux``.
    """

    total: torch.Tensor
    count: torch.Tensor
    aux: Optional[torch.Tensor] = None
    expert_load: Optional[torch.Tensor] = None

    def objective(self, aux_coef: float) -> torch.Tensor:
        """What training sums: the token losses, plus the router loss weighted by this batch's supervised tokens
        (so that divided by the step's token count it is ``aux_coef`` x the token-weighted mean of the batches'
        router losses, and a single batch gets transformers' own ``loss + coef * aux_loss``)."""
        if self.aux is None or aux_coef == 0:
            return self.total
        return self.total + aux_coef * self.count * self.aux.float()


# The config keys under which transformers' mixture-of-experts models keep the weight of their router's
# load-balancing loss (JetMoE names it its own way); the model computes that loss only when asked
# (``output_router_logits=True``), which it is not by default.
ROUTER_AUX_KEYS = ("router_aux_loss_coef", "aux_loss_coef")


def model_router_aux_coef(config: Any) -> Optional[float]:
    """The weight ``config``'s model gives its router's load-balancing loss; None: it has no such loss (a dense
    model, or a mixture of experts balanced otherwise)."""
    if not hasattr(config, "output_router_logits"):
        return None
    for key in ROUTER_AUX_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def router_aux_coef(chosen: Optional[float], config: Any) -> float:
    """The weight of the router's load-balancing loss in training: ``chosen`` (``model.router_aux_loss_coef``)
    if set, else the model's own; 0 for a model without one (preflight refuses ``chosen`` > 0 for it)."""
    own = model_router_aux_coef(config)
    if own is None:
        return 0.0
    return own if chosen is None else float(chosen)


def loss_terms(model: torch.nn.Module, batch: Dict[str, torch.Tensor], chunks: int = 1,
               router_aux: bool = False) -> LossTerms:
    """The training loss's terms: summed token cross-entropy over the supervised positions (shifted logits
    upcast to fp32) and their count, and with ``router_aux`` the router's load-balancing loss and each
    expert's load. The one definition: training, validation and the fake steps all call it.

    No batch builds a KV cache (``use_cache=False``): a cache would keep every block's keys and values alive
    for the whole step, past activation checkpointing, and grow between a checkpointed block's forward and its
    recompute. A packed block (``position_ids`` restarting at each example) is given no attention mask: that is
    how transformers recognises packing and keeps attention inside each example. Other batches keep their
    attention mask (the planner's fake step gives none, and answers transformers' packing check as a real
    unpacked step does: ``fake_tensors.unpacked_sequences``).

    ``chunks`` > 1 (``trainer.loss_chunks``): the output projection and the loss run on that many pieces of the
    sequence, each recomputed in backward (:func:`chunked_output_loss`), so the ``[batch, seq, vocab]`` fp32
    logits, the largest activation of a step at a 128k vocabulary, never exist; the same sum."""
    if batch.get("position_ids") is not None:
        inputs = {"position_ids": batch["position_ids"], "use_cache": False}
    else:
        inputs = {"attention_mask": batch["attention_mask"], "use_cache": False}
    if router_aux:
        inputs["output_router_logits"] = True
    labels = batch["labels"][:, 1:]
    count = (labels != IGNORE_INDEX).sum()
    if chunks > 1:
        with chunked_output_loss(model, labels, chunks) as result:
            output = model(input_ids=batch["input_ids"], **inputs)
        # The model's output (a stand-in, [batch, seq, 1]) joins the graph with weight 0: FSDP's hooks on the
        # root's output (unshard for backward) fire as they do for real logits.
        total = result["total"] + 0.0 * output.logits.sum()
    else:
        output = model(input_ids=batch["input_ids"], **inputs)
        logits = output.logits[:, :-1].float()
        total = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    if not router_aux or not torch.is_tensor(getattr(output, "aux_loss", None)):
        return LossTerms(total, count)
    return LossTerms(total, count, output.aux_loss, _expert_load(model, output, batch.get("attention_mask")))


def loss_sum(model: torch.nn.Module, batch: Dict[str, torch.Tensor], chunks: int = 1,
             router_aux_coef: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """The training loss before its division by the step's token count (:meth:`LossTerms.objective`; the router
    loss only with ``router_aux_coef`` > 0), and the batch's supervised token count."""
    terms = loss_terms(model, batch, chunks, router_aux=router_aux_coef > 0)
    return terms.objective(router_aux_coef), terms.count


def _expert_load(model: torch.nn.Module, output: Any, attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Tokens each expert of each MoE layer received (``[layers, experts]``, float), from the router logits
    the model returned with its aux loss; None where they are not one ``[tokens, experts]`` tensor a layer."""
    layers = getattr(output, "router_logits", None)
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "top_k", None)
    if not isinstance(layers, tuple) or not layers or not isinstance(top_k, int):
        return None
    experts = layers[0].shape[-1]
    if any(layer.dim() != 2 or layer.shape[-1] != experts for layer in layers) or top_k > experts:
        return None
    loads = []
    with torch.no_grad():
        for layer in layers:
            chosen = layer.topk(top_k, dim=-1).indices  # softmax keeps the order: top-k of the logits
            weight = torch.ones_like(chosen, dtype=torch.float32)
            if attention_mask is not None and attention_mask.numel() == layer.shape[0]:
                weight = weight * attention_mask.reshape(-1, 1).to(weight)
            loads.append(torch.zeros(experts, device=layer.device).scatter_add_(0, chosen.reshape(-1),
                                                                                weight.reshape(-1)))
    return torch.stack(loads)


# Model configs that transform the logits after the output projection (inside the model's forward, where a
# chunked loss does not see them): the chunked loss refuses these models rather than compute another loss.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def logit_transform(config: Any) -> Optional[str]:
    """The config key by which ``config``'s model changes its logits after ``lm_head`` (None: it does not)."""
    for key in LOGIT_TRANSFORMS:
        value = getattr(config, key, None)
        if value not in (None, 1, 1.0):
            return key
    return None


def _chunk_loss(forward: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
    logits = forward(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


@contextmanager
def chunked_output_loss(model: torch.nn.Module, labels: torch.Tensor, chunks: int) -> Iterator[Dict[str, Any]]:
    """While the model runs its forward: its output projection computes the loss against ``labels`` (already
    shifted) in ``chunks`` pieces of the sequence, each under activation checkpointing (its fp32 logits are
    recomputed in backward, not kept), puts the sum in the yielded dict's ``total`` and returns a
    ``[batch, seq, 1]`` stand-in for the logits. The projection is the model's own module, called inside the
    model's forward, so an FSDP unit that holds it has its parameters gathered then, as it would."""
    head = model.get_output_embeddings()
    forward = head.forward
    result: Dict[str, Any] = {}

    def projected_loss(hidden: torch.Tensor) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        size = -(-(length - 1) // chunks)
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(hidden[:, :-1].split(size, dim=1), labels.split(size, dim=1)):
            total = total + checkpoint(_chunk_loss, forward, h, y, use_reentrant=False)
        result["total"] = total
        return hidden.new_zeros(batch, length, 1) + 0.0 * total  # the stand-in for the logits, in the graph

    own = head.__dict__.get("forward")  # an instance's own forward (a wrapper's patch), else the class's
    head.forward = projected_loss
    try:
        yield result
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    if "total" not in result:
        raise RuntimeError("trainer.loss_chunks: the model's forward never called its output projection")
