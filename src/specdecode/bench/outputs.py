"""What `specdecode bench` writes: results.json (every raw measurement), report.md (tables) and plots.

Every number in the report is computed here from the measurements; none is typed in.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.bench.costs import ROUNDS
from specdecode.bench.environment import summary_line
from specdecode.bench.harness import BenchResult
from specdecode.bench.plots import write_plots
from specdecode.bench.summary import ALL, Row
from specdecode.bench.tables import fmt, row_line, rule

GROUPS = {
    "a": "transformers `generate`, target only (greedy, or sampling at the same temperature)",
    "b": "transformers assisted generation: `prompt_lookup_num_tokens=k`, or `assistant_model=` with k drafts a step",
    "c": "this engine, target only (`speculative=False`)",
    "d": "this engine with a drafter and k",
    "e": "llama.cpp's plain decoding (llama-cpp-python, flash attention on), on the target's own .gguf file",
    "f": "llama.cpp with llama-cpp-python's prompt-lookup drafter (`LlamaPromptLookupDecoding`), on the same file",
}


def write_outputs(result: BenchResult, output_dir: str | Path) -> list[Path]:
    """Write results.json, the plots and report.md into output_dir; returns their paths."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    results = folder / "results.json"
    results.write_text(json.dumps(results_dict(result), indent=1))
    plots = write_plots(result.rows, result.specs, folder)
    report = folder / "report.md"
    report.write_text(render_report(result, [p.name for p in plots]))
    return [results, report, *plots]


def results_dict(result: BenchResult) -> dict:
    return {
        "command": result.config.to_command(),
        "config": result.config.to_dict(),
        "environment": result.environment,
        "systems": result.systems,
        "prompts": result.prompts,
        "skipped_prompts": result.skipped_prompts,
        "forward_costs": result.costs.to_dict(),
        "summary": [row.to_dict() for row in result.rows],
        "greedy_differences": [d.to_dict() for d in result.differences],
        "measurements": [m.to_dict() for m in result.measurements],
    }


def render_report(result: BenchResult, plot_files: list[str]) -> str:
    sections = [
        _header(result),
        "## All categories\n\n" + overall_table(result.rows, result.config.greedy),
        "## Speedup over (a) by category\n\n" + _by_category_table(result.rows, "speedup_vs_a", "{:.2f}x"),
        *(
            [
                "## Speedup over (e), llama.cpp, by category\n\n"
                + _by_category_table(result.rows, "speedup_vs_e", "{:.2f}x")
            ]
            if any(s.group == "e" for s in result.specs)
            else []
        ),
        "## Tokens/s by category\n\n" + _by_category_table(result.rows, "tokens_per_second", "{:.1f}"),
        "## Acceptance by draft position\n\n" + _position_table(result.rows),
        "## Step costs\n\n" + _costs_table(result),
    ]
    if result.config.greedy:
        sections.append("## Greedy outputs that differ from their reference\n\n" + _differences(result))
    if plot_files:
        sections.append("## Plots\n\n" + "\n\n".join(f"![{Path(f).stem}]({f})" for f in plot_files))
    sections.append(_definitions(result.config.greedy))
    return "\n\n".join(sections) + "\n"


def overall_table(rows: list[Row], greedy: bool) -> str:
    quality = ("identical", "greedy_identical", "{:.0%}") if greedy else ("perplexity", "perplexity", "{:.2f}")
    columns = [
        ("tok/s", "tokens_per_second", "{:.1f}"),
        ("vs (a)", "speedup_vs_a", "{:.2f}x"),
        ("vs (b)", "speedup_vs_b", "{:.2f}x"),
        ("vs (c)", "speedup_vs_c", "{:.2f}x"),
        *([("vs (e)", "speedup_vs_e", "{:.2f}x")] if any(r.group == "e" for r in rows) else []),
        ("acceptance", "acceptance_rate", "{:.0%}"),
        ("alpha", "alpha", "{:.2f}"),
        ("tokens/forward", "mean_accepted_length", "{:.2f}"),
        ("ms/token p50", "time_per_token_p50_ms", "{:.1f}"),
        ("ms/token p90", "time_per_token_p90_ms", "{:.1f}"),
        ("predicted vs (c)", "predicted_speedup", "{:.2f}x"),
        ("measured/predicted", "measured_over_predicted", "{:.2f}"),
        quality,
    ]
    lines = [row_line(["", "system", *(title for title, _, _ in columns)]), rule(len(columns) + 2)]
    for row in (r for r in rows if r.category == ALL):
        cells = [fmt(getattr(row, attribute), spec) for _, attribute, spec in columns]
        lines.append(row_line([f"({row.group})", row.system, *cells]))
    return "\n".join(lines)


def _by_category_table(rows: list[Row], attribute: str, spec: str) -> str:
    categories = list(dict.fromkeys(r.category for r in rows))  # ALL comes last, as summarize orders it
    systems = list(dict.fromkeys(r.system for r in rows))
    value = {(r.system, r.category): getattr(r, attribute) for r in rows}
    lines = [row_line(["system", *categories]), rule(len(categories) + 1)]
    for system in systems:
        lines.append(row_line([system, *(fmt(value.get((system, c)), spec) for c in categories)]))
    return "\n".join(lines)


