"""Failures and load with real worker processes under `dflashd serve` (issue 5).

* SIGKILL of the only worker in the middle of a stream: the client gets a clear error (never a
  silently truncated success), the router stays up, the supervisor restarts the worker, and the next
  request succeeds; the time to recovery is measured and printed.
* Two workers for one model: a worker killed while a non-streaming request runs on it is invisible
  to the client (the request is retried on the other worker); 20 concurrent requests spread over both.
* No orphans: SIGKILL of the router takes its workers down with it (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import openai
import pytest

from tests.router_fixtures import CYCLE, ServeProcess, pid_alive, wait_until, write_scripted_qwen35


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("router_failover") / "scripted.gguf"
    write_scripted_qwen35(p)
    return p


def _workers(url: str) -> list[dict]:
    return httpx.get(f"{url}/props", timeout=10).json()["workers"]


def test_sigkill_mid_stream_error_then_recovery(model_path):
    proc = ServeProcess(["serve", "--model", str(model_path), "--alias", "scripted", "--port", "0"])
    try:
        url = proc.wait_ready(timeout=180)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        (w,) = _workers(url)
        old_pid = w["pid"]
        stream = client.completions.create(model="scripted", prompt="a", max_tokens=3000, stream=True)
        received = ""
        t_kill = None
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                received += chunk.choices[0].text if chunk.choices else ""
                # >= rather than ==: on a loaded machine one chunk may carry several characters
                if t_kill is None and len(received) >= 20:
                    os.kill(old_pid, signal.SIGKILL)
                    t_kill = time.monotonic()
        # a clear error, after a correct prefix; not a success with a truncated text
        assert "worker" in str(err.value) and "incomplete" in str(err.value), str(err.value)
        assert 20 <= len(received) < 3000 and received == (CYCLE * 200)[1:1 + len(received)]
        # the router is up and says why it cannot serve right now (or already can again)
        h = httpx.get(f"{url}/health", timeout=10)
        assert h.status_code in (200, 503) and proc.proc.poll() is None
        if h.status_code == 503:
            assert h.json()["reason"]
        # the next request waits for the restarted worker and succeeds
        r = client.completions.create(model="scripted", prompt="abc", max_tokens=5)
        t_served = time.monotonic() - t_kill
        assert r.choices[0].text == "defgh"
        wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, 30, what="healthy again")
        t_healthy = time.monotonic() - t_kill
        (w2,) = _workers(url)
        assert w2["pid"] != old_pid and w2["healthy"] and not pid_alive(old_pid)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'dflashd:stream_errors_total{model="scripted"} 1' in metrics
        print(f"\n[failover] SIGKILL mid-stream -> next request served after {t_served:.2f} s, "
              f"/health 200 after {t_healthy:.2f} s (restart backoff 0.5 s)")
        assert any("restarting in" in line for line in proc.lines)
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def two_workers(model_path):
    proc = ServeProcess(["serve", "--model", str(model_path), "--alias", "scripted", "--workers", "2",
                         "--port", "0"])
    url = proc.wait_ready(timeout=180)
    wait_until(lambda: len([w for w in _workers(url) if w["healthy"]]) == 2, 60, what="two healthy workers")
    yield proc, url
    # teardown: SIGKILL the router; the kernel must take the workers down too (no orphans)
    pids = [w["pid"] for w in _workers(url)]
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    wait_until(lambda: not any(pid_alive(p) for p in pids), 10, what="workers to die with the router")


def test_twenty_concurrent_requests_use_both_workers(two_workers):
    proc, url = two_workers

    def one(i: int) -> tuple[str, str]:
        prompt = CYCLE[i % len(CYCLE)]
        r = httpx.post(f"{url}/v1/completions", json={"model": "scripted", "prompt": prompt, "max_tokens": 40},
                       timeout=120)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        start = CYCLE.index(prompt) + 1
        assert text == (CYCLE * 4)[start:start + 40]
        return r.headers["x-worker-id"], text

    t = time.monotonic()
    with cf.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    elapsed = time.monotonic() - t
    by_worker: dict[str, int] = {}
    for wid, _ in results:
        by_worker[wid] = by_worker.get(wid, 0) + 1
    print(f"\n[load] 20 concurrent requests x 40 tokens in {elapsed:.2f} s over workers {by_worker}")
    # Late binding: each worker holds at most 2 requests (max_inflight_per_worker), the rest wait in
    # the router for whichever frees a slot first, so both work from the start and a worker slowed
    # by the shared CPU simply takes fewer.
    assert len(by_worker) == 2 and min(by_worker.values()) >= 2 and sum(by_worker.values()) == 20, by_worker


def test_worker_killed_before_output_is_retried_elsewhere(two_workers):
    """A non-streaming request has delivered nothing until it ends: its worker dying is retried on
    the other worker, and the client sees only a normal, complete answer."""
    proc, url = two_workers
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, f"{url}/v1/completions",
                          json={"model": "scripted", "prompt": "a", "max_tokens": 1000}, timeout=120)
        busy = wait_until(lambda: [w for w in _workers(url) if w["inflight"]], 30, interval=0.01,
                          what="the request to reach a worker")
        os.kill(busy[0]["pid"], signal.SIGKILL)
        r = fut.result()
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert len(text) == 1000 and text == (CYCLE * 100)[1:1001]
    assert r.headers["x-worker-id"] != busy[0]["worker_id"]
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "dflashd:retries_total 1" in metrics
    # the killed worker comes back
    wait_until(lambda: len([w for w in _workers(url) if w["healthy"]]) == 2, 60, what="the restart")
