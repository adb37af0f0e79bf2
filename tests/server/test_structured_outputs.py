"""Structured outputs through the real server and the official `openai` client: OpenAI's
response_format (JSON, JSON of a schema) and vLLM's structured_outputs (regex, choice, Lark
grammar), answered as the engine answers the same constraint, streamed or not; a bad
constraint is a 400 naming its parameter, and the server goes on."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from helpers import byte_llama, openai_client, serving
from specdecode import SpeculativeEngine
from specdecode.core.constraints import Constraint
from specdecode.drafters import PromptLookupDrafter
from specdecode.server import create_app

MODEL = "tiny-bytes"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"enum": [1, 2, 3]}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


def engine() -> SpeculativeEngine:
    return SpeculativeEngine(*byte_llama(), PromptLookupDrafter(), num_speculative_tokens=4)


@pytest.fixture(scope="module")
def reference():
    return engine()


@pytest.fixture(scope="module")
def url():
    with serving(create_app(engine(), model_name=MODEL)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai_client(url)


def test_a_json_schema_answer_follows_the_schema_as_the_engine_answers(client, reference):
    expected = reference.generate("Rank a city:", max_new_tokens=60, constraint=Constraint.json_schema(SCHEMA))[0]
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Rank a city:"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
    )
    text = response.choices[0].message.content
    assert text == expected.text
    assert set(json.loads(text)) == {"city", "rank"}
    assert response.model_extra["speculative"]["forced_accepted"] > 0  # keys and quotes drafted for free


def test_json_mode_and_every_structured_output_kind(client, reference):
    asked = [
        ({"response_format": {"type": "json_object"}}, Constraint.json_object()),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, Constraint.regex("[0-9]{3}-[a-z]{2}")),
        ({"structured_outputs": {"choice": ["red", "green"]}}, Constraint.choice(["red", "green"])),
        ({"structured_outputs": {"json": SCHEMA}}, Constraint.json_schema(SCHEMA)),
        ({"structured_outputs": {"grammar": 'start: "a" ("b" | "c")+'}}, Constraint.grammar('start: "a" ("b" | "c")+')),
    ]
    for extra, constraint in asked:
        expected = reference.generate("x:", max_new_tokens=40, constraint=constraint)[0].text
        for stream in (False, True):
            response = client.completions.create(
                model=MODEL, prompt="x:", max_tokens=40, temperature=0, stream=stream, extra_body=extra
            )
            text = "".join(c.choices[0].text for c in response) if stream else response.choices[0].text
            assert text == expected, (extra, stream)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it_and_the_server_goes_on(url, extra, param):
    body = {"model": MODEL, "prompt": "x:", "max_tokens": 5} | extra
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code in (400, 422), response.text
    assert response.json()["error"]["param"] == param
    assert (
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x:", "max_tokens": 3}).status_code == 200
    )


class City(BaseModel):
    city: str = Field(max_length=8)
    rank: Literal[1, 2, 3]


def test_the_official_clients_parse_gets_its_pydantic_model(client):
    """client.chat.completions.parse sends the model's strict schema and parses the answer back."""
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Rank a city:"}], response_format=City, max_tokens=60
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.rank in (1, 2, 3) and len(parsed.city) <= 8
