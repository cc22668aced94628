"""Where a run's step time went, and what to do about it: one verdict per profiled window.

* ``step_split``: the step split per rank and overall (compute, overlapped, exposed transfer/wait, input wait, idle);
* ``facts`` → ``verdicts`` (the table: one row per verdict, and ``diagnose``: the primary verdict, evidence,
  ranked actions); ``result``: ``Diagnosis`` and ``Action``;
* ``render``: ``window_line``, ``step_bar``, ``render_panel`` (Rich);
* ``markdown_report``: ``write_report`` (Markdown + PNGs);
* ``run_inputs``: a run directory's trace window, memory and throughput metrics, wrap report and recipe settings.

Its thresholds are the recipe's ``diagnosis:`` section (``shardlight.recipe.instrument_sections``). A leaf of
the instruments (the import contracts): it imports the trace reader and the core's plain data, never the
callbacks or the planner, whose alternatives come in as plain data (``shardlight.planner.alternatives``).
"""

from shardlight.diagnosis.markdown_report import write_report
from shardlight.diagnosis.render import render_panel, step_bar, window_line
from shardlight.diagnosis.result import VERDICTS, Action, Diagnosis
from shardlight.diagnosis.verdicts import diagnose

__all__ = ["diagnose", "Diagnosis", "Action", "VERDICTS", "window_line", "step_bar", "render_panel",
           "write_report"]
