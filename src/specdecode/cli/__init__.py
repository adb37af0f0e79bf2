"""The `specdecode` command line: one typer app, its commands registered here in the order
`specdecode --help` lists them.

| command | module |
|---|---|
| `generate` | cli/generation.py |
| `bench`, `profile` | cli/benchmarks.py |
| `serve`, `loadtest` | cli/serving.py |
| `batch` | cli/batch_files.py |
| `train-draft` | training/command.py |

Beside them: cli/options.py (the options several commands take, and the caches' options and
server config made from them), cli/errors.py (bad input: one line on stderr, exit status 2),
cli/console.py (stderr, where everything but a command's result goes).
"""

from __future__ import annotations

import typer
from rich.markup import escape

from specdecode.cli.batch_files import batch
from specdecode.cli.benchmarks import bench, profile
from specdecode.cli.console import stderr
from specdecode.cli.errors import missing_extra, user_errors
from specdecode.cli.generation import generate
from specdecode.cli.serving import loadtest, serve
from specdecode.training import train_draft_command

__all__ = ["app", "main", "generate", "bench", "profile", "serve", "loadtest", "batch"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Exact speculative decoding for Hugging Face causal language models.",
)


@app.callback()
def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


app.command()(generate)
app.command()(bench)
app.command()(profile)
app.command()(serve)
app.command()(loadtest)
app.command()(batch)
app.command("train-draft")(user_errors()(train_draft_command))


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as error:  # an import outside a command's user_errors: the same line
        message = missing_extra(error)
        if message is None:
            raise
        stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None
