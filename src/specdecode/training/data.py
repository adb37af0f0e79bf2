"""Training data for a draft head: instructions the target writes itself (Magpie, Xu et al. 2024)
or a user's JSONL of prompts, and the target's own answers to them, greedy and sampled, so the
head learns the target's distribution rather than a corpus's.

Magpie: the chat target is given only its template's user prefix (for SmolLM2, the default
system turn and `<|im_start|>user\\n`) and samples what it writes there, up to a newline: a
plausible instruction. A base model (no chat template, as Gemma-3-270M) is given its
beginning-of-sequence token alone and writes a text's first line, which its answers continue.
Instructions are deduplicated, and held-out prompts (`evaluate.py`) are never trained on; a
Spec-Bench file is refused (the benchmark measures what the head never saw).
"""

from __future__ import annotations

import codecs
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdecode.errors import InvalidArgumentError

MARKER = "\x00INSTRUCTION\x00"  # stands for the user's text while the template is rendered
# sequences decoded together: the fast runner's products cost little more for many rows than
# for one (docs/speed.md), so a wide batch makes the data faster (benchmarks/results/draft-head.md)
BATCH_SIZE = 32


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]  # the prompt as the target reads it (its chat template applied)
    answer_ids: list[int]  # the target's answer
    sampled: bool  # drawn at a temperature (else greedy)


def user_prefix(tokenizer) -> str:
    """The text a chat template puts before a user's first message (a default system turn included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False)
    return text[: text.index(MARKER)]


def normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def magpie_instructions(
    engine,
    count: int,
    seed: int,
    held_out: list[str],
    max_tokens: int = 64,
    on_batch: Callable[[int], None] | None = None,
    batch_size: int = BATCH_SIZE,
) -> list[str]:
    """Up to count distinct instructions the target writes after its user prefix (temperature 1,
    top-p 1, ending at a newline, as Magpie's generator), none of them a held-out prompt."""
    prefix = magpie_prefix(engine)
    seen = {normalized(p) for p in held_out}
    found: list[str] = []
    batch, attempt = 2 * batch_size, 0
    while len(found) < count and attempt < 4 * count:
        results = magpie_batch(engine, prefix, batch, seed + attempt, max_tokens, batch_size)
        attempt += batch
        found += keep_instructions(results, seen)
        if on_batch is not None:
            on_batch(min(len(found), count))
    return found[:count]


def magpie_prefix(engine) -> list[int]:
    """What the target writes an instruction after: a chat model's user prefix; a base model's
    beginning of sequence alone, after which it writes the first line of a text of its own (the
    answers then continue that line)."""
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        return tokenizer(user_prefix(tokenizer), add_special_tokens=False).input_ids
    if tokenizer.bos_token_id is None:
        raise InvalidArgumentError(
            "this base model has no chat template and no beginning-of-sequence token to write its own prompts "
            "after: give --prompts FILE",
            "target",
        )
    return [tokenizer.bos_token_id]


def magpie_batch(engine, prefix: list[int], rows: int, seed: int, max_tokens: int, batch_size: int) -> list:
    """rows instructions sampled after prefix; row i seeded seed + i (engine.generate)."""
    return engine.generate(
        [prefix] * rows, max_new_tokens=max_tokens, temperature=1.0, seed=seed, stop="\n", max_batch_size=batch_size
    )


def keep_instructions(results, seen: set[str]) -> list[str]:
    """The results' texts worth training on and not in seen (normalized), which they join."""
    kept = []
    for result in results:
        text = result.text.strip()
        key = normalized(text)
        # a cut-off instruction (no end before max_tokens) or a fragment teaches nothing useful
        if len(key) >= 12 and result.finish_reason == "stop" and key not in seen:
            seen.add(key)
            kept.append(text)
    return kept


def read_prompts(path: str | Path, held_out: list[str]) -> list[str]:
    """Prompts from a JSONL file: one object a line with "prompt" (or "instruction", "text"),
    deduplicated, held-out prompts left out. Spec-Bench's question file is refused."""
    prompts, seen = [], {normalized(p) for p in held_out}
    for number, record in jsonl_objects(Path(path), "prompts", 'write each line as one {"prompt": ...} object'):
        if "question_id" in record and "turns" in record:
            raise InvalidArgumentError(
                f"{path} is a Spec-Bench question file: a head must not train on the benchmark it is measured on",
                "prompts",
            )
        text = next((record[k] for k in ("prompt", "instruction", "text") if isinstance(record.get(k), str)), None)
        if text is None:
            raise InvalidArgumentError(f'{path}, line {number}: no "prompt" string', "prompts")
        if normalized(text) not in seen:
            seen.add(normalized(text))
            prompts.append(text)
    return prompts


def answers(
    engine,
    prompts: list[str] | list[list[int]],
    seed: int,
    max_new_tokens: int,
    sampled_share: float = 0.5,
    temperature: float = 0.7,
    chat: bool = True,
    on_batch: Callable[[int], None] | None = None,
    batch_size: int = BATCH_SIZE,
) -> list[Sample]:
    """The target's answer to each prompt: the first (1 - sampled_share) greedy, the rest sampled
    at temperature (seeded), in batches through the engine's batched decoding."""
    sampled_from = round(len(prompts) * (1 - sampled_share))
    samples: list[Sample] = []
    for start in range(0, len(prompts), 2 * batch_size):
        chunk = prompts[start : start + 2 * batch_size]
        greedy = [p for i, p in enumerate(chunk, start) if i < sampled_from]
        drawn = [p for i, p in enumerate(chunk, start) if i >= sampled_from]
        for group, sampled in ((greedy, False), (drawn, True)):
            if group:
                seeded = seed + start if sampled else None
                samples += answer_batch(engine, group, seeded, max_new_tokens, temperature, chat, batch_size)
        if on_batch is not None:
            on_batch(min(start + 2 * batch_size, len(prompts)))
    return samples


def answer_batch(
    engine, prompts, seed: int | None, max_new_tokens: int, temperature: float, chat: bool, batch_size: int
) -> list[Sample]:
    """The target's answers to prompts: sampled at temperature with a seed (prompt i seeded
    seed + i), greedy without one; empty answers left out (they teach nothing)."""
    results = engine.generate(
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=0.0 if seed is None else temperature,
        seed=seed,
        chat=chat,
        max_batch_size=batch_size,
    )
    return [Sample(r.prompt_token_ids, r.token_ids, seed is not None) for r in results if r.token_ids]


def draft_vocabulary(samples: list[Sample], size: int, eos_token_ids: frozenset[int] | set[int]) -> torch.Tensor:
    """The `size` tokens most frequent in the answers (ties: the smaller id), end-of-sequence
    tokens included whatever their count: [<= size] int64, sorted by id."""
    counts = Counter(t for s in samples for t in s.answer_ids)
    chosen = sorted(eos_token_ids)[:size]
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def save_samples(samples: list[Sample], path: Path) -> None:
    path.write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples))


