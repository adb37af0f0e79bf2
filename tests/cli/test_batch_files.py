"""`specdecode batch`: the OpenAI Batch API format, answered in process as the server answers,
every line exactly once, resumable after a run that stopped part-way."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdecode import SpeculativeEngine
from specdecode.cli import app as cli_app


def lines(model: str) -> list[dict]:
    completion = {"model": model, "prompt": "w1 w2 w3 w1", "max_tokens": 6, "temperature": 0}
    chat = {"model": model, "messages": [{"role": "user", "content": "w4 w5 w4"}], "max_tokens": 5, "temperature": 0}
    return [
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": completion},
        {"custom_id": "c2", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "c3", "method": "POST", "url": "/v1/completions", "body": completion | {"prompt": "w7 w8"}},
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": completion},
        {"custom_id": "bad-value", "method": "POST", "url": "/v1/completions", "body": completion | {"max_tokens": 0}},
    ]


def key(record: dict) -> str | int:
    """What ties an answer to its input line: its custom_id, or for a line without one its number."""
    return record["custom_id"] if record["custom_id"] is not None else record["error"]["line"]


def run(tmp_path, model_dir: str, output):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines(model_dir)) + "\n{not json\n")
    args = ["batch", str(source), "--output", str(output), "--target", model_dir, "--concurrency", "3"]
    return CliRunner().invoke(cli_app, args)


def test_every_line_is_answered_once_as_the_server_would(tmp_path, tiny_model_dir):
    output = tmp_path / "out.jsonl"
    result = run(tmp_path, tiny_model_dir, output)
    assert result.exit_code == 0, result.output
    records = {key(r): r for r in map(json.loads, output.read_text().splitlines())}
    assert sorted(records, key=str) == [6, "bad-url", "bad-value", "c1", "c2", "c3"]
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    expected = engine.generate("w1 w2 w3 w1", max_new_tokens=6)[0]
    body = records["c1"]["response"]["body"]
    assert records["c1"]["response"]["status_code"] == 200 and body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    assert records["c2"]["response"]["body"]["object"] == "chat.completion"
    assert records["bad-value"]["response"]["status_code"] == 400
    assert records["bad-value"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert records["bad-url"]["error"]["code"] == "invalid_request" and records["bad-url"]["response"] is None
    assert records[6]["custom_id"] is None and records[6]["error"]["code"] == "invalid_json"


def test_a_rerun_answers_only_what_is_missing(tmp_path, tiny_model_dir):
    output = tmp_path / "out.jsonl"
    assert run(tmp_path, tiny_model_dir, output).exit_code == 0
    kept = output.read_text().splitlines()[:3]
    output.write_text("\n".join(kept[:2]) + "\n" + kept[2][:40])  # a run killed mid-write
    result = run(tmp_path, tiny_model_dir, output)
    assert result.exit_code == 0 and "4 answered" in result.output
    keys = [key(json.loads(text)) for text in output.read_text().splitlines()]
    assert sorted(keys, key=str) == [6, "bad-url", "bad-value", "c1", "c2", "c3"]  # each exactly once
    again = run(tmp_path, tiny_model_dir, output)
    assert again.exit_code == 0 and "0 answered" in again.output


def test_bad_batch_input_exits_2_with_one_line(tmp_path, tiny_model_dir):
    missing = CliRunner().invoke(cli_app, ["batch", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o")])
    assert missing.exit_code == 2 and "no input file" in missing.output
    twice = tmp_path / "twice.jsonl"
    twice.write_text("\n".join(json.dumps(line) for line in lines(tiny_model_dir)[:1] * 2))
    result = CliRunner().invoke(
        cli_app, ["batch", str(twice), "--output", str(tmp_path / "o"), "--target", tiny_model_dir]
    )
    assert result.exit_code == 2 and "appears twice" in result.output


def write_lines(path, records: list[dict], separator: str = "\n") -> None:
    """Input lines as a user's tool may write them: UTF-8, not ASCII-escaped."""
    path.write_bytes(separator.join(json.dumps(r, ensure_ascii=False) for r in records).encode() + b"\n")


def test_a_streamed_line_gets_its_own_error_and_the_run_goes_on(tmp_path, tiny_model_dir):
    streamed = lines(tiny_model_dir)[0] | {"custom_id": "streamed"}
    streamed["body"] = streamed["body"] | {"stream": True}
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, [streamed, lines(tiny_model_dir)[1]])
    args = ["batch", str(source), "--output", str(output), "--target", tiny_model_dir]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    records = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert sorted(records) == ["c2", "streamed"]
    error = records["streamed"]["error"]
    assert records["streamed"]["response"] is None and error["code"] == "invalid_request"
    assert error["param"] == "stream" and "stream" in error["message"], error
    assert records["c2"]["response"]["status_code"] == 200


