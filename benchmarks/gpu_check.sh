#!/usr/bin/env bash
# GPU check of the observability callbacks: the default recipe on one CUDA GPU (NCCL, world size 1,
# bf16-mixed) with the comm/memory/throughput callbacks, then a short QLoRA run (4-bit base); prints the
# CUDA memory metrics, MFU and the comm callback's kernel classification of the real CUDA trace, and writes the trace and the metrics
# into OUT_DIR. A few minutes at most (set-up excluded).
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# Sets up .venv like `make setup` (TORCH_SPEC=... selects a CUDA build of torch if the default index
# gives a CPU one), then runs. Exit status 0 only when the run finished on CUDA and the checks passed.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
cd "$REPO"

make setup
PY="$REPO/.venv/bin/python"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "error: torch in .venv has no CUDA device (torch $("$PY" -c 'import torch; print(torch.__version__)')); " \
         "install a CUDA build, e.g. rm -rf .venv && make setup TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

export WANDB_MODE=offline WANDB_SILENT=true TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
"$REPO/.venv/bin/shardlight" train \
    trainer.accelerator=gpu trainer.devices=1 trainer.precision=bf16-mixed \
    trainer.max_steps=30 trainer.val_every_n_steps=30 trainer.log_every_n_steps=5 trainer.progress_bar=false \
    callbacks.comm.every_n_steps=10 callbacks.comm.keep_windows=null \
    "output_dir=$OUT/runs" --summary-json "$OUT/summary.json" 2>&1 | tee "$OUT/train.log"

# QLoRA (peft.method: qlora): LoRA adapters on a base loaded in 4 bits with bitsandbytes, which only a GPU runs.
# The base must be a pretrained checkpoint (the 4-bit load quantizes saved weights): the default recipe's tiny
# Llama, saved here first. Its own check: the run finishes its steps and exports its adapter.
"$PY" - "$OUT/qlora-base" <<'EOF'
import sys
from transformers import AutoModelForCausalLM
from shardlight.build import build_hf_config
from shardlight.recipe import load_recipe

AutoModelForCausalLM.from_config(build_hf_config(load_recipe(None, []).model)).save_pretrained(sys.argv[1])
EOF
"$REPO/.venv/bin/shardlight" train recipes/tiny-llama-lora.yaml peft.method=qlora \
    "model.name_or_path=$OUT/qlora-base" model.config=null \
    trainer.accelerator=gpu trainer.devices=1 trainer.precision=bf16-mixed trainer.max_steps=10 \
    trainer.progress_bar=false callbacks.comm.enabled=false \
    "output_dir=$OUT/qlora-runs" --summary-json "$OUT/qlora-summary.json" 2>&1 | tee "$OUT/qlora.log"
"$PY" -c 'import json, sys; s = json.load(open(sys.argv[1])); assert s["steps"] == 10 and s["model_dir"], s; print("QLORA OK", s["model_dir"])' "$OUT/qlora-summary.json"

"$PY" - "$OUT" <<'EOF'
import csv, json, shutil, sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, ".")
from shardlight.trace import analyze_trace_file
from shardlight.trace import classify

out = Path(sys.argv[1])
summary = json.loads((out / "summary.json").read_text())
run_dir = Path(summary["run_dir"])
rows = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
metrics = {}
for row in rows:
    for key, value in row.items():
        if value and key.startswith(("memory/", "throughput/", "comm/", "step/")):
            metrics[key] = float(value)  # the latest value of each key
(out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
shutil.copy(run_dir / "csv" / "metrics.csv", out / "metrics.csv")

print("\n== CUDA memory (rank 0, GB) ==")
for key in ("peak", "reserved", "capacity", "headroom", "params", "grads", "optim"):
    print(f"  memory/{key}_gb = {metrics.get(f'memory/{key}_gb')}")
print("\n== throughput ==")
for key in ("tokens_per_sec_per_device", "flops_per_token", "tflops_per_device", "mfu"):
    print(f"  throughput/{key} = {metrics.get(f'throughput/{key}')}")

windows = sorted((run_dir / "traces").glob("step_*"))
assert windows, "no comm window traces were written"
trace = windows[-1] / "rank0.pt.trace.json"
dest = out / f"trace_{windows[-1].name}_rank0.pt.trace.json"
shutil.copy(trace, dest)
data = json.loads(trace.read_text())
kernels = [e for e in data["traceEvents"] if isinstance(e.get("args"), dict) and "stream" in e["args"]
           and e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
kinds = Counter(classify.kernel_type(e["name"]) for e in kernels)
collectives = Counter(classify.nccl_collective(e["name"]) for e in kernels
                      if classify.kernel_type(e["name"]) == classify.COMMUNICATION)
result = analyze_trace_file(trace)
print(f"\n== comm callback's classification of {dest.name} ==")
print(f"  mode: {result['mode']}; kernels by type: {dict(kinds)}; NCCL kernels by collective: {dict(collectives)}")
names = Counter(e["name"] for e in kernels if classify.kernel_type(e["name"]) == classify.COMMUNICATION)
for name, count in names.most_common(5):
    print(f"    {count:5d} x {name}")
print(f"  comm_us={result['comm_us']} compute_us={result['compute_us']} overlap_pct={result['overlap_pct']} "
      f"exposed_comm_us={result['exposed_comm_us']}")
print(f"  logged: comm/total_ms={metrics.get('comm/total_ms')} comm/compute_ms={metrics.get('comm/compute_ms')} "
      f"step/time_ms={metrics.get('step/time_ms')}")
(out / "classification.json").write_text(json.dumps(
    {"trace": str(dest), "kernels_by_type": kinds, "nccl_by_collective": collectives,
     "analysis": {k: v for k, v in result.items() if k != "steps"}}, indent=2, default=dict) + "\n")
if not collectives:
    print("  note: no NCCL kernels at world size 1 (NCCL may run single-rank collectives as copies)")

problems = []
if result["mode"] != "gpu":
    problems.append(f"trace mode is {result['mode']}, not gpu")
if not kinds.get(classify.COMPUTATION):
    problems.append("no computation kernels in the trace")
for key in ("memory/peak_gb", "memory/capacity_gb", "memory/headroom_gb", "throughput/mfu"):
    if not metrics.get(key, 0) > 0:
        problems.append(f"{key} missing or not positive")
if metrics.get("throughput/mfu", 0) >= 1:
    problems.append("MFU >= 1")
print(f"\nwrote {out}/metrics.json, metrics.csv, classification.json, {dest.name}")
if problems:
    print("GPU CHECK FAILED: " + "; ".join(problems))
    sys.exit(1)
print("GPU CHECK OK")
EOF
