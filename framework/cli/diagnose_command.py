"""``shardlight diagnose RUN_DIR|TRACE_DIR``: the verdict of a profiled window, offline.

A run that hung (``run_dir/flight_recorder/rank_<R>``: the hang watchdog's dumps, or the ones torch's NCCL
watchdog writes there on a collective timeout), or a folder of such dumps: which rank is missing from which
collective (``shardlight.diagnosis.hang_verdict``), instead of a window's verdict.

A run directory: its latest ``traces/step_<N>/`` window, memory and throughput from ``csv/metrics.csv``, the
wrap report, the recipe's micro-batch, strategy and ``diagnosis:`` thresholds, and the planner's alternatives
for the recipe. A trace directory: the traces alone. A rank whose trace is missing gives a partial diagnosis
that names it (exit 0, with a note on stderr); traces of different steps, or no traces, are an error (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from shardlight.errors import ShardlightError, first_line
from shardlight.files import write_json

if TYPE_CHECKING:
    from shardlight.diagnosis.run_inputs import RunInputs

DIAGNOSE_HELP = "say what bounds a run's step time (communication, a straggler, input, memory, host) and what to try"


def add_parsers(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "diagnose", help=DIAGNOSE_HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", metavar="RUN_DIR|TRACE_DIR",
                        help="a shardlight run directory, or a directory of per-rank profiler traces")
    parser.add_argument("--json", metavar="OUT", dest="json_out", help="write the diagnosis as JSON")
    parser.add_argument("--report", metavar="DIR", dest="report_dir", help="write report.md and PNG plots here")
    parser.add_argument("--apply", action="store_true",
                        help="write RUN_DIR/recipe-next.yaml: the run's recipe with the top action's recipe change")
    parser.set_defaults(func=run_diagnose)


def planner_alternatives(inputs: RunInputs) -> tuple:
    """(alternatives, note): the planner's rows for the run's recipe, or none and why (never fatal)."""
    if inputs.run_dir is None or not (inputs.run_dir / "recipe.yaml").exists():
        return [], None
    try:
        from shardlight.build import build_hf_config  # heavy (transformers): only for a run directory
        from shardlight.planner.alternatives import alternatives_on_device
        from shardlight.recipe import load_recipe

        cfg = load_recipe(str(inputs.run_dir / "recipe.yaml"))
        return alternatives_on_device(cfg, build_hf_config(cfg.model), inputs.memory)
    except Exception as exc:  # noqa: BLE001 - the diagnosis stands without the planner's costing (bad recipe)
        return [], f"planner alternatives unavailable ({first_line(exc)})"


NEXT_RECIPE = "recipe-next.yaml"


def apply_top_action(run_dir: Optional[Path], diagnosis: Any) -> Path:
    """Write ``run_dir/recipe-next.yaml``: the run's recipe (``recipe.yaml``) with the recipe change of the
    verdict's first action that has one, validated as ``shardlight train`` will load it."""
    from shardlight.recipe import load_recipe, to_yaml

    if run_dir is None or not (run_dir / "recipe.yaml").is_file():
        raise ShardlightError("--apply needs a run directory (one with recipe.yaml), not a folder of traces")
    action = next((a for a in diagnosis.actions if a.change), None)
    if action is None:
        raise ShardlightError(f"--apply: no action of the {diagnosis.verdict} verdict is a recipe change "
                              "(they are checks of the machine); nothing written")
    cfg = load_recipe(str(run_dir / "recipe.yaml"), action.change.split())
    out = run_dir / NEXT_RECIPE
    try:
        out.write_text(f"# {run_dir / 'recipe.yaml'} with `shardlight diagnose --apply`: {action.change}\n"
                       f"# ({action.text}; expected: {action.effect})\n" + to_yaml(cfg))
    except OSError as exc:
        raise ShardlightError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"wrote {out} ({action.change}); run it: shardlight train {out}")
    return out


def _metrics(run_dir: Optional[Path]) -> Dict[str, List[float]]:
    from shardlight.planner.runs import read_metrics  # the planner imports torch: only for a run directory

    return read_metrics(run_dir) if run_dir is not None else {}


def _diagnose_hang(path: Path, json_out: Optional[str]) -> bool:
    """The hang verdict of a run's (or a folder's) flight-recorder dumps; False when there are none."""
    from shardlight.diagnosis.hang_verdict import hang_report
    from shardlight.run_context import FLIGHT_RECORDER_DIR

    folder = path / FLIGHT_RECORDER_DIR if (path / FLIGHT_RECORDER_DIR).is_dir() else path
    verdict = hang_report(folder) if folder.is_dir() else None
    if verdict is None:
        return False
    print("\n".join(verdict.lines))
    print("verdict: " + verdict.error.removeprefix("error: "))
    if json_out:
        write_json(json_out, {"flight_recorder": str(folder), "hang": verdict.to_dict()})
        print(f"wrote {json_out}")
    return True


def run_diagnose(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if _diagnose_hang(path, args.json_out):
        return 0
    # The diagnosis and the analyzer under it (numpy: about 190 ms of imports) for this command only
    from shardlight.diagnosis import render_panel, write_report
    from shardlight.diagnosis.run_inputs import load_run_inputs

    inputs = load_run_inputs(path, metrics=_metrics(path if (path / "csv").is_dir() else None))
    alternatives, note = planner_alternatives(inputs)
    diagnosis = inputs.diagnosis(alternatives=alternatives)
    from rich.console import Console

    Console().print(render_panel(diagnosis))
    if inputs.missing_ranks:
        print(f"note: partial diagnosis: no trace from rank(s) {', '.join(map(str, inputs.missing_ranks))}",
              file=sys.stderr)
    if note:
        print(f"note: {note}", file=sys.stderr)
    if args.json_out:
        write_json(args.json_out, {"window": str(inputs.trace_dir), "step": inputs.window_step,
                                   "diagnosis": diagnosis.to_dict(), "alternatives": alternatives})
        print(f"wrote {args.json_out}")
    if args.apply:
        apply_top_action(inputs.run_dir, diagnosis)
    if args.report_dir:
        try:
            report = write_report(args.report_dir, diagnosis, inputs.analysis, memory=inputs.memory,
                                  throughput=inputs.throughput)
        except OSError as exc:
            raise ShardlightError(f"cannot write the report to {args.report_dir}: {exc.strerror or exc}") from None
        print(f"wrote {report}")
    return 0
