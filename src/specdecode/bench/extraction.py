"""`specdecode bench --workload json`: schema-constrained JSON extraction, the structured-output
workload applications send, constrained target-only decoding against `auto` with the grammar's
forced tokens drafted for free, in one interleaved run.

The documents and schemas (bench/data/extraction.jsonl: people, products, invoices, flights,
...) were written for this project, not taken from Spec-Bench. Each request asks, through the
chat template where the model has one, for the document's fields as JSON, under the document's
schema. Greedy; every output is compared with constrained target-only decoding's and checked
against its schema's required keys. The grammar's cost is measured apart: the time spent in
the matcher (masks, forced tokens, advancing) per target-only step, against that step's time.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from importlib import resources

from specdecode.bench.environment import cpu_name
from specdecode.bench.interleave import interleave
from specdecode.bench.repeat import prompt_ids
from specdecode.bench.tables import markdown_table
from specdecode.core import constraints
from specdecode.core.constraints import Constraint
from specdecode.engine import GenerationResult, SpeculativeEngine

INSTRUCTION = "Extract the fields of this text as JSON.\n\n{document}"


def documents() -> list[dict]:
    text = (resources.files("specdecode.bench") / "data" / "extraction.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_extraction_workload(
    engine: SpeculativeEngine,
    new_tokens: int,
    runs: int = 1,
    seed: int = 0,
    on_request: Callable[[], None] = lambda: None,
) -> str:
    """The Markdown table: each system's tokens/s, speedup, tokens per forward, forced tokens
    kept, valid and identical outputs; and the grammar's share of a target-only step."""
    rows = documents()
    requests = [
        (prompt_ids(engine, [{"role": "user", "content": INSTRUCTION.format(document=r["document"])}]), r) for r in rows
    ]
    views = {"constrained target-only": engine.with_drafter(None, 0), "auto + forced tokens": engine}

    def system(view: SpeculativeEngine) -> Callable[[tuple], GenerationResult]:
        def run(request: tuple) -> GenerationResult:
            ids, row = request
            result = view.generate([ids], max_new_tokens=new_tokens, constraint=Constraint.json_schema(row["schema"]))
            on_request()
            return result[0]

        return run

    runs_ = interleave(
        {name: system(view) for name, view in views.items()}, requests, repeats=runs, order="shuffle", seed=seed
    )
    share = grammar_share(views["constrained target-only"], requests, new_tokens)
    return _table(runs_, views, requests, share, new_tokens, runs)


def grammar_share(engine: SpeculativeEngine, requests: list[tuple], new_tokens: int) -> float:
    """The matcher's time over constrained target-only decoding's whole time: its cost as a
    share of a target-only step."""
    with _timed_matcher() as spent:
        start = time.perf_counter()
        for ids, row in requests:
            engine.generate([ids], max_new_tokens=new_tokens, constraint=Constraint.json_schema(row["schema"]))
        total = time.perf_counter() - start
    return spent[0] / total


@contextmanager
def _timed_matcher():
    """Every Matcher method the decoder calls, timed (seconds summed in the yielded list)."""
    spent = [0.0]
    names = ("masked", "forced", "advance")
    originals = {name: getattr(constraints.Matcher, name) for name in names}

    def timing(method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return timed

    for name, method in originals.items():
        setattr(constraints.Matcher, name, timing(method))
    try:
        yield spent
    finally:
        for name, method in originals.items():
            setattr(constraints.Matcher, name, method)


def _valid(text: str | None, schema: dict) -> bool:
    try:
        value = json.loads(text or "")
    except ValueError:
        return False
    return isinstance(value, dict) and set(schema.get("required", [])) <= set(value)


def _table(runs: list, views: dict, requests: list, share: float, new_tokens: int, repeats: int) -> str:
    baseline = {(r.item, r.repeat): r.value.token_ids for r in runs if r.system == "constrained target-only"}
    totals: dict[str, defaultdict[str, float]] = {name: defaultdict(float) for name in views}
    for run in runs:
        cell, result = totals[run.system], run.value
        cell["tokens"] += len(result.token_ids)
        cell["seconds"] += run.seconds
        cell["forwards"] += result.stats.target_forwards
        cell["forced"] += result.stats.forced_accepted
        cell["valid"] += _valid(result.text, requests[run.item][1]["schema"])
        cell["identical"] += result.token_ids == baseline[(run.item, run.repeat)]
        cell["requests"] += 1
    base = totals["constrained target-only"]
    header = [
        "system",
        "tok/s",
        "x constrained target-only",
        "tokens/forward",
        "forced tokens kept",
        "valid",
        "identical",
    ]
    rows = []
    for name, cell in totals.items():
        rate, n = cell["tokens"] / cell["seconds"], int(cell["requests"])
        rows.append(
            [name, f"{rate:.1f}", f"{rate / (base['tokens'] / base['seconds']):.2f}x"]
            + [f"{cell['tokens'] / cell['forwards']:.2f}", f"{int(cell['forced'])}"]
            + [f"{int(cell['valid'])}/{n}", f"{int(cell['identical'])}/{n}"]
        )
    title = (
        f"JSON extraction under each document's schema, {cpu_name()}, greedy, {len(requests)} documents, up to "
        f"{new_tokens} new tokens, {repeats} run(s), `specdecode bench --workload json --max-new-tokens {new_tokens}"
        f" --runs {repeats}`"
    )
    cost = f"The grammar (masks, forced tokens, advancing) took {100 * share:.1f}% of constrained target-only decoding's time."
    return f"{title}\n\n{markdown_table(header, rows)}\n\n{cost}"
