"""Record a real 2-rank gloo FSDP run under torch.profiler, then analyse its traces."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import free_port

torch = pytest.importorskip("torch")

from shardlight.cli.main import main  # noqa: E402
from shardlight.trace import analyze_traces  # noqa: E402

RECORD_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed.fsdp import FullyShardedDataParallel


    def worker(rank, world_size, out_dir, port):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU()) for _ in range(4)]
        model = FullyShardedDataParallel(torch.nn.Sequential(*blocks), device_id=torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def export(profiler):
            profiler.export_chrome_trace(os.path.join(out_dir, f"rank{rank}.pt.trace.json"))

        schedule = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    schedule=schedule, on_trace_ready=export) as profiler:
            for _ in range(4):
                loss = model(torch.randn(32, 128)).sum()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                profiler.step()
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2, join=True)
    """
)


@pytest.fixture(scope="module")
def gloo_traces(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("gloo_fsdp")
    script = work / "record.py"
    script.write_text(RECORD_SCRIPT)
    out_dir = work / "traces"
    out_dir.mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(out_dir), str(free_port())],
        capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out_dir.iterdir()) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    return out_dir


def test_recorded_gloo_fsdp_run_has_comm_and_compute(gloo_traces):
    analysis = analyze_traces([gloo_traces])
    assert sorted(analysis["ranks"]) == ["0", "1"]
    for rank, result in analysis["ranks"].items():
        assert result["mode"] == "gloo"
        assert result["comm_us"] > 0, rank
        assert result["compute_us"] > 0, rank
        assert 0 <= result["overlap_pct"] <= 100
        assert result["exposed_comm_us"] == result["comm_us"] - result["overlap_us"]
        assert result["span_us"] >= result["comm_us"]
        collectives = result["by_collective"]
        assert "all_gather" in collectives and "reduce_scatter" in collectives, collectives
        # 3 active steps were recorded; as in HTA the last one is dropped by default
        assert len([s for s in result["steps"] if s != "unassigned"]) == 2, result["steps"]
    assert analysis["summary"]["num_ranks"] == 2
    assert len(analysis["summary"]["stragglers"]) == 2


def test_recorded_gloo_include_last_step_keeps_three_steps(gloo_traces):
    with_last = analyze_traces([gloo_traces], include_last_step=True)["ranks"]
    default = analyze_traces([gloo_traces])["ranks"]
    for rank, result in with_last.items():
        steps = [s for s in result["steps"] if s != "unassigned"]
        assert len(steps) == 3, result["steps"]
        assert steps[:2] == [s for s in default[rank]["steps"] if s != "unassigned"]
        assert result["comm_us"] > default[rank]["comm_us"]
        assert result["by_collective"]["all_gather"]["count"] > default[rank]["by_collective"]["all_gather"]["count"]


def test_recorded_gloo_cli_json_and_plot(gloo_traces, tmp_path, capsys):
    out_json = tmp_path / "report.json"
    out_png = tmp_path / "report.png"
    assert main(["analyze", str(gloo_traces), "--json", str(out_json), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "gloo" in printed and "overlap %" in printed
    report = json.loads(out_json.read_text())
    assert set(report) == {"ranks", "summary"}
    for key in ("overlap_pct", "comm_us", "compute_us", "exposed_comm_us", "idle_us",
                "non_compute_us", "span_us", "comm_to_compute", "by_collective", "steps"):
        assert key in report["ranks"]["0"], key
    assert out_png.stat().st_size > 0
