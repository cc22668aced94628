"""2 gloo ranks run preflight's model checks (``check_model``) on every architecture of tests/architectures.py
(half each), then train each one accepted: 4 optimizer steps on FSDP1, then 4 on FSDP2, with
the strategy's own sharding (``apply_fsdp1``, ``apply_fsdp2`` over ``fsdp2_mesh``, the blocks of
``_no_split_modules`` as units), shardlight's loss and AdamW, on packed random blocks. One process pair for
every architecture: the grouped runs cost one start-up.

Usage: python architecture_matrix.py OUT.json PORT. OUT (rank 0): {"refused": {family: line}, "trained":
{family: {"fsdp1": [losses], "fsdp2": [losses], "seconds"} or {"error": line, "where": traceback}}}.
"""

import copy
import datetime
import functools
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: architectures

STEPS = 4
# The default recipe on 2 ranks, the model's own attention and blocks, packed 32-token blocks.
RECIPE = ["data.seq_len=32", "trainer.micro_batch_size=2", "model.attn_implementation=null",
          "fsdp.transformer_cls_names_to_wrap=null"]


@functools.lru_cache(maxsize=None)
def _default_recipe():
    from shardlight.recipe import load_recipe

    return load_recipe(None, RECIPE)


def recipe(family: str):
    """The default recipe (read once: loading takes longer than a tiny model's step) with ``family``'s model."""
    from architectures import tiny_config

    cfg = copy.deepcopy(_default_recipe())
    cfg.model.config = tiny_config(family)
    return cfg


def preflight_models(families):
    """{family: None (accepted) or the refusal's line}."""
    from shardlight.build import build_hf_config
    from shardlight.errors import ShardlightError
    from shardlight.preflight import check_model
    from shardlight.strategy import resolve_recipe_fsdp

    verdicts = {}
    for family in families:
        cfg = recipe(family)
        try:
            check_model(cfg, build_hf_config(cfg.model), resolve_recipe_fsdp(cfg))
            verdicts[family] = None
        except ShardlightError as exc:
            verdicts[family] = str(exc)
    return verdicts


def train(cfg, version: int, rank: int):
    from shardlight.build import build_hf_model
    from shardlight.lm_loss import loss_sum
    from shardlight.strategy import apply_fsdp1, apply_fsdp2, resolve_recipe_fsdp
    from shardlight.strategy.fsdp2 import fsdp2_mesh

    cfg.fsdp.fsdp_version = version
    resolved = resolve_recipe_fsdp(cfg)
    torch.manual_seed(0)
    model = build_hf_model(cfg.model)
    model.train()
    if version == 1:
        model, _ = apply_fsdp1(model, resolved, torch.device("cpu"))
    else:
        model, _ = apply_fsdp2(model, resolved, fsdp2_mesh(resolved, "cpu", dist.get_world_size()))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # one op per step, not per tensor
    vocab = int(model.config.get_text_config().vocab_size) if hasattr(model, "config") else 512
    seq, half = cfg.data.seq_len, cfg.data.seq_len // 2
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(3, min(vocab, 512), (cfg.trainer.micro_batch_size, seq), generator=generator)
        positions = torch.cat([torch.arange(half), torch.arange(seq - half)]).expand_as(ids)
        total, count = loss_sum(model, {"input_ids": ids, "labels": ids, "position_ids": positions,
                                        "attention_mask": torch.ones_like(ids)})
        loss = total / count
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def main(rank: int, world: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    warnings.filterwarnings("ignore")
    import transformers
    from architectures import families

    from shardlight.collectives import all_gather_objects

    transformers.logging.set_verbosity_error()
    # A rank stuck in a collective its peer never entered fails the case after this long instead of hanging.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    # Preflight is one process's work: the two ranks split it, then both know every verdict.
    verdicts = {}
    for part in all_gather_objects(preflight_models(families()[rank::world])):
        verdicts.update(part)
    results = {}
    for family in sorted(f for f, refusal in verdicts.items() if refusal is None):
        start = time.perf_counter()
        try:
            results[family] = {f"fsdp{v}": train(recipe(family), v, rank) for v in (1, 2)}
            results[family]["seconds"] = time.perf_counter() - start
        except Exception as exc:
            results[family] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}",
                               "where": traceback.format_exc()[-2000:]}
    if rank == 0:
        refused = {family: refusal for family, refusal in verdicts.items() if refusal is not None}
        Path(out).write_text(json.dumps({"refused": refused, "trained": results}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see full_params_worker.py: no interpreter teardown beside gloo's threads


if __name__ == "__main__":
    mp.spawn(main, args=(2, *sys.argv[1:3]), nprocs=2)
