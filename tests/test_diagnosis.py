"""shardlight.diagnosis: truth tables of hand-built analysis dicts (known splits → the expected verdict, its
evidence and its actions), thresholds from DiagnosisConfig, the formats, the report files, and the planner's
alternatives as plain data."""

from __future__ import annotations

import pytest

from shardlight.diagnosis import VERDICTS, diagnose, render_panel, step_bar, window_line, write_report
from shardlight.diagnosis.step_split import PARTS, check_same_steps
from shardlight.errors import ShardlightError
from shardlight.planner.alternatives import alternatives_from_plan
from shardlight.recipe.instrument_sections import DiagnosisConfig

GB = 1e9


def rank(*, wall=100.0, compute=60.0, overlapped=10.0, transfer=5.0, wait=2.0, input_wait=1.0, input_ms=None,
         steps=2, gather_share=0.7, step_numbers=None):
    """One rank's analysis entry whose split is exactly the given ms per step (totals over ``steps``, in us)."""
    k = 1000.0 * steps
    comm = overlapped + transfer + wait
    collectives = {}
    for name, share, count in (("all_gather", gather_share, 20), ("reduce_scatter", 1 - gather_share, 10)):
        collectives[name] = {"comm_us": share * comm * k, "overlap_us": share * overlapped * k,
                             "exposed_comm_us": share * (transfer + wait) * k, "count": count * steps}
    numbers = step_numbers or range(1, steps + 1)
    return {
        "comm_us": comm * k, "compute_us": (compute + overlapped) * k, "overlap_us": overlapped * k,
        "exposed_comm_us": (transfer + wait) * k, "idle_us": 0, "span_us": wall * k, "by_collective": collectives,
        "steps": {str(n): {} for n in numbers},
        "split": {"steps": steps, "wall_us": wall * k, "wait_us": wait * k, "transfer_us": (comm - wait) * k,
                  "exposed_wait_us": wait * k, "exposed_transfer_us": transfer * k,
                  "input_us": (input_wait + 1.0 if input_ms is None else input_ms) * k,
                  "input_wait_us": input_wait * k, "matched": 30, "unmatched": 0},
    }


def analysis(*ranks, missing=(), bandwidth=None):
    return {"ranks": {str(r): entry for r, entry in enumerate(ranks)},
            "summary": {"clock": "cpu", "collectives": {"missing_ranks": list(missing)}, "bandwidth": bandwidth or {}}}


def memory(*headrooms_gb, capacity_gb=80.0, peak_gb=50.0, state_gb=(5.0, 5.0, 10.0)):
    return {r: {"headroom_bytes": h * GB, "capacity_bytes": capacity_gb * GB, "peak_bytes": peak_gb * GB,
                "params_bytes": state_gb[0] * GB, "grads_bytes": state_gb[1] * GB, "optim_bytes": state_gb[2] * GB}
            for r, h in enumerate(headrooms_gb)}


def alt(label, *, fits=True, headroom_gb=9.2, change=-1 / 3, current=False, what="removes backward all-gathers"):
    return {"label": label, "strategy": label, "fits": fits, "headroom_bytes": headroom_gb * GB,
            "comm_change_fraction": change, "what": what, "current": current}


# --- the truth table: a known split → the verdict -------------------------------------------------------------
CASES = {
    "communication-bound": dict(compute=40, transfer=31, wait=4),
    "input-bound": dict(compute=50, transfer=3, wait=2, input_wait=30),
    "host-bound": dict(compute=45, overlapped=5, transfer=3, wait=2, input_wait=1),  # idle = 44
    "compute-bound": dict(compute=80, overlapped=10, transfer=4, wait=2, input_wait=1),
}


@pytest.mark.parametrize("verdict", sorted(CASES))
def test_known_split_gives_its_verdict(verdict):
    result = diagnose(analysis(rank(**CASES[verdict]), rank(**CASES[verdict])), memory=memory(30, 30))
    assert result.verdict == verdict
    assert result.headline.startswith(f"{verdict}: ")
    assert result.straggler_rank is None and result.secondary == []


