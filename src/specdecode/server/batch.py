"""Offline generation of a JSONL file in the OpenAI Batch API format (`specdecode batch`), as
`vllm run-batch` reads it.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}`; each output line `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`, the body exactly what `specdecode serve`
answers, because the lines are sent to the same app, in process, several at a time so that
continuous batching decodes them together. A line that is not a request gets an output line
with its error, never a crash; one with no custom_id of its own is answered with custom_id null
and its line number in error.line (an id invented for it could be a real line's). Resumable: a
rerun skips the lines already answered in the output and appends the rest, so every input line
appears in the output exactly once; an output that is not this input's is refused, untouched.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from specdecode.errors import InvalidArgumentError

URLS = ("/v1/chat/completions", "/v1/completions")
BOM = b"\xef\xbb\xbf"  # a byte-order mark some editors write
ANSWER_FIELDS = {"id", "custom_id", "response", "error"}
ANSWER_START = '{"id": "batch_req_'  # how every line write_answers writes begins (answer(), json.dumps)


def jsonl_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(line number, text) of every line of a JSONL file; text None where it is not UTF-8.

    Only '\\n' ends a line ('\\r\\n' too: the '\\r' is dropped). str.splitlines() would also
    split at U+2028, U+0085 and other characters that JSON allows, unescaped, inside a string,
    and so cut a valid request in two."""
    data = path.read_bytes().removeprefix(BOM)
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            yield number, raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError:
            yield number, None


def read_requests(path: Path) -> list[dict]:
    """Every line of the input, as a request or as an error for it; a duplicate id is an error
    of the whole file (its lines could not be told apart in the output)."""
    lines, seen = [], set()
    for number, text in jsonl_lines(path):
        if text is not None and not text.strip():
            continue
        line = _parse(text, number)
        if line["custom_id"] in seen:
            raise InvalidArgumentError(
                f"{path}:{number}: custom_id '{line['custom_id']}' appears twice; ids must be unique"
            )
        if line["custom_id"] is not None:  # a line with no id is told apart by its number
            seen.add(line["custom_id"])
        lines.append(line)
    return lines


def line_key(record: dict) -> str | int | None:
    """What ties an input line and its answer: the custom_id, or for a line without one its number
    (error.line), an int, so that it can never equal an id; None where record has neither."""
    custom_id, error = record.get("custom_id"), record.get("error")
    if isinstance(custom_id, str):
        return custom_id
    if custom_id is None and isinstance(error, dict) and type(error.get("line")) is int:
        return error["line"]
    return None


def done_keys(output: Path, keys: set[str | int]) -> set[str | int]:
    """The keys (line_key) of the input lines already answered in output. Reads the file once:
    call it once per run, not once per line. Every line of output must answer one of keys, but
    for a last line cut short by a killed run (write_answers drops it); any other file is refused,
    before anything is written to it, as it may be a file of the user's that --output misnames."""
    if not output.exists():
        return set()
    if not output.is_file():
        raise _not_this_inputs(output, "it is not a file")
    found = list(jsonl_lines(output))
    done = set()
    for number, text in found:
        if text is not None and not text.strip():
            continue
        record = _json(text)
        if record is None and number == len(found) and _cut_short(text):
            continue
        key = line_key(record) if _is_answer(record) else None
        if key not in keys:
            raise _not_this_inputs(output, _why_not(number, key))
        done.add(key)
    return done


def pending(lines: list[dict], output: Path) -> list[dict]:
    """The lines not yet answered in output, in input order (done_keys: output must be this
    input's)."""
    done = done_keys(output, {line_key(line) for line in lines})
    return [line for line in lines if line_key(line) not in done]


