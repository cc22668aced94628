"""``shardlight plan`` and ``shardlight profile``: their arguments, parsed into the planner's typed inputs
(``shardlight.planner.plan.ClusterOptions``/``WorkloadOptions``, ``shardlight.planner.sweep.ProfileRequest``),
and the two handlers. The planning and the sweep themselves are ``shardlight.planner``'s."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Optional, Tuple

from shardlight.cli.common import add_recipe_items, parse_number, parse_on_off, split_recipe_and_overrides, write_json
from shardlight.errors import ShardlightError

if TYPE_CHECKING:  # the planner imports torch and transformers: each handler imports it when it runs
    from shardlight.planner.measured import StepModel
    from shardlight.planner.model_spec import ModelSpec
    from shardlight.planner.plan import ClusterOptions, WorkloadOptions
    from shardlight.recipe import RecipeConfig


def model_from_args(args: argparse.Namespace) -> Tuple[ModelSpec, StepModel, Optional[RecipeConfig]]:
    """(model spec, what the fake step builds, recipe or None) from ``[RECIPE] [key=value ...]`` or
    ``--hf-config``. A recipe's config comes from ``build_hf_config``: its inline ``model.config``, else the
    hub cache / a local path of ``model.name_or_path``."""
    from shardlight.build import build_hf_config
    from shardlight.planner.plan import model_from_hf_config, spec_from_recipe, step_model_from_recipe
    from shardlight.recipe import load_recipe

    items = list(getattr(args, "items", []) or [])
    hf_config = getattr(args, "hf_config", None)
    if hf_config:
        if items:
            raise ShardlightError("give either a recipe or --hf-config, not both")
        spec, step_model = model_from_hf_config(hf_config)
        return spec, step_model, None
    recipe, overrides = split_recipe_and_overrides(items)
    cfg = load_recipe(recipe, overrides)
    config = build_hf_config(cfg.model)
    return spec_from_recipe(cfg, config), step_model_from_recipe(cfg, config), cfg


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    from shardlight.planner.plan import WorkloadOptions

    return WorkloadOptions(
        micro_batch_size=parse_number("--micro-batch-size", args.micro_batch_size),
        seq_len=parse_number("--seq-len", args.seq_len),
        accumulate_grad_batches=parse_number("--accumulate", args.accumulate_grad_batches),
        precision=args.precision or None, param_dtype=args.param_dtype or None, optimizer=args.optimizer or None,
        peft=args.peft or None, lora_r=parse_number("--lora-r", args.lora_r),
    )


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    from shardlight.planner.plan import ClusterOptions

    return ClusterOptions(
        nodes=parse_number("--nodes", args.nodes), gpus_per_node=parse_number("--gpus-per-node", args.gpus_per_node),
        gpu_memory=args.gpu_memory, interconnect=tuple(args.interconnect or ()),
        intra_node_bw=parse_number("--intra-node-bw", args.intra_node_bw, float),
        inter_node_bw=parse_number("--inter-node-bw", args.inter_node_bw, float),
        peak_tflops=parse_number("--peak-tflops", args.peak_tflops, float),
        mfu=parse_number("--mfu", args.mfu, float),
        overhead_gb=parse_number("--overhead-gb", args.overhead_gb, float, False),
        host_memory=args.host_memory,
    )


def restrictions(args: argparse.Namespace) -> Tuple[Optional[bool], Optional[bool]]:
    """(activation checkpointing, CPU offload): True/False restricts the plan to on/off, None keeps both."""
    return (parse_on_off("--activation-checkpointing", args.activation_checkpointing),
            parse_on_off("--cpu-offload", args.cpu_offload))


def run_plan(args: argparse.Namespace) -> int:
    from shardlight.planner.calibration import check_matches, load_calibration
    from shardlight.planner.plan import cluster_for, plan_for, render, workload_for

    spec, step_model, cfg = model_from_args(args)
    work, cluster = workload_options(args), cluster_options(args)
    ckpt, offload = restrictions(args)
    planned_cluster = cluster_for(cluster, cfg)
    calibration = None
    if args.calibration:
        calibration = load_calibration(args.calibration)
        check_matches(calibration, planned_cluster.world_size, cfg.trainer.accelerator if cfg else None,
                      source=f"--calibration {args.calibration}")
    plan = plan_for(spec, planned_cluster, workload_for(work, cfg), ckpt, offload,
                    model=None if args.analytic else step_model, calibration=calibration)
    sys.stdout.write(render(plan) + "\n")
    if args.json:
        write_json(args.json, plan)
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from shardlight.planner.sweep import ProfileRequest, profile

    steps = parse_number("--steps", args.steps)
    timeout = parse_number("--timeout", args.timeout, float)
    recipe, overrides = split_recipe_and_overrides(list(args.items or []))
    ckpt, offload = restrictions(args)
    request = ProfileRequest(
        recipe=recipe, overrides=tuple(overrides), out_dir=args.out, steps=steps,
        strategies=tuple(str(args.strategies).split(",")), baseline=not args.no_baseline, timeout=timeout,
        cluster=cluster_options(args), workload=workload_options(args), restrict_ckpt=ckpt, restrict_offload=offload,
    )
    return profile(request)


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
    w.add_argument("--peft", metavar="none|lora",
                   help="lora: adapters on a frozen base (no gradients or optimizer state for it); default: "
                        "the recipe's peft.method, else none")
    w.add_argument("--lora-r", metavar="R", help="LoRA rank (default: the recipe's peft.r, else 16)")
    w.add_argument("--activation-checkpointing", metavar="on|off|auto", help="restrict to on or off (default: both)")
    w.add_argument("--cpu-offload", metavar="on|off|auto", help="restrict to on or off (default: both)")


def add_parsers(subparsers: Any) -> None:
    plan = subparsers.add_parser(
        "plan", help="estimate per-rank memory and step time per sharding strategy and recommend one",
        description="Sharding-aware estimate (parameters, gradients, optimizer state, activations, all-gather "
                    "buffers, communication vs compute) for NO_SHARD (DDP), SHARD_GRAD_OP, FULL_SHARD and "
                    "HYBRID_SHARD, x activation checkpointing x CPU offload, tensor-parallel degrees (tp) that "
                    "divide the heads and fit in a node, and a recommendation with reasons. "
                    "Each peak is measured by one training step of the real model on fake tensors (no weights, "
                    "no GPU, no download) over a fake process group of the planned world size; --analytic skips it.")
    add_recipe_items(plan)
    plan.add_argument("--hf-config", metavar="CONFIG_JSON", help="a Hugging Face config.json instead of a recipe")
    plan.add_argument("--json", metavar="OUT", help="write the recommendation and every estimate as JSON")
    plan.add_argument("--calibration", metavar="PROFILE_JSON",
                      help="step times from what `shardlight profile` measured (its profile.json or "
                           "calibration.json) instead of the bandwidth table and --peak-tflops x --mfu; "
                           "only for the world size it was measured on")
    plan.add_argument("--analytic", action="store_true",
                      help="memory from the closed-form model only, without the fake-tensor training steps")
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
    prof.set_defaults(func=run_profile)
