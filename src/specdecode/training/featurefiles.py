"""train-draft's features pass, chunk by chunk, in the output folder, so that an interrupted run
goes on where it stopped (as the data phase does: datafiles.py).

Files, in DIR/features/:

- `manifest.json`: what decides the features besides each sample (the target's fingerprint,
  dtype and runner, the layers read, the length cut, and a digest of the samples). A folder made
  for anything else is emptied first: its chunks would be another run's features.
- `chunk-NNNNN.pt`: the Examples of CHUNK samples in a row (torch.save of their tensors),
  written beside their name and renamed into place once durable. A chunk that does not load (a
  kill or a full disk cut it short) is computed again.

Each sample's features come from a forward of that sample alone (features.collect), so a chunk
computed in a resumed run holds bitwise what the uninterrupted run computes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from specdecode.training.data import Sample
from specdecode.training.features import Example, collect

FOLDER = "features"
MANIFEST = "manifest.json"
CHUNK = 64  # samples a file


def collect_in(
    output: Path,
    target,
    samples: list[Sample],
    feature_layers: tuple[int, ...],
    max_length: int,
    identity: list,
    on_sample: Callable[[int], None] | None = None,
) -> list[Example]:
    """collect()'s Examples, the chunks an earlier run left in output/features loaded, the others
    computed and saved. identity: what decides the target's outputs (its fingerprint, dtype and
    runner: datafiles.DataSettings' fields), JSON-able."""
    folder = output / FOLDER
    _start(folder, _key(samples, feature_layers, max_length, identity))
    examples: list[Example] = []
    for index, start in enumerate(range(0, len(samples), CHUNK)):
        chunk, path = samples[start : start + CHUNK], folder / f"chunk-{index:05d}.pt"
        loaded = _load(path)
        if loaded is None:
            progress = None if on_sample is None else (lambda done, start=start: on_sample(start + done))
            loaded = collect(target, chunk, feature_layers, max_length, progress)
            _save(path, loaded)
        examples += loaded
        if on_sample is not None:
            on_sample(start + len(chunk))
    return examples


def discard(output: Path) -> None:
    """--restart: the features an earlier run left."""
    folder = output / FOLDER
    for path in [*folder.glob("chunk-*"), folder / MANIFEST]:
        path.unlink(missing_ok=True)


def _key(samples: list[Sample], feature_layers: tuple[int, ...], max_length: int, identity: list) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for sample in samples:
        digest.update(json.dumps(asdict(sample)).encode() + b"\n")
    settings = [identity, list(feature_layers), max_length, CHUNK, digest.hexdigest()]
    return hashlib.blake2b(json.dumps(settings).encode(), digest_size=16).hexdigest()


def _start(folder: Path, key: str) -> None:
    """The folder for features of this key: kept if it holds them, else emptied and marked."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / MANIFEST
    try:
        if json.loads(manifest.read_text()) == {"key": key}:
            return
    except (OSError, ValueError):
        pass
    discard(folder.parent)
    _durably(manifest, lambda file: file.write(json.dumps({"key": key}).encode()))


def _save(path: Path, examples: list[Example]) -> None:
    _durably(path, lambda file: torch.save([vars(e) for e in examples], file))  # the tensors, not copies


def _load(path: Path) -> list[Example] | None:
    """A chunk's Examples, or None where there is none or it does not load whole."""
    if not path.is_file():
        return None
    try:
        return [Example(**record) for record in torch.load(path, weights_only=True)]
    except Exception:  # cut short, or not a chunk: computed again
        return None


def _durably(path: Path, write: Callable) -> None:
    """Written beside its name, synced, then renamed: a kill leaves the old file or the new one."""
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
