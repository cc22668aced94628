"""``shardlight analyze``: communication vs computation from PyTorch profiler traces."""

from __future__ import annotations

import argparse

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
    from shardlight.trace.analyze_output import format_split, format_summary, format_table, write_plot

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

