"""Speculative decoding through the router: `dflashd serve --model T --draft D` (real router and worker
processes) and the TOML config's per-model draft settings.

The pair is the alternating target/draft of tests/test_worker_spec.py: a chat answer is `abab...`, the
draft always proposes `a`, so some draft tokens are accepted and some rejected.  What must hold: the
draft and its defaults reach the worker (flags or TOML), per-request options (`speculative` object or
llama-server's flat `speculative.n_max` keys) reach GENERATE, the response's timings carry the
worker's real counters, `/metrics` grows by exactly those counters, and `/props` shows the settings.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from router.config import ConfigError, parse_config
from router.supervisor import Supervisor, WorkerSlot
from tests.router_fixtures import ROOT, ServeProcess
from tests.test_worker_spec import BLOCK, write_alternating_pair

MODEL = "alt"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_alternating_pair(tmp_path_factory.mktemp("router-spec"))


@pytest.fixture(scope="module")
def url(pair):
    target, draft = pair
    proc = ServeProcess(["serve", "--model", str(target), "--draft", str(draft), "--draft-max", "4",
                         "--alias", MODEL, "--ctx-size", "512", "--port", "0"])
    try:
        yield proc.wait_ready(timeout=120)
    finally:
        proc.stop()


def spec_metrics(url: str) -> dict[str, float]:
    """The speculative counters of MODEL from /metrics (absent families count 0)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {"drafted": 0.0, "accepted": 0.0, "drafts": 0.0, "pos0": 0.0, "pos1": 0.0}
    names = {"dflashd:spec_decode_num_draft_tokens_total": "drafted",
             "dflashd:spec_decode_num_accepted_tokens_total": "accepted",
             "dflashd:spec_decode_num_drafts_total": "drafts"}
    for line in text.splitlines():
        m = re.fullmatch(r'([a-z_:]+)\{model="' + MODEL + r'"(?:,position="(\d+)")?\} (\S+)', line)
        if not m:
            continue
        if m.group(1) in names:
            out[names[m.group(1)]] = float(m.group(3))
        elif m.group(1) == "dflashd:spec_decode_num_accepted_tokens_per_pos_total" and m.group(2) in ("0", "1"):
            out["pos" + m.group(2)] = float(m.group(3))
    return out


def chat(url: str, max_tokens: int = 13, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def expected_text(n: int) -> str:
    return "".join("a" if i % 2 == 0 else "b" for i in range(n))


def test_chat_timings_and_metrics_carry_the_workers_spec_stats(url):
    # Guards: --draft (and --draft-max) not reaching the worker, spec stats lost between DONE and the
    # response, /metrics counters that do not follow the DONE messages.
    before = spec_metrics(url)
    r = chat(url)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == expected_text(13)
    t = body["usage"]["timings"]
    assert t == body["timings"]
    steps, drafted, accepted = t["draft_n_steps"], t["draft_n"], t["draft_n_accepted"]
    # --draft-max 4: chains of at most 4; from anchor "b" exactly one draft token is accepted
    assert steps >= 4 and steps <= drafted <= 4 * steps and 1 <= accepted < drafted
    assert t["draft_accepted_per_position"] == [accepted]
    assert t["draft_acceptance_length"] == pytest.approx((accepted + steps) / steps)
    assert accepted + steps <= body["usage"]["completion_tokens"] - 1
    assert body["usage"]["speculative"]["draft_tokens"] == drafted
    after = spec_metrics(url)
    assert after["drafted"] - before["drafted"] == drafted
    assert after["accepted"] - before["accepted"] == accepted
    assert after["drafts"] - before["drafts"] == steps
    assert (after["pos0"] - before["pos0"], after["pos1"] - before["pos1"]) == (accepted, 0)

    # a streamed answer reports the same counters in its usage chunk and counts them the same way
    before = after
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 13,
                            "stream": True, "stream_options": {"include_usage": True}}) as resp:
        events = [json.loads(line[5:]) for line in resp.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    usage = next(e["usage"] for e in events if e.get("usage"))
    assert usage["timings"]["draft_n"] == drafted and usage["timings"]["draft_n_steps"] == steps
    assert spec_metrics(url)["drafted"] - before["drafted"] == drafted


def test_per_request_options_reach_the_worker(url):
    # Guards: llama-server's per-request spellings (flat keys and the nested object) ignored, p_min
    # not mapped to the margin cut, contradicting spellings silently resolved.
    before = spec_metrics(url)
    r = chat(url, **{"speculative.n_max": 0})  # plain autoregressive decoding
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected_text(13)
    assert "draft_n" not in r.json()["usage"]["timings"]
    assert spec_metrics(url) == before
    t = chat(url, speculative={"n_max": 1}).json()["usage"]["timings"]
    assert t["draft_n"] == t["draft_n_steps"] >= 4
    # the draft's top-1 - top-2 margin is ~0.51: p_min 0.6 cuts every chain, 0.3 none
    t = chat(url, **{"speculative.p_min": 0.6}).json()["usage"]["timings"]
    assert (t["draft_n_steps"], t["draft_n"]) == (0, 0)
    t = chat(url, speculative={"p_min": 0.3, "n_min": 4}).json()["usage"]["timings"]
    assert t["draft_n_steps"] >= 2 and t["draft_n"] == 4 * t["draft_n_steps"]
    r = chat(url, speculative={"n_max": 2}, **{"speculative.n_max": 3})
    assert r.status_code == 400 and "speculative.n_max" in r.json()["error"]["message"]
    r = chat(url, speculative={"n_max": 2, "n_min": 3})
    assert r.status_code == 400
    r = chat(url, **{"speculative.p_min": 1.5})
    assert r.status_code in (400, 422)
    # the Anthropic endpoint takes the same keys
    r = httpx.post(f"{url}/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}],
        "speculative.n_max": 1})
    assert r.status_code == 200, r.text
    t = r.json()["timings"]
    assert t["draft_n"] == t["draft_n_steps"] >= 2


