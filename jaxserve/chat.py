"""Chat messages: validation, their images taken out of the content parts (`split_images`), and rendering through
the model's chat template into prompt token ids."""

from __future__ import annotations

from typing import Any, Callable

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
TEXT_PARTS = ("text", "input_text", "output_text")
# image parts: OpenAI chat's image_url ({"url": ...} or a string), the Responses API's input_image, vLLM's image_pil,
# transformers' image ({"image": ...} or {"url": ...})
IMAGE_PARTS = ("image_url", "input_image", "image_pil", "image")


def split_images(messages: Any) -> tuple[Any, list[Any]]:
    """Messages as chat templates read them, and their images in order (URLs, bytes or PIL images, read later).
    A content list of text parts becomes its joined text; one with images a list of `{"type": "text", "text"}` and
    `{"type": "image"}` parts (where templates write the image placeholder). ValueError naming a part of another
    type; anything that is not a list of messages is left for `validate_messages`."""
    if not isinstance(messages, list):
        return messages, []
    images: list[Any] = []
    out = []
    for index, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            parts = [_part(part, f"messages[{index}].content[{n}]", images)
                     for n, part in enumerate(message["content"])]
            if all(part["type"] == "text" for part in parts):
                message = {**message, "content": "".join(part["text"] for part in parts)}
            else:
                message = {**message, "content": parts}
        out.append(message)
    return out, images


def _part(part: Any, where: str, images: list[Any]) -> dict[str, str]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind in IMAGE_PARTS:
        source = part.get(kind) if kind != "input_image" else part.get("image_url")
        if kind == "image" and source is None:
            source = part.get("url")
        if isinstance(source, dict):
            source = source.get("url")
        if source is None:
            raise ValueError(f"{where} is an image part with no image (an image_url's url, or the image itself)")
        images.append(source)
        return {"type": "image"}
    shown = kind if kind is not None else type(part).__name__
    raise ValueError(f"{where} has type {shown!r}; messages take text parts ({', '.join(TEXT_PARTS)}) and image "
                     f"parts ({', '.join(IMAGE_PARTS)})")


def validate_messages(messages: Any) -> None:
    """Raises ValueError unless `messages` is a non-empty list of {"role": str, "content": str} dicts (an assistant
    message with `tool_calls` may have no content; content with images is a list of text and image parts, as
    `split_images` makes it)."""
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
        content = message.get("content")
        parts = isinstance(content, list) and all(isinstance(part, dict) and part.get("type") in ("text", "image")
                                                  for part in content)
        if not isinstance(content, str) and not parts and not (calls and content is None):
            raise ValueError(f"messages[{index}].content must be a string")


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                chat_template: str | None = None, tools: list[dict] | None = None,
                encode: Callable[[str], list[int]] | None = None) -> list[int]:
    """Prompt token ids for `messages` (and `tools`, for templates that render them); ValueError if they are
    ill-formed or the model has no template. `encode`: how the rendered text becomes ids when not by the template's
    own tokenization (a conversation with images: `InputProcessor.encode_chat`, as the family's processor does)."""
    if tokenizer is None or (tokenizer.chat_template is None and chat_template is None):
        raise ValueError("this model has no chat template")
    validate_messages(messages)
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            chat_template=chat_template, tokenize=encode is None, tools=tools)
    except Exception as err:  # a template may reject some conversations (e.g. role order): the caller's input
        raise ValueError(f"cannot apply the chat template to these messages: {err}") from err
    if encode is not None:
        return list(encode(ids))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
