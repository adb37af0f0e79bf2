"""`specdecode generate` on a local tiny model folder: output formats and clear errors."""

import json

import pytest
from typer.testing import CliRunner

from helpers import byte_llama
from specdecode import precision
from specdecode.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, ["generate", *args])


def test_json_output_has_text_tokens_and_stats(tiny_model_dir):
    result = run("w1 w2 w3 w1 w2", "--target", tiny_model_dir, "--max-new-tokens", "12", "--json")
    assert result.exit_code == 0, result.output
    output = json.loads(result.stdout)
    tokens = output["token_ids"]
    ended_at_eos = tokens[-1] == 0  # <eos> of the tiny tokenizer
    assert output["finish_reason"] == ("stop" if ended_at_eos else "length")
    assert len(tokens) == 12 or ended_at_eos
    stats = output["stats"]
    assert stats["drafter"] == "auto" and stats["num_speculative_tokens"] == 4
    assert stats["generated_tokens"] == len(tokens)
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["mean_accepted_length"] >= 1.0
    assert set(stats) >= {
        "drafted_tokens",
        "accepted_tokens",
        "accepted_per_position",
        "target_forwards",
        "wall_time_s",
    }


def test_human_output_and_compare(tiny_model_dir):
    result = run("w1 w2 w3 w1 w2", "--target", tiny_model_dir, "--max-new-tokens", "16", "--compare")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert "tokens per target forward" in lines[-2]
    assert "speedup" in lines[-1] and "outputs identical" in lines[-1]


def test_json_compare_reports_identical_greedy_output(tiny_model_dir):
    result = run("w5 w6", "--target", tiny_model_dir, "--max-new-tokens", "10", "--compare", "--json", "-k", "2")
    compare = json.loads(result.stdout)["compare"]
    assert compare["identical_output"] is True
    assert compare["speedup"] > 0


