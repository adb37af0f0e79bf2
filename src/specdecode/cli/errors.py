"""Bad input on the command line (`user_errors`), and its message with the argument spelled as
the flag the user wrote."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.markup import escape

from specdecode.cli.console import stderr
from specdecode.errors import SpecDecodeError

# the packages of each optional feature (pyproject.toml's extras), by the module a command imports
EXTRAS = {
    **dict.fromkeys(("fastapi", "uvicorn", "starlette", "tenacity"), ("serve", "specdecode serve and batch")),
    "prometheus_client": ("serve", "the server's metrics"),
    "redis": ("redis", "--cache-url (the Redis cache backend)"),
    "opentelemetry": ("otel", "OpenTelemetry traces"),
    "matplotlib": ("bench", "specdecode bench's and loadtest's plots"),
    "openai": ("bench", "specdecode loadtest"),
    "bitsandbytes": ("bnb", "bitsandbytes quantization (nf4, fp4, llm-int8)"),
    "ray": ("ray", "Ray replicas (--ray)"),
    "llguidance": ("structured", "structured outputs"),
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one line that names the extra to install, where an optional feature's package is missing."""
    module = (error.name or "").split(".")[0]
    if module not in EXTRAS:
        return None
    extra, feature = EXTRAS[module]
    return f"{feature}: the '{module}' package is not installed; pip install 'specdecode[{extra}]'"


@contextmanager
def user_errors() -> Iterator[None]:
    """Bad input, or a missing optional package, ends the command with one line on stderr and
    exit status 2, never a traceback."""
    try:
        yield
    except SpecDecodeError as error:
        stderr.print(f"[bold red]error:[/] {_as_flags(error)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except ModuleNotFoundError as error:
        message = missing_extra(error)
        if message is None:
            raise
        stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
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
