"""PNG plots of a benchmark: speedup by category, acceptance by draft position, tokens/s versus k.

matplotlib's object API (Figure, not pyplot) draws without a display or global state.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from specdecode.bench.summary import ALL, Row
from specdecode.bench.systems import ENGINE, HF, LLAMACPP, SystemSpec

DPI = 130
HATCH = {HF: "///", ENGINE: None, LLAMACPP: "..."}  # bars: which framework ran the system, in this order
LINE = {HF: "--", ENGINE: "-", LLAMACPP: ":"}  # lines: the same


def write_plots(rows: list[Row], specs: list[SystemSpec], folder: Path) -> list[Path]:
    plots = [
        speedup_by_category(rows, specs, folder / "speedup_by_category.png"),
        acceptance_by_position(rows, folder / "acceptance_by_position.png"),
        tokens_per_second_vs_k(rows, specs, folder / "tokens_per_second_vs_k.png"),
    ]
    return [path for path in plots if path is not None]


def speedup_by_category(rows: list[Row], specs: list[SystemSpec], path: Path) -> Path:
    """Grouped bars: one group per category, one bar per system, height = speedup over (a).

    A drafter and k share one colour: transformers' bar hatched with lines and llama.cpp's with
    dots, beside this engine's; llama.cpp's plain decoding (e) shares the colour of the engine's (c).
    """
    categories = list(dict.fromkeys(r.category for r in rows))
    pairs = list(dict.fromkeys(s.on(ENGINE) for s in specs if s.group != "a"))  # (a) is the line at 1
    bars = sorted(
        (s for s in specs if s.group != "a"), key=lambda s: (pairs.index(s.on(ENGINE)), list(HATCH).index(s.framework))
    )
    value = {(r.system, r.category): r.speedup_vs_a or 0.0 for r in rows}
    width = 0.8 / max(len(bars), 1)
    figure = Figure(figsize=(max(7.0, 1.0 * len(categories) + 0.3 * len(bars)) + 3.0, 4.8), layout="constrained")
    axes = figure.subplots()
    for i, spec in enumerate(bars):
        offsets = [c + (i - (len(bars) - 1) / 2) * width for c in range(len(categories))]
        heights = [value.get((spec.name, c), 0.0) for c in categories]
        axes.bar(
            offsets,
            heights,
            width,
            label=spec.name,
            color=f"C{pairs.index(spec.on(ENGINE)) % 10}",
            hatch=HATCH[spec.framework],
            edgecolor="white",
            linewidth=0.5,
        )
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="(a) hf target-only")
    axes.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    axes.set_ylabel("speedup over transformers generate (a)")
    axes.set_title("Speedup by category")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.savefig(path, dpi=DPI)
    return path


def acceptance_by_position(rows: list[Row], path: Path) -> Path | None:
    """One line per speculative system: the share of drafts accepted at each draft position."""
    speculative = [r for r in rows if r.category == ALL and r.acceptance_by_position]
    if not speculative:
        return None
    figure = Figure(figsize=(9.0, 4.5), layout="constrained")
    axes = figure.subplots()
    for row in speculative:
        rates = [float("nan") if rate is None else rate for rate in row.acceptance_by_position]  # never drafted
        axes.plot(range(1, len(rates) + 1), rates, marker="o", label=row.system)
    axes.set_xlabel("draft position")
    axes.set_ylabel("accepted / drafted")
    axes.set_ylim(0, 1.05)
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_title("Acceptance by draft position (all categories)")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.savefig(path, dpi=DPI)
    return path


def tokens_per_second_vs_k(rows: list[Row], specs: list[SystemSpec], path: Path) -> Path:
    """Tokens/s against k for each drafter (transformers dashed, llama.cpp dotted: its k is its drafter's
    own setting, one point); target-only systems as horizontal lines."""
    overall = {r.system: r for r in rows if r.category == ALL}
    figure = Figure(figsize=(9.0, 4.5), layout="constrained")
    axes = figure.subplots()
    speculative = [s for s in specs if s.speculative]
    drafters = list(dict.fromkeys(s.on(ENGINE).series for s in speculative))  # one colour per drafter
    for series in dict.fromkeys(s.series for s in speculative):
        members = [s for s in speculative if s.series == series]
        points = sorted((s.k, overall[s.name].tokens_per_second) for s in members)
        axes.plot(
            *zip(*points),
            LINE[members[0].framework],
            marker="o",
            label=series,
            color=f"C{drafters.index(members[0].on(ENGINE).series) % 10}",
        )
    for spec in (s for s in specs if not s.speculative):
        axes.axhline(
            overall[spec.name].tokens_per_second,
            color="gray",
            linestyle=LINE[spec.framework],
            linewidth=1,
            label=f"({spec.group}) {spec.name}",
        )
    axes.set_xlabel("k (tokens drafted per step)")
    axes.set_ylabel("tokens/s (all categories)")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_ylim(bottom=0)
    axes.set_title("Tokens/s versus k")
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.savefig(path, dpi=DPI)
    return path