def test_seeded_sampling_is_reproducible(tiny_model_dir):
    args = ["w5 w6", "--target", tiny_model_dir, "--temperature", "1.0", "--seed", "3", "--json"]
    first, second = run(*args), run(*args)
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["", "--target", "{model}"], "the prompt is empty"),
        (["w1", "--target", "{model}", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["w1", "--target", "{model}", "--max-new-tokens", "-2"], "--max-new-tokens must be at least 1"),
        (["w1", "--target", "{model}", "--temperature", "-1"], "temperature must be >= 0"),
        (["w1", "--target", "{model}", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["w1", "--target", "{model}", "--top-p", "1.2"], "--top-p must be in (0, 1]"),
        (["w1", "--target", "{model}", "-k", "-1"], "--num-speculative-tokens (k) must be an integer >= 0"),
        (["w1", "--target", "./does/not/exist"], "is not a model folder or a .gguf file"),
        (["w1", "--target", "{model}", "--drafter", "magic"], "unknown drafter 'magic'"),
        (["w1", "--target", "{model}", "--device", "tpu"], "unknown device 'tpu'"),
        (["w1", "--target", "{model}", "--dtype", "int3"], "unknown dtype 'int3'"),
        ([" ".join(["w3"] * 200), "--target", "{model}"], "shorten the prompt"),
        (["w1", "--target", "{model}", "--max-model-len", "1000"], "--max-model-len must be in [2, 128]"),
        (["w1", "--target", "{model}", "--max-model-len", "1"], "--max-model-len must be at least 2"),
        (["w1", "--target", "{model}", "--quantization", "int4"], "unknown quantization 'int4'"),
        (["w1", "--target", "{model}", "--drafter", "head"], "drafter 'head' needs a draft head folder"),
        (["w1", "--target", "{model}", "--drafter", "head", "--draft", "{model}"], "is no draft head folder"),
        (
            ["w1", "--target", "{model}", "--drafter", "recycling", "--recycling-width", "0"],
            "--recycling-width must be an integer >= 1",
        ),
        (["w1", "--target", "{model}", "--draft-quantization", "nf4"], "applies to the self-quantized drafter only"),
        (
            ["w1", "--target", "{model}", "--drafter", "prompt-lookup", "--draft-quantization", "int8"],
            "not to 'prompt-lookup'",
        ),
        (
            ["w1", "--target", "{model}", "--drafter", "self-quantized", "--draft-quantization", "int4"],
            "unknown draft quantization 'int4'",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(tiny_model_dir, args, message):
    result = run(*[a.replace("{model}", tiny_model_dir) for a in args])
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_unknown_model_name_exits_2(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run("hello", "--target", "no-such-model")
    assert result.exit_code == 2
    assert "could not load model 'no-such-model'" in result.stderr


def test_max_model_len_ends_generation_at_that_length(tiny_model_dir):
    # "w1 w2": no end-of-sequence token within 100 greedy tokens of the tiny model
    result = run("w1 w2", "--target", tiny_model_dir, "--max-model-len", "12", "--max-new-tokens", "50", "--json")
    assert result.exit_code == 0, result.output
    output = json.loads(result.stdout)
    assert output["finish_reason"] == "length" and len(output["token_ids"]) == 12 - 2


def serve(*args):
    return runner.invoke(app, ["serve", *args])


def test_serve_sizes_the_batch_to_the_kv_cache_budget(tiny_model_dir, monkeypatch):
    served = []
    monkeypatch.setattr("specdecode.server.run_server", lambda server_app, host, port: served.append(server_app))
    # 64 tokens x 256 bytes (2 layers, 2 key/value heads of 8 floats, keys and values) = 16 KiB a sequence
    budget = str(5 * 64 * 256 / 2**30)
    result = serve("--target", tiny_model_dir, "--dtype", "float32", "--max-model-len", "64", "--kv-cache-gb", budget)
    assert result.exit_code == 0, result.output
    (server_app,) = served
    assert server_app.state.worker.decoder.capacity == 5  # --max-batch-size 16 did not fit
    assert server_app.state.server.context_length == 64


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kv-cache-gb", "1e-9"], "less than one sequence of max_model_len 128 tokens needs (32768 bytes"),
        (["--kv-cache-gb", "0"], "--kv-cache-gb must be positive"),
        (["--max-model-len", "1000"], "--max-model-len must be in [2, 128]"),
    ],
)
def test_serve_refuses_a_budget_or_length_that_cannot_work(tiny_model_dir, args, message):
    result = serve("--target", tiny_model_dir, "--dtype", "float32", *args)  # 4-byte cache entries
    assert result.exit_code == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def bnb_model_dir(tmp_path_factory) -> str:
    """A tiny Llama whose layers bitsandbytes' 4-bit CPU kernel can lay out (outputs of 32 and more)."""
    from helpers import bnb_llama, tiny_tokenizer

    folder = tmp_path_factory.mktemp("bnb-llama")
    bnb_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def test_a_4bit_layout_bitsandbytes_cannot_run_exits_2(tiny_model_dir):
    import bitsandbytes

    if not bitsandbytes.functional.has_avx512bf16():
        pytest.skip("only bitsandbytes' AVX512-BF16 kernel lays 4-bit weights out in blocks of 32 rows")
    result = run("w1", "--target", tiny_model_dir, "--quantization", "nf4")
    assert result.exit_code == 2
    assert "multiple of 32 outputs" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_quantized_target_names_its_precision_and_reproduces_itself(bnb_model_dir, quantization):
    args = ["w1 w2 w3 w1 w2 w3 w1", "--target", bnb_model_dir, "--quantization", quantization, "--max-new-tokens"]
    result = run(*args, "12", "--compare", "--json")
    assert result.exit_code == 0, result.output
    output = json.loads(result.stdout)
    name = precision.quantization_named(quantization).name  # "int8", the older spelling, is llm-int8
    assert output["stats"]["target_precision"].startswith(f"{name} (bitsandbytes")
    assert output["compare"]["identical_output"] is True
    human = run(*args, "6")
    assert f"| target {name} (bitsandbytes" in human.stdout.splitlines()[-1]


def test_4bit_self_draft_from_the_command_line(bnb_model_dir):
    args = ["w1 w2 w3", "--target", bnb_model_dir, "--dtype", "float32", "--drafter", "self-quantized"]
    args += ["--draft-quantization", "nf4", "--fixed-k"]  # adaptive k follows the clock
    result = run(*args, "--max-new-tokens", "12", "--compare", "--json")
    assert result.exit_code == 0, result.output
    output = json.loads(result.stdout)
    assert output["stats"]["drafter"] == "self-quantized-nf4" and output["stats"]["target_precision"] == "float32"
    assert output["stats"]["drafted_tokens"] > 0
    assert output["compare"]["identical_output"] is True


def test_train_draft_refuses_an_unknown_loss_before_loading_anything(tmp_path):
    result = runner.invoke(app, ["train-draft", "--output", str(tmp_path / "head"), "--loss", "bogus"])
    assert result.exit_code == 2
    assert "unknown loss 'bogus'" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "head").exists()


def test_sampling_options_and_grammars_reach_the_engine(tiny_model_dir):
    from specdecode import SpeculativeEngine

    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    prompt, base = "w1 w2 w3 w1 w2", ["--target", tiny_model_dir, "--max-new-tokens", "12", "--json"]
    penalized = json.loads(run(prompt, *base, "--repetition-penalty", "0.2", "--presence-penalty", "1").stdout)
    expected = engine.generate(prompt, max_new_tokens=12, repetition_penalty=0.2, presence_penalty=1.0)[0]
    assert penalized["token_ids"] == expected.token_ids
    assert expected.token_ids != engine.generate(prompt, max_new_tokens=12)[0].token_ids  # the options mattered
    scored = json.loads(run(prompt, *base, "--logprobs", "2").stdout)["logprobs"]
    assert [e["token"] for e in scored] == engine.generate(prompt, max_new_tokens=12)[0].token_ids
    assert all(len(e["top"]) == 2 for e in scored)


def test_json_schema_and_regex_options(tmp_path):
    """On a byte-level tokenizer (llguidance cannot read the tiny word-level one)."""
    target, tokenizer = byte_llama()
    target.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    base = ["--target", str(tmp_path), "--max-new-tokens", "64", "--json", "--no-chat"]
    answer = json.loads(run("x", *base, "--json-schema", str(tmp_path / "schema.json")).stdout)
    assert isinstance(json.loads(answer["text"])["n"], int)
    answer = json.loads(run("x", *base, "--regex", "[ab]{3}").stdout)
    assert answer["text"] in {a + b + c for a in "ab" for b in "ab" for c in "ab"}


@pytest.mark.parametrize(
    "args, says",
    [
        (["--presence-penalty", "5"], "--presence-penalty"),
        (["--min-p", "2"], "--min-p"),
        (["--logprobs", "50"], "--logprobs"),
        (["--json-schema", "{not json"], "--json-schema"),
        (["--regex", "w1", "--json-schema", "{}"], "not both"),
        (["--regex", "w[0-9]"], "cannot use this model's tokenizer"),
    ],
)
def test_bad_sampling_options_exit_2_with_one_line(tiny_model_dir, args, says):
    result = run("w1 w2", "--target", tiny_model_dir, "--max-new-tokens", "4", *args)
    assert result.exit_code == 2, result.output
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1
