"""What ``shardlight profile`` writes from its result dict (besides ``profile.json``):
``profile_report.md``, its PNG plots and the W&B ``profile/strategies`` table.

matplotlib and wandb are heavy: each is imported lazily, in the one function that draws or logs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from shardlight.errors import warn
from shardlight.planner.inputs import GB

# The step columns are the runs' step frames (``calibration.step_frame``): the measured best is the row with the
# least step_ms, and the plots draw the same numbers.
COLUMNS = ["run", "world_size", "step_ms", "scaling_efficiency", "compute_ms", "exposed_transfer_ms", "other_ms",
           "peak_gb", "params_gb", "grads_gb", "optim_gb", "pred_params_gb", "pred_grads_gb", "pred_optim_gb",
           "pred_peak_gb", "pred_bound", "verdict"]


def table_rows(result: Dict[str, Any]) -> List[List[Any]]:
    rows = []
    for name, run in result["runs"].items():
        m, p = run.get("measured") or {}, run.get("predicted") or {}

        def gbv(d: Dict[str, Any], key: str) -> Optional[float]:
            return None if d.get(key) is None else d[key] / GB

        rows.append([name, run.get("world_size"), m.get("step_ms"), m.get("scaling_efficiency"),
                     m.get("compute_ms"), m.get("exposed_transfer_ms"), m.get("other_ms"), m.get("peak_gb"),
                     gbv(m, "params_bytes"), gbv(m, "grads_bytes"), gbv(m, "optim_bytes"),
                     gbv(p, "params_bytes"), gbv(p, "grads_bytes"), gbv(p, "optim_bytes"), gbv(p, "peak_bytes"),
                     p.get("bound"), (run.get("diagnosis") or {}).get("verdict")])
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def plots(result: Dict[str, Any], out: Path) -> List[str]:
    """The three PNGs (communication, memory per rank, throughput) in ``out``; their file names."""
    import matplotlib  # heavy: lazy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {k: v for k, v in result["runs"].items() if v.get("measured")}
    names = list(runs)
    written = []
    if not names:
        return written
    m = [runs[n]["measured"] for n in names]
    # 1. the step, split: compute, exposed transfer, the rest (the frame's three parts add up to step_ms)
    fig, ax = plt.subplots(figsize=(7, 4))
    compute = [x.get("compute_ms") or 0 for x in m]
    exposed = [x.get("exposed_transfer_ms") or 0 for x in m]
    other = [x.get("other_ms") or 0 for x in m]
    ax.bar(names, compute, label="compute")
    ax.bar(names, exposed, bottom=compute, label="exposed transfer")
    ax.bar(names, other, bottom=[a + b for a, b in zip(compute, exposed)], label="other (host work, waits)")
    ax.set_ylabel("ms per step (median of the quiet profiled steps)")
    ax.set_title("Step time: compute vs communication")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "comm.png", dpi=110)
    plt.close(fig)
    written.append("comm.png")
    # 2. memory per rank per strategy
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, max(len(x.get("peak_gb_per_rank") or [0]) for x in m))
    labelled: set = set()
    for i, (name, x) in enumerate(zip(names, m)):
        ranks = x.get("peak_gb_per_rank") or []
        for r, peak in enumerate(ranks):
            ax.bar(i + (r - (len(ranks) - 1) / 2) * width, peak or 0, width=width, color=f"C{r}",
                   label=None if r in labelled else f"rank {r}")
            labelled.add(r)
        pred = (runs[name].get("predicted") or {}).get("peak_bytes")
        if pred is not None:
            ax.plot([i - 0.4, i + 0.4], [pred / GB] * 2, "k--",
                    label=None if "plan" in labelled else "planned peak (tensors)")
            labelled.add("plan")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("peak GB (GPU: max allocated; CPU: process RSS)")
    ax.set_title("Memory per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)
    written.append("memory.png")
    # 3. step time and scaling efficiency vs the baseline (the table's step_ms and scaling_efficiency)
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, [x.get("step_ms") or 0 for x in m], color="C2")
    for bar, x in zip(bars, m):
        eff = x.get("scaling_efficiency")
        if eff is not None:
            ax.annotate(f"{eff:.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom")
    ax.set_ylabel("ms per step (lower is faster)")
    ax.set_title("Step time (labels: scaling efficiency vs the 1-device baseline)")
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)
    written.append("step_time.png")
    return written


def log_wandb_table(result: Dict[str, Any], out: Path, mode: Optional[str]) -> Optional[str]:
    """A W&B run in ``out/wandb`` with the ``profile/strategies`` table; failures are warnings."""
    try:
        import wandb  # heavy, and a failure here is a warning: lazy

        run_mode = mode or os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if run_mode == "disabled":
            return None
        run = wandb.init(project="shardlight", name=f"profile-{result['recipe']}", dir=str(out), mode=run_mode,
                         job_type="profile", reinit=True)
        run.log({"profile/strategies": wandb.Table(columns=COLUMNS, data=table_rows(result))})
        run.summary["measured_best"] = result["measured_best"]
        run.summary["plan_prediction"] = result["plan_prediction"]
        run.finish()
        return "profile/strategies"
    except Exception as exc:  # noqa: BLE001 - the report must still be written
        warn(f"W&B profile table failed: {type(exc).__name__}: {exc}")
        return None


def diagnosis_lines(result: Dict[str, Any], out: Path) -> List[str]:
    """Each strategy run's verdict (``shardlight.diagnosis``, one table for all), its top action and its report."""
    diagnosed = {k: v["diagnosis"] for k, v in result["runs"].items() if v.get("diagnosis")}
    if not diagnosed:
        return []
    lines = ["## Diagnosis per strategy (the same verdict table as `shardlight diagnose`)", ""]
    for name, d in diagnosed.items():
        if "error" in d:
            lines.append(f"- **{name}**: no diagnosis ({d['error']})")
            continue
        report = os.path.relpath(d["report"], out) if d.get("report") else None
        lines.append(f"- **{name}**: {d['headline']}" + (f" ([report]({report}))" if report else ""))
        if d.get("actions"):
            top = d["actions"][0]
            lines.append(f"  - try: {top['text']} — *{top['effect']}*")
    return lines + [""]


