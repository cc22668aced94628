"""shardlight's training loss, the one definition training, validation, preflight and the planner's fake step
all call: summed token cross-entropy over the supervised positions, whole or in pieces of the sequence
(``trainer.loss_chunks``). Without Lightning, so the planner and preflight load without it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def loss_sum(model: torch.nn.Module, batch: Dict[str, torch.Tensor],
             chunks: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """The training loss, before its mean: summed token cross-entropy over the supervised positions (shifted
    logits upcast to fp32), and their count. The one definition: training, validation and the planner's fake
    step all call it.

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
    labels = batch["labels"][:, 1:]
    count = (labels != IGNORE_INDEX).sum()
    if chunks > 1:
        with chunked_output_loss(model, labels, chunks) as result:
            output = model(input_ids=batch["input_ids"], **inputs)
        # The model's output (a stand-in, [batch, seq, 1]) joins the graph with weight 0: FSDP's hooks on the
        # root's output (unshard for backward) fire as they do for real logits.
        return result["total"] + 0.0 * output.logits.sum(), count
    logits = model(input_ids=batch["input_ids"], **inputs).logits
    logits = logits[:, :-1].float()
    total = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total, count


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