def test_props_show_the_draft_settings(url, pair):
    # Guards: /props silent about the draft a model is served with.
    card = next(m for m in httpx.get(f"{url}/props", timeout=10).json()["models"] if m["id"] == MODEL)
    spec = card["speculative"]
    assert spec["draft"] == str(pair[1].resolve()) and spec["draft_models"] == ["alternating-draft"]
    assert (spec["block_size"], spec["draft_max"], spec["draft_min"], spec["draft_margin"]) == (BLOCK, 4, 0, 0.0)
    assert card["drafts"] == ["alternating-draft"]


def test_toml_draft_settings_reach_the_worker_command(pair, tmp_path):
    # Guards: the TOML keys draft_max / draft_min / draft_margin accepted but never passed on.
    target, draft = pair
    toml = {"models": [{"id": "m", "path": str(target), "draft": str(draft), "draft_max": 3, "draft_min": 1,
                        "draft_margin": 0.25}]}
    cfg = parse_config(toml)
    m = cfg.models[0]
    assert (m.draft, m.draft_max, m.draft_min, m.draft_margin) == (draft, 3, 1, 0.25)
    args, _ = Supervisor.command(SimpleNamespace(config=cfg, endpoint="tcp://127.0.0.1:1"),
                                 WorkerSlot(worker_id="w", model=m, spec=m.workers[0]))
    i = args.index("--draft")
    assert args[i:i + 8] == ["--draft", str(draft), "--draft-max", "3", "--draft-min", "1", "--draft-margin", "0.25"]
    bare = parse_config({"models": [{"id": "m", "path": str(target), "draft": str(draft)}]}).models[0]
    args, _ = Supervisor.command(SimpleNamespace(config=cfg, endpoint="tcp://127.0.0.1:1"),
                                 WorkerSlot(worker_id="w", model=bare, spec=bare.workers[0]))
    assert "--draft-max" not in args and "--draft" in args
    for bad, words in ([{"draft_max": 3}, "need"], [{"draft": str(draft), "draft_max": 2, "draft_min": 3}, "exceeds"],
                       [{"draft": str(draft), "draft_margin": 1.5}, "draft_margin"],
                       [{"draft": str(target.parent / "nowhere")}, "no draft"]):
        with pytest.raises(ConfigError, match=words):
            parse_config({"models": [{"id": "m", "path": str(target), **bad}]})
    # the serve flags: one line, exit 2
    r = subprocess.run([sys.executable, "-m", "daemons.cli", "serve", "--model", str(target), "--draft-max", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "dflashd: error: --draft-max, --draft-min and --draft-margin need --draft"]