def step_time_lines(result: Dict[str, Any]) -> List[str]:
    """Every strategy's calibrated step time against the measured one (the calibration is in-sample here)."""
    check = result.get("step_time_check")
    if not check:
        return ["## Step time", "", f"- not calibrated: {result.get('calibration_error', 'no calibration')}", ""]
    cal = result["calibration"]
    lines = ["## Step time: calibrated prediction vs measured", "",
             f"Calibrated on {', '.join(cal['calibrated_on'])} ({cal['world_size']} ranks, {cal['device_kind']}, "
             f"{cal['backend']}): {cal['achieved_tflops'] * 1e3:.3g} GFLOP/s per rank, "
             f"{cal['host_overhead_s'] * 1e3:.3g} ms host time per step, {cal['exposed_fraction']:.0%} of "
             "transfers exposed; `calibration.json` is the file `shardlight plan --calibration` reads.", "",
             "| strategy | predicted ms | measured ms | error |", "|---|---|---|---|"]
    for name, c in check.items():
        measured = c["measured_step_s"]
        lines.append(f"| {name} | {c['predicted_step_s'] * 1e3:.4g} | {_fmt(measured and measured * 1e3)} | "
                     + (f"{c['error']:+.1%} |" if c["error"] is not None else "– |"))
    return lines + ["", "Every run here is in the calibration, so this is how well the model's form fits; "
                    "`benchmarks/plan_calibration.py` predicts strategies left out of it.", ""]


def write_report(result: Dict[str, Any], out: Path, wandb_enabled: bool = True,
                 wandb_mode: Optional[str] = None) -> None:
    """``out/profile_report.md`` with the plots and, when enabled, the W&B table."""
    images = plots(result, out)
    table = log_wandb_table(result, out, wandb_mode) if wandb_enabled else None
    rec = result["plan_recommendation"]
    lines = [f"# shardlight profile: {result['recipe']}", "",
             f"{result['steps']} optimizer steps per run, {result['world_size']} ranks per strategy run.", "",
             f"- **measured best**: {result['measured_best']} (the least step_ms in the table below)",
             f"- **plan's prediction** among the swept strategies: {result['plan_prediction']}"
             f" ({'agree' if result['agree'] else 'disagree' if result['agree'] is False else 'no comparison'})",
             f"- **plan's overall recommendation** for the planned cluster: {rec['label']}", ""]
    if result["notes"]:
        lines += ["## Where measurement and plan disagree", ""] + [f"- {n}" for n in result["notes"]] + [""]
    lines += ["## Runs", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in table_rows(result)]
    lines += ["", "Measured `params/grads/optim` are the exact local shard bytes (memory callback, max over ranks); "
              "predicted ones come from `shardlight plan`. Peak on CPU is the process RSS (includes the Python/torch "
              "runtime), on GPU `max_memory_allocated`; the planned peak counts tensors only.", ""]
    lines += step_time_lines(result)
    lines += diagnosis_lines(result, out)
    failed = {k: v for k, v in result["runs"].items() if "error" in v}
    if failed:
        lines += ["## Failed runs", ""] + [f"- {k}: {v['error']} (log: `{v['log']}`)" for k, v in failed.items()] + [""]
    for image in images:
        lines += [f"![{image}]({image})", ""]
    if result.get("baseline_file"):
        lines += [f"Baseline for `callbacks.throughput.baseline_file`: `{result['baseline_file']}`", ""]
    if table:
        lines += [f"W&B table: `{table}` (run in `{out / 'wandb'}`)", ""]
    cluster = result["plan"]["cluster"]
    lines += [f"## Plan reasons (for the planned cluster: {cluster['nodes']} x {cluster['gpus_per_node']} GPUs of "
              f"{cluster['gpu_memory_gb']:g} GB over {cluster['intra_node']}; not necessarily this machine)", ""]
    lines += [f"- {r}" for r in rec["reasons"]] + [""]
    (out / "profile_report.md").write_text("\n".join(lines))
