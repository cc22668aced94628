"""``shardlight analyze``: communication vs computation from PyTorch profiler traces, and how the analysis
(:mod:`shardlight.trace`) is shown: a per-rank text table, the JSON file, a matplotlib chart."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardlight.errors import ShardlightError
from shardlight.files import write_json

ANALYZE_HELP = "communication vs computation per rank from PyTorch profiler traces (HTA-compatible)"
ANALYZE_DESCRIPTION = """\
Read PyTorch profiler (Kineto) chrome traces, one file per rank (.json or .json.gz; the rank
comes from distributedInfo.rank), and report per rank: communication time, computation time,
overlap %, exposed communication, idle time and span, per ProfilerStep and per collective, with
HTA 0.5.0's definitions. GPU traces: NCCL/RCCL kernels are communication. CPU traces of gloo
runs: gloo:* annotations are communication, main-thread aten::* ops are computation.

Across ranks, each collective's time is split into WAIT (for the last rank of its group to
arrive) and TRANSFER (after it arrived), with clock offsets between ranks estimated from the
collectives' ends; bus bandwidth per collective uses nccl-tests' sizes and factors. Input
time is torch DataLoader's __next__ on the main thread.

Several large files are decoded in a pool of processes (--workers sets how many).
"""


def add_parsers(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help=ANALYZE_HELP,
        description=ANALYZE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", metavar="PATH", nargs="+",
                        help="trace files, or directories holding one trace file per rank")
    parser.add_argument("--json", metavar="OUT", dest="json_out",
                        help="write all metrics (ranks, steps, collectives, summary) to this JSON file")
    parser.add_argument("--plot", metavar="OUT.png", dest="plot_out",
                        help="draw compute vs overlapped/exposed communication per rank and step")
    parser.add_argument("--include-last-step", action="store_true",
                        help="keep the last ProfilerStep (HTA drops it when a trace has 2 or more)")
    parser.add_argument("--link-peak-gbps", type=float, metavar="GB/s", default=None,
                        help="a link's peak bandwidth (GB/s): report bus bandwidth as a share of it")
    parser.add_argument("--workers", type=int, metavar="N", default=None,
                        help="processes that decode the trace files (default: from their number and size and "
                             "this process's CPUs; 1: this one alone). Same results either way")
    parser.set_defaults(func=run_analyze)


def run_analyze(args) -> int:
    if args.link_peak_gbps is not None and not args.link_peak_gbps > 0:
        raise ShardlightError(f"--link-peak-gbps must be a positive GB/s figure, got {args.link_peak_gbps}")
    if args.workers is not None and args.workers < 1:
        raise ShardlightError(f"--workers must be 1 or more, got {args.workers}")
    # numpy and the analyzer (about 150 ms of imports) for this command only, not for every command's parser
    from shardlight.trace.analysis import analyze_traces

    analysis = analyze_traces(args.paths, include_last_step=args.include_last_step,
                              link_peak_gbps=args.link_peak_gbps, workers=args.workers)
    print(format_table(analysis))
    summary = format_summary(analysis)
    if summary:
        print(summary)
    split = format_split(analysis)
    if split:
        print(split)
    if args.json_out:
        write_json(args.json_out, analysis)
        print(f"wrote {args.json_out}")
    if args.plot_out:
        write_plot(analysis, args.plot_out)
        print(f"wrote {args.plot_out}")
    return 0


_COLUMNS = (
    ("rank", "rank", None),
    ("mode", "mode", None),
    ("comm ms", "comm_us", 1e-3),
    ("compute ms", "compute_us", 1e-3),
    ("overlap %", "overlap_pct", 1.0),
    ("exposed ms", "exposed_comm_us", 1e-3),
    ("idle ms", "idle_us", 1e-3),
    ("span ms", "span_us", 1e-3),
    ("comm/compute", "comm_to_compute", 1.0),
)


def _cell(value: Any, scale: float | None) -> str:
    if value is None:
        return "-"
    if scale is None:
        return str(value)
    return f"{value * scale:,.2f}"


def format_table(analysis: dict[str, Any]) -> str:
    rows = [[title for title, _, _ in _COLUMNS]]
    for rank, result in analysis["ranks"].items():
        values = dict(result, rank=rank)
        rows.append([_cell(values.get(key), scale) for _, key, scale in _COLUMNS])
    return "\n".join(_aligned(rows))


def format_summary(analysis: dict[str, Any]) -> str:
    summary = analysis["summary"]
    lines = []
    collectives: dict[str, float] = {}
    for result in analysis["ranks"].values():
        for name, stats in result["by_collective"].items():
            collectives[name] = collectives.get(name, 0) + stats["comm_us"]
    if collectives:
        parts = ", ".join(f"{name} {us / 1e3:,.2f} ms" for name, us in sorted(collectives.items()))
        lines.append(f"communication by collective (all ranks): {parts}")
    stragglers = summary.get("stragglers", {})
    if len(analysis["ranks"]) > 1 and stragglers:
        parts = [
            f"step {step}: rank {info['rank']} (+{info['slowdown_us'] / 1e3:,.2f} ms)"
            for step, info in stragglers.items()
        ]
        lines.append("slowest rank per step: " + "; ".join(parts))
    if not summary.get("include_last_step"):
        lines.append("(last ProfilerStep dropped as in HTA when a trace has 2 or more; --include-last-step keeps it)")
    for item in summary.get("skipped", []):
        lines.append(f"skipped {item['file']}: {item['reason']}")
    return "\n".join(lines)


_SPLIT_COLUMNS = (
    ("wait ms", "wait_us"),
    ("transfer ms", "transfer_us"),
    ("exposed wait ms", "exposed_wait_us"),
    ("exposed transfer ms", "exposed_transfer_us"),
    ("input ms", "input_us"),
    ("input wait ms", "input_wait_us"),
)


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.1f} {unit}" if unit != "B" else f"{value:,.0f} B"
        value /= 1024
    return "-"


def format_split(analysis: dict[str, Any]) -> str:
    """Wait vs transfer per rank (ms per analysed step), bus bandwidth per collective, the clock line."""
    summary = analysis["summary"]
    if "clock" not in summary:
        return ""
    rows = [["rank"] + [title for title, _ in _SPLIT_COLUMNS] + ["matched", "unmatched"]]
    for rank, result in analysis["ranks"].items():
        split = result["split"]
        per_step = 1e-3 / max(1, split["steps"])
        rows.append([rank] + [f"{split[key] * per_step:,.2f}" for _, key in _SPLIT_COLUMNS]
                    + [str(split["matched"]), str(split["unmatched"])])
    lines = ["wait vs transfer (ms per analysed step):"] + _aligned(rows)
    bandwidth = summary["bandwidth"]
    if bandwidth:
        peak = any("peak_pct" in entry for entry in bandwidth.values())
        titles = ["collective", "count", "bytes", "transfer ms", "algbw GB/s", "busbw GB/s"]
        rows = [titles + (["% of peak"] if peak else [])]
        for kind, entry in bandwidth.items():
            row = [kind, str(entry["count"]), _bytes(entry["bytes"]), f"{entry['transfer_us'] / 1e3:,.2f}",
                   _cell(entry["algbw_gbps"], 1.0), _cell(entry["busbw_gbps"], 1.0)]
            rows.append(row + ([_cell(entry.get("peak_pct"), 1.0)] if peak else []))
        lines += ["bus bandwidth by collective (transfer after the last rank arrived):"] + _aligned(rows)
    clock, collectives = summary["clock"], summary["collectives"]
    offsets = ", ".join(f"{rank} {offset:+,.1f}" for rank, offset in clock["offsets_us"].items())
    lines.append(f"clock offsets vs rank {clock['reference_rank']} (us): {offsets}; residual median "
                 f"{clock['residual_us']:,.1f} us, max {clock['max_residual_us']:,.1f} us, "
                 f"from {clock['matched']} collectives matched by {collectives['match']}")
    if collectives["missing_ranks"]:
        missing = collectives["missing_ranks"]
        shown = ", ".join(map(str, missing[:16])) + (f", ... ({len(missing)} in all)" if len(missing) > 16 else "")
        lines.append(f"partial run: no trace for rank(s) {shown} of world size {collectives['world_size']}; "
                     "their groups' collectives are unmatched (counted as transfer, no wait)")
    return "\n".join(lines)


def _stack(axis, labels: list[str], results: list[dict[str, Any]], title: str) -> None:
    positions = range(len(labels))
    compute_only = [r["compute_us"] - r["overlap_us"] for r in results]
    overlapped = [r["overlap_us"] for r in results]
    exposed = [r["exposed_comm_us"] for r in results]
    to_ms = lambda values: [v / 1e3 for v in values]  # noqa: E731
    axis.bar(positions, to_ms(compute_only), label="compute only", color="#4c72b0")
    axis.bar(positions, to_ms(overlapped), bottom=to_ms(compute_only), label="comm overlapped", color="#55a868")
    bottoms = [a + b for a, b in zip(compute_only, overlapped)]
    axis.bar(positions, to_ms(exposed), bottom=to_ms(bottoms), label="comm exposed", color="#c44e52")
    axis.set_xticks(list(positions))
    axis.set_xticklabels(labels, rotation=45 if len(labels) > 8 else 0, ha="right" if len(labels) > 8 else "center")
    axis.set_ylabel("ms")
    axis.set_title(title)


def write_plot(analysis: dict[str, Any], out: str | Path) -> None:
    """Compute vs overlapped/exposed communication per rank and per (rank, step)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShardlightError("--plot needs matplotlib (pip install matplotlib)") from None
    ranks = analysis["ranks"]
    step_labels, step_results = [], []
    for rank, result in ranks.items():
        for step, metrics in result["steps"].items():
            step_labels.append(f"r{rank}/{step}")
            step_results.append(metrics)
    figure, (by_rank, by_step) = plt.subplots(
        1, 2, figsize=(max(10, 4 + 0.5 * (len(ranks) + len(step_labels))), 5),
        gridspec_kw={"width_ratios": [max(1, len(ranks)), max(1, len(step_labels))]},
    )
    _stack(by_rank, [f"rank {r}" for r in ranks], list(ranks.values()), "per rank")
    _stack(by_step, step_labels, step_results, "per rank / ProfilerStep")
    by_rank.legend(loc="upper left", fontsize="small")
    figure.suptitle("shardlight analyze: computation vs communication")
    figure.tight_layout()
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=100)
    except OSError as exc:
        raise ShardlightError(f"{out}: cannot write plot ({exc.strerror or exc})") from None
    finally:
        plt.close(figure)
