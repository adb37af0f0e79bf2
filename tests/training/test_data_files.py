"""train-draft's data phase, chunk by chunk in the output folder (training/datafiles.py), on a
tiny chat target:

- an interrupted data phase (the target's decoding raising after N batches, or its files cut
  mid-line as a kill while writing leaves them) run again ends with byte for byte the files of
  an uninterrupted run; another seed's files differ (so the comparison can fail);
- each instruction is answered greedily and sampled;
- a rerun with another setting is refused, naming the option (`train-draft` exits 2 with one
  line), but for more samples, which grow the data into the larger run's files; --restart
  discards the data and starts over, a data.jsonl without a manifest is used as it is, and
  damage before a file's last line is refused.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
from rich.progress import Progress
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from typer.testing import CliRunner

from helpers import tiny_llama
from specdecode import SpeculativeEngine
from specdecode.cli import app
from specdecode.errors import InvalidArgumentError
from specdecode.training import command, data, datafiles
from specdecode.training.evaluate import HELD_OUT

FILES = (datafiles.MANIFEST, datafiles.INSTRUCTIONS, datafiles.ANSWERS, datafiles.DATA)


class Interrupted(Exception):
    pass


@pytest.fixture(scope="module")
def engine():
    """A tiny Llama with a chat template and a newline token, so that Magpie finds instructions."""
    words = ["<eos>", "<unk>", "\n"] + [f"w{i}" for i in range(21)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}w1 w2 {{ m['content'] }} w3{% endfor %}"
    target = tiny_llama(seed=3, vocab_size=24, max_positions=256, init=0.3)
    return SpeculativeEngine(target, tokenizer, drafter=None, runner="transformers")


def settings_for(engine, seed: int = 0, samples: int = 20) -> datafiles.DataSettings:
    # 10 instructions from rounds of 8 sequences, answered in 6 chunks of 4 (3 greedy, 3 sampled)
    settings = datafiles.data_settings(engine, samples, None, HELD_OUT, seed, 8, chat=True)
    return replace(settings, batch_size=4, magpie_max_tokens=16)


def make(engine, folder, settings, interrupt_after: int | None = None, restart: bool = False, calls=None):
    """make_data, raising Interrupted after interrupt_after decoding calls; calls, if given, gets
    one item per decoding call."""
    calls = [] if calls is None else calls
    generate = engine.generate

    def counting(*args, **kwargs):
        if len(calls) == interrupt_after:
            raise Interrupted
        calls.append(1)
        return generate(*args, **kwargs)

    engine.generate = counting
    try:
        return datafiles.make_data(engine, folder, settings, None, HELD_OUT, Progress(disable=True), restart)
    finally:
        del engine.generate  # the instance attribute: the method again


def lines_of(files: dict[str, bytes], name: str) -> int:
    return files[name].count(b"\n")


def contents(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in FILES}


@pytest.fixture(scope="module")
def whole(engine, tmp_path_factory):
    folder = tmp_path_factory.mktemp("whole")
    make(engine, folder, settings_for(engine))
    return contents(folder)


def test_the_uninterrupted_data_answers_each_instruction_greedily_and_sampled(whole):
    instructions = [t for line in whole[datafiles.INSTRUCTIONS].splitlines() for t in json.loads(line)["instructions"]]
    assert len(instructions) >= 10 and len(set(instructions)) == len(instructions)
    samples = [data.Sample(**json.loads(line)) for line in whole[datafiles.DATA].splitlines()]
    ways = Counter((tuple(s.prompt_ids), s.sampled) for s in samples)
    prompts = {prompt for prompt, _ in ways}
    assert len(prompts) == 10 and len(samples) == 20
    assert all(ways[(prompt, False)] == 1 and ways[(prompt, True)] == 1 for prompt in prompts)
    assert lines_of(whole, datafiles.ANSWERS) == 6


def lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


# the uninterrupted run: 3 Magpie rounds, then 6 chunks of answers
@pytest.mark.parametrize(("interrupt_after", "rounds", "chunks"), [(2, 2, 0), (6, 3, 3)])
def test_an_interrupted_data_phase_run_again_writes_the_uninterrupted_files(
    engine, tmp_path, whole, interrupt_after, rounds, chunks
):
    assert lines_of(whole, datafiles.INSTRUCTIONS) == 3 and lines_of(whole, datafiles.ANSWERS) == 6
    with pytest.raises(Interrupted):
        make(engine, tmp_path, settings_for(engine), interrupt_after=interrupt_after)
    assert lines(tmp_path / datafiles.INSTRUCTIONS) == rounds and lines(tmp_path / datafiles.ANSWERS) == chunks
    assert not (tmp_path / datafiles.DATA).exists()
    make(engine, tmp_path, settings_for(engine))
    assert contents(tmp_path) == whole


@pytest.mark.parametrize("cut", [datafiles.INSTRUCTIONS, datafiles.ANSWERS])
def test_files_cut_mid_line_by_a_kill_are_resumed_to_the_uninterrupted_files(engine, tmp_path, whole, cut):
    for name, content in whole.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / datafiles.DATA).unlink()
    if cut == datafiles.INSTRUCTIONS:
        (tmp_path / datafiles.ANSWERS).unlink()  # a kill while Magpie ran: no answers yet
    lines = whole[cut].splitlines(keepends=True)
    (tmp_path / cut).write_bytes(b"".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    make(engine, tmp_path, settings_for(engine))
    assert contents(tmp_path) == whole


def test_another_seed_writes_other_data(engine, tmp_path, whole):  # negative control of the byte comparisons
    make(engine, tmp_path, settings_for(engine, seed=1))
    other = contents(tmp_path)
    assert other[datafiles.INSTRUCTIONS] != whole[datafiles.INSTRUCTIONS]
    assert other[datafiles.DATA] != whole[datafiles.DATA]


def test_a_rerun_with_another_setting_is_refused_and_restart_starts_over(engine, tmp_path):
    with pytest.raises(Interrupted):
        make(engine, tmp_path, settings_for(engine), interrupt_after=1)
    with pytest.raises(InvalidArgumentError, match="another --seed: 0, not 1; .*--restart") as refused:
        make(engine, tmp_path, settings_for(engine, seed=1))
    assert refused.value.param == "seed"
    with pytest.raises(InvalidArgumentError, match="another --samples: 20, not 18"):
        make(engine, tmp_path, settings_for(engine, samples=18))  # fewer: more grow (below)
    (tmp_path / "checkpoint.pt").write_bytes(b"trained on the old data")
    make(engine, tmp_path, settings_for(engine, seed=1), restart=True)
    assert not (tmp_path / "checkpoint.pt").exists()
    fresh = tmp_path / "fresh"
    make(engine, fresh, settings_for(engine, seed=1))
    assert contents(tmp_path) == contents(fresh)


@pytest.mark.parametrize(("smaller", "blocks"), [(2, 0), (12, 1), (14, 1)])
def test_more_samples_grow_the_data_of_fewer_into_the_uninterrupted_files(engine, tmp_path, whole, smaller, blocks):
    """Data of 2, 12 or 14 samples (1, 6 or 7 instructions: `blocks` blocks of 4 answered whole,
    then one cut short) grown to 20 ends as the 20 samples' run, decoding only the Magpie rounds
    and answer chunks the smaller run did not make; the checkpoint trained on it goes."""
    make(engine, tmp_path, settings_for(engine, samples=smaller))
    rounds = lines(tmp_path / datafiles.INSTRUCTIONS)
    (tmp_path / "checkpoint.pt").write_bytes(b"trained on the smaller data")
    calls: list = []
    made = make(engine, tmp_path, settings_for(engine), calls=calls)
    assert contents(tmp_path) == whole and len(made) == 20
    assert not (tmp_path / "checkpoint.pt").exists()
    decoded_chunks = len(calls) - (lines_of(whole, datafiles.INSTRUCTIONS) - rounds)
    assert decoded_chunks == lines_of(whole, datafiles.ANSWERS) - 2 * blocks


def test_a_data_file_without_a_manifest_is_used_as_it_is(engine, tmp_path):
    samples = [data.Sample([4, 5], [6, 0], False), data.Sample([4, 5], [7], True)]
    data.save_samples(samples, tmp_path / datafiles.DATA)
    assert make(engine, tmp_path, settings_for(engine), interrupt_after=0) == samples


def test_damage_before_the_last_line_is_refused(tmp_path):
    path = tmp_path / datafiles.ANSWERS
    path.write_bytes(b'{"chunk": 0, "samples": []}\n{"chunk": 1, "sam\n{"chunk": 2, "samples": []}\n')
    with pytest.raises(InvalidArgumentError, match="line 2, is damaged"):
        datafiles.read_chunks(path, "chunk")
    path.write_bytes(b'{"chunk": 0, "samples": []}\n{"chunk": 1, "sam')  # a kill's cut: dropped
    assert datafiles.read_chunks(path, "chunk") == [{"chunk": 0, "samples": []}]
    assert path.read_bytes() == b'{"chunk": 0, "samples": []}\n'


def test_train_draft_refuses_other_data_settings_with_one_line(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}"}) + "\n" for i in range(3)))
    output = tmp_path / "head"
    output.mkdir()
    engine = command._engine(tiny_model_dir, "auto")  # as train-draft loads it
    settings = datafiles.data_settings(engine, 2, prompts, HELD_OUT, 0, 4, command._chat(engine))
    datafiles.make_data(engine, output, settings, prompts, HELD_OUT, Progress(disable=True))
    args = ["train-draft", "--output", str(output), "--target", tiny_model_dir, "--prompts", str(prompts)]
    result = CliRunner().invoke(app, [*args, "--samples", "2", "--max-new-tokens", "4", "--seed", "1"])
    assert result.exit_code == 2, result.output
    assert "another --seed: 0, not 1" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    prompts.write_text(json.dumps({"prompt": "w5"}) + "\n")
    result = CliRunner().invoke(app, [*args, "--samples", "2", "--max-new-tokens", "4"])
    assert result.exit_code == 2 and "another --prompts (the file's digest)" in result.stderr


def test_train_draft_interrupted_in_its_data_phase_and_run_again_ends_as_an_uninterrupted_run(
    tiny_model_dir, tmp_path, monkeypatch
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(40)))
    args = ["--target", tiny_model_dir, "--prompts", str(prompts), "--samples", "70", "--max-new-tokens", "6"]
    args += ["--epochs", "1", "--vocab-size", "8"]  # 35 prompts: answers in 4 chunks (2 of 32, 2 of 3)

    def train_draft(output):
        result = CliRunner().invoke(app, ["train-draft", "--output", str(output), *args])
        assert result.exit_code == 0, result.output
        return {name: (output / name).read_bytes() for name in (datafiles.ANSWERS, datafiles.DATA, "head.safetensors")}

    whole = train_draft(tmp_path / "whole")
    assert lines_of(whole, datafiles.ANSWERS) == 4
    answer_batch, calls = data.answer_batch, []

    def interrupted(*arguments, **options):
        if len(calls) == 2:
            raise Interrupted
        calls.append(1)
        return answer_batch(*arguments, **options)

    monkeypatch.setattr(data, "answer_batch", interrupted)
    result = CliRunner().invoke(app, ["train-draft", "--output", str(tmp_path / "cut"), *args])
    assert isinstance(result.exception, Interrupted) and lines(tmp_path / "cut" / datafiles.ANSWERS) == 2
    monkeypatch.setattr(data, "answer_batch", answer_batch)
    assert train_draft(tmp_path / "cut") == whole


def base_engine(bos: bool) -> SpeculativeEngine:
    """The tiny Llama as a base model: no chat template, and a beginning-of-sequence token or none."""
    words = ["<eos>", "<unk>", "\n", "<bos>"] + [f"w{i}" for i in range(20)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = dict(eos_token="<eos>", unk_token="<unk>") | (dict(bos_token="<bos>") if bos else {})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    target = tiny_llama(seed=3, vocab_size=24, max_positions=256, init=0.3)
    return SpeculativeEngine(target, tokenizer, drafter=None, runner="transformers")


def test_a_base_model_writes_first_lines_after_its_beginning_of_sequence_and_continues_them(tmp_path):
    engine = base_engine(bos=True)
    assert data.magpie_prefix(engine) == [engine.tokenizer.bos_token_id]
    settings = replace(datafiles.data_settings(engine, 8, None, HELD_OUT, 0, 8, chat=False), magpie_max_tokens=16)
    samples = datafiles.make_data(engine, tmp_path, replace(settings, batch_size=4), None, HELD_OUT, Progress(), False)
    lines = [
        t
        for line in (tmp_path / datafiles.INSTRUCTIONS).read_text().splitlines()
        for t in json.loads(line)["instructions"]
    ]
    assert len(samples) == 8 and all(s.answer_ids for s in samples)
    # each prompt is a line the model wrote, as plain text (no template): its answer continues it
    assert {tuple(s.prompt_ids) for s in samples} <= {tuple(engine.tokenizer(line).input_ids) for line in lines}


def test_a_base_model_without_a_beginning_of_sequence_token_is_asked_for_prompts():
    with pytest.raises(InvalidArgumentError, match="--prompts") as error:
        data.magpie_prefix(base_engine(bos=False))
    assert error.value.param == "target"
