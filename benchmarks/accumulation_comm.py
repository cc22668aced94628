"""Reduce-scatter bytes per optimizer step under gradient accumulation (accumulate_grad_batches=4, FSDP2,
2 gloo ranks): shardlight (skips the reduce-scatter on non-final micro-batches) vs Lightning 2.6's stock
behaviour (its Trainer only skips sync for models with ``no_sync()``, which FSDP2 modules lack, so it
reduce-scatters every micro-batch; reproduced here with ``fsdp.sync_each_batch=true``).

A count, not a time: one JSON line through the harness (``benchmarks/_harness.py``'s ``exact``); ``ratio`` =
shardlight bytes / stock bytes, which must be exactly ``1 / accumulate_grad_batches``.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import emit, exact  # noqa: E402

WORKER = REPO / "tests" / "workers" / "instrumented_train.py"
STEPS, ACCUMULATE = 4, 4


def run(out: Path, extra):
    env = dict(os.environ, SHARDLIGHT_COUNTS_DIR=str(out / "counts"), PYTHONPATH=str(REPO),
               WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    for key in ("LOCAL_RANK", "SHARDLIGHT_BENCH_RESULTS"):
        env.pop(key, None)
    args = [sys.executable, str(WORKER), "train", f"output_dir={out}", "fsdp.fsdp_version=2",
            f"trainer.max_steps={STEPS}", f"trainer.accumulate_grad_batches={ACCUMULATE}",
            "trainer.limit_val_batches=0", "trainer.progress_bar=false", "logging.wandb.enabled=false",
            "callbacks.comm.enabled=false", "callbacks.memory.enabled=false", "callbacks.throughput.enabled=false",
            *extra]
    result = subprocess.run(args, env=env, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed: {result.stderr[-2000:]}")
    counts = [json.loads(p.read_text()) for p in sorted((out / "counts").glob("rank*.json"))]
    return sum(c["reduce_scatter_bytes"] for c in counts) / len(counts) / STEPS


def main():
    with tempfile.TemporaryDirectory() as tmp:
        shardlight = run(Path(tmp) / "shardlight", [])
        stock = run(Path(tmp) / "stock", ["fsdp.sync_each_batch=true"])
    emit(exact("accumulation_comm", value=shardlight / stock, target=1 / ACCUMULATE, fsdp_version=2,
               accumulate_grad_batches=ACCUMULATE, shardlight_rs_bytes_per_step=shardlight,
               stock_rs_bytes_per_step=stock))

if __name__ == "__main__":
    main()
