"""Router overhead: added latency per request and streaming throughput, against fake workers.

Run:  .venv/bin/python tests/bench/bench_router.py [--requests 300] [--stream-tokens 20000] [--streams 4]

Processes: one `dflashd router` (real, over loopback HTTP) and `tests/fake_worker.py` workers that
answer GENERATE with tokens as fast as they can, so everything measured is the router's cost plus
the client's.  Figures:

* floor: a bare ZeroMQ ROUTER in this process sending GENERATE(max_tokens=1) to a fake worker and
  waiting for DONE (msgpack + ZeroMQ + the fake worker's loop), and the tokens/s such a bare ROUTER
  receives from one fake worker;
* router latency: HTTP request -> complete response for one generated token (p50/p90/p99), for
  /v1/completions with a token-id prompt and /v1/chat/completions (chat template + tokenizer);
  "added" subtracts the floor;
* streaming: SSE events per second one client receives from one stream, and the aggregate of
  `--streams` concurrent streams (one fake worker each).

The client runs on the same machine, so on 2 cores it competes with the router for CPU.
Not collected by pytest (no ``test_`` prefix).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from daemons.synthetic import write_synthetic_qwen35  # noqa: E402
from protocol.framing import recv, router_socket, send  # noqa: E402
from protocol.messages import ROUTER_ACCEPTS, Done, Generate, Hello, Tokens  # noqa: E402
from tests.router_fixtures import ROOT, ServeProcess, free_port, wait_until  # noqa: E402


def _fake_worker(endpoint: str, wid: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.fake_worker", "--connect", endpoint, "--worker-id", wid,
                             "--model-id", "tiny"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _transport() -> httpx.HTTPTransport:
    # httpx writes a request's headers and body separately; without TCP_NODELAY, Nagle holds the
    # body until the server's delayed ACK (40 ms on Linux), which would be measured as router time.
    import socket
    return httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def floor(n_requests: int, n_tokens: int) -> tuple[list[float], float]:
    """Round trips and streaming rate of a bare ROUTER socket talking to one fake worker."""
    ctx = zmq.Context()
    sock = router_socket(ctx, "tcp://127.0.0.1:0")
    ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    w = _fake_worker(ep, "floor-0")
    try:
        ident, msg = recv(sock, accept=ROUTER_ACCEPTS)
        while not isinstance(msg, Hello):
            ident, msg = recv(sock, accept=ROUTER_ACCEPTS)
        prompt = np.arange(97, 107, dtype=np.int32)
        lat = []
        for i in range(n_requests):
            t = time.perf_counter()
            send(sock, Generate(request_id=f"f{i}", max_tokens=1, prompt_ids=prompt), identity=ident)
            while True:
                _, m = recv(sock, accept=ROUTER_ACCEPTS)
                if isinstance(m, Done):
                    break
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        send(sock, Generate(request_id="stream", max_tokens=n_tokens, prompt_ids=prompt), identity=ident)
        got = 0
        while True:
            _, m = recv(sock, accept=ROUTER_ACCEPTS)
            if isinstance(m, Tokens):
                got += int(m.ids.size)
            elif isinstance(m, Done):
                break
        rate = got / (time.perf_counter() - t)
        return lat, rate
    finally:
        w.kill()
        w.wait()
        sock.close(0)
        ctx.term()


def stream_rate(client: httpx.Client, n_tokens: int) -> tuple[float, int]:
    """(tokens/s one client receives over SSE, SSE events it took)."""
    t = time.perf_counter()
    events = 0
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": [97, 98], "max_tokens": n_tokens,
                                                        "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    got = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    events += 1
    assert got == n_tokens, got
    return got / (time.perf_counter() - t), events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--stream-tokens", type=int, default=20000)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    workdir = tempfile.TemporaryDirectory(prefix="bench-router-")
    model = Path(workdir.name) / "tiny.gguf"  # the router reads its chat template and tokenizer
    write_synthetic_qwen35(model, "tiny")

    floor_lat, floor_rate = floor(args.requests, args.stream_tokens)

    zport = free_port()
    endpoint = f"tcp://127.0.0.1:{zport}"
    router = ServeProcess(["router", "--bind", endpoint, "--model", f"tiny={model}", "--port", "0"])
    workers = []
    try:
        router.wait_for_line(r"listening on http://", 60)
        url = router.url
        workers = [_fake_worker(endpoint, f"fake-{i}") for i in range(max(1, args.streams))]
        wait_until(lambda: len([w for w in httpx.get(f"{url}/props").json()["workers"] if w["healthy"]])
                   == len(workers), 60, what="fake workers")
        results: dict[str, float] = {}
        with httpx.Client(base_url=url, timeout=120, transport=_transport()) as client:
            for _ in range(20):  # warm-up: connections, code paths
                client.post("/v1/completions", json={"model": "tiny", "prompt": [97], "max_tokens": 1})
            for name, path, body in (
                    ("completions", "/v1/completions", {"model": "tiny", "prompt": [97, 98, 99], "max_tokens": 1}),
                    ("chat", "/v1/chat/completions", {"model": "tiny", "max_tokens": 1,
                                                      "messages": [{"role": "user", "content": "Hello there!"}]})):
                lat = []
                for _ in range(args.requests):
                    t = time.perf_counter()
                    r = client.post(path, json=body)
                    lat.append(time.perf_counter() - t)
                    assert r.status_code == 200, r.text
                results[f"{name}_p50_ms"] = _pct(lat, 0.5) * 1000
                results[f"{name}_p90_ms"] = _pct(lat, 0.9) * 1000
                results[f"{name}_p99_ms"] = _pct(lat, 0.99) * 1000
                results[f"{name}_added_p50_ms"] = (_pct(lat, 0.5) - _pct(floor_lat, 0.5)) * 1000
            stream_rate(client, 1000)  # warm-up
            results["stream_tokens_per_s"], results["stream_events"] = stream_rate(client, args.stream_tokens)
        if args.streams > 1:
            rates: list[float] = []

            def one() -> None:
                with httpx.Client(base_url=url, timeout=300, transport=_transport()) as c:
                    rates.append(stream_rate(c, args.stream_tokens // 2)[0])

            threads = [threading.Thread(target=one) for _ in range(args.streams)]
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t
            results[f"aggregate_{args.streams}_streams_tokens_per_s"] = args.streams * (args.stream_tokens // 2) / wall
        results["floor_p50_ms"] = _pct(floor_lat, 0.5) * 1000
        results["floor_stream_tokens_per_s"] = floor_rate
    finally:
        for w in workers:
            w.kill()
            w.wait()
        router.stop()
        workdir.cleanup()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"router bench on {os.cpu_count()} cores ({args.requests} requests each; client on the same machine)")
    print(f"  floor (bare ZeroMQ ROUTER <-> fake worker):  p50 {results['floor_p50_ms']:.2f} ms per 1-token request, "
          f"{results['floor_stream_tokens_per_s']:,.0f} tokens/s streamed")
    for name in ("completions", "chat"):
        print(f"  {name:<12} 1 token over HTTP: p50 {results[f'{name}_p50_ms']:.2f} ms  p90 "
              f"{results[f'{name}_p90_ms']:.2f} ms  p99 {results[f'{name}_p99_ms']:.2f} ms  "
              f"(router adds {results[f'{name}_added_p50_ms']:.2f} ms at p50)")
    print(f"  streaming    one SSE stream: {results['stream_tokens_per_s']:,.0f} tokens/s "
          f"({args.stream_tokens} tokens in {results['stream_events']} SSE events)")
    key = f"aggregate_{args.streams}_streams_tokens_per_s"
    if key in results:
        print(f"  streaming    {args.streams} concurrent streams: {results[key]:,.0f} tokens/s in total")


if __name__ == "__main__":
    main()