def _json(text: str | None) -> object:
    """text's JSON value; None where text is no JSON (or JSON null, which no answer is)."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


def _is_answer(record: object) -> bool:
    """Whether record has the shape of an output line (answer())."""
    return isinstance(record, dict) and record.keys() == ANSWER_FIELDS and isinstance(record["id"], str)


def _cut_short(text: str | None) -> bool:
    """Whether text is the start of a line write_answers was writing when its run was killed."""
    return text is not None and (text.startswith(ANSWER_START) or ANSWER_START.startswith(text))


def _why_not(number: int, key: str | int | None) -> str:
    if key is None:
        return f"its line {number} is not a batch answer"
    if isinstance(key, int):
        return f"its line {number} answers an input line {key} with no custom_id, which this input does not have"
    return f"its line {number} answers custom_id '{key}', which this input does not have"


def _not_this_inputs(output: Path, why: str) -> InvalidArgumentError:
    message = (
        "output must be a new or empty file, or this input's batch output to resume it; "
        f"{output} is neither ({why}) and is left as it is"
    )
    return InvalidArgumentError(message, param="output")  # the CLI says --output


def run_batch(
    app: FastAPI, todo: list[dict], output: Path, concurrency: int, on_done: Callable[[], None] = lambda: None
) -> int:
    """Answer every line of todo (pending(): those not yet in output) with app, in this process,
    `concurrency` at a time, appending each answer to output; the number answered. (On a Ray
    cluster: ray_batch.run_batch_on_ray.)"""
    with TestClient(app) as client, ThreadPoolExecutor(concurrency) as pool:

        def answers(todo: list[dict]) -> Iterator[dict]:
            for future in as_completed([pool.submit(answer, client, line) for line in todo]):
                yield future.result()

        return write_answers(todo, output, answers, on_done)


def write_answers(
    todo: list[dict], output: Path, answers: Callable[[list[dict]], Iterable[dict]], on_done: Callable[[], None]
) -> int:
    """Append to output an answer for every line of todo (pending(): those not yet in it), as
    `answers(todo)` yields them (in any order: each carries its custom_id); the number answered."""
    _end_last_line(output)
    with output.open("a") as out:
        for record in answers(todo):
            out.write(json.dumps(record) + "\n")
            out.flush()  # a killed run keeps every line written so far
            on_done()
    return len(todo)


def _end_last_line(path: Path) -> None:
    """A run killed mid-write leaves a last line without its newline: end it where it is a
    complete answer (done_keys counted it as done), else cut it, so appended lines start clean."""
    if not path.exists():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    start = data.rfind(b"\n") + 1
    if _is_answer(_json(data[start:].removeprefix(BOM).decode("utf-8", "replace"))):
        with path.open("ab") as out:
            out.write(b"\n")
    else:
        path.write_bytes(data[:start])


def answer(client: TestClient, line: dict) -> dict:
    """The output line for one input line, answered by the app behind client."""
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line["custom_id"], "response": None, "error": None}
    if "error" in line:
        record["error"] = line["error"]
        return record
    response = client.post(line["url"], json=line["body"])
    try:
        body = response.json()
    except ValueError:  # _parse refuses what would stream; whatever else is not JSON is this line's error
        kind = response.headers.get("content-type", "no content type")
        message = f"the server answered {response.status_code} with {kind}, not JSON"
        record["error"] = {"code": "invalid_response", "message": message}
        return record
    record["response"] = {"status_code": response.status_code, "request_id": record["id"], "body": body}
    return record


def _parse(text: str | None, number: int) -> dict:
    if text is None:
        return _invalid(number, None, "invalid_json", "not UTF-8 text; JSONL is UTF-8")
    try:
        line = json.loads(text)
    except ValueError as error:
        return _invalid(number, None, "invalid_json", str(error))
    if not isinstance(line, dict) or not isinstance(line.get("custom_id"), str):
        return _invalid(number, None, "invalid_request", "needs a string custom_id")
    problem, param = _problem(line)
    if problem is not None:
        return _invalid(number, line["custom_id"], "invalid_request", problem, param)
    return line


def _invalid(number: int, custom_id: str | None, code: str, problem: str, param: str | None = None) -> dict:
    """An input line that is no request, with its error. The line number is kept in error.line
    (as OpenAI's batch errors do): for a line with no custom_id it is what tells its answer apart."""
    error = {"code": code, "message": f"line {number}: {problem}", "line": number}
    return {"custom_id": custom_id, "error": error | ({"param": param} if param else {})}


def _problem(line: dict) -> tuple[str | None, str | None]:
    """What makes a parsed line no request of this API (and the field at fault), or (None, None)."""
    if line.get("method") != "POST":
        return "method must be POST", "method"
    if line.get("url") not in URLS:
        return f"url must be one of {', '.join(URLS)}", "url"
    if not isinstance(line.get("body"), dict):
        return "body must be an object", "body"
    # a batch answer is one JSON body in the output file, never a stream of events (the OpenAI
    # Batch API does not stream either); answering it unstreamed would answer another request
    if line["body"].get("stream") not in (None, False):
        return 'body.stream: a batch line cannot be streamed; drop "stream" or set it to false', "stream"
    return None, None
