"""Tool calls (OpenAI's `tools` and `tool_choice`): the prompt that shows the tools, the grammar
that makes a call, and the calls read back from the answer.

A call is written as Hermes' format, which Qwen, SmolLM3 and Hermes models were trained on:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, on lines of their
own. The chat template renders the tools where it can (its text names `tools`); for one that
cannot, a system message lists them and says how to call one, and earlier calls and results are
written into the messages' text in the same format.

- tool_choice "none": the answer is text, and nothing is read from it;
- "auto" (the default with tools): the target writes what it writes, exactly as without tools;
  blocks of known functions in it become `tool_calls`, and the text around them the content;
- "required", or a named function: the answer follows a grammar of one call (or several, with
  parallel_tool_calls) whose arguments follow the function's `parameters` schema; under
  speculation it is the constrained target's answer exactly (core/constraints.py).
"""

from __future__ import annotations

import json
import re
import uuid

from specdecode.core.constraints import JSON_LAYOUT, Constraint
from specdecode.core.detokenize import Holdback
from specdecode.server import schemas
from specdecode.server.errors import APIError

MAX_TOOLS = 128  # OpenAI's bound on a request's functions
OPEN = "<tool_call>"
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# a call's opening up to its arguments, as the calls' grammar writes it (name first)
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
INSTRUCTIONS = (
    "You may call these functions, described by JSON schemas of their arguments:\n{tools}\n"
    'To call one, answer with <tool_call>{{"name": NAME, "arguments": ARGUMENTS}}</tool_call>, '
    "one block per call, each on its own line."
)


def choice_of(body: schemas.ChatCompletionRequest) -> str | None:
    """ "none", "auto", "required", a function's name, or None without tools; checked against them."""
    tools = body.tools or []
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise APIError(400, "tools must have different names", param="tools")
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools; give the functions in tools", param="tool_choice")
        return None
    if isinstance(choice, schemas.NamedToolChoice):
        if choice.function.name not in names:
            message = f"tool_choice names '{choice.function.name}', which is not among the tools: {', '.join(names)}"
            raise APIError(400, message, param="tool_choice")
        return choice.function.name
    return choice or "auto"


def constraint(body: schemas.ChatCompletionRequest, choice: str | None) -> Constraint | None:
    """The grammar of the calls that tool_choice requires (None where the answer is free)."""
    if choice in (None, "none", "auto"):
        return None
    tools = [t for t in body.tools or [] if choice == "required" or t.function.name == choice]
    one = {"anyOf": [_call_schema(t.function) for t in tools]} if len(tools) > 1 else _call_schema(tools[0].function)
    one["x-guidance"] = {k: v for k, v in JSON_LAYOUT.items()}  # json.dumps' layout, as structured outputs
    several = body.parallel_tool_calls is not False and choice == "required"
    start = 'start: call ("\\n" call)*' if several else "start: call"
    return Constraint.grammar(f'{start}\ncall: "<tool_call>" %json {json.dumps(one)} "</tool_call>"')