def _position_table(rows: list[Row]) -> str:
    speculative = [r for r in rows if r.category == ALL and r.acceptance_by_position]
    if not speculative:
        return "No speculative system of this engine ran."
    width = max(len(r.acceptance_by_position) for r in speculative)
    lines = [
        "Accepted / drafted at each draft position, all categories.\n",
        row_line(["system", *(str(i + 1) for i in range(width))]),
        rule(width + 1),
    ]
    for row in speculative:
        cells = [fmt(v, "{:.0%}") for v in row.acceptance_by_position]
        lines.append(row_line([row.system, *cells, *[""] * (width - len(cells))]))
    return "\n".join(lines)


def _costs_table(result: BenchResult) -> str:
    costs = result.costs
    lines = [
        f"Median of {ROUNDS} timed calls each, interleaved, after a {costs.context_tokens}-token prefix (the median prompt).\n",
        "| call | ms |",
        "|---|---|",
    ]
    lines += [f"| target forward, {n} token{'s' * (n > 1)} | {1000 * s:.1f} |" for n, s in costs.target_s.items()]
    for series, by_k in costs.draft_s.items():
        lines += [f"| {series}: one proposal of {k} tokens | {1000 * s:.2f} |" for k, s in by_k.items()]
    return "\n".join(lines)


def _differences(result: BenchResult) -> str:
    if not result.differences:
        return (
            f"None: all {len(result.measurements)} outputs equal their reference's output for the same prompt, "
            "token for token."
        )
    lines = [
        "Where a system's output first differs from its reference's (see Definitions), the target's two most likely "
        "tokens there (one uncached forward on the reference's prefix). A logit gap near zero is a numerical "
        "near-tie, not a wrong output.\n",
        "| system | prompt | run | position | reference's token | its token | top 1 (logit) | top 2 (logit) | gap |",
        rule(9),
    ]
    for d in result.differences:
        # json.dumps shows spaces and newlines; a | would end the table cell
        top = [f"{t['token']} {json.dumps(t['text'])} ({t['logit']:.4f})".replace("|", "\\|") for t in d.top_two]
        lines.append(
            row_line(
                [
                    d.system,
                    d.prompt_id,
                    str(d.run),
                    str(d.position),
                    str(d.reference_token),
                    str(d.system_token),
                    *top,
                    f"{d.logit_gap:.2e}",
                ]
            )
        )
    return "\n".join(lines)


def _header(result: BenchResult) -> str:
    config = result.config
    categories = list(dict.fromkeys(p["category"] for p in result.prompts))
    skipped = f" ({len(result.skipped_prompts)} skipped: too long for the context)" if result.skipped_prompts else ""
    lines = [
        "# Speculative decoding benchmark",
        "",
        f"`{config.to_command()}`, {result.environment['date_utc']}",
        "",
        f"- machine: {summary_line(result.environment)}",
        f"- target: {config.target}; drafts: {', '.join(config.drafts) or 'none'}; "
        f"drafters: {', '.join(config.active_drafters)}; k: {', '.join(map(str, config.k_values))}",
        f"- prompts: {len(result.prompts)}{skipped} from {config.prompts or 'the Spec-Bench subset shipped with specdecode'}, "
        f"first turn only; categories: {', '.join(categories)}",
        f"- {config.max_new_tokens} new tokens at most, temperature {config.temperature:g}, {config.runs} run(s); "
        "each prompt runs every system once per run, in a new random order, after one warm-up of each",
        "",
        "Systems:",
        *(f"- ({letter}) {text}" for letter, text in GROUPS.items() if letter in {s.group for s in result.specs}),
    ]
    return "\n".join(lines)


def _definitions(greedy: bool) -> str:
    quality = (
        "identical: the fraction of outputs equal to the reference's output for the same prompt, token for token; "
        "the reference of a speculative system is its own framework's target-only run, (c) for (d) and (e) for (f) "
        "(speculation is exact relative to the target as that framework runs it), and (a) for the others."
        if greedy
        else "perplexity: exp of the target's mean negative log-likelihood of the generated tokens (temperature 1), "
        "averaged over outputs; systems that sample the target's distribution score alike on average."
    )
    return "\n".join(
        [
            "## Definitions",
            "",
            "- tok/s: new tokens over wall time (prefill included), summed over prompts; vs (x): the ratio of tok/s "
            "on the same prompts; (b) is matched by drafter and k; (e), llama.cpp's plain decoding, where it ran.",
            "- acceptance: accepted / drafted tokens; alpha: the chance a draft token is accepted when all before it "
            "were (drafts after a rejection are not tested); tokens/forward: new tokens per target forward "
            "(for (f): per llama.cpp decode call, the prefill's included).",
            "- ms/token p50, p90: percentiles over generations of wall time / new tokens.",
            "- predicted vs (c): Leviathan et al.'s expected tokens per step (1 - alpha^(k+1)) / (1 - alpha), times the "
            "measured 1-token target forward, over the measured step cost (one proposal of k tokens plus one target "
            "forward of k + 1 tokens); measured/predicted compares it with the measured speedup over (c).",
            f"- {quality}",
        ]
    )
