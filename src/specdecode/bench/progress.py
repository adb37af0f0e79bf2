"""A progress bar over the timed generations, with the time left."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from specdecode.progress import LoggedProgress


def bench_progress(console: Console) -> Progress:
    return LoggedProgress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        # generations differ a lot in length (a RAG prompt prefills ~700 tokens): estimate the
        # rate over several minutes, across several shuffled rounds of systems, not the last few
        speed_estimate_period=300,
    )
