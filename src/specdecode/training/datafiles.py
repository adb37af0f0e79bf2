"""train-draft's data phase, chunk by chunk, in the output folder, so that an interrupted run
goes on where it stopped: decoding the data is most of a run (80 minutes for the shipped head's).

Files, in DIR:

- `data-manifest.json`: the settings that decide the data (`DataSettings`), written first.
  A rerun whose settings differ is refused, naming the option: resuming it would mix two
  datasets (`--restart` discards the folder's data instead).
- `instructions.jsonl`: one line per Magpie round (64 sequences): the instructions it kept.
- `answers.jsonl`: one line per batch of 32 answers: block b of 32 instructions is answered
  greedily (line 2b), then sampled (line 2b + 1), so each instruction is answered both ways.
- `data.jsonl`: every sample, one a line, written whole when the last chunk is done; the input
  of the features pass. A `data.jsonl` without a manifest (made by hand, or by an earlier
  train-draft) is used as it is.

More samples than the manifest's, every other setting the same, grow the data instead of being
refused (`_grow`): the larger run's Magpie rounds and its answers to every block of instructions
the smaller run filled are the smaller run's own, so they stay, and only the rest is decoded.

Each line is appended, flushed and fsynced as its chunk completes; a line a kill cut short is
dropped on resume (and cut off the file). A chunk's randomness is a function of the seed and
the chunk's index alone, never of a generator's running state, and greedy rows do not depend
on their batch, so a resumed run writes byte for byte the files of an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from specdecode.drafters.head import target_fingerprint
from specdecode.errors import InvalidArgumentError
from specdecode.training import data, trainer

MANIFEST = "data-manifest.json"
INSTRUCTIONS = "instructions.jsonl"
ANSWERS = "answers.jsonl"
DATA = "data.jsonl"
FORMAT = 1  # of the files above: a manifest of another format is refused like other settings
ANSWER_TEMPERATURE = 0.7  # the sampled answers': the target's distribution, a little sharpened

# how a refusal names each setting: the option that sets it, else what it is
NAMES = {
    "target": "--target (its fingerprint)",
    "dtype": "--dtype (the target's dtype)",
    "runner": "the target's runner",
    "seed": "--seed",
    "samples": "--samples",
    "prompts": "--prompts (the file's digest)",
    "max_new_tokens": "--max-new-tokens",
    "held_out": "the held-out prompts (their digest)",
    "chat": "the target's chat template",
}


@dataclass(frozen=True)
class DataSettings:
    """What decides the data, recorded in the manifest: the same settings, the same bytes."""

    target: str  # drafters.head.target_fingerprint
    dtype: str  # the fingerprint is the same in float32 and bfloat16; the answers are not
    runner: str
    seed: int
    samples: int  # answers; half as many instructions (rounded up), each answered twice
    prompts: str | None  # the --prompts file's digest; None: Magpie
    max_new_tokens: int
    held_out: str  # their digest: they are left out of the instructions
    chat: bool
    temperature: float = ANSWER_TEMPERATURE
    batch_size: int = data.BATCH_SIZE
    magpie_max_tokens: int = 64
    format: int = FORMAT

    @property
    def instructions(self) -> int:
        return math.ceil(self.samples / 2)


def data_settings(
    engine, samples: int, prompts, held_out: list[str], seed: int, max_new_tokens: int, chat: bool
) -> DataSettings:
    model = engine.target_runner.model
    return DataSettings(
        target=target_fingerprint(model),
        dtype=str(model.dtype).removeprefix("torch."),
        runner=type(engine.target_runner).__name__,
        seed=seed,
        samples=samples,
        prompts=None if prompts is None else _file_digest(Path(prompts)),
        max_new_tokens=max_new_tokens,
        held_out=hashlib.blake2b(json.dumps(held_out).encode(), digest_size=8).hexdigest(),
        chat=chat,
    )


def make_data(
    engine, output: Path, settings: DataSettings, prompts, held_out: list[str], bars, restart: bool = False
) -> list[data.Sample]:
    """The samples: those output holds, else made (or made on from where an earlier run of
    these settings stopped). bars: a rich Progress, on which each phase shows its count."""
    output.mkdir(parents=True, exist_ok=True)
    if restart:
        discard(output)
    if (output / DATA).is_file() and not (output / MANIFEST).is_file():
        bars.console.print(f"training on {output / DATA} (made elsewhere: no {MANIFEST})")
        return data.load_samples(output / DATA)
    # read before the manifest is written: a file refused leaves nothing its mended rerun is refused by
    texts = None if prompts is None else data.read_prompts(prompts, held_out)[: settings.instructions]
    grown_from = _check_manifest(output, settings)
    if grown_from is not None:
        bars.console.print(f"growing the data in {output} from {grown_from} to {settings.samples} samples")
    if (output / DATA).is_file():
        return data.load_samples(output / DATA)
    if (output / INSTRUCTIONS).is_file() or (output / ANSWERS).is_file():
        bars.console.print(f"resuming the data an earlier run left in {output}")
    if texts is None:
        texts = _instructions(engine, output / INSTRUCTIONS, settings, held_out, bars)
    samples = _answers(engine, output / ANSWERS, settings, texts, bars)
    _write_whole(output / DATA, "".join(json.dumps(asdict(s)) + "\n" for s in samples))
    return samples


def discard(output: Path) -> None:
    """--restart: what an earlier run left (the checkpoint too: it was trained on that data)."""
    for name in (MANIFEST, INSTRUCTIONS, ANSWERS, DATA):
        (output / name).unlink(missing_ok=True)
        (output / (name + ".partial")).unlink(missing_ok=True)
    trainer.discard_checkpoint(output / trainer.CHECKPOINT)


def chunk_seed(seed: int, stage: str, index: int) -> int:
    """Chunk index's seed, from the run's seed and the index alone (a resumed run draws what the
    uninterrupted one did); hashed to 48 bits, so that two chunks' rows (seeded chunk_seed + row)
    almost surely never meet (seed + 64 x index would give --seed 1 the rows of --seed 0, shifted)."""
    digest = hashlib.blake2b(f"{stage}:{seed}:{index}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


def _instructions(engine, path: Path, settings: DataSettings, held_out: list[str], bars) -> list[str]:
    """Magpie rounds (data.magpie_instructions' rule) until enough instructions, resumed."""
    rounds = read_chunks(path, "round")
    found = [text for record in rounds for text in record["instructions"]]
    seen = {data.normalized(p) for p in held_out + found}
    needed, rows = settings.instructions, 2 * settings.batch_size
    task = bars.add_task("Magpie instructions", total=needed, completed=min(len(found), needed))
    prefix = data.magpie_prefix(engine)
    index = len(rounds)
    while len(found) < needed and index < math.ceil(4 * needed / rows):  # a target that repeats itself ends
        seed = chunk_seed(settings.seed, "instructions", index)
        kept = data.keep_instructions(
            data.magpie_batch(engine, prefix, rows, seed, settings.magpie_max_tokens, settings.batch_size), seen
        )
        append_chunk(path, {"round": index, "instructions": kept})
        found, index = found + kept, index + 1
        bars.update(task, completed=min(len(found), needed))
    return found[:needed]


def _answers(engine, path: Path, settings: DataSettings, texts: list[str], bars) -> list[data.Sample]:
    """Each text answered greedily and sampled, a chunk of batch_size sequences at a time, resumed."""
    size = settings.batch_size
    plan = [(texts[i : i + size], sampled) for i in range(0, len(texts), size) for sampled in (False, True)]
    chunks = read_chunks(path, "chunk")
    if len(chunks) > len(plan):
        raise InvalidArgumentError(f"{path} holds more chunks than its manifest asks for: --restart", "output")
    done = sum(len(block) for block, _ in plan[: len(chunks)])
    task = bars.add_task("target answers", total=2 * len(texts), completed=done)
    for index in range(len(chunks), len(plan)):
        block, sampled = plan[index]
        seed = chunk_seed(settings.seed, "answers", index) if sampled else None
        samples = data.answer_batch(
            engine, block, seed, settings.max_new_tokens, settings.temperature, settings.chat, size
        )
        record = {"chunk": index, "samples": [asdict(s) for s in samples]}
        append_chunk(path, record)
        chunks.append(record)
        bars.update(task, advance=len(block))
    return [data.Sample(**s) for record in chunks for s in record["samples"]]


def append_chunk(path: Path, record: dict) -> None:
    """One line, on disk before the next chunk starts (a kill loses at most the chunk under way)."""
    with path.open("ab") as file:
        file.write(json.dumps(record).encode() + b"\n")
        file.flush()
        os.fsync(file.fileno())


def read_chunks(path: Path, key: str) -> list[dict]:
    """The complete lines of path, in order (line i has key = i). A last line a kill cut short,
    or left unreadable, is dropped and cut off the file, so that the next chunk starts a line."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")  # the last item: empty, or a line cut short
    records, kept = [], 0
    for number, line in enumerate(lines[:-1]):
        record = _record(line)
        if record is None or record.get(key) != number:
            if number < len(lines) - 2:  # damage before the last line is not an interruption's
                raise InvalidArgumentError(f"{path}, line {number + 1}, is damaged: --restart to discard it", "output")
            break
        records.append(record)
        kept += len(line) + 1
    if kept < len(raw):
        with path.open("r+b") as file:
            file.truncate(kept)
    return records


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:  # UnicodeDecodeError too
        return None
    return record if isinstance(record, dict) else None


def _check_manifest(output: Path, settings: DataSettings) -> int | None:
    """Refuse to resume data made with other settings; write the manifest of a new run. Data
    made for fewer samples, every other setting the same, grows: the samples it was made for."""
    path = output / MANIFEST
    if not path.is_file():
        if (output / INSTRUCTIONS).exists() or (output / ANSWERS).exists():
            raise InvalidArgumentError(f"{output} holds data files without {MANIFEST}: --restart", "output")
        _write_manifest(output, settings)
        return None
    saved = _record(path.read_bytes()) or {}
    wanted = asdict(settings)
    others = [name for name, value in wanted.items() if name != "samples" and saved.get(name) != value]
    smaller = saved.get("samples")
    if not others and isinstance(smaller, int) and not isinstance(smaller, bool) and smaller < settings.samples:
        _grow(output, smaller, settings)
        return smaller
    for name, value in wanted.items():
        if saved.get(name) != value:
            raise InvalidArgumentError(_refusal(output, name, saved.get(name), value), name)
    return None


def _grow(output: Path, smaller: int, settings: DataSettings) -> None:
    """Make data of `smaller` samples the start of the larger run's. Its Magpie rounds are the
    larger run's first (a round is a function of the seed and its index), and so are its answer
    chunks of every block of instructions it filled: the instructions are the same, in order,
    and a chunk is a function of its block, the seed and its index. The answers to a last block
    it cut short, the data file and the checkpoint (trained on the smaller data) go; the
    manifest is written last, so that a kill midway leaves data that grows again."""
    filled = math.ceil(smaller / 2) // settings.batch_size  # blocks of instructions it answered whole
    _keep_lines(output / ANSWERS, 2 * filled)  # a greedy and a sampled chunk a block
    (output / DATA).unlink(missing_ok=True)
    trainer.discard_checkpoint(output / trainer.CHECKPOINT)
    _write_manifest(output, settings)


def _write_manifest(output: Path, settings: DataSettings) -> None:
    _write_whole(output / MANIFEST, json.dumps(asdict(settings), indent=2) + "\n")


def _keep_lines(path: Path, count: int) -> None:
    """Cut path after its first `count` lines (nothing if it has no more)."""
    if not path.is_file():
        return
    raw, end = path.read_bytes(), 0
    for _ in range(count):
        end = raw.find(b"\n", end) + 1
        if end == 0:
            return
    with path.open("r+b") as file:
        file.truncate(end)
        file.flush()
        os.fsync(file.fileno())


def _refusal(output: Path, name: str, saved, value) -> str:
    return (
        f"{output} holds data made with another {NAMES.get(name, name)}: {saved}, not {value}; "
        "rerun with the options it was made with to resume it, give another --output, or --restart to discard it"
    )


def _write_whole(path: Path, text: str) -> None:
    """Written then renamed: a kill leaves the old file or the new one, never half of one."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _file_digest(path: Path) -> str:
    if not path.is_file():
        raise InvalidArgumentError(f"{path}: no such file", "prompts")
    return hashlib.blake2b(path.read_bytes(), digest_size=8).hexdigest()
