"""Tool calling on `/v1/chat/completions`: a request's `tools` and `tool_choice` checked and planned.

* `"none"`: plain text (the tools are still rendered into the prompt, as vLLM does).
* a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained to that
  function's parameter schema, so the arguments always parse; they are the whole output.
* `"required"`: the output is constrained to a JSON array of `{"name", "parameters"}` calls of the given tools.
* `"auto"` (the default when tools are given): free text, whose tool calls the server's `--tool-call-parser`
  takes out (`tool_parsers.py`); it needs `--enable-auto-tool-choice`, as in vLLM.

`ToolStream` turns one choice's streamed text deltas into OpenAI's chunk deltas (`content`, `tool_calls`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.sampling_params import GuidedDecodingParams
from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS, ToolCall

ANY_OBJECT = {"type": "object"}


def _function(tool: Any, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise ValueError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                         "\"parameters\": {...}}}")
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"tools[{index}].function.name must be a non-empty string")
    if not isinstance(function.get("parameters", ANY_OBJECT), dict):
        raise ValueError(f"tools[{index}].function.parameters must be a JSON schema object")
    return function


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict]  # the request's tool definitions, for the chat template
    named: str | None = None
    parser_name: str | None = None
    guided: GuidedDecodingParams | None = None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content and tool calls; an output cut before it parses is content only."""
        if self.mode == "named":
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            try:
                calls = [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                         for item in json.loads(text)]
            except (json.JSONDecodeError, TypeError, KeyError):
                return text, []
            return None, calls
        if self.mode == "auto":
            return TOOL_CALL_PARSERS[self.parser_name]().extract(text)
        return text, []


def plan_tools(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser_name: str | None) -> ToolPlan | None:
    """The request's tool plan (None: no tools); ValueError naming what is wrong."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice is only allowed when tools are given")
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    functions = [_function(tool, index) for index, tool in enumerate(tools)]
    names = [function["name"] for function in functions]
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice.get("function"), dict) else None
        if tool_choice.get("type", "function") != "function" or name not in names:
            raise ValueError(f"tool_choice names no given tool (tools: {names}); it must be \"none\", \"auto\", "
                             "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        schema = functions[names.index(name)].get("parameters", ANY_OBJECT)
        return ToolPlan("named", tools, named=name, guided=GuidedDecodingParams(json=schema))
    if tool_choice == "none":
        return ToolPlan("none", tools)
    if tool_choice == "required":
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": function["name"]},
                                 "parameters": function.get("parameters", ANY_OBJECT)}} for function in functions]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, guided=GuidedDecodingParams(json=schema))
    if tool_choice == "auto":
        if parser_name is None:
            raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        return ToolPlan("auto", tools, parser_name=parser_name)
    raise ValueError(f"tool_choice {tool_choice!r} is not one of \"none\", \"auto\", \"required\" or a named function")


class ToolStream:
    """One streamed choice under a tool plan: `feed(delta text)` and `finish()` return the chunk deltas to send."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content (auto) or arguments (named)
        self.calls: list[ToolCall] = [ToolCall(plan.named, "")] if plan.mode == "named" else []
        self.opened = False  # named: the call's id and name are sent

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if self.plan.mode == "named":
            self.sent = len(self.text)
            call = {"index": 0, "function": {"arguments": delta}}
            if not self.opened:
                self.opened = True
                call = {"index": 0, "id": self.calls[0].id, "type": "function",
                        "function": {"name": self.plan.named, "arguments": delta}}
            elif not delta:
                return []
            return [{"tool_calls": [call]}]
        if self.plan.mode == "auto":
            ready = len(self.text) - TOOL_CALL_PARSERS[self.plan.parser_name]().held_back(self.text)
            if ready > self.sent:
                content, self.sent = self.text[self.sent:ready], ready
                return [{"content": content}]
            return []
        if self.plan.mode == "none":
            self.sent = len(self.text)
            return [{"content": delta}] if delta else []
        return []  # required: the array is parsed whole at the end

    def finish(self) -> tuple[list[dict], bool]:
        """The last deltas of the choice, and whether it made tool calls."""
        if self.plan.mode == "named":
            return [], True
        if self.plan.mode == "none":
            return [], False
        content, calls = self.plan.extract(self.text)
        deltas = []
        if not calls:
            rest = self.text[self.sent:]
            return ([{"content": rest}] if rest else []), False
        if content and len(content) > self.sent:  # auto: content before the calls not yet sent
            deltas.append({"content": content[self.sent:]})
        deltas.append({"tool_calls": [{"index": index, **call.to_dict()} for index, call in enumerate(calls)]})
        self.calls = calls
        return deltas, True
