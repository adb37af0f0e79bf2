"""LoggedProgress (specdecode/progress.py): bars on a terminal, lines in a log."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import TextColumn

from specdecode import progress
from specdecode.progress import LoggedProgress


def lines_written(terminal: bool, monkeypatch, every: float) -> list[str]:
    monkeypatch.setattr(progress, "LOG_EVERY", every)
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=100)
    with LoggedProgress(TextColumn("{task.description}"), console=console, auto_refresh=False) as bars:
        task = bars.add_task("target answers", total=4)
        for _ in range(4):
            bars.update(task, advance=1)
    return [line for line in out.getvalue().splitlines() if "/4 after" in line]


def test_a_log_gets_a_line_per_interval_and_one_at_the_end(monkeypatch):
    assert lines_written(False, monkeypatch, every=0.0)[-1].startswith("target answers: 4/4 after 0:00:00")
    assert len(lines_written(False, monkeypatch, every=0.0)) == 4
    assert len(lines_written(False, monkeypatch, every=3600.0)) == 2  # the first update, and the end


def test_a_terminal_gets_the_bars_alone(monkeypatch):
    assert lines_written(True, monkeypatch, every=0.0) == []
