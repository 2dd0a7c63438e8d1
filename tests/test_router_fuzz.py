"""Hundreds of generated bad requests against the router's own OpenAPI schema: no 5xx, no crash.

The router (`dflashd router`, a real process) publishes its request schemas at /openapi.json.  A
hypothesis strategy reads them and breaks valid bodies in the ways clients do: a required field
removed, a field given a value of another type or out of its declared range or enum, unknown fields,
junk inside nested messages and content blocks, a body that is not an object, not JSON, or not even
UTF-8, and absurd nesting.  Every answer must be a 4xx with the API's error object (or a 200 when
the mutation happened to leave the body valid); never a 5xx, and the router must still serve a
normal request afterwards.  A protocol-speaking stand-in worker (tests/fake_worker.py) answers the
bodies that are valid, so they are dispatched for real; `--n-predict 8` keeps those short.

Guards: an unvalidated field reaching code that raises (a 500 with a traceback), an error handler
that itself fails, a request shape that kills the event loop.
"""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router_fixtures import ROOT, SMALL_MODEL_ENV, ServeProcess, free_port, wait_until, write_scripted_qwen35

N_EXAMPLES = 600
VALID = {
    "/v1/chat/completions": {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"model": "scripted", "prompt": "abc", "max_tokens": 4},
    "/v1/messages": {"model": "scripted", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
}
SENT: list[int] = []


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    d = tmp_path_factory.mktemp("router_fuzz")
    write_scripted_qwen35(d / "scripted.gguf")
    zport = free_port()
    proc = ServeProcess(["router", "--bind", f"tcp://127.0.0.1:{zport}", "--model", f"scripted={d / 'scripted.gguf'}",
                         "--port", "0", "--n-predict", "8", "--timeout", "5"])
    worker = None
    try:
        proc.wait_for_line(r"listening on http://", 60)
        url = proc.url
        # no worker yet: /health says so (the reference's /health said "ok" regardless)
        h = httpx.get(f"{url}/health")
        assert h.status_code == 503 and "waiting for a worker to join" in h.json()["reason"], h.text
        worker = subprocess.Popen([sys.executable, "-m", "tests.fake_worker", "--connect", f"tcp://127.0.0.1:{zport}",
                                   "--worker-id", "fake-0", "--model-id", "scripted"], cwd=ROOT,
                                  env={**__import__("os").environ, "PYTHONPATH": str(ROOT), **SMALL_MODEL_ENV})
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 60, what="the fake worker to join")
        schema = httpx.get(f"{url}/openapi.json").json()
        with httpx.Client(base_url=url, timeout=30) as client:
            yield proc, client, schema
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(10)
        proc.stop()


# ---- schema-driven bad values ------------------------------------------------------------------------

def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = root["components"]["schemas"][name]
    return schema


def _variants(schema: dict, root: dict) -> list[dict]:
    s = _resolve(schema, root)
    if "anyOf" in s or "oneOf" in s:
        out = []
        for sub in s.get("anyOf", []) + s.get("oneOf", []):
            out.extend(_variants(sub, root))
        return out
    return [s]


JUNK = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                 st.floats(allow_nan=False), st.text(max_size=12), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def violating(schema: dict, root: dict) -> st.SearchStrategy:
    """Values that break `schema`: other types, out-of-range numbers, bad enums, bad lengths."""
    variants = _variants(schema, root)
    types = {v.get("type") for v in variants}
    options = []
    if "string" not in types:
        options.append(st.text(max_size=8))
    if not types & {"integer", "number"}:
        options.append(st.integers(min_value=-(1 << 66), max_value=1 << 66))
    if "integer" in types and "number" not in types:
        options.append(st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)))
    if "boolean" not in types:
        options.append(st.booleans())
    if "array" not in types:
        options.append(st.lists(JUNK, max_size=3))
    if "object" not in types:
        options.append(st.dictionaries(st.text(max_size=5), JUNK, max_size=3))
    if "null" not in types:
        options.append(st.none())
    for v in variants:
        for key in ("minimum", "exclusiveMinimum"):
            if key in v:
                options.append(st.just(v[key] - 1))
        for key in ("maximum", "exclusiveMaximum"):
            if key in v:
                options.append(st.just(v[key] + 1))
        if "enum" in v:
            options.append(st.text(max_size=10).filter(lambda x, e=v["enum"]: x not in e))
        if "const" in v:
            options.append(st.text(max_size=10).filter(lambda x, c=v["const"]: x != c))
        if v.get("minLength"):
            options.append(st.just(""))
        if "minItems" in v:
            options.append(st.just([]))
        if "maxItems" in v:
            options.append(st.just([None] * (v["maxItems"] + 1)))
    return st.one_of(options) if options else JUNK