def _call_schema(function: schemas.Function) -> dict:
    parameters = function.parameters if function.parameters is not None else {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def conversation(body: schemas.ChatCompletionRequest, template: str | None) -> tuple[list[dict], list[dict] | None]:
    """The messages as the chat template takes them, and the tools to pass it (None where the
    template cannot render them: a system message lists them instead)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    native = bool(tools) and template is not None and "tools" in template
    messages = [_message(m, native) for m in body.messages]
    if tools and not native:
        listed = "\n".join(json.dumps(t["function"]) for t in tools)
        system = {"role": "system", "content": INSTRUCTIONS.format(tools=listed)}
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + system["content"]}
        else:
            messages.insert(0, system)
    return messages, tools if native else None


def _message(message: schemas.ChatMessage, native: bool) -> dict:
    out: dict = {"role": message.role, "content": message.text()}
    calls = message.tool_calls or []
    if native:
        if calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}} for c in calls
            ]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        return out
    blocks = [_block(c.function.name, _arguments(c)) for c in calls]
    out["content"] = "\n".join([out["content"]] * bool(out["content"]) + blocks)
    return out


def _arguments(call: schemas.ToolCall) -> dict | str:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def _block(name: str, arguments: dict | str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class CallHoldback:
    """A streamed answer's text that cannot be part of a call, sent as it comes: what may still
    begin `<tool_call>` waits for the next text (the stop strings' Holdback, with that one
    string), and from a call's start on everything waits for the end, where the answer is read
    for calls (`calls_in`)."""

    def __init__(self) -> None:
        self._start = Holdback([OPEN])
        self._call: str | None = None  # from the call's start on, once one began

    @property
    def calling(self) -> bool:
        return self._call is not None

    @property
    def held(self) -> str:
        return self._start.held if self._call is None else self._call

    def release(self, text: str) -> str:
        if self._call is not None:
            self._call += text
            return ""
        released = self._start.release(text)
        start = released.find(OPEN)
        if start < 0:
            return released
        self._call = released[start:] + self._start.held
        return released[:start]


class CallStream:
    """The calls of an answer under the calls' grammar (tool_choice "required" or a named
    function: calls only, each valid), streamed as OpenAI streams them: a call's id and name once
    its opening is written, then its arguments' JSON text as it comes. The pieces of a call's
    arguments join into the text `calls_in` reads from the whole answer."""

    def __init__(self) -> None:
        self.text, self.at, self.calls = "", 0, 0
        self._arguments: _JsonEnd | None = None  # within a call's arguments

    def release(self, text: str) -> list[schemas.ToolCallDelta]:
        self.text += text
        deltas: list[schemas.ToolCallDelta] = []
        while (delta := self._arguments_piece() if self._arguments else self._opening()) is not None:
            deltas.append(delta)
        return deltas

    def _opening(self) -> schemas.ToolCallDelta | None:
        start = self.text.find(OPEN, self.at)
        header = HEADER.match(self.text, start + len(OPEN)) if start >= 0 else None
        if header is None or header.end() == len(self.text):  # its end is not written yet
            return None
        self.at, self._arguments = header.end(), _JsonEnd()
        function = schemas.FunctionCallDelta(name=json.loads(f'"{header.group(1)}"'), arguments="")
        return schemas.ToolCallDelta(index=self.calls, id=_call_id(), type="function", function=function)

    def _arguments_piece(self) -> schemas.ToolCallDelta | None:
        assert self._arguments is not None
        if self.at == len(self.text):
            return None
        end = self._arguments.feed(self.text, self.at)
        piece, self.at = self.text[self.at : end], end
        index = self.calls
        if self._arguments.done:
            self._arguments, self.calls = None, self.calls + 1
        return schemas.ToolCallDelta(index=index, function=schemas.FunctionCallDelta(arguments=piece))


class _JsonEnd:
    """Where a JSON value written piece by piece ends: its brackets' depth, outside strings."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def feed(self, text: str, start: int) -> int:
        """Reads text from start; the index after the value's last character, or len(text)."""
        for i in range(start, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:  # a string value
                        self.done = True
                        return i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]" and self.depth > 0:
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
            elif self.depth == 0 and c in ",}":  # the end of a number or a literal
                self.done = True
                return i
        return len(text)


def calls_in(text: str, body: schemas.ChatCompletionRequest) -> tuple[str | None, list[schemas.ToolCall]]:
    """The answer's content (None when it is calls only) and the calls of known functions in it."""
    known = {t.function.name for t in body.tools or []}
    calls, rest, end = [], [], 0
    for match in CALL.finditer(text):
        call = _parsed(match.group(1), known)
        if call is None:
            continue  # not a call of a known function: it stays text
        rest.append(text[end : match.start()])
        end = match.end()
        calls.append(call)
    content = ("".join(rest) + text[end:]).strip() if calls else text
    return (content or None), calls


def _parsed(block: str, known: set[str]) -> schemas.ToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in known:
        return None
    return schemas.ToolCall(
        id=_call_id(), function=schemas.FunctionCall(name=value["name"], arguments=_arguments_text(block, value))
    )


def _arguments_text(block: str, value: dict) -> str:
    """The arguments as the model wrote them, where the block opens as the calls' grammar writes
    a call (what CallStream streams); else their JSON, laid out by json.dumps."""
    header = HEADER.match(block)
    if header is not None:
        scan = _JsonEnd()
        end = scan.feed(block, header.end())
        if scan.done and block[end:].strip() == "}":
            return block[header.end() : end]
    return json.dumps(value.get("arguments", {}))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