def test_line_separators_inside_json_strings_do_not_split_a_line(tmp_path, tiny_model_dir):
    """U+2028, U+2029, U+0085 and the like are legal, unescaped, inside a JSON string; only
    '\\n' (or '\\r\\n') ends a line of JSONL."""
    separators = "\u2028\u2029\u0085\x1c\x1d\x1e\x0b\x0c"
    first, second = lines(tiny_model_dir)[:2]
    first = first | {"body": first["body"] | {"prompt": f"w1 w2{separators}w3 w1"}}
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, [first, second], separator="\r\n")  # written on Windows
    result = CliRunner().invoke(cli_app, ["batch", str(source), "--output", str(output), "--target", tiny_model_dir])
    assert result.exit_code == 0, result.output
    records = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert sorted(records) == ["c1", "c2"], sorted(records)
    assert [r["response"]["status_code"] for r in records.values()] == [200, 200]


def test_a_resumed_run_parses_each_finished_line_once(tmp_path, tiny_model_dir, monkeypatch):
    """Resuming reads the output once, not once per input line (which was quadratic)."""
    finished, request = 300, lines(tiny_model_dir)[0]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, [request | {"custom_id": f"r{i}"} for i in range(finished + 2)])
    done = [{"id": f"batch_req_{i}", "custom_id": f"r{i}", "response": None, "error": None} for i in range(finished)]
    output.write_text("".join(json.dumps(record) + "\n" for record in done))
    parses, loads = [], json.loads

    def counting(text, *args, **kwargs):
        if '"batch_req_' in str(text):  # a line of the output, not of the input
            parses.append(text)
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting)
    result = CliRunner().invoke(cli_app, ["batch", str(source), "--output", str(output), "--target", tiny_model_dir])
    assert result.exit_code == 0 and "2 answered" in result.output, result.output
    assert len(parses) <= finished, f"{len(parses)} parses of {finished} finished lines"
    ids = [loads(text)["custom_id"] for text in output.read_text().splitlines()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(finished + 2))


def test_a_finished_last_answer_without_its_newline_is_kept(tmp_path, tiny_model_dir):
    """A run killed between an answer and its '\\n' leaves a complete last line: a rerun counts
    it as done and keeps it, ending it with its newline (only a line cut short is dropped)."""
    output = tmp_path / "out.jsonl"
    assert run(tmp_path, tiny_model_dir, output).exit_code == 0
    finished = output.read_text()
    output.write_text(finished.removesuffix("\n"))
    result = run(tmp_path, tiny_model_dir, output)
    assert result.exit_code == 0 and "0 answered" in result.output, result.output
    assert output.read_text() == finished


def answer_line(custom_id, error=None) -> str:
    return json.dumps({"id": "batch_req_1", "custom_id": custom_id, "response": None, "error": error})


NOT_THIS_INPUTS_OUTPUT = {
    "text": "notes\nthe last line, with no newline",
    "one line of text": "a whole file of one line, with no newline",
    "JSON of another shape": '{"custom_id": "c1", "answer": 42}\n',
    "an answer of another input": answer_line("c1") + "\n" + answer_line("other"),
    "an answer for a line that has an id": answer_line(None, {"code": "invalid_json", "message": "m", "line": 1}),
}


@pytest.mark.parametrize("content", NOT_THIS_INPUTS_OUTPUT.values(), ids=NOT_THIS_INPUTS_OUTPUT.keys())
def test_an_output_that_is_not_this_inputs_is_refused_and_left_as_it_is(tmp_path, tiny_model_dir, content):
    output = tmp_path / "notes.txt"
    output.write_bytes(content.encode())
    result = run(tmp_path, tiny_model_dir, output)
    assert result.exit_code == 2 and "--output" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert output.read_bytes() == content.encode()


def test_an_empty_output_file_is_filled(tmp_path, tiny_model_dir):
    output = tmp_path / "out.jsonl"
    output.touch()
    result = run(tmp_path, tiny_model_dir, output)
    assert result.exit_code == 0 and "6 answered" in result.output, result.output
    assert len(output.read_text().splitlines()) == 6


def test_an_invalid_lines_answer_never_takes_a_real_id(tmp_path, tiny_model_dir):
    """A line with no id is answered with custom_id null and its number in error.line, so a real
    custom_id "line-3" and an invalid line 3 each get their own answer, and a rerun tells them apart."""
    first, second = lines(tiny_model_dir)[:2]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(first) + "\n" + json.dumps(second | {"custom_id": "line-3"}) + "\n{not json\n")
    args = ["batch", str(source), "--output", str(output), "--target", tiny_model_dir]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    answers = {key(json.loads(text)): text for text in output.read_text().splitlines()}
    assert sorted(answers, key=str) == [3, "c1", "line-3"]
    assert json.loads(answers["line-3"])["response"]["status_code"] == 200
    assert json.loads(answers[3])["error"]["code"] == "invalid_json"
    for kept in ("line-3", 3):
        output.write_text(answers[kept] + "\n")
        again = CliRunner().invoke(cli_app, args)
        assert again.exit_code == 0 and "2 answered" in again.output, again.output
        keys = [key(json.loads(text)) for text in output.read_text().splitlines()]
        assert sorted(keys, key=str) == [3, "c1", "line-3"]  # each exactly once
