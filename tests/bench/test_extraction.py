"""`specdecode bench --workload json` (bench/extraction.py) on a tiny byte-level model: both
systems run every document under its schema, outputs identical, the grammar's share measured;
options that do not apply are refused in one line."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from helpers import byte_llama
from specdecode import SpeculativeEngine
from specdecode.bench.extraction import documents, run_extraction_workload
from specdecode.cli import app
from specdecode.drafters import PromptLookupDrafter


def test_the_workload_compares_constrained_decoding_with_forced_tokens():
    engine = SpeculativeEngine(*byte_llama(max_positions=1024), PromptLookupDrafter(), num_speculative_tokens=4)
    asked = []
    table = run_extraction_workload(engine, 24, on_request=lambda: asked.append(1))
    n = len(documents())
    assert len(asked) == 2 * n
    rows = {line.split("|")[1].strip(): line.split("|") for line in table.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"constrained target-only", "auto + forced tokens"}
    assert rows["auto + forced tokens"][-2].strip() == f"{n}/{n}"  # identical to constrained target-only
    assert int(rows["auto + forced tokens"][5]) > 0  # forced tokens were drafted and kept
    assert re.search(r"took \d+\.\d% of constrained target-only", table)


def test_options_that_do_not_apply_are_refused():
    result = CliRunner().invoke(app, ["bench", "--workload", "json", "--drafter", "model"])
    assert result.exit_code == 2 and "--drafter do not apply to --workload json" in result.stderr
