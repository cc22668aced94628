"""``write_report``: a diagnosis as ``report.md`` with PNGs (matplotlib, Agg): the step split per rank, memory
per rank by component against capacity, throughput against the 1-device baseline when there is one."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from shardlight.diagnosis.facts import GB, normalize_memory
from shardlight.diagnosis.render import COLORS, NAMES, format_value, step_bar
from shardlight.diagnosis.result import Diagnosis
from shardlight.diagnosis.step_split import PARTS
from shardlight.errors import ShardlightError

MEMORY_PARTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optim_bytes", "optimizer state"))


# Every PNG write_report may write next to report.md (the W&B images of the end-of-run verdict).
REPORT_IMAGES = ("timeline.png", "split.png", "memory.png", "throughput.png")


def _pyplot():
    import matplotlib  # heavy: imported only when a report is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_split(diagnosis: Diagnosis, path: Path) -> None:
    """One horizontal stacked bar per rank: its mean step, part by part, left to right."""
    plt = _pyplot()
    ranks = sorted(diagnosis.split_by_rank)
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.5 * len(ranks)))
    left = [0.0] * len(ranks)
    for part in PARTS:
        widths = [diagnosis.split_by_rank[r][part] for r in ranks]
        ax.barh([f"rank {r}" for r in ranks], widths, left=left, color=COLORS[part].replace("bright_black", "grey"),
                label=NAMES[part])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean over the analysed ProfilerSteps)")
    ax.set_title(f"Step split per rank: {diagnosis.verdict}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never over a bar
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(analysis: Mapping[str, Any], path: Path) -> bool:
    """One step on every rank, on one clock (the ranks' offsets removed): two lanes per rank, computation and
    input above, communication below, split into waiting for the last rank and transfer. False: no timeline."""
    timelines = {int(r): result["timeline"] for r, result in (analysis.get("ranks") or {}).items()
                 if result.get("timeline")}
    if not timelines:
        return False
    plt = _pyplot()
    ranks = sorted(timelines)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.9 * len(ranks)))
    # the y axis is inverted below (rank 0 on top), so the lane at lift 0 is the upper one
    lanes = (("compute", 0.0, COLORS["compute_ms"], "compute"), ("input", 0.0, "gold", "input (DataLoader)"),
             ("wait", 0.45, COLORS["exposed_wait_ms"], "comm: waiting for the last rank"),
             ("transfer", 0.45, COLORS["exposed_transfer_ms"], "comm: transfer"))
    labelled = set()
    for row, rank in enumerate(ranks):
        line = timelines[rank]
        base = row * 1.2
        for key, lift, color, label in lanes:
            bars = [(start / 1e3, (end - start) / 1e3) for start, end in line.get(key, [])]
            if bars:
                ax.broken_barh(bars, (base + lift, 0.4), facecolors=color,
                               label=None if label in labelled else label)
                labelled.add(label)
        for edge in (line["start_us"], line["end_us"]):
            ax.plot([edge / 1e3] * 2, [base - 0.05, base + 0.9], color="black", linewidth=0.8)
    ax.set_yticks([row * 1.2 + 0.45 for row in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the first rank's start of the step")
    ax.set_title(f"ProfilerStep#{timelines[ranks[0]]['step']} on every rank (black: the rank's step boundaries)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_memory(memory: Dict[int, Dict[str, float]], path: Path) -> None:
    """Per rank: parameters, gradients, optimizer state and the rest of the peak, with capacity as a line."""
    plt = _pyplot()
    ranks = sorted(memory)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(ranks)
    for key, label in MEMORY_PARTS:
        values = [memory[r].get(key, 0.0) / GB for r in ranks]
        ax.bar([str(r) for r in ranks], values, bottom=bottom, label=label)
        bottom = [a + b for a, b in zip(bottom, values)]
    rest = [max(0.0, memory[r].get("peak_bytes", 0.0) / GB - b) for r, b in zip(ranks, bottom)]
    ax.bar([str(r) for r in ranks], rest, bottom=bottom, label="activations and buffers (peak − state)")
    for i, r in enumerate(ranks):
        capacity = memory[r].get("capacity_bytes")
        if capacity:
            ax.plot([i - 0.4, i + 0.4], [capacity / GB] * 2, "k--", label="capacity" if i == 0 else None)
    ax.set_xlabel("rank")
    ax.set_ylabel("GB")
    ax.set_title("Memory per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(tokens_per_sec: float, baseline: float, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    bars = ax.bar(["1-device baseline", "this run"], [baseline, tokens_per_sec], color=["C7", "C2"])
    ax.annotate(f"{tokens_per_sec / baseline:.0%}", (bars[1].get_x() + bars[1].get_width() / 2, tokens_per_sec),
                ha="center", va="bottom")
    ax.set_ylabel("tokens/s per device")
    ax.set_title("Throughput vs baseline (label: scaling efficiency)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _baseline(throughput: Optional[Mapping[str, Any]]) -> Optional[tuple]:
    tps = (throughput or {}).get("tokens_per_sec_per_device")
    efficiency = (throughput or {}).get("scaling_efficiency")
    if not tps or not efficiency:
        return None
    return float(tps), float(tps) / float(efficiency)


def _split_table(diagnosis: Diagnosis) -> List[str]:
    header = ["rank", *(NAMES[p] for p in PARTS), "step"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rank, split in sorted(diagnosis.split_by_rank.items()):
        rows.append("| " + " | ".join([str(rank), *(f"{split[p]:.2f}" for p in PARTS), f"{split['step_ms']:.2f}"])
                    + " |")
    rows.append("| mean | " + " | ".join(f"{diagnosis.split[p]:.2f}" for p in [*PARTS, "step_ms"]) + " |")
    return rows


def write_report(out_dir, diagnosis: Diagnosis, analysis: Mapping[str, Any], *,
                 memory: Optional[Mapping] = None, throughput: Optional[Mapping[str, Any]] = None) -> Path:
    """``out_dir/report.md`` and its PNGs (``timeline.png``, one step on every rank, when the analysis has one;
    ``split.png``; ``memory.png`` with memory numbers; ``throughput.png`` with a baseline); returns its path."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShardlightError(f"cannot write the report to {out}: {exc.strerror or exc}") from None
    for stale in REPORT_IMAGES:  # a requeued run reports into the same run dir: no image of an earlier attempt
        (out / stale).unlink(missing_ok=True)
    images = ["timeline.png"] if plot_timeline(analysis, out / "timeline.png") else []
    images.append("split.png")
    plot_split(diagnosis, out / "split.png")
    mem = normalize_memory(memory)
    if mem:
        plot_memory(mem, out / "memory.png")
        images.append("memory.png")
    baseline = _baseline(throughput)
    if baseline:
        plot_throughput(*baseline, out / "throughput.png")
        images.append("throughput.png")
    files = sorted({str(r.get("file")) for r in (analysis.get("ranks") or {}).values() if r.get("file")})
    lines = [f"# Diagnosis: {diagnosis.verdict}", "", diagnosis.headline, "", "```", step_bar(diagnosis), "```", ""]
    if diagnosis.secondary:
        lines += [f"Also: {', '.join(diagnosis.secondary)}.", ""]
    if diagnosis.missing_ranks:
        lines += [f"**Partial**: no trace from rank(s) {', '.join(map(str, diagnosis.missing_ranks))}; the split "
                  "and the verdict cover the ranks that have one.", ""]
    lines += ["## Actions", ""]
    lines += [f"{i}. {a.text} — *{a.effect}*" for i, a in enumerate(diagnosis.actions, 1)] or ["None."]
    lines += ["", "## Evidence", ""] + [f"- `{k}`: {format_value(v)}" for k, v in diagnosis.evidence.items()]
    lines += ["", f"## Step split (ms per step, {diagnosis.steps} ProfilerStep(s) per rank)", ""]
    lines += _split_table(diagnosis) + [""]
    lines += [f"![{image}]({image})" for image in images] + [""]
    if files:
        lines += ["Traces: " + ", ".join(f"`{f}`" for f in files), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
