"""Bad input on the command line (`user_errors`), and its message with the argument spelled as
the flag the user wrote."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from specdecode.cli.console import stderr
from specdecode.errors import SpecDecodeError


@contextmanager
def user_errors() -> Iterator[None]:
    """Bad input ends the command with one line on stderr and exit status 2, never a traceback."""
    try:
        yield
    except SpecDecodeError as error:
        stderr.print(f"[bold red]error:[/] {_as_flags(error)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _as_flags(error: SpecDecodeError) -> str:
    """The message of a rule on an argument ("max_new_tokens must ...") with the argument spelled
    as an option (--max-new-tokens): the checks word each rule once, in Python's names
    (core/checks.py), and each interface names the argument as its users write it (the
    server: server/errors.py, API_NAMES)."""
    message, param = str(error), error.param
    if param and re.match(rf"{re.escape(param)}( \(\w+\))? must ", message):  # "top_p must ...", "num_... (k) must ..."
        return "--" + param.replace("_", "-") + message[len(param) :]
    return message
