"""The router's HTTP API against a real `dflashd serve` with a real worker process (issue 5).

Unit tests first (output parsing, config, registry, metrics text), then one `dflashd serve` process
with three configured models: `scripted` (one local worker on the scripted tiny model, see
tests/router_fixtures.py), `remote-only` (no local worker: status loading) and `broken` (a worker
that cannot start: status failed).
"""
from __future__ import annotations

import json
import re
import socket
import time
import tomllib

import httpx
import pytest

from protocol.messages import PROTOCOL_VERSION, Capacity, Hello
from router.chat import OutputParser, parse_output
from router.config import ConfigError, device_isolation, parse_config
from router.metrics import Metrics
from router.registry import ModelEntry, Registry
from tests.router_fixtures import CALL, CHAT_ANSWER_TEXT, CYCLE, REASONING, ROOT, ServeProcess, wait_until, \
    write_scripted_qwen35

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


# ---- units: output parsing --------------------------------------------------------------------------

def _collect(events):
    out = {"content": "", "reasoning": "", "calls": []}
    for kind, value in events:
        if kind == "tool_call":
            out["calls"].append((value.name, json.loads(value.arguments)))
        else:
            out[kind] += value
    return out


def test_stream_parser_agrees_with_whole_parse_at_every_split():
    """Guards: a marker (<think>, </think>, <tool_call>) cut between two TOKENS chunks leaking into
    content, or the streamed result differing from the non-streamed one."""
    text = "<think>\nplan it\n</think>\n\nSure.<tool_call>\n" + json.dumps(CALL) + "\n</tool_call> done <tag>"
    whole = parse_output(text, parse_tools=True)
    assert whole.reasoning == "\nplan it\n" and whole.content == "Sure. done <tag>"
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather", {"city": "Paris"})]
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 3)):
            p = OutputParser(parse_tools=True)
            got = _collect(p.feed(text[:cut]) + p.feed(text[cut:cut2]) + p.feed(text[cut2:]) + p.finish())
            assert got == {"content": whole.content, "reasoning": whole.reasoning,
                           "calls": [("get_weather", {"city": "Paris"})]}, cut


def test_parser_edge_cases():
    # not JSON: the client gets the text as written, not a dropped or invented call
    bad = parse_output("<tool_call>{not json}</tool_call>", parse_tools=True)
    assert bad.tool_calls == [] and bad.content == "<tool_call>{not json}</tool_call>"
    # tools not offered: the tag is content
    assert parse_output("<tool_call>{}</tool_call>", parse_tools=False).content == "<tool_call>{}</tool_call>"
    # the prompt opened <think>: everything before </think> is reasoning
    r = parse_output("thinking...</think>\n\nanswer", parse_tools=False, in_reasoning=True)
    assert (r.reasoning, r.content) == ("thinking...", "answer")
    # cut off inside the think block (finish=length): all reasoning, no content
    r = parse_output("<think>half a thought", parse_tools=False)
    assert (r.reasoning, r.content) == ("half a thought", "")
    # <think> after content began is text
    r = parse_output("a <think>b</think>", parse_tools=False)
    assert r.content == "a <think>b</think>" and r.reasoning == ""
    # tool_choice naming a function: the router writes the call's opening into the prompt and
    # parses it together with what the model continues
    forced = '<tool_call>\n{"name": "get_weather", "arguments": '
    r = parse_output(forced + '{"city": "Paris"}}\n</tool_call>', parse_tools=True)
    assert [(c.name, json.loads(c.arguments)) for c in r.tool_calls] == [("get_weather", {"city": "Paris"})]
    # reasoning_format none: no split
    assert parse_output("<think>x</think>y", parse_tools=False, split_reasoning=False).content == "<think>x</think>y"


# ---- units: config, registry, metrics ---------------------------------------------------------------

