"""Rank 0's report of a comm window, once every rank's result is gathered (:class:`WindowReport`): the
cross-rank wait/transfer split, the verdict, the logged metrics and the console line.

What rank 0 logs of a window, per step of it (ms per step), at the window's last step:

* aggregated (mean over ranks): ``comm/all_gather_ms``, ``comm/reduce_scatter_ms``, ``comm/all_reduce_ms``,
  ``comm/total_ms``, ``comm/exposed_ms``, ``comm/overlap_pct``, ``comm/compute_ms``, ``comm/ratio``
  (communication / computation time), ``step/time_ms``; each also as ``<key>_min``/``_max``/``_mean``;
* ``comm/slowest_rank``: the rank holding the cross-rank maximum of ``comm/total_ms``
  (``comm/total_ms_max``) — usually the rank that *waits* most, not the one it waits for (that is
  ``comm/straggler_rank`` below); ``step/slowest_rank`` likewise for ``step/time_ms``;
* per rank (``per_rank``): ``comm/rank<R>/<name>`` and ``step/rank<R>/time_ms``;
* where the communication time went, from the ranks' traces matched collective by collective
  (``shardlight.trace.combine``): ``comm/wait_ms`` (waiting for the last rank to arrive) and
  ``comm/transfer_ms`` (moving bytes once all are there), ``comm/exposed_wait_ms`` and
  ``comm/exposed_transfer_ms`` (the parts not hidden behind compute), ``input/wait_ms`` (host time waiting
  for the next batch), aggregated and per rank like the others; ``comm/<collective>_busbw_gbps`` (bus
  bandwidth, nccl-tests conventions; on CPU only with ``record_shapes``); ``comm/straggler_rank``: the rank
  the others wait for;
* the window's verdict (judged as the run's is, ``across_windows.diagnose_run``, on this window alone: the
  classes it cannot tell apart named together): ``diagnosis/*`` shares of the step, and one console line,
  e.g. ``step 150: communication-bound — exposed transfer 31% of step (all-gather 70% of it), wait 4%;
  headroom 22.1 GB (rank 1)``. The latest window's combined analysis stays in ``Shared.findings`` for the
  end-of-run verdict. ``diagnosis.enabled: false`` keeps the split and bandwidth metrics, without the verdict.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl

from shardlight.callbacks._comm_metrics import METRIC_KEYS, bandwidth_metrics, group_metric_keys, split_metrics
from shardlight.callbacks._common import Findings, RankTable, aggregate, log_metrics, per_rank_key
from shardlight.diagnosis import Diagnosis, window_line
from shardlight.diagnosis.across_windows import diagnose_run
from shardlight.errors import warn
from shardlight.recipe.instrument_sections import DiagnosisConfig
from shardlight.trace import combine


class WindowReport:
    """What rank 0 does with a window's gathered results (``CommTimeCallback``'s arguments of the same names).

    Args:
        per_rank: also log ``comm/rank<R>/...`` keys.
        table: where the latest per-rank values go for the end-of-run table (None: nowhere).
        findings: where the latest window's analysis goes, and the memory and throughput callbacks' latest
            values come from.
        diagnosis: the recipe's ``diagnosis:`` thresholds; micro_batch_size: what its advice is about.
        print_windows: print each window's verdict line.
    """

    def __init__(self, *, per_rank: bool, table: Optional[RankTable], findings: Findings, diagnosis: DiagnosisConfig,
                 micro_batch_size: Optional[int], print_windows: bool) -> None:
        self.per_rank = per_rank
        self.table = table
        self.findings = findings
        self.diagnosis = diagnosis
        self.micro_batch_size = micro_batch_size
        self.print_windows = print_windows

    def log(self, trainer: pl.Trainer, window: Dict[str, Any], results: List[Dict[str, Any]]) -> None:
        failed = [r for r, res in enumerate(results) if "metrics" not in res]
        if failed:
            reasons = "; ".join(f"rank {r}: {results[r].get('error')}" for r in failed[:4])
            warn(f"comm window at step {window['start']}: no result from rank(s) {failed} ({reasons})")
        per_rank = [res.get("metrics") for res in results]
        if all(m is None for m in per_rank):
            return
        verdict, diagnosis = self._diagnose(trainer, window, results, per_rank)
        metrics = aggregate(METRIC_KEYS + tuple(group_metric_keys(per_rank)), per_rank, worst="mean")
        for key, slow_key in (("comm/total_ms", "comm/slowest_rank"), ("step/time_ms", "step/slowest_rank")):
            candidates = [(m[key], r) for r, m in enumerate(per_rank) if m is not None and key in m]
            if candidates:
                metrics[slow_key] = float(max(candidates)[1])
        for r, m in enumerate(per_rank):
            if m is None:
                continue
            if self.per_rank:
                metrics.update({per_rank_key(k, r): v for k, v in m.items() if k in METRIC_KEYS})
            if self.table is not None:
                self.table.update(r, {k: m.get(k) for k in METRIC_KEYS})
        metrics["comm/window_start_step"] = float(window["start"])
        if verdict is not None:
            metrics.update(verdict)
        log_metrics(trainer, metrics, step=window["end"])
        if diagnosis is not None and self.print_windows:
            self._print(trainer, window_line(window["end"], diagnosis))

    def _diagnose(self, trainer: pl.Trainer, window: Dict[str, Any], results: List[Dict[str, Any]],
                  per_rank: List[Optional[Dict[str, float]]]) -> Tuple[Dict[str, float], Optional[Diagnosis]]:
        """Match the ranks' collectives (wait vs transfer) and, with ``diagnosis.enabled``, diagnose the window:
        the bandwidth and verdict metrics, and the verdict (None when off or failed).

        Rank 0's main thread does this, after the gather (about 2 ms for 2 ranks of the default recipe): the
        cross-rank match needs every rank's payload. The split metrics go into ``per_rank`` (each rank's dict).
        A failure here is a warning: the window's plain comm metrics are still logged.
        """
        analyses = {str(r): res["analysis"] for r, res in enumerate(results) if "analysis" in res}
        try:
            analysis = combine(analyses, link_peak_gbps=self.diagnosis.link_peak_gbps)
        except Exception as exc:  # noqa: BLE001 - the analysis must never stop training
            warn(f"comm window at step {window['start']}: no cross-rank split ({type(exc).__name__}: {exc})")
            return {}, None
        for r, metrics in enumerate(per_rank):
            rank_result = analysis["ranks"].get(str(r))
            if metrics is not None and rank_result is not None:
                metrics.update(split_metrics(rank_result))
        self.findings.add_window(window["start"], analysis)
        out = bandwidth_metrics(analysis["summary"])
        if not self.diagnosis.enabled:
            return out, None
        try:
            # Judged as the end-of-run verdict judges its windows (one here): the classes its steps cannot tell
            # apart are named together, and a warm-up window says so, so no window's line reads as a flip.
            diagnosis = diagnose_run(
                [(window["start"], analysis)], run_start=self.findings.run_start, config=self.diagnosis,
                memory=self.findings.memory or None, throughput=self.findings.throughput or None,
                wrap=getattr(trainer.strategy, "wrap_report", None), micro_batch_size=self.micro_batch_size,
            )
        except Exception as exc:  # noqa: BLE001 - the diagnosis must never stop training
            warn(f"comm window at step {window['start']}: no diagnosis ({type(exc).__name__}: {exc})")
            return out, None
        out.update({k: v for k, v in diagnosis.summary_metrics().items() if isinstance(v, (int, float))})
        if diagnosis.straggler_rank is not None:  # only when the window is straggler-bound
            out["comm/straggler_rank"] = float(diagnosis.straggler_rank)
        return out, diagnosis

    @staticmethod
    def _print(trainer: pl.Trainer, line: str) -> None:
        bar = trainer.progress_bar_callback
        if bar is not None and hasattr(bar, "print"):
            bar.print(line)  # above a live progress bar, not through it
        else:
            print(line, flush=True)