def body_schema(root: dict, path: str) -> dict:
    op = root["paths"][path]["post"]
    return _resolve(op["requestBody"]["content"]["application/json"]["schema"], root)


@st.composite
def bad_request(draw, root: dict):
    path = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(VALID[path]))
    schema = body_schema(root, path)
    kind = draw(st.sampled_from(["wrong_value", "wrong_value", "wrong_value", "drop_required", "nested",
                                 "nested", "extra", "not_object", "raw_bytes", "deep"]))
    if kind == "wrong_value":
        props = schema.get("properties", {})
        for _ in range(draw(st.integers(1, 3))):
            name = draw(st.sampled_from(sorted(props)))
            body[name] = draw(violating(props[name], root))
    elif kind == "drop_required":
        required = schema.get("required", [])
        for name in draw(st.lists(st.sampled_from(required), min_size=1, unique=True)):
            body.pop(name, None)
    elif kind == "nested":
        target = "messages" if "messages" in body else "prompt"
        if target == "messages":
            msg = body["messages"][0]
            field = draw(st.sampled_from(["role", "content", "tool_calls", "name", "tool_call_id", "extra"]))
            msg[field] = draw(st.one_of(JUNK, st.lists(st.dictionaries(
                st.sampled_from(["type", "text", "id", "name", "input", "tool_use_id", "content", "function"]),
                JUNK, max_size=4), max_size=3)))
            if draw(st.booleans()):
                body["messages"] = draw(st.lists(st.just(msg), max_size=3))
        else:
            body["prompt"] = draw(st.one_of(JUNK, st.lists(JUNK, max_size=4)))
    elif kind == "extra":
        body.update(draw(st.dictionaries(st.text(max_size=10), JUNK, min_size=1, max_size=4)))
    elif kind == "not_object":
        return path, json.dumps(draw(st.one_of(JUNK, st.lists(JUNK, max_size=3)))).encode()
    elif kind == "raw_bytes":
        return path, draw(st.one_of(st.binary(max_size=64), st.just(b"{\"messages\": [1, 2"),
                                    st.just(b"\xff\xfe{}"), st.just(b"")))
    else:
        depth = draw(st.integers(50, 5000))
        return path, (b"[" * depth + b"]" * depth) if draw(st.booleans()) else \
            json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "x"}],
                        "tools": [{"type": "function", "function": {"name": "f", "parameters": _nest(depth)}}]}).encode()
    return path, json.dumps(body, allow_nan=True).encode()


def _nest(depth: int) -> dict:
    d: dict = {}
    for _ in range(min(depth, 200)):
        d = {"a": d}
    return d


def test_generated_bad_requests_never_5xx(router):
    proc, client, schema = router
    for path in VALID:
        assert body_schema(schema, path).get("properties"), path

    @settings(max_examples=N_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(bad_request(schema))
    def check(req):
        path, raw = req
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        SENT.append(r.status_code)
        assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:500])
        if r.status_code >= 400:
            body = r.json()
            if path.startswith("/v1/messages"):
                assert body["type"] == "error" and body["error"]["message"], body
            else:
                assert body["error"]["message"] and body["error"]["type"], body

    check()
    assert len(SENT) >= 500
    rejected = sum(s >= 400 for s in SENT)
    print(f"\n[fuzz] {len(SENT)} generated requests: {rejected} rejected with 4xx, "
          f"{len(SENT) - rejected} valid after all (200), 0 with 5xx")
    assert rejected >= 400
    # still alive and serving, and nothing logged an internal error
    assert proc.proc.poll() is None
    r = client.post("/v1/chat/completions", json=VALID["/v1/chat/completions"])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert not [line for line in proc.lines if "internal error" in line or "Traceback" in line], proc.log()
