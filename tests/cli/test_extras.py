"""`pip install specdecode` without extras: `generate` needs none of them, and a command that needs
a missing one says which extra in one line (exit status 2), never a traceback. The packages are
hidden from a child process by an import hook, as in an environment that never installed them."""

import subprocess
import sys
import textwrap

import pytest

from specdecode.cli.errors import EXTRAS

HIDE = textwrap.dedent(
    """
    import importlib.abc, sys
    HIDDEN = set(sys.argv.pop(1).split(","))
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HIDDEN:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Hide())
    from specdecode.cli import main
    sys.argv[0] = "specdecode"
    main()
    """
)
EVERY_EXTRA = ",".join(EXTRAS)


def specdecode_without(hidden: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HIDE, hidden, *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_generate_needs_no_extra():
    done = specdecode_without(EVERY_EXTRA, "generate", "Hello", "--max-new-tokens", "3")
    assert done.returncode == 0, done.stderr
    assert "target-only" not in done.stdout and "tokens per target forward" in done.stdout


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["serve", "--port", "1"], "serve"),
        (["generate", "Hi", "--max-new-tokens", "2", "--cache-url", "redis://127.0.0.1:1"], "redis"),
        (["generate", "Hi", "--max-new-tokens", "2", "--quantization", "nf4"], "bnb"),
        (["loadtest", "--url", "http://127.0.0.1:1/v1"], "bench"),
    ],
    ids=["serve", "redis", "bnb", "loadtest"],
)
def test_a_feature_without_its_extra_names_it_in_one_line(args, extra):
    done = specdecode_without(EVERY_EXTRA, *args)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"pip install 'specdecode[{extra}]'" in lines[0]


def test_an_import_error_of_the_project_itself_stays_a_traceback():
    from specdecode.cli.errors import missing_extra

    assert missing_extra(ModuleNotFoundError("No module named 'specdecode.nothing'", name="specdecode.nothing")) is None
    assert "specdecode[otel]" in missing_extra(ModuleNotFoundError("x", name="opentelemetry.sdk"))
