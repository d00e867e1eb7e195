"""The OpenAI-compatible server, end to end, on the default model.

One real server process (`default_server`, tests/default_server.py: default model, small engine options) serves
these tests: start-up, the official `openai` client, streaming (stop strings included), bad input,
hang-ups, 100 concurrent seeded requests, /metrics, and a graceful SIGTERM (exit 0) at teardown.
Client libraries and the Responses API are in test_server_clients.py.
Every test stands alone (`-k` any of them): none relies on traffic or state left by another.
The app over a fake engine is in test_server_app.py, the process's ends on a tiny model in
test_server_process.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from tests.default_server import MODEL, ServerProcess

slow = pytest.mark.slow  # the tests that use the real server (default model)
IDLE_TIMEOUT = 120  # seconds
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(default_server) -> ServerProcess:
    return default_server


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def running_gauge(server: ServerProcess) -> float:
    return server.metrics()["jaxserve:num_requests_running"]


def wait_idle(server: ServerProcess) -> dict[str, float]:
    """The metrics once nothing runs or waits (a bound only against hanging forever, not a latency check)."""
    deadline = time.monotonic() + IDLE_TIMEOUT
    while True:
        samples = server.metrics()
        if samples["jaxserve:num_requests_running"] == 0 and samples["jaxserve:num_requests_waiting"] == 0:
            return samples
        assert time.monotonic() < deadline, f"still busy after {IDLE_TIMEOUT}s: {samples}"
        time.sleep(0.05)


def finished(samples: dict[str, float], reason: str) -> float:
    return sum(v for k, v in samples.items()
               if k.startswith("jaxserve:request_success_total{") and f'finished_reason="{reason}"' in k)


# -- the official client ---------------------------------------------------------------------------------------


@slow
def test_health_went_from_503_to_200(server):
    assert server.health_statuses[-1] == 200
    assert 503 in server.health_statuses, "the HTTP server should answer 503 while the model loads"
    assert httpx.get(server.url + "/version").json()["version"]


@slow
def test_requests_for_the_served_model_get_503_while_loading(server):
    """The README's curl during start-up: 503 with Retry-After, never 404 for the model's own name."""
    statuses = server.chat_statuses_while_loading
    assert (503, True) in statuses, statuses
    assert {status for status, _ in statuses} <= {200, 503}, statuses  # 200: it became ready meanwhile


@slow
def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@slow
def test_chat_capital_of_france(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24)
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


@slow
def test_completion_text_tokens_and_logprobs(client):
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                       logprobs=2)
    choice = answer.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert answer.usage.completion_tokens == len(choice.logprobs.tokens) <= 5
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert "".join(choice.logprobs.tokens) == choice.text

    ids = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"prompt": "The capital of France is"})
    token_ids = ids.json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=[token_ids, token_ids], max_tokens=5, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert by_ids.choices[0].text == by_ids.choices[1].text == choice.text
    assert by_ids.usage.prompt_tokens == 2 * len(token_ids)
    detok = httpx.post(str(client.base_url).replace("/v1/", "/detokenize"), json={"tokens": token_ids})
    assert detok.json()["prompt"] == "The capital of France is"


@slow
def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])
    whole = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=12, temperature=0)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@slow
def test_n2_and_seed_reproducibility(client):
    messages = [{"role": "user", "content": "Tell me a short story about a cat."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=16, temperature=1.0,
                                           seed=1234)
    second = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=16, temperature=1.0,
                                            seed=1234)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.choices[0].message.content != first.choices[1].message.content
    assert first.usage.completion_tokens == second.usage.completion_tokens
    other = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=1.0, seed=99)
    assert other.choices[0].message.content != first.choices[0].message.content


@slow
def test_chat_logprobs_format(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2, "temperature": 0}
    content = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    entries = content["logprobs"]["content"]
    assert len(entries) >= 1
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert entry["token"] == entry["top_logprobs"][0]["token"]  # greedy picks the top token
    assert "".join(e["token"] for e in entries) == content["message"]["content"]


# -- bad input ---------------------------------------------------------------------------------------------------

BAD_REQUESTS = [
    # (path, raw body or JSON, expected status, words the message must contain)
    (COMPLETIONS, b"{not json", 400, "malformed JSON"),
    (COMPLETIONS, b"", 400, "empty"),
    (COMPLETIONS, b"[1, 2]", 400, "JSON object"),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt is required"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt must be"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt must not be empty"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt is empty"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n must be"),
    (COMPLETIONS, {"prompt": "x", "n": True}, 400, "n:"),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 600}, 400, "max_model_len"),
    (COMPLETIONS, {"prompt": list(range(600))}, 400, "max_model_len"),
    (COMPLETIONS, {"prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [10**9]}, 400, "vocabulary"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream"),
    (COMPLETIONS, {"prompt": "x", "n": 100000}, 400, "sequences"),
    (CHAT, {"model": MODEL}, 400, "messages is required"),
    (CHAT, {"messages": []}, 400, "non-empty"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "content"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "role"),
    (CHAT, {"messages": GOOD_MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": GOOD_MESSAGES, "max_tokens": 10**6}, 400, "max_model_len"),
    (CHAT, {"messages": GOOD_MESSAGES, "top_logprobs": 2}, 400, "logprobs"),
    (CHAT, {"messages": GOOD_MESSAGES, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": GOOD_MESSAGES, "model": "nope"}, 404, "nope"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
    ("/v1/nowhere", {}, 404, "Not Found"),
]


@slow
def test_bad_requests_get_openai_errors(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body, status, words in BAD_REQUESTS:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            response = http.post(path, headers={"content-type": "application/json"}, **kwargs)
            assert response.status_code == status, (path, body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert words in error["message"], (body, error)
        # oversized bodies: declared (Content-Length) and streamed (chunked)
        huge = json.dumps({"prompt": "a" * (5 * 1024 * 1024)}).encode()
        assert http.post(COMPLETIONS, content=huge).status_code == 413
        chunks = (huge[i:i + 65536] for i in range(0, len(huge), 65536))
        response = http.post(COMPLETIONS, content=chunks)
        assert response.status_code == 413 and "larger than" in response.json()["error"]["message"]
        # the server still answers correctly
        ok = http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert "Traceback" not in server.log()


# -- structured output -------------------------------------------------------------------------------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 150}}}


@slow
def test_response_format_json_schema_and_json_object(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], temperature=0,
        max_tokens=60, response_format={"type": "json_schema",
                                        "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    person = json.loads(answer.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert answer.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=80,
                                       temperature=0.7, seed=3, stream=True,
                                       extra_body={"response_format": {"type": "json_object"}})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    if [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: reported as length, never as a complete object
        assert text.startswith("{")


@slow
def test_vllm_guided_extras(client):
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], temperature=0, max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].text)
    grammar = client.completions.create(model=MODEL, prompt="Count:", max_tokens=20, temperature=0,
                                        extra_body={"structured_outputs": {"grammar": 'start: "1, 2, " /[0-9]/'}})
    assert re.fullmatch(r"1, 2, [0-9]", grammar.choices[0].text)


@slow
def test_bad_grammars_get_400_with_the_library_message(client):
    import openai

    for extra, words in (({"guided_regex": "(unclosed"}, "does not compile"),
                         ({"guided_json": {"type": "nope"}}, "does not compile"),
                         ({"guided_regex": "a", "guided_choice": ["b"]}, "only one output constraint"),
                         ({"response_format": {"type": "json_schema"}}, "json_schema needs")):
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(model=MODEL, messages=GOOD_MESSAGES, max_tokens=4, extra_body=extra)


# -- tool calls --------------------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 30}}}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@slow
def test_named_and_required_tool_choice(client):
    named = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    required = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                              tool_choice="required", temperature=0, max_tokens=60)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls
    assert all(c.function.name == "get_weather" and "city" in json.loads(c.function.arguments) for c in calls)
    # the conversation goes on with the call and its result in the history
    follow_up = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, tools=[WEATHER_TOOL], tool_choice="none",
        messages=WEATHER_QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert follow_up.choices[0].message.content and not follow_up.choices[0].message.tool_calls


@slow
def test_streamed_named_tool_call(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=0, max_tokens=40, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = list(stream)
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather"
    arguments = "".join(call.function.arguments or "" for call in calls)
    assert set(json.loads(arguments)) == {"city"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


@slow
def test_auto_tool_choice_parses_the_hermes_format(client):
    """The model is made to write a hermes tool call (a guided choice of that one text): the server's parser
    must take it out of the text, whole and streamed."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], temperature=0, max_tokens=60,
                  extra_body={"guided_choice": [text]})
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # no markup as content
    calls = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           tools=[WEATHER_TOOL], temperature=0, max_tokens=8,
                                           extra_body={"guided_choice": ["Hi there!"]})
    assert plain.choices[0].message.content == "Hi there!" and not plain.choices[0].message.tool_calls


