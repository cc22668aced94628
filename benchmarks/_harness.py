"""The one harness every timing benchmark uses: interleaved A/B pairs, a bootstrap 90% interval of the
ratio, an A/A noise floor from the same runs, and one JSON line per benchmark.

* **Pairs in ABBA order.** A block is ``baseline, candidate, candidate, baseline``: two pairs whose
  ratios (candidate / baseline) see the machine's drift from both sides. Blocks repeat until at least
  ``min_pairs`` pairs ran and the interval's half-width is at most ``half_width`` (1 percentage point),
  or ``max_pairs`` is reached. The time budget bounds it all: no pair starts that would not fit (the
  first always runs), ``min_pairs`` or not; each run and each pair prints a line to stderr as it ends.
* **The ratio** is the geometric mean of the per-pair ratios; ``ci90`` is the bootstrap percentile
  interval of that mean (pairs resampled with replacement, a fixed seed, so a rerun of the same numbers
  gives the same interval).
* **A/A noise.** Each block runs each arm twice, so the ratio of an arm's second run to its first is
  an A/A pair at the same spacing as the A/B pairs. ``aa_noise`` is the larger distance of the A/A
  interval's ends from 1: an A/B effect smaller than it is not resolved on this machine.
* **holds** is true only when the interval's bound on the wrong side meets the target: ``ci90[1] <=
  target`` for an upper-bound claim, ``ci90[0] >= target`` for a lower bound; and at least ``min_pairs`` ran.

Each arm is a callable that runs once and returns its metrics (``{"step_s": 0.12, ...}``); the primary
``metric`` drives the stopping rule and ``holds``, every other metric gets its own ratio and interval
under ``metrics``. :func:`emit` prints the line and, when ``make bench`` sets ``SHARDLIGHT_BENCH_RESULTS``,
appends it there; ``python benchmarks/_harness.py table FILE`` prints the table ``make bench`` ends with.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

# Set by `make bench` (a process boundary): the file every benchmark appends its JSON line to.
RESULTS_ENV = "SHARDLIGHT_BENCH_RESULTS"
Metrics = Dict[str, float]


def interval(ratios: Sequence[float], confidence: float = 0.90, resamples: int = 4000,
             seed: int = 0) -> tuple[float, float, float]:
    """(geometric mean, lo, hi): the bootstrap percentile interval of the geometric mean of ``ratios``."""
    if not ratios:
        raise ValueError("no ratios")
    logs = [math.log(r) for r in ratios]
    center = math.exp(statistics.fmean(logs))
    if len(logs) == 1:
        return center, center, center
    rng = random.Random(seed)
    n = len(logs)
    means = sorted(statistics.fmean(rng.choices(logs, k=n)) for _ in range(resamples))
    tail = (1.0 - confidence) / 2.0
    lo = means[int(math.floor(tail * (resamples - 1)))]
    hi = means[int(math.ceil((1.0 - tail) * (resamples - 1)))]
    return center, math.exp(lo), math.exp(hi)


def holds(ci90: Sequence[float], target: float, bound: str) -> bool:
    """A claim holds when the interval's bound on the wrong side meets the target."""
    if bound == "upper":
        return ci90[1] <= target
    if bound == "lower":
        return ci90[0] >= target
    if bound == "equal":
        return ci90[0] == ci90[1] == target
    raise ValueError(f"bound must be upper, lower or equal, not {bound!r}")


def machine() -> str:
    """The machine a figure ran on, in words (the README quotes it with the figure)."""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_implementation()} " \
           f"{platform.python_version()}"


def _stats(ratios: List[float]) -> Dict[str, Any]:
    center, lo, hi = interval(ratios)
    return {"ratio": round(center, 4), "ci90": [round(lo, 4), round(hi, 4)]}


def _noise(ci90: Sequence[float]) -> float:
    """The A/A interval's larger distance from 1."""
    return round(max(ci90[1] - 1.0, 1.0 - ci90[0]), 4)


