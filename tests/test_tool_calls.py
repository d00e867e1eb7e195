"""Tool calling: the hermes and llama3_json parsers, tool_choice planning and its errors, streamed tool-call deltas,
and tool-call history through a chat template (the end-to-end HTTP tests with the openai client are in
test_server.py)."""

from __future__ import annotations

import json

import pytest

from jaxserve.chat import render_chat
from jaxserve.server.protocol import normalize_messages
from jaxserve.server.tool_parsers import HermesParser, Llama3JsonParser
from jaxserve.server.tools import ToolStream, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_hermes_parser():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = HermesParser().extract(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert HermesParser().extract("no calls here") == ("no calls here", [])
    broken = 'x <tool_call>{"name": "get_weather", "arguments": {"city": '  # cut by max_tokens
    assert HermesParser().extract(broken) == (broken, [])
    unterminated = '<tool_call>{"name": "get_time", "arguments": {}}'  # the model stopped before the end tag
    assert [c.name for c in HermesParser().extract(unterminated)[1]] == ["get_time"]


def test_llama3_json_parser():
    content, calls = Llama3JsonParser().extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                                '{"name": "get_time", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert Llama3JsonParser().extract("The weather is fine.") == ("The weather is fine.", [])
    assert Llama3JsonParser().extract('{"not": "a call"}') == ('{"not": "a call"}', [])


def test_held_back_text_is_what_may_become_a_call():
    assert HermesParser().held_back("Hello <tool") == len("<tool")
    assert HermesParser().held_back("Hello <tool_call>{\"na") == len("<tool_call>{\"na")
    assert HermesParser().held_back("Hello there") == 0
    assert Llama3JsonParser().held_back('  {"name"') == len('  {"name"')
    assert Llama3JsonParser().held_back("Sure, ") == 0


@pytest.mark.parametrize("tools, choice, parser, message", [
    ([WEATHER], "auto", None, "--enable-auto-tool-choice"),
    ([WEATHER], None, None, "--enable-auto-tool-choice"),  # auto is the default with tools
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "names no given tool"),
    ([WEATHER], "sometimes", "hermes", "is not one of"),
    ([{"type": "function", "function": {"description": "no name"}}], "none", None, "name must be"),
    ([{"type": "retrieval"}], "none", None, "must be"),
    (None, "required", None, "only allowed when tools are given"),
])
def test_bad_tool_requests(tools, choice, parser, message):
    with pytest.raises(ValueError, match=message):
        plan_tools(tools, choice, None, parser)


def test_plans_constrain_named_and_required_choices():
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert named.guided.json == WEATHER["function"]["parameters"]
    assert named.extract('{"city": "Rome"}')[1][0].name == "get_weather"
    required = plan_tools([WEATHER, TIME], "required", False, None)
    assert required.guided.json["maxItems"] == 1 and len(required.guided.json["items"]["anyOf"]) == 2
    content, calls = required.extract('[{"name": "get_time", "parameters": {}}]')
    assert content is None and [c.name for c in calls] == ["get_time"]
    assert required.extract('[{"name": "get_ti')[1] == []  # cut short: no calls
    assert plan_tools([WEATHER], "none", None, None).guided is None
    assert plan_tools(None, None, None, None) is None


def test_streamed_deltas_add_up_to_the_calls():
    named = ToolStream(plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None))
    deltas = named.feed('{"ci') + named.feed('ty": "Lima"}')
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather" and "id" in deltas[0]["tool_calls"][0]
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Lima"}'
    assert named.finish() == ([], True)

    auto = ToolStream(plan_tools([WEATHER], "auto", None, "hermes"))
    sent = []
    for piece in ["Checking", " now <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Kyiv"}}',
                  "</tool_call>"]:
        sent += auto.feed(piece)
    assert "".join(d["content"] for d in sent) == "Checking now "  # no markup ever streamed as content
    last, called = auto.finish()
    assert called and last[-1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                               "arguments": '{"city": "Kyiv"}'}

    plain = ToolStream(plan_tools([WEATHER], "auto", None, "hermes"))
    assert plain.feed("Just text <tool") == [{"content": "Just text "}]
    assert plain.finish() == ([{"content": "<tool"}], False)  # it never became a call: the rest is content


def test_tool_call_history_reaches_the_template(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    template = ("{% for tool in tools %}[tool {{ tool.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
                "{% for call in m.tool_calls or [] %}(call {{ call.function.name }} "
                "city={{ call.function.arguments.city }}){% endfor %}{% endfor %}")
    messages, _ = normalize_messages([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    ids = render_chat(tokenizer, messages, add_generation_prompt=False, chat_template=template, tools=[WEATHER])
    assert tokenizer.decode(ids) == ("[tool get_weather]<user>Weather?<assistant>(call get_weather city=Nice)"
                                     "<tool>sunny")
    with pytest.raises(ValueError, match="content must be a string"):
        normalize_messages([{"role": "user", "content": None}])