# -- stop strings ------------------------------------------------------------------------------------------------


@slow
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_stop_string_through_streaming(server, path):
    """Streamed deltas concatenate to the text cut before the stop string, which no chunk ever shows."""
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    if path == COMPLETIONS:
        body["prompt"] = "The capital of France is"
    else:
        body["messages"] = [{"role": "user", "content": "Describe Paris in one sentence."}]

    def text_of(choice: dict) -> str:
        if path == COMPLETIONS:
            return choice["text"]
        return (choice.get("message") or choice["delta"]).get("content") or ""

    with httpx.Client(base_url=server.url, timeout=120) as http:
        whole = text_of(http.post(path, json=body).json()["choices"][0])
        start = len(whole) // 3
        stop = whole[start:start + 6]  # from the middle, likely spanning tokens
        assert len(stop.strip()) >= 3, whole
        expected = whole[:whole.find(stop)]
        chunks, finishes = [], []
        with http.stream("POST", path, json={**body, "stop": [stop], "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        chunks.append(text_of(choice))
                        if choice["finish_reason"]:
                            finishes.append((choice["finish_reason"], choice["stop_reason"]))
    assert "".join(chunks) == expected
    assert not any(stop in chunk for chunk in chunks)
    assert finishes == [("stop", stop)]


# -- hang-ups ----------------------------------------------------------------------------------------------------


@slow
def test_streaming_client_hangup_aborts_its_request(server):
    before = wait_idle(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=60) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                assert running_gauge(server) == 1
                break  # leaving iter_lines early closes the connection
    after = wait_idle(server)
    assert finished(after, "abort") == finished(before, "abort") + 1
    assert finished(after, "length") == finished(before, "length")
    assert after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"] < 400
    assert after["jaxserve:kv_cache_usage_perc"] == 0  # its pages are free again


@slow
def test_non_streaming_client_hangup_aborts_its_request(server):
    before = wait_idle(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}

    async def hang_up() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            request = asyncio.create_task(http.post(COMPLETIONS, json=body))
            while running_gauge(server) != 1:
                assert not request.done(), "the request ended before the client hung up"
                await asyncio.sleep(0.05)
            request.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(hang_up())
    after = wait_idle(server)
    assert finished(after, "abort") == finished(before, "abort") + 1
    assert after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"] < 400


# -- load --------------------------------------------------------------------------------------------------------


def seeded_request(spec: int) -> tuple[str, dict]:
    """The `spec`-th of 50 distinct seeded requests (chat or completions, 1-8 tokens)."""
    topics = ["the sea", "a robot", "Paris", "music", "a small dog", "winter", "coffee", "the moon"]
    if spec % 3 == 0:
        path, body = COMPLETIONS, {"prompt": f"Write about {topics[spec % 8]}" + " please" * (spec % 7)}
    else:
        path, body = CHAT, {"messages": [{"role": "user", "content": f"Say something about {topics[spec % 8]}."}]}
    body.update(model=MODEL, max_tokens=1 + spec % 8, temperature=0.7, seed=spec)
    return path, body


async def send(http: httpx.AsyncClient, path: str, body: dict) -> tuple[str, str]:
    """(text, finish_reason) of the first choice, streamed or not as `body` says."""
    if not body.get("stream"):
        response = await http.post(path, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"] if path == COMPLETIONS else choice["message"]["content"], choice["finish_reason"]
    text, finish = "", None
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"] if path == COMPLETIONS else choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
    return text, finish


@slow
def test_100_concurrent_seeded_requests(server):
    """50 seeded requests, each sent twice at once (streamed and not): the pair agree, and each agrees with the
    same request sent again alone, so batching with 99 others changes nothing."""

    async def main() -> tuple[list, list]:
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
            jobs = [send(http, path, {**body, "stream": copy == 1})
                    for spec in range(50) for copy in range(2) for path, body in [seeded_request(spec)]]
            together = await asyncio.gather(*jobs)
            alone = [await send(http, *seeded_request(spec)) for spec in range(50)]
        return together, alone

    started = time.monotonic()
    together, alone = asyncio.run(main())
    print(f"100 concurrent + 50 sequential requests in {time.monotonic() - started:.1f}s")
    assert {finish for _, finish in together} <= {"stop", "length"}
    for spec in range(50):
        assert together[2 * spec] == together[2 * spec + 1] == alone[spec], (spec, seeded_request(spec))
    assert len({text for text, _ in alone}) >= 25  # the seeds and prompts really differ
    wait_idle(server)


@slow
def test_metrics_count_this_traffic(server):
    """Deltas of the counters around known traffic: prompt tokens and successes count requests (n=2 once)."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = wait_idle(server)
        prompt = "Tell me about the history of the city of Paris, the capital of France, in a few words. " * 2
        num_prompt = len(http.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        whole = http.post(COMPLETIONS, json={**body, "n": 2})
        assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == num_prompt
        with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and events[-1] == "data: [DONE]"
        after = wait_idle(server)
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    assert delta["jaxserve:prompt_tokens_total"] == 2 * num_prompt  # two requests, one of them n=2
    assert delta["jaxserve:generation_tokens_total"] == 2 * 4 + 4
    assert finished(after, "length") - finished(before, "length") == 2
    assert after["jaxserve:kv_cache_usage_perc"] == 0
    assert 0 < delta["jaxserve:prefix_cache_hits_total"] <= delta["jaxserve:prefix_cache_queries_total"]
    assert "jaxserve:num_preemptions_total" in after
    counts = {"time_to_first_token_seconds": 2, "e2e_request_latency_seconds": 2, "request_queue_time_seconds": 2,
              "time_per_output_token_seconds": 2, "inter_token_latency_seconds": 3 + 3}  # 3 gaps per 4 tokens
    for histogram, count in counts.items():
        assert delta[f"jaxserve:{histogram}_count"] == count, histogram
        assert 0 < delta[f"jaxserve:{histogram}_sum"] / count < 120, histogram
    deadline = time.monotonic() + IDLE_TIMEOUT  # the periodic stats line follows traffic (--log-stats-interval 2)
    while "Avg generation throughput" not in server.log():
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)


@slow
def test_render_gives_the_prompt_tokens_a_request_runs_with(server):
    """vLLM's render endpoints (vllm-router asks them for the tokens it routes by): the token ids of each prompt,
    as the completion or chat request itself reports them, without running it."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        completion = {"model": MODEL, "prompt": ["The capital of France is", "Hello there"], "max_tokens": 1,
                      "temperature": 0, "return_token_ids": True}
        rendered = http.post(COMPLETIONS + "/render", json=completion)
        assert rendered.status_code == 200, rendered.text
        ran = http.post(COMPLETIONS, json=completion).json()
        assert [entry["token_ids"] for entry in rendered.json()] == [
            choice["prompt_token_ids"] for choice in ran["choices"]]
        assert rendered.json()[0]["sampling_params"]["max_tokens"] == 1
        chat = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, *GOOD_MESSAGES],
                "max_tokens": 1, "temperature": 0, "return_token_ids": True}
        rendered = http.post(CHAT + "/render", json=chat)
        assert rendered.status_code == 200, rendered.text
        assert rendered.json()["token_ids"] == http.post(CHAT, json=chat).json()["prompt_token_ids"]
        bad = http.post(CHAT + "/render", json={**chat, "messages": []})
        assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