def test_config_parsing_and_device_isolation(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    cfg = parse_config({"server": {"port": 0, "api_keys": ["k1"], "bind": "tcp://127.0.0.1:5555"},
                        "models": [{"id": "m", "path": "m.gguf", "devices": ["cuda:1", "hip:0", "cpu"],
                                    "sampling": {"temperature": 0.7}, "ctx_size": 8192}]}, base=tmp_path)
    m = cfg.models[0]
    assert [w.device for w in m.workers] == ["cuda:1", "hip:0", "cpu"] and m.sampling.temperature == 0.7
    assert cfg.server.api_keys == ("k1",) and m.path == model
    env, told = device_isolation("cuda:3")
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["HIP_VISIBLE_DEVICES"] == "" and told == "cuda:0"
    env, told = device_isolation("hip:1")
    assert env["HIP_VISIBLE_DEVICES"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "" and told == "hip:0"
    env, told = device_isolation("cpu")
    assert env["CUDA_VISIBLE_DEVICES"] == "" and told == "cpu"
    bad = [
        ({"server": {"prot": 1}}, "unknown key 'prot'"),
        ({"models": [{"path": "m.gguf", "devices": ["gpu:0"]}]}, "not cpu, cuda:N or hip:N"),
        ({"models": [{"path": "missing.gguf"}]}, "no such file"),
        ({"models": [{"id": "a", "path": "m.gguf"}, {"id": "a", "path": "m.gguf"}]}, "used twice"),
        ({"server": {"port": "8080"}}, "server.port must be int"),
        ({"models": [{"path": "m.gguf", "sampling": {"top_p": 2}}]}, "top_p"),
    ]
    for doc, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(doc, base=tmp_path)


def _hello(wid: str, model: str, n_ctx: int = 4096) -> Hello:
    return Hello(worker_id=wid, protocol_version=PROTOCOL_VERSION, architecture="qwen35", model_id=model,
                 model_hash="h", backend="cpu", device="cpu",
                 capacity=Capacity(n_ctx=n_ctx, n_slots=0, snapshot_bytes=0, memory_bytes=0))


def test_registry_least_loaded_pick_and_expiry():
    """Guards: routing to a busy/unhealthy worker while an idle one exists, or to one whose context
    cannot hold the request; a dead worker's in-flight requests not being reported."""
    reg = Registry(liveness_s=3.0, max_inflight=2)
    reg.add_model(ModelEntry(id="m"))
    a, _ = reg.register(b"a", _hello("a", "m"), now=0.0)
    b, _ = reg.register(b"b", _hello("b", "m", n_ctx=128), now=0.0)
    reg.acquire(a, "r1", now=1.0)
    assert reg.pick("m", 10) is b  # a has one in flight
    assert reg.pick("m", 1000) is a  # b's context is too small
    reg.acquire(a, "r2", now=1.0)
    assert reg.pick("m", 1000) is None  # a is full (max_inflight), b too small
    assert reg.pick("m", 10, exclude={("b", b.incarnation)}) is None
    reg.seen(b, 2.0)
    lost = reg.expire(now=4.5)  # a silent since 0.0, b since 2.0
    assert [(r.worker_id, ids) for r, ids in lost] == [("a", ["r1", "r2"])]
    assert not a.healthy and b.healthy and reg.model_status("m")[0] == "ready"
    a2, lost2 = reg.register(b"a", _hello("a", "m"), now=5.0)  # HELLO again: routable again
    assert a2.healthy and a2.incarnation > a.incarnation and lost2 == []
    reg.mark_unhealthy("a", "test")
    reg.mark_unhealthy("b", "test")
    assert reg.model_status("m")[0] == "loading"


def test_metrics_text_is_prometheus():
    reg = Registry()
    reg.add_model(ModelEntry(id='m"x'))
    reg.register(b"w", _hello("w", 'm"x'), now=0.0)

    class D:
        inflight = retries_total = cancels_total = worker_failures_total = 0

    m = Metrics()
    m.request("chat", 'm"x', 200)
    text = m.render(reg, D())
    line_re = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\.)*",?)*\})? '
                         r'(-?[0-9.e+-]+|\+Inf|NaN)$')
    for line in text.splitlines():
        assert line.startswith("# ") or line_re.match(line), line
    assert 'dflashd:requests_total{endpoint="chat",model="m\\"x",status="200"} 1' in text


