"""Tool-call parsers for `tool_choice: "auto"` (vLLM's `--tool-call-parser` names): the tool calls a model wrote in
its own format, taken out of its text.

* `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of
  them, after optional content.
* `llama3_json` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`.

A parser also says how much of a streamed text may still turn into a tool call (`held_back`), so that streaming
sends content as it comes and nothing of a call's markup.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(value, arguments_key: str) -> ToolCall | None:
    """A ToolCall from a parsed object with a string `name` and an object of arguments; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _prefix_overlap(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls); a text whose calls do not all parse is content only."""
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for body in self.CALL.findall(text[start:]):
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return content or None, calls

    def held_back(self, text: str) -> int:
        """How many trailing characters of a streamed `text` must wait: from a call's start on, everything."""
        start = text.find(self.START)
        return len(text) - start if start >= 0 else _prefix_overlap(text, self.START)


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text, []
        decoder, calls, index = json.JSONDecoder(), [], 0
        while index < len(body):
            try:
                value, index = decoder.raw_decode(body, index)
            except json.JSONDecodeError:
                return text, []
            call = _call(value, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while index < len(body) and body[index] in " \t\n;":
                index += 1
        return None, calls

    def held_back(self, text: str) -> int:
        """A call is the whole answer: wait while the text (blanks aside) is empty, '{', or the tag's start."""
        body = text.lstrip()
        if not body or body.startswith("{") or body.startswith(self.TAG) or self.TAG.startswith(body):
            return len(text)
        return 0


TOOL_CALL_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
