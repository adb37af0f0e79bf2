"""Benchmark prompts: Spec-Bench's question.jsonl, the subset shipped in the package, or the
user's own JSONL file.

Each line is a JSON object with either `turns` (a list of user turns, as Spec-Bench has) or
`prompt` (one string); `category` and `question_id` (or `id`) are optional. Only the first
turn is timed: a second turn would need each system's own first answer in its context,
so the systems would no longer see the same prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specdecode.errors import InvalidArgumentError

# the third prompt of each of these shipped categories: `bench --quick` times only the first
HELD_OUT_CATEGORIES = ("writing", "qa", "coding", "stem")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
DEFAULT_CATEGORY = "custom"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str


# Prompts written for the scripts in benchmarks/ (none from Spec-Bench or a set a drafter learns from).
PASSAGE = (
    "The city council met on Tuesday to discuss the new public library. The building will have three floors, "
    "a children's reading room, and a cafe. Construction starts in March and should take eighteen months. "
    "The budget is twelve million dollars, paid for by a state grant and local taxes."
)
# copy-type prompts (the answer copies or edits the prompt) against open-ended ones
DRAFTER_PROMPTS = {
    "copy": [
        f"Copy this text exactly, word for word: {PASSAGE}",
        f"Rewrite this text, replacing 'library' with 'museum' and changing nothing else: {PASSAGE}",
        f"Extract every sentence that contains a number from this text, one per line: {PASSAGE}",
        f"Summarize this text in two sentences, reusing its own words: {PASSAGE}",
    ],
    "open-ended": [
        "Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give five tips for staying focused while studying.",
        "Write a friendly email inviting a colleague to lunch.",
    ],
}
# everyday open-ended chat requests (benchmarks/head.py, step_phases.py), the drafters' open-ended ones last
OPEN_CHAT_PROMPTS = (
    "Write a poem about autumn leaves falling in a quiet park.",
    "What should I pack for a week-long camping trip?",
    "Explain how a bicycle stays upright when it moves.",
    "Why do cats purr, and what does it mean?",
    *DRAFTER_PROMPTS["open-ended"],
)
COPY_PROMPTS = [
    "Copy this sentence exactly: Speculative decoding lets a small drafter propose tokens that a large model "
    "verifies in one pass, so generation gets faster without changing its output.",
    "Repeat the following list word for word: apples, bananas, cherries, dates, elderberries, figs, grapes, "
    "honeydew melons, kiwis, lemons, mangoes and nectarines.",
    "Rename the variable `total` to `sum_of_values` in this code and print the whole function:\n"
    "def add_all(values):\n    total = 0\n    for value in values:\n        total += value\n    return total\n",
]
OPEN_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are the main differences between renewable and non-renewable energy?",
]
# a fixed text for perplexity
PERPLEXITY_TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers moved their animals to the hills, while the children watched from the bridge as boats "
    "carried sacks of grain to the village hall. Nobody in the valley remembered a flood this early "
    "in the spring, and the old miller said the snow in the mountains had melted three weeks too soon."
)


def held_out_prompts() -> list[str]:
    """The third shipped prompt of each HELD_OUT_CATEGORIES category: chat prompts the quick bench never times."""
    prompts = load_prompts()
    return [[p for p in prompts if p.category == c][2].text for c in HELD_OUT_CATEGORIES]


def default_prompt_file() -> Path:
    return Path(str(resources.files("specdecode.bench") / "data" / "specbench_subset.jsonl"))


def load_prompts(path: str | Path | None = None) -> list[BenchPrompt]:
    """Read a prompt file (None = the shipped Spec-Bench subset); errors name the line at fault."""
    path = Path(path).expanduser() if path is not None else default_prompt_file()
    if not path.is_file():
        raise InvalidArgumentError(f"prompt file '{path}' does not exist; give a JSONL file (one JSON object a line)")
    prompts = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                prompts.append(_parse_line(line, number, path))
    if not prompts:
        raise InvalidArgumentError(f"prompt file '{path}' holds no prompts")
    return prompts


def select_prompts(
    prompts: list[BenchPrompt], categories: tuple[str, ...] = (), per_category: int = 0
) -> list[BenchPrompt]:
    """The first `per_category` prompts (0 = all) of each wanted category, category by category."""
    available = list(dict.fromkeys(p.category for p in prompts))  # file order, no repeats
    wanted = _expand_categories(categories, available) if categories else available
    selected = []
    for category in wanted:
        in_category = [p for p in prompts if p.category == category]
        selected += in_category[:per_category] if per_category else in_category
    return selected


def _expand_categories(categories: tuple[str, ...], available: list[str]) -> list[str]:
    wanted: list[str] = []
    for category in categories:
        if category == "mt-bench":  # Spec-Bench's name for its eight MT-bench categories together
            names = [c for c in MT_BENCH_CATEGORIES if c in available]
        else:
            names = [category] if category in available else []
        if not names:
            raise InvalidArgumentError(f"unknown category '{category}'; the prompt file has: {', '.join(available)}")
        wanted += [n for n in names if n not in wanted]
    return wanted


def _parse_line(line: str, number: int, path: Path) -> BenchPrompt:
    where = f"{path.name} line {number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"{where} is not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise InvalidArgumentError(f"{where} must be a JSON object with 'prompt' or 'turns'")
    turns = row.get("turns")
    text = turns[0] if isinstance(turns, list) and turns else row.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgumentError(f"{where} needs a non-empty 'prompt' string or a 'turns' list of strings")
    prompt_id = row.get("question_id", row.get("id", number))
    return BenchPrompt(str(prompt_id), str(row.get("category") or DEFAULT_CATEGORY), text)