# ---- one real router with a real worker -------------------------------------------------------------

def test_example_config_parses(tmp_path):
    """Guards: the shipped deploy/router.toml drifting from what the config parser accepts."""
    text = (ROOT / "deploy" / "router.toml").read_text()
    (tmp_path / "m.gguf").write_bytes(b"x")
    (tmp_path / "keys").write_text("# keys\nk-1\n")
    text = re.sub(r'"/srv/models/[^"]+"', '"m.gguf"', text).replace("/etc/dflashd/api-keys", "keys")
    cfg = parse_config(tomllib.loads(text), base=tmp_path)
    assert cfg.server.api_keys == ("k-1",) and cfg.server.port == 8080
    assert [w.device for w in cfg.models[0].workers] == ["cuda:0", "hip:0"]


def test_sd_notify(tmp_path, monkeypatch):
    from router.cli import sd_notify
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sd_notify("READY=1\nSTATUS=serving")
        assert s.recv(100) == b"READY=1\nSTATUS=serving"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not sd_notify("READY=1")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("router_api")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(d / "notify.sock"))
    notify.settimeout(30)
    write_scripted_qwen35(d / "scripted.gguf")
    (d / "router.toml").write_text(f"""
[server]
port = 0
api_keys = ["{KEY}"]
n_predict = 400
restart_backoff_s = 0.2
max_start_failures = 2
admission_timeout_s = 20
max_body_bytes = 1048576

[[models]]
id = "scripted"
path = "scripted.gguf"
aliases = ["qwen-test"]
ctx_size = 512

[[models]]
id = "scripted-long"
path = "scripted.gguf"
ctx_size = 8192

[[models]]
id = "remote-only"
path = "scripted.gguf"
devices = []

[[models]]
id = "broken"
path = "scripted.gguf"
[[models.workers]]
args = ["--no-such-flag"]
""")
    proc = ServeProcess(["serve", "--config", str(d / "router.toml")], env={"NOTIFY_SOCKET": str(d / "notify.sock")})
    try:
        url = proc.wait_ready(timeout=180)
        # systemd readiness: READY=1 once the models settled (scripted ready, broken failed)
        messages = [notify.recv(4096).decode()]
        while not messages[-1].startswith("READY=1"):
            messages.append(notify.recv(4096).decode())
        assert "ready: scripted, scripted-long; failed: broken" in messages[-1], messages
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
            client.proc = proc  # type: ignore[attr-defined]
            yield client
    finally:
        assert proc.stop() == 0, proc.log()
        notify.close()


def sse(resp: httpx.Response) -> list[tuple[str | None, str]]:
    out, event = [], None
    for line in resp.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            out.append((event, line[5:].strip()))
            event = None
    return out


def test_health_and_model_statuses(server):
    r = httpx.get(f"{server.base_url}/health")  # no key needed
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.get(f"{server.base_url}/v1/models")
    assert r.status_code == 401
    models = {m["id"]: m for m in server.get("/v1/models").json()["data"]}
    assert models["scripted"]["status"]["value"] == "ready"
    assert models["scripted"]["aliases"] == ["qwen-test"]
    assert models["remote-only"]["status"]["value"] == "loading"
    assert models["broken"]["status"]["value"] == "failed"
    assert "exited with status 2" in models["broken"]["status"]["reason"]


