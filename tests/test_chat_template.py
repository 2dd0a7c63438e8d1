"""Chat-template rendering against transformers' apply_chat_template, and the sandbox.

Bugs these tests guard against:
* a rendering environment that differs from transformers' (whitespace control, `tojson` escaping
  or separators, missing `raise_exception`/`strftime_now`/loop controls, variables not passed,
  `enable_thinking` passed when not asked for) -> prompts that differ from what the model was
  trained on;
* a template in a model file reaching Python internals or mutating the caller's messages;
* template failures surfacing as bare tracebacks instead of ChatTemplateError.
"""

from __future__ import annotations

import copy
import json
import random
import re
from datetime import datetime

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from daemons.chat_template import ChatTemplate, ChatTemplateError

BOS = "<|endoftext|>"
EOS = "<|im_end|>"

# A ChatML template in the Qwen style, written for these tests: tool schemas as JSON, assistant
# tool calls inside <tool_call> tags, tool results grouped into one user turn, reasoning kept in a
# <think> block only after the last user query, and `enable_thinking=false` pre-filling an empty
# <think> block.  It uses namespace(), loop controls, tojson with arguments, string methods,
# raise_exception and strftime_now.
QWEN_STYLE_TEMPLATE = r"""
{%- set ns = namespace(last_query=messages|length - 1, in_tools=false) %}
{%- for message in messages[::-1] %}
    {%- set index = messages|length - 1 - loop.index0 %}
    {%- if message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.last_query = index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{{- bos_token if add_bos_marker is defined and add_bos_marker else '' }}
{%- if tools %}
{{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
{{- messages[0].content ~ '\n\n' }}
    {%- endif %}
{{- '# Tools (' ~ strftime_now('fixed') ~ ')\n\nYou may call functions. Their signatures are inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
{{- '\n' ~ (tool | tojson) }}
    {%- endfor %}
{{- '\n</tools>\n\nParameters, pretty-printed:\n' }}
    {%- for tool in tools %}
        {%- set fn = tool.function if tool.function is defined else tool %}
{{- fn.name ~ ': ' ~ (fn.parameters | tojson(indent=2, sort_keys=true)) ~ '\n' }}
    {%- endfor %}
{{- 'Call one with:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' ~ eos_token ~ '\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' ~ messages[0].content ~ eos_token ~ '\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('a system message is only allowed first') }}
        {%- endif %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'user' %}
{{- '<|im_start|>user\n' ~ content ~ eos_token ~ '\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\n<think>\n' ~ reasoning.strip('\n') ~ '\n</think>\n\n' ~ content.lstrip('\n') }}
        {%- else %}
{{- '<|im_start|>assistant\n' ~ content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {%- set call = call.function if call.function is defined else call %}
                {%- if loop.first and content %}
{{- '\n' }}
                {%- elif not loop.first %}
{{- '\n' }}
                {%- endif %}
{{- '<tool_call>\n{"name": "' ~ call.name ~ '", "arguments": ' }}
                {%- if call.arguments is string %}
{{- call.arguments }}
                {%- else %}
{{- call.arguments | tojson }}
                {%- endif %}
{{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
{{- eos_token ~ '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
        {%- endif %}
{{- '\n<tool_response>\n' ~ content ~ '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- eos_token ~ '\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo actuelle — returns <temperature> & wind for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "城市名"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web; quotes \"like this\" and back\\slashes survive",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "k": {"type": "integer", "default": 3}},
                "required": ["query"],
            },
        },
    },
    {
        "name": "calculator",
        "description": "A tool given without the 'function' wrapper",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
]

_TEXTS = [
    "Hello!", "What's the weather in Paris?", "日本語で答えてください。", "Use <b>tags</b> & ampersands",
    "multi\nline\n\ntext", "  leading and trailing spaces  ", "emoji 😀👍🏽", "", "{\"json\": [1, 2]}",
    "\\escaped\\ and 'quotes'", "<tool_response>looks like a tool result</tool_response>",
]


def _assistant(rng: random.Random, allow_tools: bool) -> dict:
    message: dict = {"role": "assistant"}
    r = rng.random()
    if r < 0.25:
        message["content"] = rng.choice(_TEXTS)
    elif r < 0.5:
        message["content"] = "<think>\n" + rng.choice(_TEXTS) + "\n</think>\n\n" + rng.choice(_TEXTS)
    elif r < 0.75:
        message["content"] = rng.choice(_TEXTS)
        message["reasoning_content"] = rng.choice(_TEXTS)
    else:
        message["content"] = None if allow_tools else rng.choice(_TEXTS)
    if allow_tools and rng.random() < 0.5:
        calls = []
        for _ in range(rng.randint(1, 3)):
            arguments = {"city": rng.choice(["Paris", "東京", "São Paulo"]), "unit": "celsius"}
            call = {"name": rng.choice(["get_weather", "search", "calculator"]),
                    "arguments": json.dumps(arguments) if rng.random() < 0.3 else arguments}
            calls.append({"type": "function", "function": call} if rng.random() < 0.8 else call)
        message["tool_calls"] = calls
    return message


def _conversation(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    tools = rng.sample(TOOLS, rng.randint(1, 3)) if rng.random() < 0.5 else None
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(["You are helpful.", "Réponds en français.", ""])})
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": rng.choice(_TEXTS)})
        if rng.random() < 0.85:
            assistant = _assistant(rng, allow_tools=True)
            messages.append(assistant)
            if assistant.get("tool_calls"):
                for _ in range(len(assistant["tool_calls"])):
                    messages.append({"role": "tool", "content": rng.choice(["22°C, windy", "{\"ok\": true}", "无结果"])})
                if rng.random() < 0.7:
                    messages.append(_assistant(rng, allow_tools=False))
    if rng.random() < 0.2 and messages[-1]["role"] != "assistant":
        messages.append(_assistant(rng, allow_tools=False))
    return messages, tools


@pytest.fixture(scope="module")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"a": 0, BOS: 1, EOS: 2}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer(models.BPE(vocab=vocab, merges=[])), bos_token=BOS, eos_token=EOS
    )
    hf.chat_template = QWEN_STYLE_TEMPLATE
    return hf


def test_render_matches_transformers(hf_tokenizer):
    ours = ChatTemplate(QWEN_STYLE_TEMPLATE, bos_token=BOS, eos_token=EOS)
    rng = random.Random(11)
    n_rendered = 0
    seen = {"tools": 0, "think_block": 0, "tool_call": 0, "tool_response": 0, "empty_think": 0}
    for _ in range(300):
        messages, tools = _conversation(rng)
        before = copy.deepcopy(messages)
        for add_generation_prompt in (False, True):
            for enable_thinking in (None, True, False):
                extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
                if rng.random() < 0.2:
                    extra["add_bos_marker"] = True
                expected = hf_tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
                )
                got = ours.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)
                assert got == expected, (messages, tools, add_generation_prompt, enable_thinking)
                n_rendered += 1
                seen["tools"] += "<tools>" in got
                seen["think_block"] += bool(re.search(r"<think>\n.+\n</think>", got))
                seen["tool_call"] += "<tool_call>\n{\"name\": \"" in got
                seen["tool_response"] += "<tool_response>\n" in got
                seen["empty_think"] += got.endswith("<think>\n\n</think>\n\n")
        assert messages == before  # rendering never changes the caller's messages
    print(f"\nchat template parity: {n_rendered} renders identical to transformers; features seen: {seen}")
    # Every feature of the template must have been exercised many times.
    assert all(count >= 50 for count in seen.values()), seen


def test_tojson_keeps_unicode_and_html_characters():
    ours = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}")
    value = {"b": "<é & 城>", "a": [1, 2.5, None, True]}
    first, second, third = ours.render([], x=value).split("|")
    assert first == json.dumps(value, ensure_ascii=False)
    assert second == json.dumps(value, ensure_ascii=False, indent=2)
    assert third == '{"b":"<é & 城>","a":[1,2.5,null,true]}'


def test_enable_thinking_is_undefined_unless_given():
    ours = ChatTemplate("{{ 'defined' if enable_thinking is defined else 'undefined' }}")
    assert ours.render([]) == "undefined"
    assert ours.render([], enable_thinking=False) == "defined"


def test_strftime_now_and_generation_block():
    ours = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}|{% generation %}{{ messages[0].content }}{% endgeneration %}")
    date, body = ours.render([{"role": "user", "content": "hi"}]).split("|")
    assert datetime.strptime(date, "%Y-%m-%d")
    assert body == "hi"


def test_raise_exception_and_errors_become_chat_template_errors(hf_tokenizer):
    ours = ChatTemplate(QWEN_STYLE_TEMPLATE, bos_token=BOS, eos_token=EOS)
    bad_role = [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]
    with pytest.raises(ChatTemplateError, match="unknown role: wizard"):
        ours.render(bad_role)
    with pytest.raises(Exception, match="unknown role: wizard"):  # transformers rejects it too
        hf_tokenizer.apply_chat_template(bad_role, tokenize=False)
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("   ")
    with pytest.raises(ChatTemplateError, match="'nothing' is undefined"):
        ChatTemplate("{{ nothing.at_all }}").render([])
    with pytest.raises(ChatTemplateError, match="messages must be a list"):
        ours.render("hello")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError, match="tools\\[0\\]"):
        ours.render([], tools=["not a schema"])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate("{% for i in range(10**9) %}{% endfor %}").render([])
    assert "\n" not in str(info.value)


def test_from_metadata():
    # bos_token/eos_token come from the file's BOS/EOS ids, as transformers takes them from the tokenizer.
    md = {
        "tokenizer.chat_template": QWEN_STYLE_TEMPLATE,
        "tokenizer.ggml.tokens": ["a", BOS, EOS],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    template = ChatTemplate.from_metadata(md)
    assert (template.bos_token, template.eos_token) == (BOS, EOS)
    rendered = template.render([{"role": "user", "content": "hi"}], add_bos_marker=True)
    assert rendered == BOS + "<|im_start|>user\nhi<|im_end|>\n"
    bare = ChatTemplate.from_metadata({"tokenizer.chat_template": "[{{ bos_token }}|{{ eos_token }}]"})
    assert bare.render([]) == "[|]"
    with pytest.raises(ChatTemplateError, match="model has no chat template"):
        ChatTemplate.from_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ChatTemplateError, match="model has no chat template"):
        ChatTemplate.from_metadata({"tokenizer.chat_template": None})


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",  # only looking is refused too
        "{{ messages.__class__.__base__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ self._TemplateReference__context }}",
        "{{ '{0.__class__}'.format(messages) }}",
        "{{ messages.append({'role': 'system', 'content': 'pwned'}) }}",
        "{% set _ = messages[0].update({'content': 'pwned'}) %}",
        "{{ messages.pop() }}",
        "{% for m in messages %}{{ m.clear() }}{% endfor %}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_sandbox_escapes_fail(source):
    messages = [{"role": "user", "content": "hi"}]
    template = ChatTemplate(source)
    with pytest.raises(ChatTemplateError) as info:
        template.render(messages)
    assert "\n" not in str(info.value)
    assert messages == [{"role": "user", "content": "hi"}]
