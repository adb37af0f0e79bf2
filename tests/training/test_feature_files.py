"""train-draft's features pass, chunk by chunk in the output folder (training/featurefiles.py):
an interrupted pass run again ends with bitwise the features of an uninterrupted one, reading
the chunks it left rather than computing them again; a chunk cut short is computed again; other
samples or settings start the folder afresh."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from specdecode.training import featurefiles
from specdecode.training.data import Sample
from specdecode.training.features import Example, collect

IDENTITY = ["tiny", "float32", "HFModelRunner"]
LAYERS = (1, 2)


class Interrupted(Exception):
    pass


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(featurefiles, "CHUNK", 4)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=5, vocab_size=32, max_positions=128)


def samples(count: int = 10, seed: int = 0) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(0, 32, (n,), generator=generator).tolist()  # noqa: E731
    return [Sample(draw(5), draw(int(n)), bool(n % 2)) for n in torch.randint(3, 20, (count,), generator=generator)]


def same(a: list[Example], b: list[Example]) -> bool:
    fields = ("tokens", "features", "last", "argmax")
    return len(a) == len(b) and all(
        x.answer_start == y.answer_start and all(torch.equal(getattr(x, f), getattr(y, f)) for f in fields)
        for x, y in zip(a, b)
    )


def run(target, folder, data, max_length: int = 64, interrupt_at: int | None = None) -> list[Example]:
    def progress(done: int) -> None:
        if done == interrupt_at:
            raise Interrupted

    return featurefiles.collect_in(folder, target, data, LAYERS, max_length, IDENTITY, progress)


def chunks(folder) -> list[str]:
    return sorted(p.name for p in (folder / featurefiles.FOLDER).glob("chunk-*.pt"))


def test_the_chunked_pass_gives_the_features_of_one_pass(target, tmp_path):
    data = samples()
    assert same(run(target, tmp_path, data), collect(target, data, LAYERS, 64))
    assert chunks(tmp_path) == ["chunk-00000.pt", "chunk-00001.pt", "chunk-00002.pt"]


def test_an_interrupted_pass_run_again_reads_its_chunks_and_ends_with_the_same_features(target, tmp_path, monkeypatch):
    data = samples()
    with pytest.raises(Interrupted):
        run(target, tmp_path, data, interrupt_at=9)  # in the third chunk: two are on disk
    assert chunks(tmp_path) == ["chunk-00000.pt", "chunk-00001.pt"]
    computed = []
    monkeypatch.setattr(featurefiles, "collect", lambda t, c, *a: computed.append(len(c)) or collect(t, c, *a))
    assert same(run(target, tmp_path, data), collect(target, data, LAYERS, 64))
    assert computed == [2]  # the last chunk alone


def test_a_chunk_cut_short_is_computed_again(target, tmp_path):
    data = samples()
    whole = run(target, tmp_path, data)
    path = tmp_path / featurefiles.FOLDER / "chunk-00001.pt"
    path.write_bytes(path.read_bytes()[:100])
    assert same(run(target, tmp_path, data), whole)


@pytest.mark.parametrize("change", ["samples", "max_length"])
def test_other_samples_or_settings_start_the_folder_afresh(target, tmp_path, change):
    run(target, tmp_path, samples(12))
    data, max_length = (samples(6, seed=1), 64) if change == "samples" else (samples(12), 8)
    again = run(target, tmp_path, data, max_length)
    assert same(again, collect(target, data, LAYERS, max_length))
    assert len(chunks(tmp_path)) == (2 if change == "samples" else 3)
