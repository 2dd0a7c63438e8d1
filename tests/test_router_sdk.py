"""The official `openai` and `anthropic` Python SDKs, unmodified, against `dflashd serve` (issue 5).

A real worker process serves the scripted tiny qwen35 model (tests/router_fixtures.py): a chat answer
is a think block then a `get_weather` tool call; a completion of "...c" continues "defgh...".  Guards:
response shapes the SDKs cannot parse (they validate with pydantic), streaming event sequences they
reject, tool calls that do not survive a round trip, auth headers either SDK sends being refused.
"""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.router_fixtures import CALL, REASONING, ServeProcess, write_scripted_qwen35

KEY = "sdk-test-key"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
A_TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    d = tmp_path_factory.mktemp("router_sdk")
    write_scripted_qwen35(d / "scripted.gguf")
    proc = ServeProcess(["serve", "--model", str(d / "scripted.gguf"), "--alias", "scripted", "--port", "0",
                         "--api-key", KEY, "--ctx-size", "1024"])
    try:
        yield proc.wait_ready(timeout=180)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ant(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def test_openai_chat_non_streaming(oai):
    r = oai.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hello"}])
    msg = r.choices[0].message
    assert msg.role == "assistant" and _extra(msg, "reasoning_content") == REASONING
    assert msg.content.startswith("<tool_call>")  # no tools offered: the call stays text
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert _extra(r.usage, "timings")["predicted_n"] == 8


def test_openai_chat_streaming(oai):
    stream = oai.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hello"}],
                                         stream=True, stream_options={"include_usage": True})
    reasoning, content, finish, usage = "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            reasoning += _extra(c.delta, "reasoning_content") or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert reasoning == REASONING and content.startswith("<tool_call>") and finish == "stop"
    assert usage is not None and usage.completion_tokens == 8


def test_openai_tool_call_round_trip(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r1 = oai.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == CALL["name"] and json.loads(call.function.arguments) == CALL["arguments"]
    result = "sunny, 21 degrees Celsius, light wind from the west"
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    r2 = oai.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    # the call and its result are rendered into the second prompt (the byte-level test vocabulary
    # spends about a token per character)
    assert r2.usage.prompt_tokens >= r1.usage.prompt_tokens + len(result)
    assert r2.choices[0].message.tool_calls[0].function.name == "get_weather"
    # streaming tool call through the SDK's own chunk models
    names, args = [], ""
    for chunk in oai.chat.completions.create(model="scripted", messages=messages[:1], tools=TOOLS,
                                             tool_choice="auto", stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                names.append(tc.function.name)
                args += tc.function.arguments or ""
    assert names == ["get_weather"] and json.loads(args) == {"city": "Paris"}


def test_openai_completions(oai):
    r = oai.completions.create(model="scripted", prompt="abc", max_tokens=5)
    assert r.choices[0].text == "defgh" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    text = "".join(c.choices[0].text for c in oai.completions.create(model="scripted", prompt="abc", max_tokens=7,
                                                                      stream=True) if c.choices)
    assert text == "defghij"


def test_openai_errors_are_typed(oai, url):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert "temperature" in str(e.value)
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    models = oai.models.list()
    assert [m.id for m in models.data] == ["scripted"]


def test_anthropic_messages_tool_use_round_trip(ant):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r1 = ant.messages.create(model="scripted", max_tokens=100, messages=messages, tools=A_TOOLS,
                             system="You are terse.")
    assert r1.stop_reason == "tool_use"
    assert [b.type for b in r1.content] == ["thinking", "tool_use"]
    assert r1.content[0].thinking == REASONING
    tool_use = r1.content[1]
    assert tool_use.name == "get_weather" and tool_use.input == {"city": "Paris"}
    messages.append({"role": "assistant", "content": r1.content})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                  "content": "sunny, 21 degrees Celsius"}]})
    r2 = ant.messages.create(model="scripted", max_tokens=100, messages=messages, tools=A_TOOLS)
    assert r2.usage.input_tokens > r1.usage.input_tokens + 20
    assert r2.stop_reason == "tool_use"


def test_anthropic_streaming(ant):
    with ant.messages.stream(model="scripted", max_tokens=100, tools=A_TOOLS,
                             messages=[{"role": "user", "content": "Paris?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.usage.output_tokens == 8
    with ant.messages.stream(model="scripted", max_tokens=100,
                             messages=[{"role": "user", "content": "hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.startswith("<tool_call>") and final.stop_reason == "end_turn"


def test_anthropic_count_tokens(ant):
    conv = dict(model="scripted", system="You are terse.", tools=A_TOOLS,
                messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    n = ant.messages.count_tokens(**conv).input_tokens
    r = ant.messages.create(max_tokens=5, **conv)
    assert n == r.usage.input_tokens and n > 20
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model="scripted", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=str(ant.base_url), api_key="nope", max_retries=0).messages.count_tokens(**conv)
