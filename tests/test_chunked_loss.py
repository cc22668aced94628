"""``trainer.loss_chunks``: the output projection and the loss on pieces of the sequence, each recomputed in
backward. The same loss and gradients as the whole loss, the full fp32 logits never held, the same training on
FSDP1 and FSDP2; models it would get wrong refused before any rank starts."""

import warnings

import pytest
import torch
from conftest import DEFAULT_RECIPE
from strategy_runs import STEPS, assert_weights_close, final_weights, reference_weights

from shardlight.lm_loss import IGNORE_INDEX, loss_sum

VOCAB = 32_000


def _model_and_batch():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    ids = torch.randint(0, VOCAB, (2, 128))
    labels = ids.clone()
    labels[:, :10] = IGNORE_INDEX  # a prompt: unsupervised positions
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def _loss_and_grads(model, batch, chunks):
    model.zero_grad(set_to_none=True)
    total, count = loss_sum(model, batch, chunks)
    (total / count).backward()
    return total.detach(), count, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("chunks", [2, 7])
def test_chunked_loss_and_gradients_equal_the_whole_loss(chunks):
    """fp32: the summed loss to 1e-6 of itself and every gradient within 1e-6 (7 pieces: 127 positions, the last
    piece shorter)."""
    model, batch = _model_and_batch()
    whole, count, grads = _loss_and_grads(model, batch, 1)
    chunked, chunked_count, chunked_grads = _loss_and_grads(model, batch, chunks)
    assert chunked_count == count == 2 * (127 - 9)
    assert abs(float(chunked - whole)) <= 1e-6 * abs(float(whole))
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=0, atol=1e-6, msg=name)
    assert "forward" not in model.lm_head.__dict__  # the projection's own forward again


def test_chunked_loss_holds_less_than_half_the_activation_memory():
    """torch's memory tracker (the planner's): activations and temporaries at the step's peak, whole loss vs 8
    pieces, on a 32k-vocabulary model whose logits are most of the step's activations."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, batch = _model_and_batch()
    peaks = {}
    for chunks in (1, 8):
        model.zero_grad(set_to_none=True)
        tracker = MemTracker()
        tracker.track_external(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ModTracker on checkpointed pieces: "hierarchy maybe messed up"
            with tracker:
                total, count = loss_sum(model, batch, chunks)
                (total / count).backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        peaks[chunks] = sum(v for k, v in peak.items() if str(k) in ("_MemRefType.ACT", "_MemRefType.TEMP"))
    logits = 2 * 127 * VOCAB * 4
    assert peaks[1] > 2 * logits  # the whole loss holds the fp32 logits and their softmax
    assert peaks[8] <= peaks[1] / 2, peaks


def test_models_the_chunked_loss_would_get_wrong_are_refused():
    from transformers import Gemma2Config, LlamaConfig

    from shardlight.errors import ShardlightError
    from shardlight.preflight import check_loss_chunks
    from shardlight.recipe import load_recipe

    cfg = load_recipe(str(DEFAULT_RECIPE), ["trainer.loss_chunks=4"])
    check_loss_chunks(cfg, LlamaConfig())
    with pytest.raises(ShardlightError, match=r"^trainer.loss_chunks 4: gemma2 changes its logits after the output "
                                              r"projection \(final_logit_softcapping\)"):
        check_loss_chunks(cfg, Gemma2Config())
    tp = load_recipe(str(DEFAULT_RECIPE), ["trainer.loss_chunks=4", "fsdp.fsdp_version=2", "parallelism.tp_size=2"])
    with pytest.raises(ShardlightError, match="tp_size > 1 is not supported yet"):
        check_loss_chunks(tp, LlamaConfig())
    with pytest.raises(ShardlightError, match="more pieces than the 127 positions"):
        check_loss_chunks(load_recipe(str(DEFAULT_RECIPE), ["trainer.loss_chunks=128"]), LlamaConfig())


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_chunked_loss_trains_as_the_whole_loss_on_fsdp(strategy_setup, strategy_two_ranks, version):
    """2 gloo ranks, FULL_SHARD: the output projection sits in the root unit, whose parameters FSDP gathers for
    the model's forward and again for the pieces' recomputation in backward; the weights after training equal
    the single-process reference computed with the whole loss (the run is one of tests/strategy_runs.py's)."""
    _, recipe = strategy_setup
    summary = strategy_two_ranks[f"fsdp{version} loss_chunks 3"]["summary"]
    assert summary["steps"] == STEPS
    assert_weights_close(final_weights(summary), reference_weights(recipe, 2))


def test_the_planner_counts_the_chunked_loss_as_the_fake_step_measures_it():
    """A 32k-vocabulary model whose logits dominate: 8 pieces cut the fake step's activations at its peak by more
    than half, and the analytic estimate follows within 10% of the fake step, whole and in pieces."""
    from transformers import LlamaConfig

    from shardlight.planner.fake_step import step_memory
    from shardlight.planner.inputs import Workload
    from shardlight.planner.memory_estimate import activation_bytes
    from shardlight.planner.model_spec import model_spec

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    fake, analytic = {}, {}
    for chunks in (1, 8):
        step = step_memory(config, 1, "FULL_SHARD", False, "bf16-mixed", 4, 512, loss_chunks=chunks)
        fake[chunks] = step["peak_by_category"]["activations"]
        work = Workload(micro_batch_size=4, seq_len=512, precision="bf16-mixed", loss_chunks=chunks)
        analytic[chunks] = activation_bytes(model_spec(config), work, False).total
        assert abs(analytic[chunks] - fake[chunks]) <= 0.1 * fake[chunks], (chunks, analytic, fake)
    assert fake[8] <= fake[1] / 2, fake