def load_samples(path: Path) -> list[Sample]:
    # made by hand, or by train-draft from answers.jsonl, which a deleted data.jsonl is made again from
    fix = f"mend the line, or delete {path} to make the data again"
    return [_sample(record, f"{path}, line {number}", fix) for number, record in jsonl_objects(path, "output", fix)]


def _sample(record: dict, where: str, fix: str) -> Sample:
    try:
        return Sample(**record)
    except TypeError:  # keys missing or unknown
        raise InvalidArgumentError(
            f"{where}, is not a sample (prompt_ids, answer_ids, sampled): {fix}", "output"
        ) from None


def jsonl_objects(path: Path, param: str, fix: str) -> Iterator[tuple[int, dict]]:
    """The JSON objects of a JSONL file, each with its line number (from 1); blank lines skipped.
    Lines end at "\n" alone: str.splitlines also breaks at U+2028, U+2029 and U+0085, which a
    JSON string may hold unescaped. A line that is not a JSON object is refused in one line
    naming it, and fix (what to do), as an error of the argument param."""
    raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # as some editors start a UTF-8 file
    for number, line in enumerate(raw.split(b"\n"), 1):
        if line.strip():
            yield number, _json_object(line, f"{path}, line {number}", param, fix)


def _json_object(line: bytes, where: str, param: str, fix: str) -> dict:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{where}, is not UTF-8 text: {fix}", param) from None
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"{where}, is not JSON ({error.msg}: column {error.colno}): {fix}", param) from None
    if not isinstance(record, dict):
        raise InvalidArgumentError(f"{where}, is not a JSON object: {fix}", param)
    return record
