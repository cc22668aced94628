"""``shardlight diagnose``: bad input is one ``error:`` line and exit 2; a trace directory and a run directory
(latest window, metrics CSV, wrap report, recipe) give a panel, JSON and a report; a missing rank is partial.

Synthetic gloo-style traces (main-thread ``aten::mm``, ``c10d::allgather_`` issuing ``gloo:all_gather`` on
a worker thread) stand in for a recorded run. ``test_trace_dir_happy_path`` takes the step split
(``ranks[r].split``) from the real shardlight.trace analysis; the others fill it in (``with_split``) only where
an analysis lacks it, so they test the diagnosis plumbing whatever the trace package's state.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import shardlight.diagnosis.run_inputs as run_inputs
from shardlight.cli.main import main
from shardlight.recipe import load_recipe, to_yaml
from shardlight.trace import analyze_traces

REPO = Path(__file__).resolve().parents[1]


def _op(name, ts, dur, tid, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def gloo_trace(rank, steps=(1, 2, 3), world=2, compute=600, gather=300):
    """Per step (1000 us): compute, then an all-gather nothing overlaps."""
    events = []
    for i, number in enumerate(steps):
        base = i * 1000
        events += [_op(f"ProfilerStep#{number}", base, 1000, 1, "user_annotation"), _op("aten::mm", base + 10, compute, 1),
                   _op("c10d::allgather_", base + 620, 5, 1),
                   _op("gloo:all_gather", base + 625, gather, 2, "user_annotation")]
    return {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": world}, "traceEvents": events}


def write_traces(directory: Path, ranks=(0, 1), steps_of=None, world=2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        steps = (steps_of or {}).get(r, (1, 2, 3))
        (directory / f"rank{r}.pt.trace.json").write_text(json.dumps(gloo_trace(r, steps, world)))
    return directory


def expect_error(capsys, args, *fragments):
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_not_a_directory(tmp_path, capsys):
    expect_error(capsys, ["diagnose", str(tmp_path / "nope")], "no such directory")
    (tmp_path / "file.json").write_text("{}")
    expect_error(capsys, ["diagnose", str(tmp_path / "file.json")], "not a directory")


def test_neither_run_nor_trace_dir(tmp_path, capsys):
    expect_error(capsys, ["diagnose", str(tmp_path)], "neither a run directory", "nor a trace directory")


def test_run_dir_without_traces(tmp_path, capsys):
    (tmp_path / "recipe.yaml").write_text("name: x\n")
    expect_error(capsys, ["diagnose", str(tmp_path)], "a run directory without traces", "callbacks.comm")


def test_traces_of_different_steps(tmp_path, capsys):
    traces = write_traces(tmp_path / "t", steps_of={1: (7, 8, 9)})
    expect_error(capsys, ["diagnose", str(traces)], "traces of different steps", "rank 0: [1, 2]", "rank 1: [7, 8]")


def test_analysis_without_split_is_a_clear_error(tmp_path, capsys, monkeypatch):
    traces = write_traces(tmp_path / "t")

    def without_split(paths):
        analysis = analyze_traces(paths)
        for result in analysis["ranks"].values():
            result.pop("split", None)
        return analysis

    monkeypatch.setattr(run_inputs, "analyze_traces", without_split)
    expect_error(capsys, ["diagnose", str(traces)], "has no step split")


def with_split(paths):
    """The real analysis, plus the split these synthetic traces have (compute 600 us, exposed gather 300 us,
    wall 1000 us per step) when the installed shardlight.trace does not compute it yet."""
    analysis = analyze_traces(paths)
    for result in analysis["ranks"].values():
        if "split" not in result:
            steps = len([s for s in result["steps"] if s.isdigit()])
            result["split"] = {"steps": steps, "wall_us": 1000 * steps, "wait_us": 0, "transfer_us": result["comm_us"],
                               "exposed_wait_us": 0, "exposed_transfer_us": result["exposed_comm_us"], "input_us": 0,
                               "input_wait_us": 0, "matched": steps, "unmatched": 0}
    return analysis


def test_trace_dir_happy_path(tmp_path, capsys):
    traces = write_traces(tmp_path / "t")
    if "split" not in analyze_traces(traces)["ranks"]["0"]:
        pytest.xfail("shardlight.trace does not compute ranks[r].split yet")
    out_json, report = tmp_path / "d.json", tmp_path / "report"
    assert main(["diagnose", str(traces), "--json", str(out_json), "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "communication-bound" in printed
    data = json.loads(out_json.read_text())["diagnosis"]
    assert data["verdict"] == "communication-bound"
    assert data["shares"]["exposed_transfer_pct"] > 15
    assert (report / "report.md").exists() and (report / "split.png").stat().st_size > 0


def make_run_dir(tmp_path: Path, world: int) -> Path:
    run = tmp_path / "run"
    write_traces(run / "traces" / "step_000002", steps_of={0: (1, 2, 3)}, ranks=(0,), world=world)
    write_traces(run / "traces" / "step_000010", ranks=(0, 1), world=world)
    cfg = load_recipe(None, [f"trainer.devices={world}", "fsdp.sharding_strategy=FULL_SHARD",
                             "diagnosis.exposed_transfer_pct=50"])
    (run / "recipe.yaml").write_text(to_yaml(cfg))
    (run / "wrap_report.json").write_text(json.dumps({"units": 3, "params_per_unit": {"median": 164_000}}))
    (run / "csv").mkdir()
    keys = ["step", "throughput/tokens_per_sec_per_device"] + [
        f"memory/rank{r}/{name}_gb" for r in range(2) for name in ("headroom", "capacity", "peak", "params")]
    with open(run / "csv" / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerow({"step": 10, "throughput/tokens_per_sec_per_device": 900.0,
                         **{f"memory/rank{r}/headroom_gb": 30.0 - r for r in range(2)},
                         **{f"memory/rank{r}/capacity_gb": 64.0 for r in range(2)},
                         **{f"memory/rank{r}/peak_gb": 3.0 for r in range(2)},
                         **{f"memory/rank{r}/params_gb": 0.1 for r in range(2)}})
    return run


def test_run_dir_uses_latest_window_metrics_recipe_and_names_a_missing_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_inputs, "analyze_traces", with_split)
    run = make_run_dir(tmp_path, world=3)
    out_json = tmp_path / "d.json"
    assert main(["diagnose", str(run), "--json", str(out_json)]) == 0
    captured = capsys.readouterr()
    assert "note: partial diagnosis: no trace from rank(s) 2" in captured.err and "error:" not in captured.err
    saved = json.loads(out_json.read_text())
    assert saved["step"] == 10 and saved["window"].endswith("step_000010")
    data = saved["diagnosis"]
    assert data["missing_ranks"] == [2] and sorted(data["split_by_rank"]) == ["0", "1"]
    # The recipe's diagnosis section raised the transfer threshold to 50%: 30% exposed transfer is not enough.
    assert data["shares"]["exposed_transfer_pct"] == pytest.approx(30)
    assert data["verdict"] == "compute-bound"
    assert data["min_headroom_bytes"] == pytest.approx(29e9) and data["min_headroom_rank"] == 1
    # The planner's alternatives for the run's recipe, its measured 64 GB capacity as the device memory.
    alternatives = {a["label"]: a for a in saved["alternatives"]}
    assert alternatives["FULL_SHARD"]["current"] and alternatives["SHARD_GRAD_OP"]["comm_change_fraction"] < 0


def test_trace_dir_with_a_rank_missing_is_partial(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_inputs, "analyze_traces", with_split)
    traces = write_traces(tmp_path / "t", ranks=(1,), world=2)
    out_json = tmp_path / "d.json"
    assert main(["diagnose", str(traces), "--json", str(out_json)]) == 0
    assert "no trace from rank(s) 0" in capsys.readouterr().err
    assert json.loads(out_json.read_text())["diagnosis"]["missing_ranks"] == [0]


def test_profile_gives_every_strategy_run_the_same_verdict(tmp_path, monkeypatch):
    from shardlight.planner import sweep_report as report
    from shardlight.planner.sweep import diagnose_run

    monkeypatch.setattr(run_inputs, "analyze_traces", with_split)
    run = make_run_dir(tmp_path, world=2)
    alternatives = [{"label": "SHARD_GRAD_OP", "fits": True, "headroom_bytes": 9e9, "comm_change_fraction": -0.5,
                     "what": "removes backward all-gathers", "current": False}]
    result = {"summary": {"run_dir": str(run)}}
    diagnosis = diagnose_run(result, alternatives, tmp_path / "profile" / "diagnosis" / "full_shard")
    assert diagnosis["verdict"] == "compute-bound" and diagnosis["window_step"] == 10
    assert Path(diagnosis["report"]).is_file()
    assert diagnose_run({"error": "exit 1"}, alternatives, tmp_path / "x") is None
    broken = diagnose_run({"summary": {"run_dir": str(tmp_path / "nothing")}}, [], tmp_path / "y")
    assert "no such directory" in broken["error"]
    runs = {"FULL_SHARD": {"diagnosis": diagnosis}, "NO_SHARD": {"diagnosis": broken}}
    lines = report.diagnosis_lines({"runs": runs}, tmp_path / "profile")
    assert lines[2].startswith("- **FULL_SHARD**: compute-bound: compute 60% of step")
    assert "([report](diagnosis/full_shard/report.md))" in lines[2]
    assert lines[-2].startswith("- **NO_SHARD**: no diagnosis (")
    assert report.table_rows({"runs": runs})[0][-1] == "compute-bound"


def test_apply_writes_the_runs_recipe_with_the_top_actions_change(tmp_path, capsys, monkeypatch):
    """``--apply``: RUN_DIR/recipe-next.yaml is the run's recipe with the first action's recipe change, and loads
    as ``shardlight train`` will load it; a folder of traces has no recipe to change (one line, exit 2)."""
    monkeypatch.setattr(run_inputs, "analyze_traces", with_split)
    run = make_run_dir(tmp_path, world=2)
    out_json = tmp_path / "d.json"
    assert main(["diagnose", str(run), "--json", str(out_json), "--apply"]) == 0
    actions = json.loads(out_json.read_text())["diagnosis"]["actions"]
    change = next(a["change"] for a in actions if a.get("change"))
    assert f"wrote {run / 'recipe-next.yaml'} ({change})" in capsys.readouterr().out
    applied = load_recipe(str(run / "recipe-next.yaml"))
    assert applied == load_recipe(str(run / "recipe.yaml"), change.split())
    assert applied != load_recipe(str(run / "recipe.yaml"))
    expect_error(capsys, ["diagnose", str(write_traces(tmp_path / "traces")), "--apply"],
                 "--apply needs a run directory")
