"""What applications built on client libraries need, end to end on the default model (the shared `default_server`):
Pydantic extraction through instructor (TOOLS and JSON_SCHEMA modes) and LangChain (`function_calling`), the
Responses API through the official client (text, a tool round trip, streamed events, text formats, refusals),
vLLM's `return_token_ids` and `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from pydantic import BaseModel

from tests.default_server import MODEL, PAGE_SIZE

slow = pytest.mark.slow
EXTRACT = "Describe Paris."  # the default model adds keys of its own here (description, population ...) unless held
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_QUESTION = "What is the weather in Paris?"


class City(BaseModel):  # as Pydantic writes its schema: no additionalProperties
    name: str
    country: str


@pytest.fixture(scope="module")
def client(default_server):
    import openai

    return openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# -- client libraries ---------------------------------------------------------------------------------------------


@slow
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_pydantic_model(client, mode):
    import instructor

    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city, completion = patched.chat.completions.create_with_completion(
        model=MODEL, response_model=City, temperature=0, max_tokens=60, max_retries=0,
        messages=[{"role": "user", "content": EXTRACT}])
    assert isinstance(city, City) and city.model_dump() == {"name": "Paris", "country": "France"}
    message = completion.choices[0].message
    raw = message.tool_calls[0].function.arguments if mode == "TOOLS" else message.content
    assert set(json.loads(raw)) == {"name", "country"}


@slow
def test_langchain_function_calling_returns_a_validated_object(default_server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=default_server.url + "/v1", api_key="unused", model=MODEL, temperature=0,
                      max_tokens=60, max_retries=0)
    answer = chat.with_structured_output(City, method="function_calling", include_raw=True).invoke(EXTRACT)
    assert answer["parsed"] == City(name="Paris", country="France")
    assert [call["args"] for call in answer["raw"].tool_calls] == [{"name": "Paris", "country": "France"}]


# -- the Responses API --------------------------------------------------------------------------------------------


@slow
def test_responses_text_and_usage(client):
    response = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                       max_output_tokens=20, instructions="Answer in one sentence.")
    assert response.object == "response" and response.status == "completed" and response.store is False
    assert "Paris" in response.output_text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    usage = response.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    cut = client.responses.create(model=MODEL, input="Count from one to fifty.", temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


@slow
def test_responses_tool_round_trip(client):
    first = client.responses.create(model=MODEL, input=WEATHER_QUESTION, tools=[WEATHER], temperature=0,
                                    max_output_tokens=40, tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    history = [{"role": "user", "content": WEATHER_QUESTION}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    answer = client.responses.create(model=MODEL, input=history, tools=[WEATHER], tool_choice="none",
                                     temperature=0, max_output_tokens=40)
    assert answer.status == "completed" and answer.output_text
    assert all(item.type == "message" for item in answer.output)
    required = client.responses.create(model=MODEL, input=WEATHER_QUESTION, tools=[WEATHER], temperature=0,
                                       max_output_tokens=60, tool_choice="required")
    assert required.output and all(item.type == "function_call" for item in required.output)


def _events(client, **kwargs) -> list:
    return list(client.responses.create(model=MODEL, stream=True, temperature=0, **kwargs))


@slow
def test_streamed_response_events_parse_and_add_up(client):
    kwargs = dict(input="Say hello.", max_output_tokens=40)
    events = _events(client, **kwargs)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    whole = client.responses.create(model=MODEL, temperature=0, **kwargs)
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(model=MODEL, temperature=0, **kwargs) as stream:  # the client's own helper
        assert stream.get_final_response().output_text == text


@slow
def test_streamed_function_call_events(client):
    events = _events(client, input=WEATHER_QUESTION, tools=[WEATHER], max_output_tokens=40,
                     tool_choice={"type": "function", "name": "get_weather"})
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert set(json.loads(arguments)) == {"city"}
    assert events[-1].response.output[0].arguments == arguments
    cut = _events(client, input="Count from one to fifty.", max_output_tokens=3)
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"


@slow
def test_responses_text_formats(client):
    parsed = client.responses.parse(model=MODEL, input=EXTRACT, text_format=City, temperature=0,
                                    max_output_tokens=60)
    assert parsed.output_parsed == City(name="Paris", country="France")
    loose = client.responses.create(model=MODEL, input="A JSON object about a cat:", temperature=0,
                                    max_output_tokens=60, text={"format": {"type": "json_object"}})
    if loose.status == "completed":
        assert isinstance(json.loads(loose.output_text), dict)
    else:
        assert loose.output_text.startswith("{")


@slow
@pytest.mark.parametrize("extra, words", [
    ({"previous_response_id": "resp_123"}, "stores no responses"),
    ({"background": True}, "background is not supported"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "has type 'input_image'"),
    ({"tools": [{"type": "web_search"}]}, "function tools only"),
    ({"text": {"format": {"type": "json_schema"}}}, "json_schema needs"),
    ({"input": []}, "non-empty list"),
])
def test_bad_responses_requests_get_400(default_server, extra, words):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}
    answer = httpx.post(default_server.url + "/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text
    missing = httpx.get(default_server.url + "/v1/responses/resp_123", timeout=60)
    assert missing.status_code == 404 and "stores no responses" in missing.json()["error"]["message"]


# -- token ids and cached tokens ----------------------------------------------------------------------------------


@slow
def test_return_token_ids_are_the_engines(default_server, client):
    messages = [{"role": "user", "content": "Name a colour."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    chat = httpx.post(default_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    tokenized = httpx.post(default_server.url + "/tokenize", json={"messages": messages}, timeout=60).json()
    assert chat["prompt_token_ids"] == tokenized["tokens"]
    token_ids = chat["choices"][0]["token_ids"]
    assert len(token_ids) == chat["usage"]["completion_tokens"]
    detokenized = httpx.post(default_server.url + "/detokenize", json={"tokens": token_ids}, timeout=60).json()
    assert detokenized["prompt"] == chat["choices"][0]["message"]["content"]
    # the same ids as a token prompt on /v1/completions continue the same way, whole and streamed
    completion = client.completions.create(model=MODEL, prompt=chat["prompt_token_ids"], max_tokens=8, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert completion.choices[0].token_ids == token_ids
    assert completion.choices[0].prompt_token_ids == chat["prompt_token_ids"]
    chunks = list(client.completions.create(model=MODEL, prompt=chat["prompt_token_ids"], max_tokens=8,
                                            temperature=0, stream=True, extra_body={"return_token_ids": True}))
    assert [t for c in chunks for t in c.choices[0].token_ids] == token_ids
    assert chunks[0].choices[0].prompt_token_ids == chat["prompt_token_ids"]
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].prompt_token_ids == chat["prompt_token_ids"]
    assert [t for c in stream if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])] == token_ids


@slow
def test_cached_tokens_count_a_repeated_prompts_prefix(client):
    prompt = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 6  # shares no first page
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    num_prompt = first.usage.prompt_tokens
    expected = (num_prompt - 1) // PAGE_SIZE * PAGE_SIZE  # whole pages, the last token always computed
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == expected > 0
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == expected
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                          temperature=0)
    response = client.responses.create(model=MODEL, input=prompt, max_output_tokens=2, temperature=0)  # same prompt
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.input_tokens_details.cached_tokens == (chat.usage.prompt_tokens - 1) // PAGE_SIZE * PAGE_SIZE
