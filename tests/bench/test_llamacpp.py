"""llama.cpp beside the engine in `specdecode bench`: the real llama.cpp (llama-cpp-python, which
`make setup` installs) on the real .gguf of the default model, in its worker process; and the
one line the bench says where llama-cpp-python is missing.

Where llama-cpp-python is not installed these tests are skipped, found by bench.llamacpp.installed()
rather than pytest.importorskip: importing llama_cpp would load llama.cpp's library and its
threads into the test process, which the bench itself never does."""

import json
import os
import signal
import sys

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from specdecode.bench.llamacpp import NOT_INSTALLED, LlamaCppError, LlamaCppWorker, gguf_file, installed
from specdecode.cli import app
from specdecode.loading import DEFAULT_TARGET, converted_gguf

needs_llamacpp = pytest.mark.skipif(not installed(), reason="llama-cpp-python is not installed (make setup)")
runner = CliRunner()
FLASH_ATTENTION_ON = 1  # llama.cpp's LLAMA_FLASH_ATTN_TYPE_ENABLED
PROMPT = "The capital of France is"
# one thread in the worker's own tests: llama.cpp's threads wait for each other spinning, which a
# busy machine (the other test worker) slows many times over; the bench itself uses torch's count
THREADS = 1


@pytest.fixture(scope="module")
def gguf():
    return gguf_file(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def tokenizer(gguf):
    return AutoTokenizer.from_pretrained(converted_gguf(gguf))  # the engine's tokenizer of the same file


@pytest.fixture
def plain(gguf):
    worker = LlamaCppWorker(gguf, threads=THREADS, n_ctx=256, num_pred_tokens=None)
    yield worker
    worker.close()


@needs_llamacpp
def test_the_worker_starts_decodes_greedily_and_stops_cleanly(plain, tokenizer):
    info = plain.info
    assert info["flash_attn_type"] == FLASH_ATTENTION_ON and info["n_threads"] == THREADS
    assert info["n_vocab"] == len(tokenizer) and info["num_pred_tokens"] is None
    ids = tokenizer(PROMPT).input_ids
    answer = plain.generate(ids, 4, stop=[])
    assert len(answer.token_ids) == 4 and answer.seconds > 0
    # the engine's token ids went in as they are: llama.cpp continues the same text
    assert "Paris" in tokenizer.decode(answer.token_ids)
    # one forward a token, the first being the prompt's prefill; no drafter, no drafts
    assert (answer.counts.target_forwards, answer.counts.drafted_tokens) == (4, 0)
    assert plain.close() == 0  # ended by the end of its input, not killed


@needs_llamacpp
def test_greedy_output_is_the_same_in_a_second_run_and_a_second_process(gguf, tokenizer):
    ids = tokenizer(PROMPT + " a city where").input_ids
    workers = [LlamaCppWorker(gguf, threads=THREADS, n_ctx=256, num_pred_tokens=None) for _ in range(2)]
    try:
        first = workers[0].generate(ids, 4, stop=[]).token_ids
        assert workers[0].generate(ids, 4, stop=[]).token_ids == first  # the first run's cache is not reused
        assert workers[1].generate(ids, 4, stop=[]).token_ids == first
        assert [worker.close() for worker in workers] == [0, 0]
    finally:
        for worker in workers:
            worker.close()  # a second close only reads the exit status again


@needs_llamacpp
def test_a_stop_token_ends_the_output_and_is_kept(plain, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    free = plain.generate(ids, 4, stop=[]).token_ids
    stopped = plain.generate(ids, 4, stop=[free[1]]).token_ids
    assert stopped == free[: free.index(free[1]) + 1] and len(stopped) < len(free)


@needs_llamacpp
def test_the_prompt_lookup_drafter_drafts_from_the_prompt(gguf, tokenizer):
    worker = LlamaCppWorker(gguf, threads=THREADS, n_ctx=256, num_pred_tokens=2)
    try:
        assert worker.info["num_pred_tokens"] == 2 and worker.info["flash_attn_type"] == FLASH_ATTENTION_ON
        text = "Repeat exactly: one two three four five six seven eight. one two three four five six seven eight."
        answer = worker.generate(tokenizer(text).input_ids, 6, stop=[])
        assert len(answer.token_ids) == 6 and answer.counts.drafted_tokens > 0
        assert 1 <= answer.counts.target_forwards <= 6
        assert worker.close() == 0
    finally:
        worker.close()


@needs_llamacpp
def test_the_drafter_takes_a_prompt_longer_than_a_batch(gguf, tokenizer):
    # llama-cpp-python sizes its logits by logits_all, not by the drafter's need of them: the
    # worker passes it, else the prompt's second batch of 512 tokens has nowhere to go
    ids = tokenizer(" ".join(f"item {i}," for i in range(300))).input_ids[:520]  # one token batch and a bit
    assert len(ids) == 520
    worker = LlamaCppWorker(gguf, threads=THREADS, n_ctx=len(ids) + 8, num_pred_tokens=2)
    try:
        answer = worker.generate(ids, 3, stop=[])
        assert len(answer.token_ids) == 3 and answer.counts.drafted_tokens > 0
        assert worker.close() == 0
    finally:
        worker.close()


@needs_llamacpp
def test_a_worker_that_dies_is_one_line(plain, tokenizer):
    os.kill(plain.process.pid, signal.SIGKILL)
    with pytest.raises(LlamaCppError) as raised:
        plain.generate(tokenizer(PROMPT).input_ids, 2, stop=[])
    message = str(raised.value)
    assert "exit status -9 (generate)" in message and "\n" not in message


@needs_llamacpp
def test_a_file_llama_cpp_cannot_load_is_one_line(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(LlamaCppError) as raised:
        LlamaCppWorker(broken, threads=1, n_ctx=64, num_pred_tokens=None)
    message = str(raised.value)
    assert message.startswith("llama.cpp failed (start): ") and "\n" not in message


@pytest.fixture(scope="module")
def one_prompt(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    text = "Rewrite this sentence in the past tense: The cat sits on the mat and watches the birds."
    rows = [{"id": "past", "category": "grounded", "prompt": text}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.slow
@needs_llamacpp
def test_the_bench_runs_llama_cpp_beside_the_other_systems(one_prompt, tmp_path):
    args = ["bench", "--prompts", one_prompt, "--max-new-tokens", "8", "-k", "2", "--output-dir", str(tmp_path)]
    result = runner.invoke(app, [*args, "--system", "llama.cpp,llama.cpp+lookup"])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    systems = {s["name"]: s for s in results["systems"]}
    plain, lookup = systems["llama.cpp target-only"], systems["llama.cpp prompt-lookup k=2"]
    assert (plain["group"], lookup["group"]) == ("e", "f")
    for system in (plain, lookup):
        options = system["llama_cpp"]
        assert options["model"] == str(gguf_file(DEFAULT_TARGET))
        assert options["flash_attn_type"] == FLASH_ATTENTION_ON
        assert options["n_threads"] == results["environment"]["torch_threads"]
        assert options["n_batch"] == 512  # llama-cpp-python's default, as it was measured
    assert lookup["llama_cpp"]["num_pred_tokens"] == 2 and plain["llama_cpp"]["num_pred_tokens"] is None
    assert results["environment"]["versions"]["llama-cpp-python"] == "0.3.36"
    # every system got the same prompt ids and the same number of new tokens (no end of sequence this soon)
    measurements = results["measurements"]
    assert len({m["prompt_tokens"] for m in measurements}) == 1
    assert {m["system"] for m in measurements} == set(systems) and all(m["new_tokens"] == 8 for m in measurements)
    rows = {r["system"]: r for r in results["summary"] if r["category"] == "all"}
    assert rows["llama.cpp target-only"]["tokens_per_second"] > 0
    assert rows["llama.cpp target-only"]["mean_accepted_length"] is None  # one token a forward, said nowhere
    # the sentence is rewritten from the prompt: its drafter drafts from it, and some drafts are kept
    assert 1.0 < rows["llama.cpp prompt-lookup k=2"]["mean_accepted_length"] <= 3.0
    assert (
        "| (e) | llama.cpp target-only |" in result.stdout and "| (f) | llama.cpp prompt-lookup k=2 |" in result.stdout
    )
    assert "--system llama.cpp --system llama.cpp+lookup" in results["command"]


@needs_llamacpp
def test_llama_cpp_needs_a_gguf_target(tiny_model_dir, one_prompt, tmp_path):
    args = ["bench", "--target", tiny_model_dir, "--prompts", one_prompt, "--system", "llama.cpp"]
    result = runner.invoke(app, [*args, "--output-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "runs the target's own .gguf file" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_without_llama_cpp_python_the_bench_says_so_in_one_line_and_runs_the_rest(
    tiny_model_dir, one_prompt, tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails, as if not installed
    args = ["bench", "--target", tiny_model_dir, "--prompts", one_prompt, "--max-new-tokens", "4", "-k", "2"]
    args += ["--dtype", "float32"]  # unquantized on every CPU: the system names below
    result = runner.invoke(app, [*args, "--system", "llama.cpp+lookup", "--output-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stderr.count(NOT_INSTALLED) == 1
    assert NOT_INSTALLED == "llama.cpp: not installed (pip install 'specdecode[llamacpp]'); skipped"
    systems = [s["name"] for s in json.loads((tmp_path / "results.json").read_text())["systems"]]
    assert systems == [
        "hf target-only",
        "hf prompt-lookup k=2",
        "specdecode target-only",
        "specdecode prompt-lookup k=2",
    ]


@needs_llamacpp
def test_generate_compare_puts_llama_cpp_beside_where_it_is_installed(monkeypatch):
    """`make run`'s side-by-side: the engine against llama.cpp's plain decoding of the target's own
    .gguf, on the same prompt ids, with the ratios; a sampled run and a missing llama.cpp leave it out."""
    args = ["generate", PROMPT, "--max-new-tokens", "8", "--compare", "--no-chat"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    compare = json.loads(result.stdout)["compare"]
    assert compare["llama_cpp_tokens_per_second"] > 0 and compare["identical_output"]
    text = runner.invoke(app, args)
    assert text.exit_code == 0, text.output
    last = text.stdout.strip().splitlines()[-1]
    assert last.startswith("[llama.cpp, plain decoding of the same .gguf ") and "x llama.cpp]" in last
    sampled = runner.invoke(app, [*args, "--json", "--temperature", "0.7", "--seed", "1"])
    assert "llama_cpp_tokens_per_second" not in json.loads(sampled.stdout)["compare"]  # greedy only
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    without = runner.invoke(app, [*args, "--json"])
    assert without.exit_code == 0 and "llama_cpp_tokens_per_second" not in json.loads(without.stdout)["compare"]
