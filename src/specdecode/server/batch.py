"""Offline generation of a JSONL file in the OpenAI Batch API format (`specdecode batch`), as
`vllm run-batch` reads it.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body": {...}}`; each output line `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`, the body exactly what `specdecode serve`
answers, because the lines are sent to the same app, in process, several at a time so that
continuous batching decodes them together. A line that is not a request gets an output line
with its error, never a crash. Resumable: a rerun skips the custom_ids already in the output
and appends the rest, so every input line appears in the output exactly once, with its id.
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


def jsonl_lines(path: Path) -> Iterator[tuple[int, str | None]]:
    """(line number, text) of every line of a JSONL file; text None where it is not UTF-8.

    Only '\\n' ends a line ('\\r\\n' too: the '\\r' is dropped). str.splitlines() would also
    split at U+2028, U+0085 and other characters that JSON allows, unescaped, inside a string,
    and so cut a valid request in two."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a byte-order mark some editors write
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
        seen.add(line["custom_id"])
        lines.append(line)
    return lines


def done_ids(path: Path) -> set[str]:
    """The custom_ids already answered in an output file (a half-written last line is ignored).
    Reads the file once: call it once per run, not once per line."""
    if not path.exists():
        return set()
    ids = set()
    for _, text in jsonl_lines(path):
        try:
            ids.add(json.loads(text)["custom_id"])
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def pending(lines: list[dict], output: Path) -> list[dict]:
    """The lines whose custom_id is not yet in output, in input order."""
    done = done_ids(output)
    return [line for line in lines if line["custom_id"] not in done]


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
    _drop_partial_line(output)
    with output.open("a") as out:
        for record in answers(todo):
            out.write(json.dumps(record) + "\n")
            out.flush()  # a killed run keeps every line written so far
            on_done()
    return len(todo)


def _drop_partial_line(path: Path) -> None:
    """A run killed mid-write leaves half a line: cut it, so appended lines start clean."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


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
        message = f"line {number}: not UTF-8 text; JSONL is UTF-8"
        return {"custom_id": f"line-{number}", "error": {"code": "invalid_json", "message": message}}
    try:
        line = json.loads(text)
    except ValueError as error:
        return {"custom_id": f"line-{number}", "error": {"code": "invalid_json", "message": f"line {number}: {error}"}}
    if not isinstance(line, dict) or not isinstance(line.get("custom_id"), str):
        message = f"line {number}: needs a string custom_id"
        return {"custom_id": f"line-{number}", "error": {"code": "invalid_request", "message": message}}
    problem, param = _problem(line)
    if problem is not None:
        error = {"code": "invalid_request", "message": f"line {number}: {problem}"}
        return {"custom_id": line["custom_id"], "error": error | ({"param": param} if param else {})}
    return line


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
