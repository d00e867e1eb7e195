"""Chat messages: validation and rendering through the model's chat template into prompt token ids."""

from __future__ import annotations

from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def validate_messages(messages: Any) -> None:
    """Raises ValueError unless `messages` is a non-empty list of {"role": str, "content": str} dicts (an assistant
    message with `tool_calls` may have no content)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}] must be an object with a string 'role'")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"messages[{index}].role {message['role']!r} is not one of {', '.join(CHAT_ROLES)}")
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
            raise ValueError(f"messages[{index}].tool_calls must be a list, on an assistant message")
        if not isinstance(message.get("content"), str) and not (calls and message.get("content") is None):
            raise ValueError(f"messages[{index}].content must be a string")


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                chat_template: str | None = None, tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids for `messages` (and `tools`, for templates that render them); ValueError if they are
    ill-formed or the model has no template."""
    if tokenizer is None or (tokenizer.chat_template is None and chat_template is None):
        raise ValueError("this model has no chat template")
    validate_messages(messages)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            chat_template=chat_template, tokenize=True, tools=tools)
    except Exception as err:  # a template may reject some conversations (e.g. role order): the caller's input
        raise ValueError(f"cannot apply the chat template to these messages: {err}") from err
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
