"""How close are ``shardlight plan``'s activation and peak estimates to a measurement? One JSON line.

For a few small Llama shapes (CPU, one process, shardlight's loss path: logits[:, :-1].float() + summed
cross-entropy), with and without activation checkpointing (non-reentrant, per decoder layer) and in
32-true and bf16 autocast:

* activations: bytes allocated by the forward + loss and still alive when backward starts (PyTorch
  profiler memory events of the CPU allocator), vs the plan's saved activations + log-softmax (bf16: the
  model in bf16 under autocast, as FSDP's bf16 parameters compute);
* peak: the highest allocation during a whole training step (forward, backward, AdamW step; optimizer
  state created by a warm-up step, gradients freed before the step as Lightning does) plus the parameter
  and optimizer-state bytes alive before it, vs the plan's peak for one device (32-true only: CPU autocast
  caches its bf16 weight copies differently from FSDP's gathered buffers).

Relative error = (estimate - measured) / measured. Run (shardlight installed, e.g. ``pip install -e .``):
python benchmarks/plan_accuracy.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from shardlight.planner.estimate import Workload, activation_bytes, estimate, make_cluster
from shardlight.planner.model_spec import model_spec

SHAPES = [
    {"name": "h256-L4-v8k-s256-b4", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
     "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8192, "seq": 256, "batch": 4},
    {"name": "h512-L4-v32k-s512-b2", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
     "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000, "seq": 512, "batch": 2},
    {"name": "h384-L8-v4k-s1024-b1", "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 8,
     "num_attention_heads": 6, "num_key_value_heads": 6, "vocab_size": 4096, "seq": 1024, "batch": 1},
]


def memory_trace(fn):
    """(bytes alive at the end, peak bytes) allocated on the CPU while ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "[memory]"
                  and e["args"].get("Device Type") == 0]
    events.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    live = peak = 0
    for event in events:
        live += event["args"]["Bytes"]
        peak = max(peak, live)
    return live, peak


def loss_of(model, input_ids):
    logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    logits = logits[:, :-1].float()
    labels = input_ids[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum") / labels.numel()


def measure(shape, checkpointing: bool, bf16: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    config = AutoConfig.for_model("llama", max_position_embeddings=4096, tie_word_embeddings=False,
                                  **{k: shape[k] for k in keys})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    if bf16:
        model = model.to(torch.bfloat16)  # FSDP bf16 mixed precision computes with gathered bf16 parameters
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    input_ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]))

    def forward():
        if bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return loss_of(model, input_ids)
        return loss_of(model, input_ids)

    def step():
        forward().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state exists from here on, as in training
    held = {}

    def forward_only():
        held["loss"] = forward()

    activations, _ = memory_trace(forward_only)
    held.clear()
    _, step_peak = memory_trace(step)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return config, activations, step_peak + params + state


def main() -> None:
    cases = []
    cluster = make_cluster(nodes=1, gpus_per_node=1, gpu_memory="80GB", overhead_gb=0)
    for shape in SHAPES:
        for bf16 in (False, True):
            for ckpt in (False, True):
                config, act_measured, peak_measured = measure(shape, ckpt, bf16)
                spec = model_spec(config)
                work = Workload(micro_batch_size=shape["batch"], seq_len=shape["seq"],
                                precision="bf16-mixed" if bf16 else "32-true", param_dtype="float32")
                acts = activation_bytes(spec, work, ckpt)
                act_est = acts["saved"] + acts["logits"]
                case = {"shape": shape["name"], "precision": work.precision, "activation_checkpointing": ckpt,
                        "activation_measured": act_measured, "activation_estimated": act_est,
                        "activation_rel_err": round((act_est - act_measured) / act_measured, 4)}
                if not bf16:
                    row = estimate(spec, cluster, work, "NO_SHARD", ckpt, False)
                    case.update(peak_measured=peak_measured, peak_estimated=row["peak_bytes"],
                                peak_rel_err=round((row["peak_bytes"] - peak_measured) / peak_measured, 4))
                cases.append(case)
    act_errs = [c["activation_rel_err"] for c in cases]
    peak_errs = [c["peak_rel_err"] for c in cases if "peak_rel_err" in c]
    print(json.dumps({
        "benchmark": "plan_accuracy",
        "device": "cpu",
        "activation_rel_err_max_abs": max(abs(e) for e in act_errs),
        "activation_rel_err_mean": round(sum(act_errs) / len(act_errs), 4),
        "peak_rel_err_max_abs": max(abs(e) for e in peak_errs),
        "peak_rel_err_mean": round(sum(peak_errs) / len(peak_errs), 4),
        "cases": cases,
    }))


if __name__ == "__main__":
    main()
