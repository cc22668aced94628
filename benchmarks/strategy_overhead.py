"""shardlight vs a hand-written raw torch FSDP loop (``benchmarks/_raw_fsdp_loop.py``): the training step and
the start-up, 2 gloo ranks, on the harness (``benchmarks/_harness.py``: ABBA pairs, ci90, A/A noise).

Arms, each one fresh process tree per run:

* baseline: the raw loop: same model (a 4-block Llama, hidden 256), micro-batch 4 x 128 tokens, FSDP1
  FULL_SHARD per decoder block, BACKWARD_PRE, AdamW + warm-up/cosine, clipping at 1.0;
* candidate: ``shardlight train`` (the real CLI, through ``_timed_train.py``) with the same model and
  settings and the default recipe's everything else: its data pipeline, Lightning's loop, logging, the
  memory and throughput callbacks and the progress bar. Left out: the comm callback (its own benchmark,
  ``comm_callback_overhead``), W&B (no network; the CSV logger stays), validation and checkpoints (not in
  a step).

Metrics per run: ``step_s``, the median over steps after warm-up of the slower rank, batch in hand to
optimizer step done; ``loop_step_s``, wall per optimizer step over the loop after warm-up (end of the
warm-up step to end of the last, over the slower rank: what a user waits for, Lightning's loop and every
hook included); ``cpu_step_s``, the same span in CPU seconds of the busier rank's process (all its threads:
the load of a shared machine moves it far less than wall time); ``startup_s``, launch (the benchmark's
``Popen``) to the first optimizer step done.

Two JSON lines: ``strategy_overhead`` (``step_s``, target <= 1.02; ``loop_step_s``, ``cpu_step_s`` under metrics) and
``startup`` (``startup_s``, target <= 1.5, with where the time goes: each arm's median seconds from launch
to rank 0's marks (imports done, preflight done, process group up, wrapped, first step), and ``python -X
importtime``'s seconds per top-level package for shardlight's training path).

Both arms run on CPU even where a GPU is visible: their process trees get ``CUDA_VISIBLE_DEVICES=""`` and
the same torch threads per rank (half the usable cores, ``_harness.cpu_env``), the shardlight arm also
``trainer.accelerator=cpu``. ``--budget-s`` bounds the whole (see ``_harness.compare``): about the budget plus
one pair, start-up included; every run prints a progress line to stderr as it ends.

    python benchmarks/strategy_overhead.py [--pairs N] [--budget-s S] [--steps N] [--run-timeout-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import compare, cpu_env, emit, holds, run_tree  # noqa: E402

WARMUP = 5
MICRO_BATCH, SEQ_LEN = 4, 128
MODEL = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
MARKS = ("imports", "preflight", "fit", "wrapped", "first_step")


def shardlight_args(steps: int, out: Path, threads: int = 0) -> list:
    """``threads``: torch threads per rank (0: shardlight's default, the cores / ranks)."""
    return [f"output_dir={out}", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
            "trainer.accelerator=cpu", "trainer.devices=2", *([f"trainer.num_threads={threads}"] if threads else []),
            f"trainer.val_every_n_steps={steps}", f"trainer.micro_batch_size={MICRO_BATCH}",
            f"data.seq_len={SEQ_LEN}", "logging.wandb.enabled=false", "callbacks.comm.enabled=false",
            "checkpoint.enabled=false", "fsdp.backward_prefetch=BACKWARD_PRE", "fsdp.use_orig_params=true"] + [
        f"model.config.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MODEL.items()
        if k != "model_type"]


def _env(times: Path) -> dict:
    """A run's environment: CPU only, the threads per rank fixed (``cpu_env``), no rank variables inherited."""
    env = cpu_env(dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", WANDB_SILENT="true",
                       HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", SHARDLIGHT_BENCH_TIMES=str(times)))
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "SHARDLIGHT_RUN_DIR", "SHARDLIGHT_BENCH_RESULTS"):
        env.pop(key, None)
    return env


def run_once(arm: str, steps: int, tmp: Path, counter: list, timeout_s: float = 600.0) -> dict:
    """One run of an arm in a fresh process tree (killed, and the benchmark ended, past ``timeout_s``); its
    metrics."""
    counter[0] += 1
    out = tmp / f"{arm}-{counter[0]}"
    times = out / "times"
    env = _env(times)
    if arm == "raw":
        command = [sys.executable, str(REPO / "benchmarks" / "_raw_fsdp_loop.py"), str(times), str(steps),
                   json.dumps(MODEL), str(MICRO_BATCH), str(SEQ_LEN), str(29500 + counter[0] % 400)]
    else:
        command = [sys.executable, str(REPO / "benchmarks" / "_timed_train.py"), "train",
                   *shardlight_args(steps, out, int(env["SHARDLIGHT_BENCH_THREADS"]))]
    launch = time.time()
    result = run_tree(command, env=env, cwd=REPO, timeout_s=timeout_s)
    if result.returncode != 0:
        why = f"exit {result.returncode}" if result.returncode is not None else f"no end after {timeout_s:.0f} s"
        sys.exit(f"strategy_overhead: the {arm} run failed ({why}):\n{result.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(times.glob("timing-rank*.json"))]
    if len(ranks) != 2:
        sys.exit(f"strategy_overhead: the {arm} run wrote {len(ranks)} timing files, not 2")
    step = statistics.median(max(per_rank) for per_rank in zip(*(r["steps"][WARMUP:] for r in ranks)))
    loop = max((r["ends"][-1] - r["ends"][WARMUP - 1]) / (len(r["ends"]) - WARMUP) for r in ranks)
    cpu = max((r["cpu_ends"][-1] - r["cpu_ends"][WARMUP - 1]) / (len(r["cpu_ends"]) - WARMUP) for r in ranks)
    metrics = {"step_s": step, "loop_step_s": loop, "cpu_step_s": cpu,
               "startup_s": max(r["marks"]["first_step"] for r in ranks) - launch}
    for mark in MARKS:  # where the start-up goes: launch -> each mark on rank 0, the launching process
        if mark in ranks[0]["marks"]:
            metrics[f"to_{mark}_s"] = ranks[0]["marks"][mark] - launch
    return metrics


def import_costs(top: int = 8) -> dict:
    """``python -X importtime -c 'import shardlight.train'``: seconds of import per top-level package (the sum
    of its modules' own times), the largest ``top``."""
    result = run_tree([sys.executable, "-X", "importtime", "-c", "import shardlight.train"],
                      env=_env(Path(tempfile.gettempdir())), cwd=REPO, timeout_s=120)
    costs: dict = {}
    for line in result.stderr.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not parts[0].split(":")[-1].strip().isdigit():
            continue
        package = parts[2].strip().split(".")[0]
        costs[package] = costs.get(package, 0) + int(parts[0].split(":")[-1]) / 1e6
    return {name: round(s, 2) for name, s in sorted(costs.items(), key=lambda kv: -kv[1])[:top]}


def main(argv=None) -> int:
    started = time.perf_counter()  # the budget counts from here
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8,
                        help="at least this many A/B pairs, the budget permitting (default 8)")
    parser.add_argument("--max-pairs", type=int, default=64)
    parser.add_argument("--budget-s", type=float, default=1500.0,
                        help="start no pair that would end past this long (the first always runs; default 1500)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (the first 5 are warm-up)")
    parser.add_argument("--run-timeout-s", type=float, default=600.0,
                        help="kill a run (and end the benchmark) that takes longer than this (default 600)")
    args = parser.parse_args(argv)
    counter = [0]
    with tempfile.TemporaryDirectory(prefix="strategy_overhead_") as tmp:
        result = compare("strategy_overhead",
                         baseline=lambda: run_once("raw", args.steps, Path(tmp), counter, args.run_timeout_s),
                         candidate=lambda: run_once("shardlight", args.steps, Path(tmp), counter, args.run_timeout_s),
                         metric="step_s", target=1.02, bound="upper", min_pairs=args.pairs,
                         max_pairs=max(args.pairs, args.max_pairs), budget_s=args.budget_s, started=started)
    startup = dict(result)
    startup_metrics = {k: v for k, v in result["metrics"].items()}
    step_stats = startup_metrics.pop("startup_s")
    step_result = dict(result)
    step_result["metrics"] = {k: result["metrics"][k] for k in ("loop_step_s", "cpu_step_s")}
    step_result["raw_step_s"] = result["medians"]["baseline"]["step_s"]
    step_result["shardlight_step_s"] = result["medians"]["candidate"]["step_s"]
    step_result["steps"], step_result["warmup"] = args.steps, WARMUP
    emit(step_result)
    # The start-up line: the same pairs, its own metric (aa noise of this metric from the same runs).
    startup.update(benchmark="startup", metric="startup_s", ratio=step_stats["ratio"], ci90=step_stats["ci90"],
                   target=1.5, bound="upper")
    startup["holds"] = holds(step_stats["ci90"], 1.5, "upper") and result["pairs"] >= args.pairs
    startup["aa_noise"] = step_stats["aa_noise"]
    startup.pop("aa_ratio"), startup.pop("aa_ci90")
    startup["where_s"] = {arm: {k: v for k, v in medians.items() if k.startswith("to_") or k == "startup_s"}
                          for arm, medians in result["medians"].items()}
    startup["imports_s"] = import_costs()
    startup.pop("metrics"), startup.pop("medians")
    emit(startup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
