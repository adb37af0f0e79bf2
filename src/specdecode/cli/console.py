"""Where the commands write what is not their result: status lines, progress, warnings and
errors go to stderr, so that stdout holds only the output (text, JSON, tables) a script reads."""

from __future__ import annotations

from rich.console import Console
from rich.status import Status

stderr = Console(stderr=True)


def loading(target: str, draft: str | None = None) -> Status:
    """The status line shown while the models load."""
    return stderr.status(f"Loading {target}" + (f" and {draft}" if draft else ""))
