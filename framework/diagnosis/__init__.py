"""Where a run's step time went, and what to do about it: one verdict per profiled window.

* ``config``: the recipe's ``diagnosis:`` section (thresholds);
* ``split``: the step split per rank and overall (compute, overlapped, exposed transfer/wait, input wait, idle);
* ``facts`` → ``verdicts`` (the table: one row per verdict) → ``diagnose`` (the primary verdict, evidence,
  ranked actions); ``model``: ``Diagnosis`` and ``Action``;
* ``render``: ``window_line``, ``step_bar``, ``render_panel`` (Rich); ``report``: ``write_report`` (Markdown + PNGs);
* ``run_inputs``: a run directory's trace window, memory and throughput metrics, wrap report and recipe settings.

Imports only ``shardlight.trace``, ``runtime``, ``files`` and ``errors`` (the import contracts): planner
alternatives come in as plain data (``shardlight.planner.alternatives``).
"""

from shardlight.diagnosis.config import Config
from shardlight.diagnosis.diagnose import diagnose
from shardlight.diagnosis.model import VERDICTS, Action, Diagnosis
from shardlight.diagnosis.render import render_panel, step_bar, window_line
from shardlight.diagnosis.report import write_report

__all__ = ["Config", "diagnose", "Diagnosis", "Action", "VERDICTS", "window_line", "step_bar", "render_panel",
           "write_report"]
