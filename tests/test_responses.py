"""The Responses API without a model: a request's translation to the chat request it amounts to (input items,
tools, tool choice, text formats, refusals by name) and the event sequence a streamed answer makes (the end-to-end
tests with the official client are in test_server_clients.py)."""

from __future__ import annotations

import json

import pytest

from jaxserve.server.responses_protocol import ResponsesRequest
from jaxserve.server.serving_responses import ResponseEvents, ResponseShell, _output_items
from jaxserve.server.tools import ToolStream, plan_tools

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def test_a_tool_round_trip_becomes_a_chat_history():
    chat = request(instructions="Be brief.", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                   input=[{"role": "developer", "content": "Use tools."},
                          {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                          {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                           "arguments": '{"city": "Oslo"}', "id": "fc_1", "status": "completed"},
                          {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
                          {"role": "assistant", "content": [{"type": "output_text", "text": "It rains."}]}],
                   max_output_tokens=7, text={"format": {"type": "json_object"}}).chat_request()
    assert chat.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "assistant", "content": "It rains."}]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather",
                                                            "parameters": WEATHER["parameters"]}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.max_completion_tokens == 7 and chat.response_format == {"type": "json_object"}
    assert chat.chat_messages()[0][3]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # for templates


def test_calls_after_an_assistant_message_join_it():
    chat = request(input=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me look."},
                          {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                          {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"}]).chat_request()
    assert chat.messages[1]["content"] == "Let me look."
    assert [call["id"] for call in chat.messages[1]["tool_calls"]] == ["a", "b"]


def test_text_format_json_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = request(text={"format": {"type": "json_schema", "name": "thing", "schema": schema,
                                    "strict": True}}).chat_request()
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    assert request(text={"format": {"type": "text"}}).chat_request().response_format is None


@pytest.mark.parametrize("fields, words", [
    ({"previous_response_id": "resp_1"}, "stores no responses"),
    ({"conversation": "conv_1"}, "stores no conversations"),
    ({"background": True}, "background is not supported"),
    ({"prompt": {"id": "pmpt_1"}}, "stored prompt template"),
    ({"input": []}, "non-empty list"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "has type 'reasoning'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0] has type 'input_file'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"tools": [{"type": "file_search"}]}, "tools[0] has type 'file_search'"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice must be"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format type 'yaml'"),
])
def test_requests_this_server_cannot_serve_are_refused_by_name(fields, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        request(**fields).chat_request()


def shell(**fields) -> ResponseShell:
    return ResponseShell("m", request(**fields), "resp_1", 5)


def events_of(lines: list[str]) -> list[dict]:
    parsed = []
    for line in lines:
        event, data = line.strip().split("\n")
        parsed.append(json.loads(data.removeprefix("data: ")))
        assert event == f"event: {parsed[-1]['type']}"
    return parsed


def test_streamed_text_events_and_final_response():
    events = ResponseEvents(shell())
    lines = events.start() + events.feed({"content": "Hel"}) + events.feed({"content": "lo"})
    lines += events.finish("stop", 2, 0)
    parsed = events_of(lines)
    assert [e["type"] for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    assert parsed[2]["item"]["status"] == "in_progress" and parsed[2]["item"]["content"] == []
    final = parsed[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["output_tokens"] == 2 and final["usage"]["input_tokens"] == 5


def test_streamed_calls_close_the_message_and_an_output_cut_is_incomplete():
    plan = plan_tools([{"type": "function", "function": {"name": "f"}}], {"type": "function", "function": {
        "name": "f"}}, None, None)
    stream, events = ToolStream(plan), ResponseEvents(shell())
    lines = events.start()
    for delta in stream.feed('{"a"') + stream.feed(": 1") + stream.finish()[0]:
        lines += events.feed(delta)
    parsed = events_of(lines + events.finish("length", 3, 0))
    assert [e["type"] for e in parsed][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.incomplete"]
    final = parsed[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["arguments"] == '{"a": 1' and final["output"][0]["status"] == "incomplete"


def test_whole_answers_put_content_first_then_calls():
    plan = plan_tools([{"type": "function", "function": {"name": "f"}}], "required", None, None)
    items = _output_items('[{"name": "f", "parameters": {"x": 1}}]', plan, "completed")
    assert [item["type"] for item in items] == ["function_call"] and json.loads(items[0]["arguments"]) == {"x": 1}
    assert [item["type"] for item in _output_items("plain", None, "completed")] == ["message"]
    assert _output_items("", None, "completed")[0]["content"][0]["text"] == ""
