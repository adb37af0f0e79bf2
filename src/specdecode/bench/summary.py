"""Measurements summed up per system and category (and over all categories).

Throughput is total new tokens over total wall time, as Spec-Bench computes it, so long
generations weigh more than short ones. Speedups compare two systems on the same prompts:
over (a), transformers' greedy generate; over (b), transformers' assisted generation with
the same drafter and k; over (c), this engine's target-only loop, which is what the
predicted speedup predicts, so measured/predicted shows the per-step overhead left; over (e),
llama.cpp's plain decoding on the same .gguf, where it ran (`--system llama.cpp`).

Acceptance comes from each system's own counts: this engine's stats for (d); for (f), the
forwards llama.cpp's worker counted (tokens per forward; it reports no accepted tokens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from specdecode.bench.costs import ForwardCosts
from specdecode.bench.measurement import Measurement
from specdecode.bench.systems import ENGINE, HF, LLAMACPP, SystemSpec
from specdecode.bench.theory import per_token_acceptance, predicted_speedup

ALL = "all"


@dataclass
class Row:
    system: str
    group: str
    category: str
    k: int
    generations: int
    new_tokens: int
    wall_time_s: float
    tokens_per_second: float
    time_per_token_p50_ms: float
    time_per_token_p90_ms: float
    speedup_vs_a: float | None = None
    speedup_vs_b: float | None = None
    speedup_vs_c: float | None = None
    speedup_vs_e: float | None = None  # over llama.cpp's plain decoding; None where it did not run
    acceptance_rate: float | None = None  # accepted / drafted, as the engine counts
    alpha: float | None = None  # per-token acceptance, see theory.per_token_acceptance
    mean_accepted_length: float | None = None  # tokens per target forward
    acceptance_by_position: list[float | None] | None = None  # accepted / drafted at each position; None: never drafted
    predicted_speedup: float | None = None  # over (c)
    measured_over_predicted: float | None = None
    greedy_identical: float | None = None  # fraction equal to the reference's (quality.py); greedy runs only
    perplexity: float | None = None  # mean over outputs; sampling runs only

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(measurements: list[Measurement], specs: list[SystemSpec], costs: ForwardCosts, greedy: bool) -> list[Row]:
    """One row per system and category, then per system over all categories."""
    categories = [*dict.fromkeys(m.category for m in measurements), ALL]
    rows = []
    for spec in specs:
        for category in categories:
            chosen = [m for m in measurements if m.system == spec.name and category in (ALL, m.category)]
            if chosen:
                rows.append(_row(spec, category, chosen, costs, greedy))
    _add_speedups(rows, specs)
    return rows


def _row(spec: SystemSpec, category: str, chosen: list[Measurement], costs: ForwardCosts, greedy: bool) -> Row:
    new_tokens = sum(m.new_tokens for m in chosen)
    wall_time = sum(m.wall_time_s for m in chosen)
    per_token_ms = [1000 * m.time_per_token_s for m in chosen]
    row = Row(
        spec.name,
        spec.group,
        category,
        spec.k,
        len(chosen),
        new_tokens,
        wall_time,
        new_tokens / wall_time if wall_time > 0 else 0.0,
        float(np.percentile(per_token_ms, 50)),
        float(np.percentile(per_token_ms, 90)),
    )
    if greedy:
        row.greedy_identical = sum(m.first_difference is None for m in chosen) / len(chosen)
    else:
        scores = [m.perplexity for m in chosen if m.perplexity is not None]
        row.perplexity = float(np.mean(scores)) if scores else None
    if spec.speculative and spec.framework == ENGINE:
        _add_acceptance(row, [m.stats for m in chosen])
        if row.alpha is not None:
            row.predicted_speedup = predicted_speedup(
                row.alpha, spec.k, costs.target_s[1], costs.target_s[spec.k + 1], costs.draft_s[spec.series][spec.k]
            )
    elif spec.speculative and spec.framework == LLAMACPP:
        forwards = sum(m.stats["target_forwards"] for m in chosen)
        row.mean_accepted_length = new_tokens / forwards if forwards else None
    return row


def _add_acceptance(row: Row, stats: list[dict]) -> None:
    def total(key: str) -> int:
        return sum(s[key] for s in stats)

    drafted = [sum(column) for column in zip(*(s["drafted_per_position"] for s in stats))]
    accepted = [sum(column) for column in zip(*(s["accepted_per_position"] for s in stats))]
    row.acceptance_rate = total("accepted_tokens") / total("drafted_tokens") if total("drafted_tokens") else None
    row.mean_accepted_length = total("generated_tokens") / total("target_forwards")
    row.acceptance_by_position = [a / d if d else None for a, d in zip(accepted, drafted)]
    row.alpha = per_token_acceptance(drafted, accepted)


def _add_speedups(rows: list[Row], specs: list[SystemSpec]) -> None:
    by_key = {(row.system, row.category): row for row in rows}
    spec_of = {spec.name: spec for spec in specs}

    def ratio(row: Row, baseline: SystemSpec) -> float | None:
        base = by_key.get((baseline.name, row.category))
        return row.tokens_per_second / base.tokens_per_second if base and base.tokens_per_second else None

    for row in rows:
        spec = spec_of[row.system]
        row.speedup_vs_a = ratio(row, SystemSpec(HF))
        row.speedup_vs_e = ratio(row, SystemSpec(LLAMACPP))
        if spec.group == "d":
            row.speedup_vs_b = ratio(row, spec.on(HF))
            row.speedup_vs_c = ratio(row, SystemSpec(ENGINE, quantization=spec.quantization))
            if row.predicted_speedup and row.speedup_vs_c is not None:
                row.measured_over_predicted = row.speedup_vs_c / row.predicted_speedup