def test_communication_bound_evidence_and_ranked_actions():
    current = alt("FULL_SHARD", current=True, headroom_gb=20.0, change=0.0)
    sgo = alt("SHARD_GRAD_OP")
    too_big = alt("NO_SHARD", fits=False, change=-0.9)
    result = diagnose(analysis(rank(compute=40, transfer=31, wait=4), rank(compute=40, transfer=31, wait=4)),
                      memory=memory(30, 22.1), alternatives=[current, too_big, sgo], micro_batch_size=4,
                      wrap={"units": 23, "params_per_unit": {"min": 1000, "median": 164_000, "max": 2_000_000}})
    assert result.verdict == "communication-bound"
    ev = result.evidence
    assert ev["exposed_transfer_ms"] == pytest.approx(31) and ev["exposed_transfer_pct"] == pytest.approx(31)
    assert ev["step_ms"] == pytest.approx(100) and ev["threshold_pct"] == 15.0
    assert ev["dominant_collective"] == "all_gather" and ev["dominant_collective_pct"] == pytest.approx(70)
    assert ev["collectives_per_step"] == pytest.approx(30)
    texts = [a.text for a in result.actions]
    # The fitting alternative, costed on the measured exposed transfer: 31 ms × 1/3; the one that does not fit
    # is not offered; the tiny-units advice (not costed) comes after the costed one.
    assert texts[0] == "SHARD_GRAD_OP fits (plan: 9.2 GB headroom) and removes backward all-gathers"
    assert result.actions[0].effect == "about −10.3 ms of exposed transfer per step"
    assert not any("NO_SHARD" in t for t in texts)
    assert any(t.startswith("units are tiny (median 164k params): coarser wrapping") for t in texts)
    assert window_line(150, result) == ("step 150: communication-bound — exposed transfer 31% of step "
                                        "(all-gather 70% of it), wait 4%; headroom 22.1 GB (rank 1)")


def test_micro_batch_action_uses_headroom_over_activations():
    # Activations = peak − state = 50 − 20 = 30 GB; spare = 70 − 5% of 80 = 66 GB → 1 + 66/30 = 3.2 → 3×.
    result = diagnose(analysis(rank(compute=40, transfer=31)), memory=memory(70), micro_batch_size=4)
    batch = [a for a in result.actions if "micro_batch_size" in a.text]
    assert batch and batch[0].text.startswith("raise trainer.micro_batch_size from 4 to 12 (headroom allows about 3×)")
    assert batch[0].score == pytest.approx(31 * (1 - 1 / 3))


@pytest.mark.parametrize("cause, slow", [("compute", dict(compute=75)), ("input", dict(input_ms=45, input_wait=26))])
def test_straggler_names_the_rank_everybody_waits_for_and_why(cause, slow):
    # Ranks 0-2 wait 25 ms per step for rank 3 (no wait itself), whose compute or input is slower than the median.
    others = [rank(wall=90, compute=50, overlapped=0, transfer=5, wait=25, input_wait=1, input_ms=20) for _ in range(3)]
    base = dict(wall=90, compute=50, overlapped=0, transfer=5, wait=0, input_wait=1, input_ms=20)
    straggler = rank(**{**base, **slow})
    result = diagnose(analysis(*others, straggler))
    assert result.verdict == "straggler-bound"
    assert result.straggler_rank == 3 and result.straggler_cause == cause
    ev = result.evidence
    assert ev["straggler_rank"] == 3 and ev["cause"] == cause
    if cause == "compute":
        assert ev["compute_slower_pct"] == pytest.approx(50) and ev["straggler_compute_ms"] == pytest.approx(75)
        assert ev["median_compute_ms"] == pytest.approx(50)
        assert result.actions[0].text.startswith("rank 3's compute is 50% slower than the median")
    else:
        assert ev["input_slower_pct"] == pytest.approx(125) and ev["median_input_ms"] == pytest.approx(20)
        assert result.actions[0].text.startswith("rank 3's input is 125% slower than the median")
    assert "everyone waits for rank 3" in result.lead


