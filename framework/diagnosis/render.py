"""A diagnosis as one log line (``window_line``), a one-line bar of the split (``step_bar``) and a Rich
panel (``render_panel``): verdict, bar, the top actions and the evidence."""

from __future__ import annotations

from typing import Any, List

from shardlight.diagnosis.result import Diagnosis
from shardlight.diagnosis.step_split import PARTS

# One letter per part of the split, the bar's alphabet (plain ASCII: logs and non-TTY consoles).
LETTERS = {"compute_ms": "C", "overlapped_ms": "O", "exposed_transfer_ms": "T", "exposed_wait_ms": "W",
           "input_wait_ms": "I", "idle_ms": "."}
NAMES = {"compute_ms": "compute", "overlapped_ms": "overlapped comm", "exposed_transfer_ms": "exposed transfer",
         "exposed_wait_ms": "exposed wait", "input_wait_ms": "input wait", "idle_ms": "idle"}
COLORS = {"compute_ms": "green", "overlapped_ms": "cyan", "exposed_transfer_ms": "red", "exposed_wait_ms": "magenta",
          "input_wait_ms": "yellow", "idle_ms": "bright_black"}
TOP_ACTIONS = 3


def window_line(step: int, diagnosis: Diagnosis) -> str:
    """``step 150: communication-bound — exposed transfer 31% of step (all-gather 70% of it), wait 4%;
    headroom 22.1 GB (rank 1)`` (the headroom part only with memory numbers). A window judged with its
    uncertainty (``across_windows.diagnose_run``) that names several classes shows them with their shares,
    ``step 60: communication-bound or compute-bound: exposed transfer 18 ± 5%, compute 57 ± 5%``, and a
    warm-up window says ``(warm-up)``."""
    when = f"step {step}" + (" (warm-up)" if diagnosis.provisional else "")
    several = diagnosis.label != diagnosis.verdict
    line = f"{when}: {diagnosis.headline}" if several else f"{when}: {diagnosis.verdict} — {diagnosis.lead}"
    if diagnosis.min_headroom_bytes is not None:
        line += f"; headroom {diagnosis.min_headroom_bytes / 1e9:.1f} GB (rank {diagnosis.min_headroom_rank})"
    if diagnosis.missing_ranks:
        line += f"; no trace from rank(s) {', '.join(map(str, diagnosis.missing_ranks))}"
    return line


def bar_cells(diagnosis: Diagnosis, width: int) -> List[int]:
    """Cells per part, summing to ``width`` (largest remainder, so small parts are not all rounded away)."""
    step = diagnosis.split["step_ms"]
    exact = [width * diagnosis.split[p] / step if step > 0 else 0.0 for p in PARTS]
    cells = [int(x) for x in exact]
    by_remainder = sorted(range(len(PARTS)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in by_remainder[: width - sum(cells)]:
        cells[i] += 1
    return cells


def step_bar(diagnosis: Diagnosis, width: int = 60) -> str:
    """``[CCCCCCOOTTTTW....] C compute 40% O overlapped comm 10% ...`` for one mean step."""
    cells = bar_cells(diagnosis, width)
    bar = "".join(LETTERS[p] * n for p, n in zip(PARTS, cells))
    legend = "  ".join(f"{LETTERS[p]} {NAMES[p]} {diagnosis.shares[p.replace('_ms', '_pct')]:.0f}%" for p in PARTS)
    return f"[{bar}] {diagnosis.split['step_ms']:.1f} ms/step  {legend}"


def format_value(value: Any) -> str:
    """An evidence number as people read it: three significant digits, whole numbers from 100 on."""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return "–" if value is None else str(value)


def render_panel(diagnosis: Diagnosis) -> Any:
    """A Rich ``Panel``: the headline, the coloured bar, the top actions with their effect, the evidence."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    bar = Text("[")
    for part, n in zip(PARTS, bar_cells(diagnosis, 60)):
        bar.append(LETTERS[part] * n, style=COLORS[part])
    bar.append(f"] {diagnosis.split['step_ms']:.1f} ms/step")
    legend = Text("  ".join(f"{LETTERS[p]} {NAMES[p]} {diagnosis.shares[p.replace('_ms', '_pct')]:.0f}%"
                            for p in PARTS), style="dim")
    lines: List[Any] = [Text(diagnosis.headline, style="bold"), bar, legend]
    if diagnosis.certainty:
        lines.append(Text(diagnosis.certainty, style="yellow" if diagnosis.provisional else ""))
    if diagnosis.secondary:
        lines.append(Text(f"also: {', '.join(diagnosis.secondary)}"))
    if diagnosis.missing_ranks:
        lines.append(Text(f"partial: no trace from rank(s) {', '.join(map(str, diagnosis.missing_ranks))}",
                          style="yellow"))
    if diagnosis.actions:
        lines.append(Text("actions:", style="bold"))
        for number, action in enumerate(diagnosis.actions[:TOP_ACTIONS], 1):
            change = f" [set {action.change}]" if action.change else ""
            lines.append(Text(f" {number}. {action.text}{change} → {action.effect}"))
    lines.append(Text("evidence: " + ", ".join(f"{k}={format_value(v)}" for k, v in diagnosis.evidence.items()),
                      style="dim"))
    return Panel(Group(*lines), title=f"diagnosis: {diagnosis.label}", title_align="left")
