"""One spelling of a precision on every command: `--dtype` and `--quantization` (profile's older
`--quantize` accepted, with one line saying so), unknown names refused before a model loads."""

from __future__ import annotations

import logging

from typer.testing import CliRunner

from specdecode import precision
from specdecode.cli import app


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_profile_takes_quantization_and_its_older_flag_with_one_line(monkeypatch, caplog):
    monkeypatch.setattr(precision, "_warned", set())  # warned once a process: start afresh
    with caplog.at_level(logging.WARNING):
        older = invoke("profile", "--quantize", "int8", "--prefix", "0")  # refused after the flag is read
    assert older.exit_code == 2 and "--prefix and --repeats" in older.stderr
    assert [r.getMessage() for r in caplog.records] == [
        "--quantize is an older spelling of --quantization (the same); it will be removed"
    ]
    both = invoke("profile", "--quantize", "int8", "--quantization", "w8a8")
    assert both.exit_code == 2 and "give --quantization alone" in both.stderr
    unknown = invoke("profile", "--quantization", "nf4")
    assert unknown.exit_code == 2
    assert "unknown quantization 'nf4'; choose one of: w8a8, int8-weight-only" in unknown.stderr


def test_batch_and_serve_refuse_an_unknown_precision_before_loading(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("{}\n")
    batch = invoke("batch", str(source), "--output", str(tmp_path / "o"), "--quantization", "int4")
    assert batch.exit_code == 2 and "unknown quantization 'int4'" in batch.stderr
    serve = invoke("serve", "--dtype", "int8", "--port", "1")
    assert serve.exit_code == 2 and "unknown dtype 'int8'" in serve.stderr


def test_profile_times_the_precision_generate_runs_by_default(tiny_model_dir):
    """`profile` with --dtype auto times what generate and serve load (w8a8 where that is their
    default on this CPU), and a named dtype the checkpoint's own arithmetic, nothing quantized."""
    from specdecode.runners.select import resolve_precision

    default = resolve_precision(tiny_model_dir, "auto", "auto", runner="fast").runner_quantization
    auto = invoke("profile", "--target", tiny_model_dir, "--runner", "fast", "--repeats", "1", "--prefix", "2")
    assert auto.exit_code == 0, auto.output
    title = "FastLlamaRunner w8a8," if default is not None else "FastLlamaRunner,"
    assert title in auto.stdout, auto.stdout
    named = invoke("profile", "--target", tiny_model_dir, "--runner", "fast", "--repeats", "1", "--prefix", "2",
                   "--dtype", "bfloat16")  # fmt: skip
    assert named.exit_code == 0 and "FastLlamaRunner," in named.stdout and "w8a8" not in named.stdout


def test_profile_refuses_a_prefix_past_the_models_context_in_one_line(tiny_model_dir):
    result = invoke("profile", "--target", tiny_model_dir, "--runner", "fast", "--prefix", "200")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--prefix 200 and 32 new tokens pass the model's context of 128 tokens: give --prefix 96 or less" in (
        result.stderr
    )
