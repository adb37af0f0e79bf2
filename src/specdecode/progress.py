"""Progress bars that also write to a log: rich's, with lines where the console is no terminal."""

from __future__ import annotations

import time
from datetime import timedelta

from rich.progress import Progress, TaskID

LOG_EVERY = 60.0  # seconds between two lines of a task's progress where the console is no terminal


class LoggedProgress(Progress):
    """rich's Progress, but where its console is no terminal (output to a file, a long job under
    nohup) a line per task at most every LOG_EVERY seconds and when it ends: there the bars are
    drawn only once, when they stop, and a log of a run of hours would say nothing until then."""

    def __init__(self, *columns, **kwargs):
        super().__init__(*columns, **kwargs)
        self._logged: dict[TaskID, float] = {}  # task -> when its last line was written

    def update(self, task_id: TaskID, **kwargs) -> None:  # type: ignore[override]
        super().update(task_id, **kwargs)
        if self.console.is_terminal or self.disable:
            return
        task = self._tasks[task_id]
        now = time.monotonic()
        if task_id in self._logged and now - self._logged[task_id] < LOG_EVERY and not task.finished:
            return
        self._logged[task_id] = now
        done = f"{task.completed:g}/{task.total:g}" if task.total else f"{task.completed:g}"
        left = f", about {_clock(task.time_remaining)} left" if task.time_remaining and not task.finished else ""
        self.console.print(f"{task.description}: {done} after {_clock(task.elapsed)}{left}", highlight=False)


def _clock(seconds: float | None) -> str:
    return str(timedelta(seconds=round(seconds or 0)))
