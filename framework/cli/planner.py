"""``shardlight plan`` and ``shardlight profile``: argument parsing and the two handlers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from shardlight.cli.common import add_recipe_items, parse_number, parse_on_off, split_recipe_and_overrides, write_json
from shardlight.errors import ShardlightError


def build_plan_from_args(args: argparse.Namespace):
    """(plan dict, recipe cfg or None) from the plan/profile arguments."""
    from shardlight.planner.estimate import Workload, make_cluster
    from shardlight.planner.plan import make_plan, spec_from_hf_config, spec_from_recipe, workload_from_recipe

    items = list(getattr(args, "items", []) or [])
    cfg = None
    hf_config = getattr(args, "hf_config", None)
    if hf_config:
        if items:
            raise ShardlightError("give either a recipe or --hf-config, not both")
        spec = spec_from_hf_config(hf_config)
        work = Workload()
    else:
        from shardlight.recipe import load_recipe

        recipe, overrides = split_recipe_and_overrides(items)
        cfg = load_recipe(recipe, overrides)
        spec = spec_from_recipe(cfg)
        work = workload_from_recipe(cfg)
    for attr, name in (("micro_batch_size", "--micro-batch-size"), ("seq_len", "--seq-len"),
                       ("accumulate_grad_batches", "--accumulate")):
        value = parse_number(name, getattr(args, attr, None))
        if value is not None:
            setattr(work, attr, value)
    for attr in ("precision", "param_dtype", "optimizer"):
        if getattr(args, attr, None):
            setattr(work, attr, getattr(args, attr))
    nodes = parse_number("--nodes", args.nodes) or (cfg.trainer.num_nodes if cfg is not None else 1)
    gpus = parse_number("--gpus-per-node", args.gpus_per_node) or (cfg.trainer.devices if cfg is not None else 8)
    cluster = make_cluster(
        nodes=nodes, gpus_per_node=gpus, gpu_memory=args.gpu_memory, interconnect=args.interconnect,
        intra_node_bw=parse_number("--intra-node-bw", args.intra_node_bw, float),
        inter_node_bw=parse_number("--inter-node-bw", args.inter_node_bw, float),
        peak_tflops=parse_number("--peak-tflops", args.peak_tflops, float),
        mfu=parse_number("--mfu", args.mfu, float), overhead_gb=parse_number("--overhead-gb", args.overhead_gb, float, False),
        host_memory=args.host_memory,
    )
    plan = make_plan(spec, cluster, work)
    ckpt = parse_on_off("--activation-checkpointing", getattr(args, "activation_checkpointing", None))
    offload = parse_on_off("--cpu-offload", getattr(args, "cpu_offload", None))
    if ckpt is not None or offload is not None:
        from shardlight.planner.recommend import recommend

        rows = [r for r in plan["strategies"] if (ckpt is None or r["activation_checkpointing"] == ckpt)
                and (offload is None or r["cpu_offload"] == offload)]
        if not rows:
            raise ShardlightError("no configuration matches --activation-checkpointing/--cpu-offload")
        plan["recommendation"] = recommend(rows, cluster, plan["model"], context=plan["strategies"])
        plan["strategies"] = rows
    return plan, cfg


def run_plan(args: argparse.Namespace) -> int:
    from shardlight.planner.plan import render

    plan, _ = build_plan_from_args(args)
    sys.stdout.write(render(plan) + "\n")
    if args.json:
        write_json(args.json, plan)
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from shardlight.planner.profile import profile

    return profile(args)


def _cluster_args(parser: argparse.ArgumentParser, for_profile: bool = False) -> None:
    g = parser.add_argument_group("cluster" + (" (for the plan shown next to the measurement)" if for_profile else ""))
    g.add_argument("--nodes", help="nodes (default: the recipe's trainer.num_nodes, else 1)")
    g.add_argument("--gpus-per-node", help="GPUs per node (default: the recipe's trainer.devices, else 8)")
    g.add_argument("--gpu-memory", default="80GB", help="memory per GPU, e.g. 80GB, 141GB, 24GiB (default 80GB)")
    g.add_argument("--interconnect", action="append", metavar="NAME",
                   help="nvlink|nvswitch|pcie (inside a node), infiniband|ethernet (between nodes); "
                        "repeat or comma-separate (default nvswitch,infiniband)")
    g.add_argument("--intra-node-bw", metavar="GB/S", help="effective intra-node bandwidth per GPU")
    g.add_argument("--inter-node-bw", metavar="GB/S", help="effective inter-node bandwidth per node")
    g.add_argument("--peak-tflops", default="989", help="peak dense TFLOP/s per GPU (default 989, H100 bf16)")
    g.add_argument("--mfu", default="0.4", help="assumed model FLOPs utilization (default 0.4)")
    g.add_argument("--host-memory", default="1TB", help="host RAM per node, for CPU offload (default 1TB)")
    g.add_argument("--overhead-gb", default="1.0", help="per-GPU runtime overhead: CUDA context, NCCL (default 1)")
    w = parser.add_argument_group("workload (default: the recipe's)")
    w.add_argument("--micro-batch-size", help="sequences per GPU per forward pass")
    w.add_argument("--seq-len", help="tokens per sequence")
    w.add_argument("--accumulate", dest="accumulate_grad_batches", help="micro-batches per optimizer step")
    w.add_argument("--precision", help="32-true, bf16-mixed, bf16-true, 16-mixed")
    w.add_argument("--param-dtype", help="weight storage dtype: float32, bfloat16 (recipe: model.dtype)")
    w.add_argument("--optimizer", help="adamw (default), adam, sgd, adamw8bit")
    w.add_argument("--activation-checkpointing", metavar="on|off|auto", help="restrict to on or off (default: both)")
    w.add_argument("--cpu-offload", metavar="on|off|auto", help="restrict to on or off (default: both)")


def add_parsers(subparsers: Any) -> None:
    plan = subparsers.add_parser(
        "plan", help="estimate per-rank memory and step time per sharding strategy and recommend one",
        description="Sharding-aware estimate (parameters, gradients, optimizer state, activations, all-gather "
                    "buffers, communication vs compute) for NO_SHARD (DDP), SHARD_GRAD_OP, FULL_SHARD and "
                    "HYBRID_SHARD, x activation checkpointing x CPU offload, and a recommendation with reasons. "
                    "The model is built on the meta device: no weights, no download.")
    add_recipe_items(plan)
    plan.add_argument("--hf-config", metavar="CONFIG_JSON", help="a Hugging Face config.json instead of a recipe")
    plan.add_argument("--json", metavar="OUT", help="write the recommendation and every estimate as JSON")
    _cluster_args(plan)
    plan.set_defaults(func=run_plan)

    prof = subparsers.add_parser(
        "profile", help="run a recipe for a few steps under each strategy and report measured vs planned",
        description="Runs the recipe on 1 device (the baseline) and under each applicable strategy on the "
                    "available devices, each a separate `shardlight train`, with the comm/memory/throughput "
                    "callbacks; writes profile_report.md with PNG plots, profile.json, a W&B table and "
                    "the throughput baseline file.")
    add_recipe_items(prof)
    prof.add_argument("--out", metavar="DIR", default="profile", help="report directory (default ./profile)")
    prof.add_argument("--steps", default="8", help="optimizer steps per run (default 8)")
    prof.add_argument("--strategies", default="NO_SHARD,SHARD_GRAD_OP,FULL_SHARD",
                      help="comma-separated strategies to run (HYBRID_SHARD needs num_nodes > 1)")
    prof.add_argument("--no-baseline", action="store_true", help="skip the 1-device baseline run")
    prof.add_argument("--timeout", default="900", help="seconds per run before it is stopped (default 900)")
    _cluster_args(prof, for_profile=True)
    prof.set_defaults(func=run_profile, hf_config=None)
