"""The request of OpenAI's Responses API (`POST /v1/responses`) and its translation to a chat request.

A Responses request is served as the chat request it amounts to (`ResponsesRequest.chat_request`): `instructions`
become a system message; `input` (a string, or a list of items) becomes the conversation — `message` items with
text content (`developer` is `system`), `function_call` items as the assistant's tool calls and
`function_call_output` items as tool messages, so a tool round trip renders through the chat template as it
does on `/v1/chat/completions`. Function `tools` and `tool_choice` map to chat's, `text.format` to
`response_format`, `max_output_tokens` to `max_completion_tokens`. The server keeps no responses: a request that
needs a stored one (`previous_response_id`, `conversation`, `background`, a stored `prompt`) is refused, and so
are input items and tools it cannot serve, each by name.
"""

from __future__ import annotations

from typing import Any

from jaxserve.chat import IMAGE_PARTS, TEXT_PARTS
from jaxserve.server.protocol import ChatCompletionRequest, StrictModel
ANY_PARAMETERS = {"type": "object", "properties": {}}


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: Any  # a string or a list of items, checked by `messages()`
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = None  # nothing is stored, whatever it says; the answer reports store: false
    metadata: dict[str, str] | None = None
    user: str | None = None
    # need a stored response, conversation or prompt, or a background worker: refused
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    # vLLM's extras, as on the other routes
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    priority: int = 0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: this server stores no responses; send the "
                             "whole conversation as input items")
        if self.conversation is not None:
            raise ValueError("conversation is not supported: this server stores no conversations")
        if self.background:
            raise ValueError("background is not supported: this server stores no responses to poll")
        if self.prompt is not None:
            raise ValueError("prompt (a stored prompt template) is not supported; send instructions and input")

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages of `instructions` and `input`; ValueError naming the item that is wrong."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        if not isinstance(self.input, list) or not self.input:
            raise ValueError("input must be a string or a non-empty list of items")
        for index, item in enumerate(self.input):
            if not isinstance(item, dict):
                raise ValueError(f"input[{index}] must be an object")
            kind = item.get("type", "message")
            if kind == "message":
                role = {"developer": "system"}.get(item.get("role"), item.get("role"))
                if role not in ("user", "system", "assistant"):
                    raise ValueError(f"input[{index}].role must be one of user, system, developer, assistant; "
                                     f"got {item.get('role')!r}")
                content = item.get("content")
                if not _has_images(content):
                    content = _text(content, f"input[{index}].content")
                messages.append({"role": role, "content": content})
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", index), "type": "function",
                        "function": {"name": _string(item, "name", index),
                                     "arguments": _string(item, "arguments", index)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", index),
                                 "content": _text(output, f"input[{index}].output")})
            else:
                raise ValueError(f"input[{index}] has type {kind!r}; this server takes message, function_call "
                                 "and function_call_output items")
        return messages

    def chat_tools(self) -> list[dict] | None:
        """The function tools in chat's shape (`{"type": "function", "function": {...}}`)."""
        if not self.tools:
            return None
        tools = []
        for index, tool in enumerate(self.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
                raise ValueError(f"tools[{index}] has type {kind!r}; this server takes function tools only")
            function = {"name": tool.get("name"), "parameters": tool.get("parameters") or ANY_PARAMETERS}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise ValueError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                         "\"name\": ...}")

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format` (None for plain text)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise ValueError("text.format json_schema needs {\"type\": \"json_schema\", \"name\": ..., "
                                 "\"schema\": {...}}")
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                           "schema": fmt["schema"]}}
        raise ValueError(f"text.format type {kind!r} is not supported ('text', 'json_object', 'json_schema')")

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one amounts to; ValueError naming what is wrong."""
        self.check_supported()
        fields = {"model": self.model, "messages": self.messages(), "stream": bool(self.stream),
                  "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "tools": self.chat_tools(), "tool_choice": self.chat_tool_choice(),
                  "parallel_tool_calls": self.parallel_tool_calls, "response_format": self.response_format(),
                  "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                  "seed": self.seed, "priority": self.priority, "user": self.user,
                  "ttft_slo_ms": self.ttft_slo_ms, "tpot_slo_ms": self.tpot_slo_ms}
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def _string(item: dict, key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"input[{index}].{key} must be a string")
    return value


def _has_images(content: Any) -> bool:
    """A content list with image parts (`input_image`): left for the chat request's messages to read."""
    return isinstance(content, list) and any(isinstance(part, dict) and part.get("type") in IMAGE_PARTS
                                             for part in content)


def _text(content: Any, where: str) -> str:
    """A content's text: a string, or the joined text of its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}[{index}] has type {kind!r}; this server takes text parts "
                             f"({', '.join(TEXT_PARTS)}) and input_image")
        texts.append(part["text"])
    return "".join(texts)
