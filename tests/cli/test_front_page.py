"""The docs' front page (docs/index.md) names every drafter and every command a user has."""

from __future__ import annotations

from pathlib import Path

from typer.main import get_command

from specdecode.cli import app
from specdecode.drafters.factory import DRAFTERS

FRONT_PAGE = (Path(__file__).resolve().parents[2] / "docs" / "index.md").read_text()


def test_the_front_page_names_every_drafter():
    assert [name for name in DRAFTERS if f"`{name}`" not in FRONT_PAGE] == []


def test_the_front_page_names_every_command():
    commands = get_command(app).commands  # type: ignore[attr-defined]
    assert len(commands) >= 7
    assert [name for name in commands if f"`specdecode {name}`" not in FRONT_PAGE] == []