def test_wait_every_rank_does_alike_is_not_a_straggler():
    # The split of the 2-rank CPU run that was called straggler-bound: both ranks wait (40 and 58 ms of a 374 ms
    # step, 13% on average), the least-waiting rank no slower than the other. Only 9 ms of the mean 49 ms is
    # waiting for rank 0 (2.4%): the rest is the ranks reaching collectives in turn, nobody's doing.
    common = dict(wall=374, overlapped=0, transfer=17, input_wait=0.7, input_ms=0.7)
    result = diagnose(analysis(rank(**common, compute=290, wait=40), rank(**common, compute=272, wait=58)))
    assert result.verdict != "straggler-bound" and "straggler-bound" not in result.secondary, result
    assert result.shares["exposed_wait_pct"] > 10  # the split still shows all of it
    # Rank 1 waiting 90 ms for a rank 0 that waits for nobody: all of the mean 45 ms (12%) is for rank 0.
    result = diagnose(analysis(rank(**common, compute=290, wait=0), rank(**common, compute=272, wait=90)))
    assert result.verdict == "straggler-bound" and result.straggler_rank == 0
    assert result.evidence["straggler_wait_pct"] == pytest.approx(result.shares["exposed_wait_pct"])  # all of it
    assert result.evidence["straggler_wait_pct"] > 10


def test_straggler_without_a_slow_part_says_neither():
    equal = dict(wall=90, compute=50, overlapped=0, transfer=5, input_wait=1, input_ms=20)
    result = diagnose(analysis(rank(**equal, wait=25), rank(**equal, wait=25), rank(**equal, wait=0)))
    assert result.verdict == "straggler-bound" and result.straggler_rank == 2 and result.straggler_cause is None
    assert "neither its compute nor its input" in result.actions[0].text


def test_memory_bound_alone_is_primary_and_is_secondary_next_to_a_time_finding():
    quiet = dict(compute=80, overlapped=10, transfer=4, wait=2, input_wait=1)
    alone = diagnose(analysis(rank(**quiet), rank(**quiet)), memory=memory(30, 2.0),
                     alternatives=[alt("SHARD_GRAD_OP", current=True, headroom_gb=1.0, change=0.0),
                                   alt("FULL_SHARD", headroom_gb=12.0, change=0.5, what="shards everything")])
    assert alone.verdict == "memory-bound"
    assert alone.evidence["min_headroom_gb"] == pytest.approx(2.0) and alone.evidence["min_headroom_rank"] == 1
    assert alone.evidence["headroom_pct"] == pytest.approx(2.5)
    assert alone.actions[0].text.startswith("FULL_SHARD fits (plan: 12.0 GB headroom)")
    assert alone.actions[0].effect == "+11.0 GB of headroom (plan)"
    both = diagnose(analysis(rank(compute=40, transfer=31), rank(compute=40, transfer=31)), memory=memory(30, 2.0))
    assert both.verdict == "communication-bound" and both.secondary == ["memory-bound"]


def test_largest_share_wins_and_the_rest_are_secondary():
    result = diagnose(analysis(rank(compute=30, overlapped=0, transfer=20, wait=0, input_wait=35)))
    assert result.verdict == "input-bound" and result.secondary == ["communication-bound"]


@pytest.mark.parametrize("share, expected", [(19.9, "compute-bound"), (20.1, "communication-bound")])
def test_config_threshold_flips_the_verdict(share, expected):
    entry = rank(compute=100 - share - 5, overlapped=0, transfer=share, wait=2, input_wait=1, wall=100)
    result = diagnose(analysis(entry), config=DiagnosisConfig(exposed_transfer_pct=20.0, host_idle_pct=50.0))
    assert result.verdict == expected