def test_api_keys(server):
    base = str(server.base_url)
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(f"{base}/v1/chat/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(f"{base}/v1/messages", json={"model": "scripted", "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{base}/v1/completions", json={"model": "scripted", "prompt": "abc", "max_tokens": 2},
                   headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.user.content"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": [100000]}, "prompt"),
])
def test_bad_requests_get_openai_400(server, path, body, param):
    r = server.post(path, json={"model": "scripted", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert (err["param"] or "").startswith(param.split(".")[0]), err


def test_bad_requests_other_shapes(server):
    r = server.post("/v1/messages", json={"model": "scripted", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": r.json()["error"]["message"]}}
    assert "max_tokens" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", content=b"[1, 2]")
    assert r.status_code == 400
    r = server.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = server.post("/v1/chat/completions", json={"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = server.post("/v1/chat/completions", content=b'{"messages": "' + b"x" * (2 << 20) + b'"}')
    assert r.status_code == 413
    # the prompt alone exceeds the worker's 512-token context
    r = server.post("/v1/completions", json={"model": "scripted", "prompt": [97] * 600})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # a model with no worker yet: a clear 503 after the admission wait, not a hang
    r = server.post("/v1/completions", json={"model": "broken", "prompt": "abc"})
    assert r.status_code == 503 and "broken" in r.json()["error"]["message"]


def test_chat_reasoning_and_tool_call(server):
    r = server.post("/v1/chat/completions", json={
        "model": "qwen-test", "tools": [WEATHER_TOOL],
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Weather in Paris?"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["reasoning_content"] == REASONING
    assert msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    usage = body["usage"]
    assert usage["completion_tokens"] == 8 and usage["total_tokens"] == usage["prompt_tokens"] + 8
    t = usage["timings"]
    for name in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                 "predicted_per_second", "cache_n"):
        assert name in t
    assert t["predicted_n"] == 8 and body["timings"] == t
    assert r.headers["x-worker-id"].startswith("scripted-cpu-")
    # without tools, the same output is plain content (no parsing), reasoning still split
    r = server.post("/v1/chat/completions", json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]})
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == REASONING and msg["content"].startswith("<tool_call>")
    assert "tool_calls" not in msg and r.json()["choices"][0]["finish_reason"] == "stop"
    # reasoning_format none: the raw text
    r = server.post("/v1/chat/completions", json={"model": "scripted", "reasoning_format": "none",
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["choices"][0]["message"]["content"] == CHAT_ANSWER_TEXT


def test_chat_stream_matches_non_stream(server):
    req = {"model": "scripted", "tools": [WEATHER_TOOL], "messages": [{"role": "user", "content": "Paris?"}],
           "stream": True, "stream_options": {"include_usage": True}}
    with server.stream("POST", "/v1/chat/completions", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    calls = [tc for c in chunks if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert reasoning == REASONING and content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "tool_calls"
    assert finals[0]["timings"]["predicted_n"] == 8
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_completions_stop_and_length(server):
    r = server.post("/v1/completions", json={"model": "scripted", "prompt": "abc", "max_tokens": 5})
    c = r.json()["choices"][0]
    assert (c["text"], c["finish_reason"]) == ("defgh", "length")
    r = server.post("/v1/completions", json={"model": "scripted", "prompt": "abc", "max_tokens": 50, "stop": ["gh"]})
    c = r.json()["choices"][0]
    assert (c["text"], c["finish_reason"]) == ("def", "stop")
    # token-id prompt; n_predict cap (400) applies when max_tokens is absent
    r = server.post("/v1/completions", json={"model": "scripted", "prompt": [ord("p")]})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and len(c["text"]) == 400 and c["text"].startswith(CYCLE)
    # Anthropic reports which stop sequence matched
    r = server.post("/v1/messages", json={"model": "scripted", "max_tokens": 20, "stop_sequences": ["zz", "</think>"],
                                          "messages": [{"role": "user", "content": "hi"}]})
    body = r.json()
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "</think>"
    assert body["content"] == [{"type": "thinking", "thinking": REASONING, "signature": ""}]


def test_count_tokens_matches_messages_usage(server):
    conv = {"model": "scripted", "system": "be brief", "tools": [{"name": "get_weather", "input_schema": {
        "type": "object"}}], "messages": [{"role": "user", "content": "Paris?"}]}
    n = server.post("/v1/messages/count_tokens", json=conv).json()["input_tokens"]
    r = server.post("/v1/messages", json={**conv, "max_tokens": 50})
    body = r.json()
    assert body["usage"]["input_tokens"] == n > 10
    assert body["stop_reason"] == "tool_use"
    assert [b["type"] for b in body["content"]] == ["thinking", "tool_use"]
    assert body["content"][1]["input"] == {"city": "Paris"} and body["content"][1]["id"].startswith("toolu_")


def test_client_disconnect_cancels_generation(server):
    """Guards: a client that goes away leaving its generation running on the worker (which then
    serves nobody while other requests queue behind it)."""
    def cancels() -> int:
        m = re.search(r"^dflashd:cancels_total (\d+)", server.get("/metrics").text, re.M)
        return int(m.group(1))

    before = cancels()
    with server.stream("POST", "/v1/completions", json={"model": "scripted", "prompt": "a", "max_tokens": 400,
                                                        "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break  # leave mid-stream
    wait_until(lambda: cancels() > before, 10, what="CANCEL after a streaming client left")
    # non-streaming: the client times out and goes away
    before = cancels()
    # 8000 tokens take seconds even on a fast machine, so the 0.5 s client timeout always fires first
    with pytest.raises(httpx.TimeoutException):
        server.post("/v1/completions", json={"model": "scripted-long", "prompt": "a", "max_tokens": 8000},
                    timeout=0.5)
    wait_until(lambda: cancels() > before, 10, what="CANCEL after a non-streaming client left")
    t = time.monotonic()
    r = server.post("/v1/completions", json={"model": "scripted", "prompt": "a", "max_tokens": 3})
    assert r.json()["choices"][0]["text"] == "bcd" and time.monotonic() - t < 10


def test_prompt_text_is_not_exposed(server):
    secret = "SECRET-PROMPT-7c1d"
    r = server.post("/v1/chat/completions", json={"model": "scripted", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": secret}]})
    assert r.status_code == 200
    r = server.post("/v1/chat/completions", json={"model": "scripted", "temperature": secret,
                                                  "messages": [{"role": "user", "content": secret}]})
    assert r.status_code == 400 and secret not in r.text  # errors name fields, not values
    props = server.get("/props")
    assert props.status_code == 200 and secret not in props.text
    assert props.json()["log_prompts"] is False and props.json()["workers"][0]["model"] == "scripted"
    assert secret not in server.get("/metrics").text
    time.sleep(0.2)
    assert secret not in server.proc.log()


def test_metrics_after_traffic(server):
    server.post("/v1/chat/completions", json={"model": "scripted", "messages": [{"role": "user", "content": "x"}]})
    text = server.get("/metrics").text
    assert re.search(r'^dflashd:requests_total\{endpoint="chat",model="scripted",status="200"\} [1-9]', text, re.M)
    assert re.search(r'^dflashd:tokens_predicted_total\{model="scripted"\} [1-9]', text, re.M)
    assert re.search(r'^dflashd:time_to_first_token_seconds_count\{model="scripted"\} [1-9]', text, re.M)
    assert re.search(r'^dflashd:worker_healthy\{worker="scripted-cpu-0",model="scripted",device="cpu"\} 1$', text, re.M)
    assert re.search(r'^dflashd:worker_inflight\{worker="scripted-cpu-0"', text, re.M)
    assert re.search(r'^dflashd:model_status\{model="broken",status="failed"\} 1$', text, re.M)
    for family in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                   "spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_per_pos_total"):
        assert f"# TYPE dflashd:{family} counter" in text


def test_remote_worker_joins_over_zeromq(server):
    """The wire side, played by this test as a DEALER: frames from an identity without HELLO get
    ERROR unknown_worker, a HELLO of another protocol version ERROR unsupported_version, a HELLO
    whose worker_id is not its identity ERROR bad_message, garbage is dropped; a proper HELLO for
    `remote-only` makes that model ready and the router sends it GENERATE, whose TOKENS and DONE
    become the HTTP answer.  Runs last: it changes remote-only's status."""
    import concurrent.futures as cf

    import numpy as np
    import zmq

    from protocol.framing import dealer_socket, encode, recv, send
    from protocol.messages import (WORKER_ACCEPTS, Done, ErrorCode, ErrorMessage, FinishReason, Generate,
                                   Heartbeat, SpecStats, Timings, Tokens, Usage)

    endpoint = server.proc.zmq_endpoint
    ctx = zmq.Context()
    sock = dealer_socket(ctx, endpoint, "remote-7")
    sock.setsockopt(zmq.RCVTIMEO, 10_000)

    def next_error() -> ErrorMessage:
        while True:
            _, msg = recv(sock, accept=WORKER_ACCEPTS)
            if isinstance(msg, ErrorMessage):
                return msg

    try:
        send(sock, Heartbeat(worker_id="remote-7", seq=1, time=time.time()))
        assert next_error().code == ErrorCode.UNKNOWN_WORKER
        frames = encode(_hello("remote-7", "remote-only"))
        import msgpack
        body = msgpack.unpackb(frames[1])
        body["protocol_version"] = PROTOCOL_VERSION + 1
        sock.send_multipart([frames[0], msgpack.packb(body)])
        assert next_error().code == ErrorCode.UNSUPPORTED_VERSION
        send(sock, _hello("someone-else", "remote-only"))
        assert next_error().code == ErrorCode.BAD_MESSAGE
        sock.send_multipart([b"TOKENS", b"\xc1not msgpack"])  # dropped: no reply, no crash
        send(sock, _hello("remote-7", "remote-only", n_ctx=1024))
        wait_until(lambda: server.get("/v1/models").json()["data"][1]["status"]["value"] == "ready", 10,
                   what="remote-only to become ready")
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(server.post, "/v1/completions", json={"model": "remote-only", "prompt": "abc",
                                                                   "max_tokens": 3})
            while True:
                _, msg = recv(sock, accept=WORKER_ACCEPTS)
                if isinstance(msg, Generate):
                    break
            assert msg.prompt_ids.tolist() == [97, 98, 99] and msg.max_tokens == 3
            send(sock, Tokens(request_id=msg.request_id, offset=0, ids=np.array([120, 121], np.int32), text="xy"))
            send(sock, Done(request_id=msg.request_id, finish_reason=FinishReason.STOP,
                            usage=Usage(prompt_tokens=3, completion_tokens=2),
                            timings=Timings(prompt_ms=1.0, prompt_per_second=3000.0, predicted_ms=2.0,
                                            predicted_per_second=1000.0, ttft_ms=1.5),
                            spec=SpecStats(drafted=6, accepted=4, accepted_per_position=(3, 1), steps=3,
                                           acceptance_length=2.33)))
            r = fut.result(30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xy"
        assert r.headers["x-worker-id"] == "remote-7"
        # speculative statistics: llama-server's names in timings, the detail in usage, and metrics
        usage = r.json()["usage"]
        assert (usage["timings"]["draft_n"], usage["timings"]["draft_n_accepted"]) == (6, 4)
        assert usage["speculative"] == {"draft_tokens": 6, "accepted_tokens": 4, "drafts": 3,
                                        "accepted_per_position": [3, 1], "acceptance_rate": 4 / 6,
                                        "acceptance_length": 2.33}
        text = server.get("/metrics").text
        assert 'dflashd:spec_decode_num_draft_tokens_total{model="remote-only"} 6' in text
        assert 'dflashd:spec_decode_num_accepted_tokens_total{model="remote-only"} 4' in text
        assert 'dflashd:spec_decode_num_drafts_total{model="remote-only"} 3' in text
        assert 'dflashd:spec_decode_num_accepted_tokens_per_pos_total{model="remote-only",position="0"} 3' in text
        assert 'dflashd:spec_decode_num_accepted_tokens_per_pos_total{model="remote-only",position="1"} 1' in text
        assert server.proc.proc.poll() is None
    finally:
        sock.close(0)
        ctx.term()
