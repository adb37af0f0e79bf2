"""What each benchmark script does with its Markdown table: print it, and keep it where asked."""

from __future__ import annotations

from pathlib import Path


def emit(table: str, out: str | None) -> None:
    print(table)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(table + "\n")