@pytest.mark.parametrize("headroom_gb, expected", [(7.9, "memory-bound"), (8.1, "compute-bound")])
def test_min_headroom_threshold_flips_memory_bound(headroom_gb, expected):
    quiet = rank(compute=80, overlapped=10, transfer=4, wait=2, input_wait=1)
    result = diagnose(analysis(quiet), memory=memory(headroom_gb), config=DiagnosisConfig(min_headroom_pct=10.0))
    assert result.verdict == expected


def test_split_parts_sum_to_the_wall_per_rank_and_overall():
    result = diagnose(analysis(rank(wall=120, compute=50, overlapped=7, transfer=11, wait=3, input_wait=6),
                               rank(wall=90, compute=40, overlapped=5, transfer=20, wait=9, input_wait=2)))
    for split in (*result.split_by_rank.values(), result.split):
        assert sum(split[p] for p in PARTS) == pytest.approx(split["step_ms"])
    assert result.split_by_rank[0]["idle_ms"] == pytest.approx(120 - 50 - 7 - 11 - 3 - 6)
    assert result.split["step_ms"] == pytest.approx(105)
    assert sum(result.shares.values()) == pytest.approx(100)
    # Rounding that makes the parts exceed the wall: idle is 0 and the step is the parts' sum.
    over = diagnose(analysis(rank(wall=50, compute=40, overlapped=10, transfer=5, wait=0, input_wait=0)))
    assert over.split["idle_ms"] == 0 and over.split["step_ms"] == pytest.approx(55)


def test_summary_metrics_keys_and_values():
    result = diagnose(analysis(rank(compute=40, transfer=31), rank(compute=40, transfer=31)), memory=memory(30, 22.1))
    metrics = result.summary_metrics()
    assert metrics["diagnosis/verdict"] == "communication-bound"
    assert metrics["diagnosis/verdict_code"] == VERDICTS.index("communication-bound")
    for key in ("exposed_transfer_pct", "exposed_wait_pct", "input_wait_pct", "compute_pct", "overlapped_pct",
                "idle_pct", "step_ms", "straggler_rank", "min_headroom_gb", "missing_ranks"):
        assert f"diagnosis/{key}" in metrics, key
    assert metrics["diagnosis/exposed_transfer_pct"] == pytest.approx(31)
    assert metrics["diagnosis/straggler_rank"] == -1 and metrics["diagnosis/min_headroom_gb"] == pytest.approx(22.1)
    assert all(isinstance(v, float) for k, v in metrics.items() if k != "diagnosis/verdict")
    assert result.to_dict()["split_by_rank"].keys() == {"0", "1"}


def test_step_bar_and_panel():
    result = diagnose(analysis(rank(compute=40, overlapped=10, transfer=31, wait=4, input_wait=5)))
    bar = step_bar(result, width=50)
    cells = bar[1:bar.index("]")]
    assert len(cells) == 50 and cells.count("T") == round(0.31 * 50) and cells.startswith("C" * 20)
    assert "T exposed transfer 31%" in bar
    from rich.console import Console

    console = Console(record=True, width=140, color_system=None)
    console.print(render_panel(result))
    text = console.export_text()
    assert "diagnosis: communication-bound" in text and "actions:" in text and "evidence:" in text


def test_missing_ranks_are_named():
    result = diagnose(analysis(rank(), rank(), missing=[2]), missing_ranks=[3])
    assert result.missing_ranks == [2, 3]
    assert window_line(5, result).endswith("; no trace from rank(s) 2, 3")


@pytest.mark.parametrize("broken, message", [
    ({"split": None}, "has no step split"),
    ({"split": {"steps": 2}}, "split lacks"),
    ({"split": {"steps": 0, "wall_us": 1, "exposed_wait_us": 0, "exposed_transfer_us": 0, "input_us": 0,
                "input_wait_us": 0}}, "no complete ProfilerStep"),
])
def test_bad_analysis_is_a_clear_error(broken, message):
    entry = rank()
    entry.update(broken)
    if entry["split"] is None:
        del entry["split"]
    with pytest.raises(ShardlightError, match=message):
        diagnose(analysis(entry))