def compare(name: str, *, baseline: Callable[[], Metrics], candidate: Callable[[], Metrics], metric: str,
            target: float, bound: str = "upper", min_pairs: int = 8, max_pairs: int = 40,
            half_width: float = 0.01, budget_s: float = 600.0, log: Optional[Callable[[str], None]] = None,
            started: Optional[float] = None) -> Dict[str, Any]:
    """Run ABBA blocks of ``baseline`` and ``candidate`` and return the benchmark's result (see the module
    docstring). ``ratio`` is candidate / baseline of ``metric``.

    The budget bounds the wall time, ``min_pairs`` or not: a pair starts only while the time spent (since
    ``started``, a ``time.perf_counter()`` reading; default: now) plus the mean pair so far fits in
    ``budget_s``. The first pair always runs, so the whole ends within about the budget plus one pair
    (``budget_hit`` says the budget stopped it). Every run and every pair logs a line as it ends."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    runs: Dict[str, List[Metrics]] = {"baseline": [], "candidate": []}
    pairs: List[tuple[Metrics, Metrics]] = []  # (baseline, candidate)
    aa: Dict[str, List[float]] = {}  # metric -> second run / first run of the same arm, both arms
    start = time.perf_counter() if started is None else started
    log(f"  {name}: ABBA pairs, {min_pairs} to {max_pairs} unless the {budget_s:.0f} s budget ends first "
        f"(a line per run)")
    arms = {"baseline": baseline, "candidate": candidate}
    pair_s: List[float] = []
    budget_hit = False
    ratios: List[float] = []

    def one(arm: str) -> Metrics:
        run_start = time.perf_counter()
        metrics = arms[arm]()
        log(f"  {name}: pair {len(pairs) + 1}, {arm} run {time.perf_counter() - run_start:.1f} s "
            f"({time.perf_counter() - start:.0f} s of {budget_s:.0f} s)")
        return metrics

    while len(pairs) < max_pairs:
        elapsed = time.perf_counter() - start
        if pairs and elapsed + statistics.fmean(pair_s) > budget_s:
            budget_hit = True
            break
        pair_start = time.perf_counter()
        if len(pairs) % 2 == 0:  # the block's first pair: A B
            a = one("baseline")
            b = one("candidate")
        else:  # its second: B A
            b = one("candidate")
            a = one("baseline")
        pair_s.append(time.perf_counter() - pair_start)
        runs["baseline"].append(a)
        runs["candidate"].append(b)
        pairs.append((a, b))
        if len(pairs) % 2 == 0:  # a block done: its A/A pairs
            (a1, b1), (a2, b2) = pairs[-2:]
            for key in a1:
                if key in b1:
                    aa.setdefault(key, []).extend([a2[key] / a1[key], b2[key] / b1[key]])
        ratios = [b[metric] / a[metric] for a, b in pairs]
        center, lo, hi = interval(ratios)
        log(f"  {name}: {len(pairs)} pairs, ratio {center:.4f} [{lo:.4f}, {hi:.4f}] "
            f"({time.perf_counter() - start:.0f} s)")
        if len(pairs) % 2 == 0 and len(pairs) >= min_pairs and (hi - lo) / 2 <= half_width:
            break
    if budget_hit and len(pairs) < min_pairs:
        log(f"  {name}: the {budget_s:.0f} s budget ran out after {len(pairs)} of at least {min_pairs} pairs")
    aa_stats = _stats(aa[metric]) if metric in aa else {"ratio": None, "ci90": None}
    result: Dict[str, Any] = {
        "benchmark": name,
        "metric": metric,
        **_stats(ratios),
        "pairs": len(pairs),
        "aa_ratio": aa_stats["ratio"],
        "aa_ci90": aa_stats["ci90"],
        "aa_noise": _noise(aa_stats["ci90"]) if aa_stats["ci90"] else None,  # None: no whole ABBA block ran
        "target": target,
        "bound": bound,
        "budget_hit": budget_hit,
    }
    # Fewer pairs than the minimum (the budget ran out) resolve nothing: the claim is not shown to hold.
    result["holds"] = holds(result["ci90"], target, bound) and len(pairs) >= min_pairs
    result["metrics"] = {}
    for key in runs["baseline"][0]:
        if key != metric and all(key in b for _, b in pairs):
            stats = _stats([b[key] / a[key] for a, b in pairs])
            stats["aa_noise"] = _noise(_stats(aa[key])["ci90"]) if key in aa else None
            result["metrics"][key] = stats
    result["medians"] = {arm: {key: round(statistics.median(r[key] for r in arm_runs), 6) for key in arm_runs[0]}
                         for arm, arm_runs in runs.items()}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["machine"] = machine()
    return result


def cpu_env(env: Dict[str, str], ranks: int = 2) -> Dict[str, str]:
    """``env`` for a CPU (gloo) benchmark's worker tree: no GPU visible (on a GPU machine torch would
    otherwise initialise CUDA in every rank: pinned-memory loaders, device probes), and ``ranks`` ranks
    sharing the usable cores (``SHARDLIGHT_BENCH_THREADS``: torch threads per rank; OpenMP's too)."""
    from shardlight.preflight import usable_cores

    threads = str(max(1, usable_cores() // ranks))
    return dict(env, CUDA_VISIBLE_DEVICES="", SHARDLIGHT_BENCH_THREADS=threads, OMP_NUM_THREADS=threads)


def _kill_tree(pid: int) -> None:
    """``pid`` and every descendant (the ranks), killed."""
    import psutil

    try:
        parent = psutil.Process(pid)
        members = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for member in members:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass


def run_tree(command: Sequence[str], *, env: Dict[str, str], cwd: Path, timeout_s: float
             ) -> subprocess.CompletedProcess:
    """Run ``command`` (a process tree: its ranks are its children) to its end, its output captured; past
    ``timeout_s`` the whole tree is killed (a rank left over would hold the output pipes open) and the
    result's ``returncode`` is None, its ``stderr`` the output so far and why. The tree stays in this
    process's group, so an outer ``timeout`` (which signals its group) ends it too."""
    proc = subprocess.Popen(list(command), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process that left the tree still holds the pipes
            out, err = "", ""
        return subprocess.CompletedProcess(proc.args, None, out,
                                           f"{err}\n[killed after {timeout_s:.0f} s: the run did not end]")
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): take the ranks down with it
            _kill_tree(proc.pid)


def exact(name: str, *, value: float, target: float, **extra: Any) -> Dict[str, Any]:
    """A benchmark that counts rather than times (bytes per step, say): its interval is the point."""
    return {"benchmark": name, "ratio": value, "ci90": [value, value], "pairs": 1, "aa_noise": 0.0,
            "target": target, "bound": "equal", "holds": value == target, **extra, "machine": machine()}


def emit(result: Dict[str, Any]) -> None:
    """Print the benchmark's JSON line; append it to ``$SHARDLIGHT_BENCH_RESULTS`` when ``make bench`` runs."""
    line = json.dumps(result)
    print(line, flush=True)
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def table(lines: Sequence[Dict[str, Any]]) -> str:
    """The summary ``make bench`` prints: one row per benchmark line."""
    rows = [["benchmark", "ratio", "ci90", "pairs", "aa_noise", "target", "holds"]]
    for r in lines:
        ci = r.get("ci90")
        bound = {"upper": "<=", "lower": ">=", "equal": "=="}.get(r.get("bound", ""), "")
        rows.append([str(r.get("benchmark")), f"{r.get('ratio')}", f"[{ci[0]}, {ci[1]}]" if ci else "-",
                     str(r.get("pairs", "-")), str(r.get("aa_noise", "-")),
                     f"{bound} {r.get('target')}" if r.get("target") is not None else "-",
                     str(r.get("holds", "-")).lower()])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "table":
        results = [json.loads(line) for line in Path(sys.argv[2]).read_text().splitlines() if line.strip()]
        print(table(results))
    else:
        sys.exit("usage: python benchmarks/_harness.py table RESULTS.jsonl")