def test_ranks_with_different_steps_are_an_error():
    assert check_same_steps(analysis(rank(), rank())) == [1, 2]
    with pytest.raises(ShardlightError, match="traces of different steps"):
        check_same_steps(analysis(rank(), rank(step_numbers=[7, 8])))


def test_write_report_writes_markdown_and_plots(tmp_path):
    data = analysis(rank(compute=40, transfer=31), rank(compute=42, transfer=29))
    mem = memory(30, 22.1)
    throughput = {"tokens_per_sec_per_device": 800.0, "scaling_efficiency": 0.8}
    result = diagnose(data, memory=mem, throughput=throughput)
    path = write_report(tmp_path / "out", result, data, memory=mem, throughput=throughput)
    assert path == tmp_path / "out" / "report.md"
    text = path.read_text()
    assert text.startswith("# Diagnosis: communication-bound") and "## Actions" in text and "| rank |" in text
    for image in ("split.png", "memory.png", "throughput.png"):
        assert (tmp_path / "out" / image).stat().st_size > 0 and f"]({image})" in text
    bare = write_report(tmp_path / "bare", result, data)
    assert sorted(p.name for p in bare.parent.iterdir()) == ["report.md", "split.png"]  # no timeline in the data
    data["ranks"]["0"]["timeline"] = {"step": "1", "start_us": 0.0, "end_us": 100.0, "compute": [[0.0, 40.0]],
                                      "wait": [[40.0, 60.0]], "transfer": [[60.0, 90.0]], "input": []}
    drawn = write_report(tmp_path / "drawn", result, data)
    assert (drawn.parent / "timeline.png").stat().st_size > 0 and "](timeline.png)" in drawn.read_text()


# --- the planner's alternatives, as plain data ---------------------------------------------------------------
def _row(strategy, *, comm, headroom_gb, fits=True, ckpt=False):
    return {"sharding_strategy": strategy, "activation_checkpointing": ckpt, "cpu_offload": False,
            "replicas": 1, "shard_group_size": 4, "mesh_shape": None, "fits": fits, "headroom_bytes": headroom_gb * GB,
            "comm_time_s": comm, "step_time_s": comm + 1.0}


def test_alternatives_from_plan_rows():
    plan = {"strategies": [_row("FULL_SHARD", comm=0.3, headroom_gb=20), _row("SHARD_GRAD_OP", comm=0.2, headroom_gb=9),
                           _row("NO_SHARD", comm=0.15, headroom_gb=-5, fits=False),
                           _row("FULL_SHARD", comm=0.3, headroom_gb=40, ckpt=True),
                           _row("SHARD_GRAD_OP", comm=0.2, headroom_gb=30, ckpt=True)]}
    alts = {a["label"]: a for a in alternatives_from_plan(plan, strategy="FULL_SHARD")}
    assert set(alts) == {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "FULL_SHARD +ckpt"}
    assert alts["FULL_SHARD"]["current"] and not alts["SHARD_GRAD_OP"]["current"]
    assert alts["SHARD_GRAD_OP"]["comm_change_fraction"] == pytest.approx(-1 / 3)
    assert alts["SHARD_GRAD_OP"]["what"].startswith("removes backward all-gathers")
    assert alts["NO_SHARD"]["fits"] is False and alts["FULL_SHARD +ckpt"]["comm_change_fraction"] == 0
    result = diagnose(analysis(rank(compute=40, transfer=30)), alternatives=list(alts.values()))
    assert result.actions[0].text.startswith("SHARD_GRAD_OP fits (plan: 9.0 GB headroom) and removes backward")
    assert result.actions[0].effect == "about −10.0 ms of exposed transfer per step"
